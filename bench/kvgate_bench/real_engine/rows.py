"""One JSON row of the real-engine benchmark from one run, real or virtual (pure).

A row is :func:`kvgate_bench.effectiveness.model.metrics.summarize`'s dict under the calibrated SLO
(``requests``, ``goodput_tokens_per_s``, ``slo_attainment``, ``well_behaved_slo_attainment``,
``ttft_p50_s``, ``tpot_p50_s``, ``rejected``, ...) with the cell's keys (``workload``,
``load``, ``arm``, ``seed``, ``profile``: the engine, ``llama-server`` or the fitted profile's
name) and (:func:`interval_fields`):

* ``good_tokens`` and ``served_tokens``: per request, in the schedule's order, its output
  tokens when it met its SLO (else 0) and when it was served (else 0): the bootstrap's input
  (:mod:`kvgate_bench.real_engine.stats`);
* ``goodput_ci95``: [lo, hi] tokens/s, bootstrap over requests, :data:`~kvgate_bench.
  real_engine.stats.RESAMPLES` resamples seeded by :func:`row_seed`;
* ``well_behaved_requests``, ``well_behaved_met`` and ``well_behaved_wilson_lo`` (Wilson's 95 %
  lower bound; None without a noisy tenant) and ``noisy_served`` (the noisy tenant's requests
  served);
* ``queue_wait_p50_s``: the median wait in the gate before the engine, seconds, of the admitted
  requests (the sidecar's own count, ``x-kvgate-queue-wait-ms``, for the ``kvgate`` arms);
  ``refused_share``: refused / requests.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from kvgate_bench.effectiveness.model.gate import REJECTED, RunResult
from kvgate_bench.effectiveness.model.metrics import NOISY_TENANT, Slo, met_slo, summarize
from kvgate_bench.kit.toolkit import percentile
from kvgate_bench.real_engine.stats import rate_ci95, wilson


def row_seed(*parts: object) -> int:
    """A bootstrap seed from the row's identity (SHA-256 of the parts: the same in every
    process)."""
    text = "/".join(str(p) for p in parts)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def interval_fields(
    run: RunResult, slo: Slo, seed: int, queue_waits_s: Mapping[str, float] | None = None
) -> dict[str, Any]:
    """The per-request vectors and intervals of the module docstring for ``run`` scored under
    ``slo`` (seconds); ``seed`` seeds the bootstrap; ``queue_waits_s`` (request id -> seconds)
    replaces ``admitted_at - arrival`` where the gate reported its own wait."""
    records = run.records
    span = max(run.schedule.duration_s, run.end_s)
    met = [met_slo(r, *slo) for r in records]
    good = [r.output_tokens if ok else 0 for r, ok in zip(records, met, strict=True)]
    served = [r.output_tokens if r.outcome != REJECTED else 0 for r in records]
    wb = [ok for r, ok in zip(records, met, strict=True) if r.request.tenant != NOISY_TENANT]
    has_noisy = any(r.request.tenant == NOISY_TENANT for r in records)
    bounds = wilson(sum(wb), len(wb)) if has_noisy else None
    waits: list[float] = []
    for r in records:
        if r.outcome == REJECTED or r.admitted_at is None:
            continue
        given = (queue_waits_s or {}).get(r.request.rid)
        waits.append(given if given is not None else max(0.0, r.admitted_at - r.request.arrival_s))
    n = len(records)
    return {
        "good_tokens": good,
        "served_tokens": served,
        "goodput_ci95": list(rate_ci95(good, span, seed)),
        "well_behaved_requests": len(wb) if has_noisy else None,
        "well_behaved_met": sum(wb) if has_noisy else None,
        "well_behaved_wilson_lo": bounds[0] if bounds else None,
        "noisy_served": sum(
            1 for r in records if r.request.tenant == NOISY_TENANT and r.outcome != REJECTED
        ),
        "queue_wait_p50_s": percentile(waits, 50) if waits else None,
        "refused_share": sum(1 for r in records if r.outcome == REJECTED) / n if n else None,
    }


def build_row(
    run: RunResult,
    slo: Slo,
    *,
    workload: str,
    load: float,
    arm: str,
    seed: int,
    profile: str,
    extra: Mapping[str, Any],
    queue_waits_s: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """The row of the module docstring: the cell's keys, ``summarize``'s figures, the
    intervals and ``extra`` (what only the real engine has, or the virtual row's setting)."""
    s = summarize(run, slo)
    iv = interval_fields(run, slo, row_seed(workload, load, arm, seed, profile), queue_waits_s)
    return {
        "workload": workload,
        "load": load,
        "arm": arm,
        "seed": seed,
        "profile": profile,
        **s,
        **iv,
        **extra,
    }


def output_stats(
    outputs: Mapping[str, int], finish: Mapping[str, str], ceiling: int | None = None
) -> dict[str, Any]:
    """The outputs' lengths (tokens) of the served requests: ``output_tokens_mean``, ``_p10``,
    ``_p50``, ``_p90``, ``_max``; ``eos_share``: the share of finished outputs llama-server ended
    with ``stop`` (the model's EOS, not a max_tokens cut); ``at_ceiling_share``: the share as
    long as ``ceiling`` (the run's max_tokens) when given."""
    xs = sorted(float(x) for x in outputs.values())
    ends = list(finish.values())
    out: dict[str, Any] = {"output_tokens_mean": sum(xs) / len(xs) if xs else None}
    for q in (10, 50, 90):
        out[f"output_tokens_p{q}"] = percentile(xs, q) if xs else None
    out["output_tokens_max"] = xs[-1] if xs else None
    out["eos_share"] = sum(1 for f in ends if f == "stop") / len(ends) if ends else None
    if ceiling is not None:
        out["at_ceiling_share"] = sum(1 for x in xs if x >= ceiling) / len(xs) if xs else None
    return out


#: Keys dropped from a row when it is printed or compared (the per-request vectors).
VECTOR_KEYS = ("good_tokens", "served_tokens")
