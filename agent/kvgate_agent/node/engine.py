"""Model-server metrics for the node agent: parse one Prometheus ``/metrics`` text into an
:class:`EngineSample`, and keep the last sample per pod with its age (:class:`EngineView`).

Both are pure: no HTTP, no threads; the caller scrapes and passes the text and the time.

Metrics read, per engine (see ``shared/notes/engine-metrics.md`` for the table); running and
waiting are request counts, usage a fraction 0..1, capacity and used in tokens:

- vLLM: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc`` (``vllm:gpu_cache_usage_perc`` only when the new name is absent:
  old vLLM), ``vllm:num_preemptions_total`` (counter); capacity = labels ``num_gpu_blocks`` ×
  ``block_size`` of ``vllm:cache_config_info``; used = usage × capacity.
- SGLang (``--enable-metrics``): ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``,
  ``sglang:token_usage``; capacity = ``sglang:max_total_num_tokens``, else labels ``num_pages``
  × ``page_size`` of ``sglang:cache_config_info``; used = ``sglang:num_used_tokens``.
- TGI: ``tgi_batch_current_size``, ``tgi_queue_size``; no usage and no capacity (that is the
  ``--max-batch-total-tokens`` flag); used = ``tgi_batch_current_max_tokens``.
- trtllm-serve: ``trtllm_num_requests_running``, ``trtllm_num_requests_waiting``,
  ``trtllm_kv_cache_utilization``; capacity = ``trtllm_kv_cache_max_blocks`` ×
  ``trtllm_kv_cache_tokens_per_block``; used = usage × capacity.

Preemptions are read for vLLM only.

Sources: vLLM https://github.com/vllm-project/vllm/blob/main/vllm/v1/metrics/loggers.py and
https://github.com/vllm-project/vllm/blob/main/docs/design/metrics.md; SGLang
https://github.com/sgl-project/sglang/blob/main/python/sglang/srt/metrics/collector.py; TGI
https://github.com/huggingface/text-generation-inference/blob/main/docs/source/reference/metrics.md;
trtllm-serve names as mapped by llm-d
https://github.com/llm-d/llm-d-router/blob/main/pkg/epp/framework/plugins/datalayer/extractor/metrics/factories.go

Several label sets of one metric (vLLM labels ``model_name`` and, with data parallelism, one
``engine`` per DP rank, each with its own KV pool; SGLang ``dp_rank``...): counts (requests,
tokens, preemptions, capacity) are **summed**, the usage fraction is the **max** (the fullest
pool decides: conservative). vLLM's derived used tokens = max usage × summed capacity is hence
an upper bound when there are several pools. Two samples with the identical label set: the last
one wins.

Validity (field lesson L07: an endpoint with stale "idle" metrics attracted a flood, and
vLLM-Ascend reported ``kv_cache_usage_perc`` = −0.39): every value is checked; a non-finite or
negative value, a fraction outside [0, 1] (1e-6 slack, then clamped), or a count that is not a
whole number makes that field ``None`` with the reason in :attr:`EngineSample.invalid`. An
invalid value is never read as 0 (idle) nor as 1 (saturated): it is unknown.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from prometheus_client.parser import text_string_to_metric_families

Engine = Literal["vllm", "sglang", "tgi", "trtllm"]
Clock = Callable[[], float]

ENGINES: tuple[Engine, ...] = ("vllm", "sglang", "tgi", "trtllm")
"""Known engines, in the order used to break a detection tie."""

_PREFIX: dict[Engine, str] = {
    "vllm": "vllm:",
    "sglang": "sglang:",
    "tgi": "tgi_",
    "trtllm": "trtllm_",
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
        engine: ``"vllm"``, ``"sglang"``, ``"tgi"``, ``"trtllm"``, or None when not detected.
        running: requests in the running batch (count), summed over label sets.
        waiting: requests queued in the engine (count), summed.
        kv_usage: fraction of the KV pool in use, 0..1 (max over label sets).
        kv_capacity_tokens: KV pool size in tokens, when the engine reports it (summed).
        kv_used_tokens: KV tokens in use: reported (SGLang, TGI) or usage × capacity rounded up
            (vLLM, trtllm).
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
        any core name, the engine whose prefix (``vllm:``, ``sglang:``, ``tgi_``, ``trtllm_``)
        appears most often.

    Never raises: unparseable text gives ``EngineSample(ok=False, reason=...)``.
    """
    try:
        series = _collect(text)
    except Exception as exc:  # the parser raises ValueError and others on garbage
        return EngineSample(ok=False, reason=f"unparseable metrics text: {type(exc).__name__}")
    chosen = engine if engine in _PREFIX else _detect(series)
    if chosen is None:
        return EngineSample(
            ok=False, reason="no known engine metrics (vllm:, sglang:, tgi_, trtllm_)"
        )
    return _READERS[chosen](series)


def _collect(text: str) -> dict[str, dict[Labels, float]]:
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
}


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
    f = _Fields(series)
    f.count(RUNNING, "tgi_batch_current_size")
    f.count(WAITING, "tgi_queue_size")
    f.count(KV_USED, "tgi_batch_current_max_tokens")
    return f.sample("tgi")


def _trtllm(series: Mapping[str, Mapping[Labels, float]]) -> EngineSample:
    f = _Fields(series)
    f.count(RUNNING, "trtllm_num_requests_running")
    f.count(WAITING, "trtllm_num_requests_waiting")
    f.fraction(KV_USAGE, "trtllm_kv_cache_utilization")
    f.capacity_from_gauges("trtllm_kv_cache_max_blocks", "trtllm_kv_cache_tokens_per_block")
    f.positive_capacity()
    f.used_from_usage()
    return f.sample("trtllm")


