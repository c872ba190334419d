"""Reject precision and Retry-After error, by replaying a run with one thing changed.

The definitions are in :mod:`kvgate_bench.effectiveness.model.metrics`' docstring; this module does
the replays. Every replay runs the same schedule into a fresh engine through a fresh arm with
the same settings (``make_arm()``), so that, the driver being deterministic, it is the original
run up to the first changed event:

* :func:`replay_forced`: one rejected request bypasses the arm and goes to the engine at its
  arrival (:func:`~kvgate_bench.effectiveness.model.driver.simulate`'s ``force_dispatch``); did it
  meet its SLO (:func:`~kvgate_bench.effectiveness.model.metrics.met_slo`)?
* :func:`replay_probes`: copies of rejected requests are re-offered to the arm after their
  rejection at the probe deltas (``probes``), one outstanding at a time, until one is admitted;
  the delta of the admitted copy is the actual wait.

Each replay stops as soon as its answer is known (``stop_when_known``): what happens after the
forced request has finished, or after every probed request's wait is known, cannot change it.

:func:`sample_rejected` picks which rejected requests to replay (up to ``k``, seeded).
"""

from __future__ import annotations

import hashlib
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvgate_bench.effectiveness.model.driver import simulate
from kvgate_bench.effectiveness.model.gate import REJECTED, Arm, RequestRecord
from kvgate_bench.effectiveness.model.metrics import DEFAULT_SLO, Slo, met_slo
from kvgate_bench.effectiveness.model.schedule import Schedule
from kvgate_bench.sim.sequences import EngineConfig
from kvgate_bench.sim.steptime import StepTimeModel

#: Rejected requests replayed per run (for each figure).
DEFAULT_REPLAYS = 16
#: Seconds after a rejection at which a copy is re-offered (the suggested Retry-After is added).
PROBE_DELTAS_S: tuple[float, ...] = (
    0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 60.0, 120.0
)  # fmt: skip


def refused_by_arm(rec: RequestRecord) -> bool:
    """Whether the arm refused ``rec`` (not the engine's 400 for a request it cannot hold)."""
    return rec.outcome == REJECTED and rec.admitted_at is None


def _order_key(seed: int, rid: str) -> bytes:
    return hashlib.sha256(f"{seed}/{rid}".encode()).digest()


def sample_rejected(
    records: Sequence[RequestRecord], k: int, seed: int, *, with_retry_after: bool = False
) -> list[RequestRecord]:
    """Up to ``k`` of the requests the arm refused, in a seeded order (SHA-256 of
    ``"<seed>/<rid>"``): the same records for the same run and seed, whatever the process.
    ``with_retry_after``: only those that carried a Retry-After (the first ``k`` of them in
    the same order, so where every refusal carries one both samples are the same)."""
    pool = [
        r
        for r in records
        if refused_by_arm(r) and (not with_retry_after or r.retry_after_s is not None)
    ]
    pool.sort(key=lambda r: _order_key(seed, r.request.rid))
    return pool[: max(0, k)]


def replay_forced(
    schedule: Schedule,
    make_arm: Callable[[], Arm],
    steptime: StepTimeModel,
    rid: str,
    config: EngineConfig | None = None,
    slo: Slo = DEFAULT_SLO,
) -> tuple[bool, float]:
    """(whether request ``rid`` met its SLO (``slo``: the interactive (TTFT, TPOT), seconds)
    when dispatched at its arrival past the arm, CPU seconds the replay took). Raises
    ``KeyError`` for an id not in ``schedule``."""
    run = simulate(
        schedule,
        make_arm(),
        steptime,
        config,
        force_dispatch=frozenset({rid}),
        stop_when_known=True,
    )
    return met_slo(run.record(rid), *slo), run.cpu_s


def replay_probes(
    schedule: Schedule,
    make_arm: Callable[[], Arm],
    steptime: StepTimeModel,
    suggested: dict[str, float],
    config: EngineConfig | None = None,
    deltas: Sequence[float] = PROBE_DELTAS_S,
) -> tuple[dict[str, float | None], float]:
    """One replay probing every request of ``suggested`` (id -> its Retry-After, seconds) at
    ``deltas`` and at its own suggestion: (id -> actual wait, seconds, or None when no copy
    was admitted within the largest delta; CPU seconds). An id the arm did not reject in the
    replay is absent (the replay diverged: it does not happen with a deterministic arm)."""
    probes = {rid: sorted({*deltas, s} - {0.0}) for rid, s in suggested.items() if s >= 0}
    run = simulate(schedule, make_arm(), steptime, config, probes=probes, stop_when_known=True)
    return {rid: run.probe_waits[rid] for rid in suggested if rid in run.probe_waits}, run.cpu_s


def precision(met: Sequence[bool]) -> float | None:
    """The share of replayed rejections whose request would have missed its SLO (None for
    none)."""
    if not met:
        return None
    return sum(1 for m in met if not m) / len(met)


@dataclass(frozen=True)
class RetryAfterError:
    """Retry-After error over the probed rejections, seconds.

    Attributes:
        median_s: median of (suggested - actual) over those with an actual wait (positive:
            told to wait too long); None when there is none.
        median_abs_s: median of |suggested - actual|.
        samples: rejections probed with an actual wait.
        censored: rejections probed whose copies were all refused up to the largest delta.
    """

    median_s: float | None
    median_abs_s: float | None
    samples: int
    censored: int


def retry_after_error(
    suggested: dict[str, float], actual: dict[str, float | None]
) -> RetryAfterError:
    """:class:`RetryAfterError` of ``suggested`` (id -> Retry-After, s) against ``actual``
    (id -> actual wait, s, None when censored); ids absent from ``actual`` are ignored."""
    errs = [s - a for rid, s in suggested.items() if (a := actual.get(rid)) is not None]
    censored = sum(1 for rid in suggested if rid in actual and actual[rid] is None)
    if not errs:
        return RetryAfterError(None, None, 0, censored)
    return RetryAfterError(
        statistics.median(errs), statistics.median(abs(e) for e in errs), len(errs), censored
    )
