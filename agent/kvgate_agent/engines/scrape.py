"""Parse one model server's Prometheus ``/metrics`` text (vLLM, SGLang, TGI, trtllm-serve,
llama.cpp's llama-server) into
an :class:`EngineSample`: running and waiting requests, KV usage (fraction 0..1), KV capacity and
used KV (tokens). Several label sets of one metric (vLLM's ``engine`` per data-parallel rank,
SGLang's ``dp_rank``) are summed, except the usage fraction, whose max is kept.

Invariant: a value that is non-finite, negative, out of range or not whole is unknown (``None``,
with the reason in :attr:`EngineSample.invalid`), never read as 0 (idle) nor as full: engines do
report such values (``kv_cache_usage_perc`` = −0.39,
https://github.com/vllm-project/vllm-ascend/issues/10048), and admission must not act on them
(https://github.com/llm-d/llm-d-router/pull/2547).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from prometheus_client.parser import text_string_to_metric_families

Engine = Literal["vllm", "sglang", "tgi", "trtllm", "llamacpp"]

ENGINES: tuple[Engine, ...] = ("vllm", "sglang", "tgi", "trtllm", "llamacpp")
"""Known engines, in the order used to break a detection tie."""

_PREFIX: dict[Engine, str] = {
    "vllm": "vllm:",
    "sglang": "sglang:",
    "tgi": "tgi_",
    "trtllm": "trtllm_",
    "llamacpp": "llamacpp:",
}

FRACTION_SLACK = 1e-6
"""How far outside [0, 1] a usage fraction may be (float rounding) before it is invalid."""

# Field names, as used in EngineSample and its ``invalid`` map.
RUNNING = "running"
WAITING = "waiting"
KV_USAGE = "kv_usage"
KV_CAPACITY = "kv_capacity_tokens"
KV_USED = "kv_used_tokens"
PREEMPTIONS = "preemptions_total"

Labels = frozenset[tuple[str, str]]


@dataclass(frozen=True, slots=True)
class EngineSample:
    """One parsed ``/metrics`` text.

    Attributes:
        ok: False when the text could not be parsed at all or carries no known engine's
            metrics; then every value is None and ``reason`` says why.
        reason: why not ``ok`` (None when ok).
        engine: ``"vllm"``, ``"sglang"``, ``"tgi"``, ``"trtllm"``, ``"llamacpp"``, or None when
            not detected.
        running: requests in the running batch (count), summed over label sets.
        waiting: requests queued in the engine (count), summed.
        kv_usage: fraction of the KV pool in use, 0..1 (max over label sets).
        kv_capacity_tokens: KV pool size in tokens, when the engine reports it (summed).
        kv_used_tokens: KV token slots in use: reported (SGLang, TGI) or usage × capacity
            rounded up (vLLM, trtllm). vLLM's usage counts whole blocks, a partly filled one as
            full, so this is blocks in use × block size, not the tokens held
            (https://github.com/vllm-project/vllm/issues/57336: 66.7 % of blocks while 36.5 % of
            token slots hold KV); kvgate's reservations are in that unit too (each sequence
            rounded up to whole blocks, ``admission.limits.kv_for``).
        preemptions_total: cumulative preemptions (vLLM counter), summed.
        invalid: field name -> reason, for each field present in the text but rejected.

    A field that is None and absent from ``invalid`` was not reported; one in ``invalid`` was
    reported with a bad value. Both mean "unknown", never 0 or full.
    """

    ok: bool
    reason: str | None = None
    engine: Engine | None = None
    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None
    kv_capacity_tokens: int | None = None
    kv_used_tokens: int | None = None
    preemptions_total: int | None = None
    invalid: dict[str, str] = field(default_factory=dict)


def parse_engine_metrics(text: str, engine: str | None = None) -> EngineSample:
    """Parse a Prometheus text exposition (format 0.0.4) from a model server.

    Args:
        text: the body of ``GET /metrics``.
        engine: an engine name to use instead of detecting one (e.g. from the pod label
            ``llm-d.ai/engine-type``); an unknown name is ignored (auto-detection).

    Returns:
        An :class:`EngineSample`. Detection: the engine whose core metric names (running,
        waiting, usage) appear most often wins, ties broken in :data:`ENGINES` order; without
        any core name, the engine whose prefix (``vllm:``, ``sglang:``, ``tgi_``, ``trtllm_``,
        ``llamacpp:``) appears most often.

    Never raises: unparseable text gives ``EngineSample(ok=False, reason=...)``.
    """
    try:
        series = _collect(text)
    except Exception as exc:  # the parser raises ValueError and others on garbage
        return EngineSample(ok=False, reason=f"unparseable metrics text: {type(exc).__name__}")
    chosen = engine if engine in _PREFIX else _detect(series)
    if chosen is None:
        return EngineSample(
            ok=False, reason="no known engine metrics (vllm:, sglang:, tgi_, trtllm_, llamacpp:)"
        )
    return _READERS[chosen](series)


def _collect(text: str) -> dict[str, dict[Labels, float]]:
    """Per metric name, the value of each label set (a repeated label set: the last wins)."""
    series: dict[str, dict[Labels, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            series.setdefault(s.name, {})[frozenset(s.labels.items())] = float(s.value)
    return series


_CORE: dict[Engine, tuple[str, ...]] = {
    "vllm": (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
    ),
    "sglang": ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage"),
    "tgi": ("tgi_batch_current_size", "tgi_queue_size", "tgi_batch_current_max_tokens"),
    "trtllm": (
        "trtllm_num_requests_running",
        "trtllm_num_requests_waiting",
        "trtllm_kv_cache_utilization",
    ),
    "llamacpp": ("llamacpp:requests_processing", "llamacpp:requests_deferred"),
}


CORE_METRICS: frozenset[str] = frozenset(name for names in _CORE.values() for name in names)
"""Every engine's core metric names (running, waiting, usage): a text holding only their lines
parses to the same ``running``, ``waiting`` and ``kv_usage`` as the whole exposition."""


def _detect(series: Mapping[str, object]) -> Engine | None:
    def best(score: Callable[[Engine], int]) -> Engine | None:
        scores = {e: score(e) for e in ENGINES}
        top = max(scores.values())
        return next(e for e in ENGINES if scores[e] == top) if top > 0 else None

    return best(lambda e: sum(n in series for n in _CORE[e])) or best(
        lambda e: sum(n.startswith(_PREFIX[e]) for n in series)
    )


# -- validation and aggregation ------------------------------------------------------------------


class _Fields:
    """Values and reasons gathered while reading one text."""

    def __init__(self, series: Mapping[str, Mapping[Labels, float]]) -> None:
        self.series = series
        self.values: dict[str, float | int] = {}
        self.invalid: dict[str, str] = {}

    def count(self, name: str, *metrics: str) -> None:
        """Sum the whole, non-negative, finite values of the first metric present."""
        metric = next((m for m in metrics if self.series.get(m)), None)
        if metric is None:
            return
        total = 0
        for value in self.series[metric].values():
            problem = _count_problem(value)
            if problem:
                self.invalid[name] = f"{metric} = {value!r}: {problem}"
                return
            total += int(value)
        self.values[name] = total

    def fraction(self, name: str, *metrics: str) -> None:
        """Max of the first metric present, each value in [0, 1] (with slack, then clamped)."""
        metric = next((m for m in metrics if self.series.get(m)), None)
        if metric is None:
            return
        worst = 0.0
        for value in self.series[metric].values():
            if not math.isfinite(value):
                problem = "not finite"
            elif not -FRACTION_SLACK <= value <= 1 + FRACTION_SLACK:
                problem = "outside [0, 1]"
            else:
                worst = max(worst, min(1.0, max(0.0, value)))
                continue
            self.invalid[name] = f"{metric} = {value!r}: {problem}"
            return
        self.values[name] = worst

    def capacity_from_labels(self, metric: str, blocks_label: str, size_label: str) -> None:
        """Sum over the series of ``metric`` of label ``blocks_label`` × label ``size_label``."""
        if KV_CAPACITY in self.values or KV_CAPACITY in self.invalid:
            return
        found = self.series.get(metric)
        if not found:
            return
        total = 0
        for labels in found:
            lab = dict(labels)
            blocks, size = _whole(lab.get(blocks_label)), _whole(lab.get(size_label))
            if not blocks or not size:
                self.invalid[KV_CAPACITY] = (
                    f"{metric} {blocks_label}={lab.get(blocks_label)!r} "
                    f"{size_label}={lab.get(size_label)!r}: not positive whole numbers"
                )
                return
            total += blocks * size
        self.values[KV_CAPACITY] = total

    def capacity_from_gauges(self, blocks_metric: str, size_metric: str) -> None:
        """Sum over label sets of gauge ``blocks_metric`` × gauge ``size_metric`` (paired by
        identical labels)."""
        if KV_CAPACITY in self.values or KV_CAPACITY in self.invalid:
            return
        blocks, sizes = self.series.get(blocks_metric), self.series.get(size_metric)
        if not blocks or not sizes:
            return
        total = 0
        for labels, n in blocks.items():
            size = sizes.get(labels)
            problem = _count_problem(n) or (
                "no matching block size" if size is None else _count_problem(size)
            )
            if problem or not n or not size:
                self.invalid[KV_CAPACITY] = (
                    f"{blocks_metric} = {n!r}, {size_metric} = {size!r}: "
                    f"{problem or 'not positive'}"
                )
                return
            total += int(n) * int(size)
        self.values[KV_CAPACITY] = total

    def positive_capacity(self) -> None:
        """A reported capacity of 0 is invalid, never "unlimited" nor "full"."""
        if self.values.get(KV_CAPACITY) == 0:
            del self.values[KV_CAPACITY]
            self.invalid[KV_CAPACITY] = "capacity 0"

    def used_from_usage(self) -> None:
        """used = usage × capacity, rounded up (conservative)."""
        usage, capacity = self.values.get(KV_USAGE), self.values.get(KV_CAPACITY)
        if usage is not None and capacity is not None:
            self.values[KV_USED] = math.ceil(usage * capacity - 1e-6)
        elif KV_USAGE in self.invalid or KV_CAPACITY in self.invalid:
            self.invalid[KV_USED] = "derived from an invalid usage or capacity"

    def used_within_capacity(self) -> None:
        used, capacity = self.values.get(KV_USED), self.values.get(KV_CAPACITY)
        if used is not None and capacity is not None and used > capacity:
            del self.values[KV_USED]
            self.invalid[KV_USED] = f"{used} used tokens exceed the capacity {capacity}"

    def sample(self, engine: Engine) -> EngineSample:
        v = self.values

        def whole(name: str) -> int | None:
            x = v.get(name)
            return None if x is None else int(x)

        usage = v.get(KV_USAGE)
        return EngineSample(
            ok=True,
            engine=engine,
            running=whole(RUNNING),
            waiting=whole(WAITING),
            kv_usage=None if usage is None else float(usage),
            kv_capacity_tokens=whole(KV_CAPACITY),
            kv_used_tokens=whole(KV_USED),
            preemptions_total=whole(PREEMPTIONS),
            invalid=dict(self.invalid),
        )


def _count_problem(value: float) -> str | None:
    if not math.isfinite(value):
        return "not finite"
    if value < 0:
        return "negative"
    if not value.is_integer():
        return "not a whole number"
    return None


def _whole(text: str | None) -> int | None:
    """A label value as a positive whole number, else None."""
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return int(value) if math.isfinite(value) and value > 0 and value.is_integer() else None


# -- per engine ------------------------------------------------------------------------------------


def _vllm(series: Mapping[str, Mapping[Labels, float]]) -> EngineSample:
    """vLLM: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
    ``vllm:kv_cache_usage_perc`` (else the old ``vllm:gpu_cache_usage_perc``),
    ``vllm:num_preemptions_total``; capacity = labels ``num_gpu_blocks`` × ``block_size`` of
    ``vllm:cache_config_info``; used = usage × capacity (an upper bound with several pools): the
    usage is the share of blocks in use, so used is in token slots of whole blocks, never read
    as tokens held (https://github.com/vllm-project/vllm/issues/57336).
    Names: https://github.com/vllm-project/vllm/blob/main/docs/design/metrics.md
    """
    f = _Fields(series)
    f.count(RUNNING, "vllm:num_requests_running")
    f.count(WAITING, "vllm:num_requests_waiting")
    f.fraction(KV_USAGE, "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    f.count(PREEMPTIONS, "vllm:num_preemptions_total")
    f.capacity_from_labels("vllm:cache_config_info", "num_gpu_blocks", "block_size")
    f.positive_capacity()
    f.used_from_usage()
    return f.sample("vllm")


def _sglang(series: Mapping[str, Mapping[Labels, float]]) -> EngineSample:
    """SGLang (``--enable-metrics``): ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``,
    ``sglang:token_usage``; capacity = ``sglang:max_total_num_tokens``, else labels
    ``num_pages`` × ``page_size`` of ``sglang:cache_config_info``; used =
    ``sglang:num_used_tokens``.
    Names: https://github.com/sgl-project/sglang/blob/main/python/sglang/srt/metrics/collector.py
    """
    f = _Fields(series)
    f.count(RUNNING, "sglang:num_running_reqs")
    f.count(WAITING, "sglang:num_queue_reqs")
    f.fraction(KV_USAGE, "sglang:token_usage")
    f.count(KV_CAPACITY, "sglang:max_total_num_tokens")
    f.capacity_from_labels("sglang:cache_config_info", "num_pages", "page_size")
    f.positive_capacity()
    f.count(KV_USED, "sglang:num_used_tokens")
    f.used_within_capacity()
    return f.sample("sglang")


def _tgi(series: Mapping[str, Mapping[Labels, float]]) -> EngineSample:
    """TGI: ``tgi_batch_current_size``, ``tgi_queue_size``; used =
    ``tgi_batch_current_max_tokens``; no usage and no capacity (that is the
    ``--max-batch-total-tokens`` flag).
    Names: https://github.com/huggingface/text-generation-inference/blob/main/docs/source/reference/metrics.md
    """
    f = _Fields(series)
    f.count(RUNNING, "tgi_batch_current_size")
    f.count(WAITING, "tgi_queue_size")
    f.count(KV_USED, "tgi_batch_current_max_tokens")
    return f.sample("tgi")


def _trtllm(series: Mapping[str, Mapping[Labels, float]]) -> EngineSample:
    """trtllm-serve: ``trtllm_num_requests_running``, ``trtllm_num_requests_waiting``,
    ``trtllm_kv_cache_utilization``; capacity = ``trtllm_kv_cache_max_blocks`` ×
    ``trtllm_kv_cache_tokens_per_block``; used = usage × capacity.
    Names as llm-d maps them:
    https://github.com/llm-d/llm-d-router/blob/main/pkg/epp/framework/plugins/datalayer/extractor/metrics/factories.go
    """
    f = _Fields(series)
    f.count(RUNNING, "trtllm_num_requests_running")
    f.count(WAITING, "trtllm_num_requests_waiting")
    f.fraction(KV_USAGE, "trtllm_kv_cache_utilization")
    f.capacity_from_gauges("trtllm_kv_cache_max_blocks", "trtllm_kv_cache_tokens_per_block")
    f.positive_capacity()
    f.used_from_usage()
    return f.sample("trtllm")


def _llamacpp(series: Mapping[str, Mapping[Labels, float]]) -> EngineSample:
    """llama.cpp's llama-server (``--metrics``): ``llamacpp:requests_processing`` (busy slots),
    ``llamacpp:requests_deferred`` (waiting for a slot); no KV usage nor capacity in the
    exposition (capacity: :func:`kvgate_agent.engines.llamacpp.parse_props`).
    Names: https://github.com/ggml-org/llama.cpp/blob/master/tools/server/README.md
    """
    f = _Fields(series)
    f.count(RUNNING, "llamacpp:requests_processing")
    f.count(WAITING, "llamacpp:requests_deferred")
    return f.sample("llamacpp")


_READERS: dict[str, Callable[[Mapping[str, Mapping[Labels, float]]], EngineSample]] = {
    "vllm": _vllm,
    "sglang": _sglang,
    "tgi": _tgi,
    "trtllm": _trtllm,
    "llamacpp": _llamacpp,
}
