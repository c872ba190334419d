"""Read the model server's own KV capacity from its Prometheus exposition.

The parsing (vLLM ``vllm:cache_config_info`` num_gpu_blocks × block_size, SGLang
``sglang:max_total_num_tokens``, trtllm blocks × tokens per block; TGI has none) is
:func:`kvgate_agent.node.engine.parse_engine_metrics`, shared with the node agent's scraper.
See ../shared/notes/engine-metrics.md for the table.
"""

from __future__ import annotations

from kvgate_agent.node.engine import parse_engine_metrics


def kv_capacity_from_metrics(text: str) -> int | None:
    """KV capacity in tokens reported in a Prometheus exposition text, or None if absent or
    invalid (non-numeric, zero, negative or non-finite values are invalid, never "unlimited").
    Several engines behind one server (vLLM data parallel) add up."""
    return parse_engine_metrics(text).kv_capacity_tokens