_READERS: dict[str, Callable[[Mapping[str, Mapping[Labels, float]]], EngineSample]] = {
    "vllm": _vllm,
    "sglang": _sglang,
    "tgi": _tgi,
    "trtllm": _trtllm,
}


# -- staleness -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EngineReading:
    """What :meth:`EngineView.reading` knows about one pod at time ``now``.

    Attributes:
        sample: the last good sample if it is at most ``max_age_seconds`` old, else None.
        reason: why ``sample`` is None: ``"never_scraped"`` (no scrape recorded),
            ``"scrape_failed:<error>"`` (the latest scrape failed and no good sample is fresh
            enough), ``"stale"`` (the last good sample is too old and no failure since: the
            scraper itself is behind). None when ``sample`` is given.
        age_seconds: now − the time of the last good sample (seconds, >= 0), None if never.
        last_good_at: clock time of the last good sample, None if never.
        last_error: the error of the latest scrape when it failed, else None (a failed scrape
            does not hide a sample that is still fresh enough, but shows here).
    """

    sample: EngineSample | None
    reason: str | None
    age_seconds: float | None
    last_good_at: float | None
    last_error: str | None


@dataclass(slots=True)
class _PodState:
    good: EngineSample | None = None
    good_at: float | None = None
    error: str | None = None
    error_at: float | None = None


class EngineView:
    """The last engine sample per pod, with staleness. Pure: time comes from ``clock`` or the
    ``now``/``at`` arguments (seconds, monotonic); not thread-safe (one scraper loop owns it).

    A sample older than ``max_age_seconds`` is invalid, never idle nor saturated: field lesson
    L07 (stale metrics scored as saturated blocked dispatch; stale "idle" attracted a flood). A
    single failed scrape does not hide a sample that is still within the age limit, so one slow
    scrape does not flip admission.

    Args:
        scrape_interval: seconds between scrapes, > 0.
        max_age_seconds: how old a good sample may be; default 3 × ``scrape_interval``.
        clock: monotonic seconds, used when ``now``/``at`` are not given.

    Raises:
        ValueError: a non-positive interval or max age.
    """

    def __init__(
        self,
        scrape_interval: float = 5.0,
        max_age_seconds: float | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        if not scrape_interval > 0:
            raise ValueError("scrape_interval must be > 0")
        max_age = 3 * scrape_interval if max_age_seconds is None else max_age_seconds
        if not max_age > 0:
            raise ValueError("max_age_seconds must be > 0")
        self.scrape_interval = scrape_interval
        self.max_age_seconds = max_age
        self.clock = clock
        self._pods: dict[str, _PodState] = {}

    def record(self, pod: str, sample: EngineSample, at: float | None = None) -> None:
        """Record a scrape that returned a body, parsed into ``sample``. A sample that is not
        ``ok`` counts as a failed scrape (``"invalid: <reason>"``). A sample older than the one
        held is ignored (out-of-order scrapes)."""
        if not sample.ok:
            self.record_error(pod, f"invalid: {sample.reason}", at)
            return
        t = self.clock() if at is None else at
        state = self._pods.setdefault(pod, _PodState())
        if state.good_at is not None and t < state.good_at:
            return
        state.good, state.good_at = sample, t
        if state.error_at is not None and state.error_at <= t:
            state.error, state.error_at = None, None

    def record_text(
        self, pod: str, text: str, at: float | None = None, engine: str | None = None
    ) -> EngineSample:
        """Parse ``text`` (see :func:`parse_engine_metrics`, ``engine`` is its hint), record
        it, and return it."""
        sample = parse_engine_metrics(text, engine)
        self.record(pod, sample, at)
        return sample

    def record_error(self, pod: str, error: str, at: float | None = None) -> None:
        """Record a failed scrape (connection refused, timeout, HTTP status...): ``error`` is a
        short label such as ``"timeout"`` or ``"http_503"``."""
        t = self.clock() if at is None else at
        state = self._pods.setdefault(pod, _PodState())
        if state.good_at is not None and t < state.good_at:
            return
        state.error, state.error_at = error, t

    def forget(self, pod: str) -> None:
        """Drop a pod (deleted, or no longer on this node)."""
        self._pods.pop(pod, None)

    def pods(self) -> list[str]:
        """Pods with anything recorded, sorted."""
        return sorted(self._pods)

    def reading(self, pod: str, now: float | None = None) -> EngineReading:
        """What is known about ``pod`` at ``now`` (see :class:`EngineReading`)."""
        t = self.clock() if now is None else now
        state = self._pods.get(pod)
        if state is None:
            return EngineReading(None, "never_scraped", None, None, None)
        age = None if state.good_at is None else max(0.0, t - state.good_at)
        if state.good is not None and age is not None and age <= self.max_age_seconds:
            return EngineReading(state.good, None, age, state.good_at, state.error)
        if state.error is not None:
            reason = f"scrape_failed:{state.error}"
        elif state.good is None:
            reason = "never_scraped"
        else:
            reason = "stale"
        return EngineReading(None, reason, age, state.good_at, state.error)

    def current(self, pod: str, now: float | None = None) -> EngineSample | None:
        """The pod's last good sample if fresh enough, else None (why: :meth:`reading`)."""
        return self.reading(pod, now).sample

    def age_seconds(self, pod: str, now: float | None = None) -> float | None:
        """Seconds since the pod's last good sample (for a metric), None if never."""
        return self.reading(pod, now).age_seconds

    def readings(self, now: float | None = None) -> dict[str, EngineReading]:
        """:meth:`reading` for every recorded pod."""
        t = self.clock() if now is None else now
        return {pod: self.reading(pod, t) for pod in self.pods()}
