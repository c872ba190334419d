"""Figures of one run: goodput, SLO attainment, latency percentiles, preemptions, fairness.

Definitions (times in seconds, lengths in tokens):

* **SLO** of a request: ``interactive``: TTFT <= :data:`TTFT_SLO_S` (0.5 s) and TPOT <=
  :data:`TPOT_SLO_S` (50 ms); ``batch``: finished within :data:`BATCH_SLO_S` (10 min) of its
  arrival. A rejected request misses; so does a degraded one cut below the output it would
  have produced undegraded (the client did not get its answer).
* **TTFT** = first token's time - arrival (queueing in the arm included); **TPOT** = (finish -
  first token) / (output tokens - 1), 0 for a one-token output.
* **Goodput** = output tokens of the requests that met their SLO / the run's span;
  **throughput** = all output tokens / the span. The span is ``max(schedule duration, last
  finish)``: the run drains, so an arm that lets a backlog build up is charged the time it
  takes to clear it.
* **Preemptions per 1,000 requests** = engine preemptions x 1000 / requests in the schedule.
* **Jain's index** (Jain, Chiu and Hawe, 1984, https://arxiv.org/abs/cs/9809099): per
  60-second window, over the tenants backlogged in it, of their weighted service x_i = output
  tokens served in the window / weight (a request's tokens spread evenly between its first
  token and its finish): ``(sum x)^2 / (n sum x^2)``; the mean over windows with at least two
  backlogged tenants, None when there is none. A tenant is backlogged in a window when its
  demand was not met at once: a request of its waited for its first token (in the arm's queue,
  the engine's queue or its prefill) during at least half of the window, or one arriving in
  the window was refused. A tenant whose requests all start promptly is not backlogged: it got
  what it asked for, whatever its share.
* **Class service ratio** (``class_service_ratio``; schedules whose tenants declare two
  classes of different weights, ``tiers``: premium weight 4 over regular weight 1; None
  otherwise): over the 60-second windows where both classes are backlogged (at least one
  tenant of each backlogged, as for Jain's index), the heavier class's output tokens served
  (all its tenants', spread as above) / the lighter class's, summed over those windows. Not
  divided by the weights: the shares hold when it is the weights' ratio (4 for ``tiers``;
  issue 34's target >= 3.5). None when no window has both backlogged or the lighter class got
  nothing in them. In the pool it is pool-wide: the records are the client requests'.
* **Isolation** (schedules with a tenant named ``noisy``; None otherwise): the *well-behaved*
  tenants are all the others. ``well_behaved_slo_attainment`` = their requests that met their
  SLO / their requests; ``well_behaved_min_tenant_slo_attainment`` = the lowest of the same
  ratio per well-behaved tenant (tenants that sent nothing left out);
  ``noisy_goodput_tokens_per_s`` = output tokens of ``noisy``'s requests that met their SLO /
  the span.
* **Prefix reuse share** (schedules with sessions, ``multi-turn``, only: the key is absent
  otherwise) = prompt tokens the engine found in its prefix cache / prompt tokens of the
  requests served (degraded ones included), over the run.
* **KV utilisation** = the time average of the engine's KV usage (used / total blocks, read
  after each step) over the span.

By replay (:mod:`kvgate_bench.effectiveness.replay`, run by
:func:`kvgate_bench.effectiveness.runner.replay_best` for the reported rows only: each arm's
best setting per workload and load, every seed). A replay runs the same schedule into a fresh
engine through a fresh arm of the same setting; the driver being deterministic, it is the
original run up to the first changed event. The sample: of the requests the *arm* refused (not
the engine's 400 for a request it cannot hold), the first K (``--replays``, default 16) in the
order of SHA-256(``"<seed>/<request id>"``): seeded, the same in every process.

* **Reject precision** = the share of the sampled refused requests that would have missed
  their SLO had they been admitted: for each, one replay in which that request alone bypasses
  the arm and enters the engine's queue at its arrival time, with the client's max_tokens
  (the engine's default when unset); the arm never sees it, the other requests are decided
  as before and compete with it. Missed = not :func:`met_slo` in that replay. None when the
  arm refused nothing (``reject_replays``: the replays behind the figure).
* **Retry-After error**, for the sampled refused requests that carried a Retry-After (the first K
  of them in the same order), seconds: for each, one replay in which, once refused, it is
  re-offered to the arm as a new arrival (a copy, same tenant and lengths) at ``t_reject + delta``
  for delta in :data:`~kvgate_bench.effectiveness.replay.PROBE_DELTAS_S` (0.1 s to 120 s) and its
  own Retry-After; one copy outstanding at a time (a probe time that comes while the previous copy
  waits in the arm's queue is skipped), until the arm admits one (at once or from its queue: a
  retry that queued and was then served succeeded, its wait counted from its offer). The admitted
  copy runs in the engine, as the retry of a client that honoured the header would. The *actual*
  wait is the delta of the admitted copy (to the grid's resolution: the true earliest success lies
  after the previous probe time); a request with no copy admitted by the last delta is *censored*
  (``retry_after_censored``) and left out. The figure: ``retry_after_error_s`` = median of
  (suggested - actual), signed (positive: told to wait longer than needed; negative: told a time
  at which a retry is still refused); ``retry_after_abs_error_s`` = median of |suggested -
  actual|; ``retry_after_samples`` = how many had an actual wait. None when no refusal carried a
  Retry-After (``concurrency-cap`` and ``saturation-shed`` send none).
* ``replay_cpu_s``: CPU seconds (process time) the row's replays took, schedule generation
  included. Each replay stops once its answer is known (the forced request finished, every
  probed request's wait known).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvgate_bench.effectiveness.model.gate import DEGRADED, REJECTED, RequestRecord, RunResult
from kvgate_bench.effectiveness.model.schedule import BATCH, INTERACTIVE, Tenant
from kvgate_bench.kit.toolkit import percentile

TTFT_SLO_S = 0.5
TPOT_SLO_S = 0.050
BATCH_SLO_S = 600.0
JAIN_WINDOW_S = 60.0
#: Share of a window a tenant's requests must spend waiting for it to count as backlogged.
BACKLOG_FRACTION = 0.5


def ttft_s(rec: RequestRecord) -> float | None:
    """Time to first token, seconds (None when it produced none)."""
    if rec.first_token_at is None:
        return None
    return rec.first_token_at - rec.request.arrival_s


def tpot_s(rec: RequestRecord) -> float | None:
    """Time per output token after the first, seconds (None when not served)."""
    if rec.first_token_at is None or rec.finished_at is None or rec.outcome == REJECTED:
        return None
    if rec.output_tokens <= 1:
        return 0.0
    return (rec.finished_at - rec.first_token_at) / (rec.output_tokens - 1)


def met_slo(
    rec: RequestRecord, ttft_slo_s: float = TTFT_SLO_S, tpot_slo_s: float = TPOT_SLO_S
) -> bool:
    """Whether ``rec`` met its tier's SLO (see the module docstring); ``ttft_slo_s`` and
    ``tpot_slo_s`` (seconds) replace the interactive tier's for an engine of another speed
    (:mod:`kvgate_bench.real_engine` calibrates them on llama-server)."""
    if rec.outcome == REJECTED or rec.finished_at is None or rec.truncated_by_arm:
        return False
    if rec.request.tier == BATCH:
        return rec.finished_at - rec.request.arrival_s <= BATCH_SLO_S
    ttft, tpot = ttft_s(rec), tpot_s(rec)
    return ttft is not None and tpot is not None and ttft <= ttft_slo_s and tpot <= tpot_slo_s


def jain(values: Iterable[float]) -> float | None:
    """Jain's fairness index of ``values``: ``(sum x)^2 / (n sum x^2)``, in [1/n, 1]; None for
    no values or all zero."""
    xs = list(values)
    sq = sum(x * x for x in xs)
    if not xs or sq == 0:
        return None
    return sum(xs) ** 2 / (len(xs) * sq)


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


@dataclass(frozen=True)
class WindowService:
    """Per tenant and ``window_s`` window: output tokens served (``service``) and whether it
    was backlogged (``backlogged``), as the module docstring defines both."""

    window_s: float
    service: dict[str, list[float]]
    backlogged: dict[str, list[bool]]


def window_service(
    records: list[RequestRecord],
    tenants: dict[str, Tenant],
    span_s: float,
    window_s: float = JAIN_WINDOW_S,
) -> WindowService | None:
    """Each tenant's service and backlog per whole window of the span; None for no window."""
    n_windows = int(span_s // window_s)
    if n_windows < 1:
        return None
    waiting: dict[str, list[tuple[float, float]]] = {name: [] for name in tenants}
    refused = {name: [False] * n_windows for name in tenants}
    service = {name: [0.0] * n_windows for name in tenants}
    for rec in records:
        req = rec.request
        if rec.outcome == REJECTED or rec.first_token_at is None:
            k = int(req.arrival_s // window_s)
            if rec.outcome == REJECTED and k < n_windows:
                refused[req.tenant][k] = True
            continue
        waiting[req.tenant].append((req.arrival_s, rec.first_token_at))
        a = rec.first_token_at
        b = rec.finished_at if rec.finished_at is not None else span_s
        sv = service[req.tenant]
        if b <= a:
            if b < n_windows * window_s:
                sv[int(b // window_s)] += rec.output_tokens
            continue
        rate = rec.output_tokens / (b - a)
        k = int(a // window_s)
        while k < n_windows and k * window_s < b:
            lo, hi = max(a, k * window_s), min(b, (k + 1) * window_s)
            if hi > lo:
                sv[k] += rate * (hi - lo)
            k += 1
    backlogged: dict[str, list[bool]] = {}
    for name, iv in waiting.items():
        spans = _merged(iv)
        backlogged[name] = [
            refused[name][k]
            or sum(max(0.0, min(b, (k + 1) * window_s) - max(a, k * window_s)) for a, b in spans)
            >= BACKLOG_FRACTION * window_s
            for k in range(n_windows)
        ]
    return WindowService(window_s, service, backlogged)


def windowed_jain(
    records: list[RequestRecord],
    tenants: dict[str, Tenant],
    span_s: float,
    window_s: float = JAIN_WINDOW_S,
) -> float | None:
    """Mean Jain's index of backlogged tenants' weighted service per window (module docstring)."""
    ws = window_service(records, tenants, span_s, window_s)
    if ws is None:
        return None
    scores: list[float] = []
    for k in range(int(span_s // window_s)):
        xs = [ws.service[n][k] / tenants[n].weight for n in tenants if ws.backlogged[n][k]]
        if len(xs) >= 2:
            j = jain(xs)
            if j is not None:
                scores.append(j)
    return sum(scores) / len(scores) if scores else None


def class_service_ratio(
    records: list[RequestRecord],
    tenants: dict[str, Tenant],
    span_s: float,
    window_s: float = JAIN_WINDOW_S,
) -> float | None:
    """The heavier class's output service over the lighter's, over the windows where both are
    backlogged (module docstring); None without two declared classes of different weights,
    without such a window, or when the lighter class got nothing in them."""
    weights: dict[str, float] = {}
    for t in tenants.values():
        if t.class_name is not None:
            weights[t.class_name] = max(weights.get(t.class_name, 0.0), t.weight)
    if len(weights) != 2 or len(set(weights.values())) != 2:
        return None
    light, heavy = sorted(weights, key=lambda c: weights[c])
    ws = window_service(records, tenants, span_s, window_s)
    if ws is None:
        return None
    members = {c: [n for n, t in tenants.items() if t.class_name == c] for c in weights}
    served = {light: 0.0, heavy: 0.0}
    windows = 0
    for k in range(int(span_s // window_s)):
        if all(any(ws.backlogged[n][k] for n in members[c]) for c in served):
            windows += 1
            for c in served:
                served[c] += sum(ws.service[n][k] for n in members[c])
    if windows == 0 or served[light] <= 0:
        return None
    return served[heavy] / served[light]


@dataclass(frozen=True)
class TierStats:
    """Latency percentiles of one tier's served requests, seconds (None when none served)."""

    requests: int
    met: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    tpot_p99_s: float | None


#: An interactive SLO as (TTFT, TPOT) seconds.
Slo = tuple[float, float]
#: The SLO of the module docstring.
DEFAULT_SLO: Slo = (TTFT_SLO_S, TPOT_SLO_S)


def _tier_stats(records: list[RequestRecord], slo: Slo = DEFAULT_SLO) -> TierStats:
    ttfts = [x for x in (ttft_s(r) for r in records) if x is not None]
    tpots = [x for x in (tpot_s(r) for r in records) if x is not None]
    return TierStats(
        len(records),
        sum(1 for r in records if met_slo(r, *slo)),
        percentile(ttfts, 50),
        percentile(ttfts, 99),
        percentile(tpots, 50),
        percentile(tpots, 99),
    )


#: The tenant the isolation figures set apart from the well-behaved ones.
NOISY_TENANT = "noisy"


def isolation_figures(
    records: list[RequestRecord], span_s: float, slo: Slo = DEFAULT_SLO
) -> dict[str, float | None]:
    """``well_behaved_slo_attainment``, ``well_behaved_min_tenant_slo_attainment`` (0..1) and
    ``noisy_goodput_tokens_per_s`` (output tokens/s over ``span_s`` seconds) of ``records``
    under ``slo`` (see the module docstring); all None when no record is the noisy tenant's."""
    if not any(r.request.tenant == NOISY_TENANT for r in records):
        return dict.fromkeys(
            (
                "well_behaved_slo_attainment",
                "well_behaved_min_tenant_slo_attainment",
                "noisy_goodput_tokens_per_s",
            )
        )
    met: dict[str, list[int]] = {}  # tenant -> [met, requests]
    noisy_tokens = 0
    for r in records:
        ok = met_slo(r, *slo)
        if r.request.tenant == NOISY_TENANT:
            noisy_tokens += r.output_tokens if ok else 0
            continue
        m = met.setdefault(r.request.tenant, [0, 0])
        m[0] += ok
        m[1] += 1
    total = sum(m[1] for m in met.values())
    return {
        "well_behaved_slo_attainment": (sum(m[0] for m in met.values()) / total if total else None),
        "well_behaved_min_tenant_slo_attainment": (
            min(m[0] / m[1] for m in met.values()) if met else None
        ),
        "noisy_goodput_tokens_per_s": noisy_tokens / span_s,
    }


def prefix_reuse_share(records: list[RequestRecord]) -> float | None:
    """Cached prompt tokens / prompt tokens of the served (and degraded) ``records``, in 0..1;
    None when none was served."""
    served = [r for r in records if r.outcome != REJECTED and r.finished_at is not None]
    prompts = sum(r.request.prompt_tokens for r in served)
    return sum(r.cached_tokens for r in served) / prompts if prompts else None


def summarize(run: RunResult, slo: Slo = DEFAULT_SLO) -> dict[str, Any]:
    """The figures of ``run`` as a JSON-ready dict: the keys of the issue's ``--json`` rows
    (less ``workload``, ``load``, ``arm`` and ``seed``, which the caller adds) plus ``params``,
    ``requests``, ``ttft_p50_s``, ``tpot_p50_s``, ``tiers`` (per-tier counts and
    percentiles), ``span_s``, ``cpu_s``, the isolation figures (:func:`isolation_figures`) and,
    for a schedule with sessions, ``prefix_reuse_share`` (:func:`prefix_reuse_share`). ``slo``:
    the interactive (TTFT, TPOT) SLO scored, seconds (default the module docstring's)."""
    sched = run.schedule
    records = run.records
    span = max(sched.duration_s, run.end_s)
    n = len(records)
    good = [r for r in records if met_slo(r, *slo)]
    goodput = sum(r.output_tokens for r in good) / span
    interactive_good = sum(r.output_tokens for r in good if r.request.tier == INTERACTIVE) / span
    served = [r for r in records if r.outcome != REJECTED]
    throughput = sum(r.output_tokens for r in served) / span
    preemptions = sum(r.preemptions for r in records)
    tiers = {}
    for tier in (INTERACTIVE, BATCH):
        recs = [r for r in records if r.request.tier == tier]
        if recs:
            tiers[tier] = _tier_stats(recs, slo)
    headline = tiers.get(INTERACTIVE) or _tier_stats(records, slo)
    reuse = {} if sched.sessions is None else {"prefix_reuse_share": prefix_reuse_share(records)}
    return {
        "params": dict(run.params),
        "requests": n,
        "goodput_tokens_per_s": goodput,
        "interactive_goodput_tokens_per_s": interactive_good,
        "throughput_tokens_per_s": throughput,
        "slo_attainment": len(good) / n if n else None,
        "preemptions_per_1k": preemptions * 1000.0 / n if n else None,
        "ttft_p50_s": headline.ttft_p50_s,
        "ttft_p99_s": headline.ttft_p99_s,
        "tpot_p50_s": headline.tpot_p50_s,
        "tpot_p99_s": headline.tpot_p99_s,
        "jain": windowed_jain(records, sched.tenants, span),
        "class_service_ratio": class_service_ratio(records, sched.tenants, span),
        "reject_precision": None,  # by replay: kvgate_bench.effectiveness.runner.replay_best
        "reject_replays": 0,
        "retry_after_error_s": None,
        "retry_after_abs_error_s": None,
        "retry_after_samples": 0,
        "retry_after_censored": 0,
        **isolation_figures(records, span, slo),
        "kv_utilisation": run.kv_busy_s / span,
        "rejected": sum(1 for r in records if r.outcome == REJECTED),
        "degraded": sum(1 for r in records if r.outcome == DEGRADED),
        "tiers": {
            tier: {
                "requests": s.requests,
                "slo_met": s.met,
                "ttft_p50_s": s.ttft_p50_s,
                "ttft_p99_s": s.ttft_p99_s,
                "tpot_p50_s": s.tpot_p50_s,
                "tpot_p99_s": s.tpot_p99_s,
            }
            for tier, s in tiers.items()
        },
        "span_s": span,
        "cpu_s": run.cpu_s,
        **reuse,
    }


def ratio_text(a: float | None, b: float | None) -> str:
    """``a / b`` as ``1.23x`` for reports; ``-`` when undefined; ``>100x`` when ``b`` is (nearly)
    nothing next to ``a``."""
    if a is None or b is None or (a == 0 and b == 0):
        return "-"
    if b <= 0 or a / b > 100:
        return ">100x"
    return f"{a / b:.2f}x"
