"""Read the model server's own KV capacity from its Prometheus exposition.

vLLM exports ``vllm:cache_config_info`` (value 1) whose labels carry ``num_gpu_blocks`` and
``block_size``: capacity in tokens = num_gpu_blocks × block_size (vllm/v1/metrics/loggers.py).
SGLang exports ``sglang:max_total_num_tokens`` (python/sglang/srt/metrics/collector.py). TGI has no
such metric. See ../shared/notes/engine-metrics.md for the table.
"""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families


def kv_capacity_from_metrics(text: str) -> int | None:
    """KV capacity in tokens reported in a Prometheus exposition text, or None if absent or
    invalid (non-numeric, zero, negative or non-finite values are invalid, never "unlimited")."""
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, TypeError):
        return None
    for fam in families:
        for s in fam.samples:
            if s.name == "vllm:cache_config_info":
                try:
                    blocks = int(s.labels["num_gpu_blocks"])
                    block = int(s.labels["block_size"])
                except (KeyError, ValueError):
                    continue
                if blocks > 0 and block > 0:
                    return blocks * block
            elif s.name == "sglang:max_total_num_tokens" and math.isfinite(s.value) and s.value > 0:
                return int(s.value)
    return None
