"""One operator pass run in the benchmark's own process against the cluster, phase by phase
(read, compute, plan), timed (:func:`time_pass`, seconds) and profiled (:func:`profile_pass`).
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time
from dataclasses import dataclass

from kvgate_bench.kit.controlplane import ControlPlane


@dataclass
class PassTiming:
    """One pass's read, compute and plan, seconds; the writes it plans."""

    read: float
    compute: float
    plan: float
    planned_writes: int


def time_pass(cp: ControlPlane, repeat: int, prof: cProfile.Profile | None = None) -> PassTiming:
    """Read, compute and plan as the operator's pass does (no writes), best of ``repeat``;
    under ``prof`` when given."""
    from kvgate_operator.desired import compute
    from kvgate_operator.plan import plan
    from kvgate_operator.reader import ClusterReader
    from kvgate_operator.reconciler import _now
    from kvgate_operator.settings import OperatorSettings

    timings = []
    with cp.api_client() as api:
        rec = ClusterReader(api, OperatorSettings())
        for _ in range(repeat):
            if prof is not None:
                prof.enable()
            t0 = time.perf_counter()
            observed = rec.read()
            t1 = time.perf_counter()
            desired = compute(observed.snapshot)
            t2 = time.perf_counter()
            todo = plan(desired, observed.node_specs, observed.policy_status, _now())
            t3 = time.perf_counter()
            if prof is not None:
                prof.disable()
            timings.append(PassTiming(t1 - t0, t2 - t1, t3 - t2, len(todo)))
    return min(timings, key=lambda p: p.read + p.compute + p.plan)


def profile_pass(cp: ControlPlane, top: int = 18) -> str:
    """cProfile of one read + compute + plan, by own time, then cumulative."""
    prof = cProfile.Profile()
    time_pass(cp, 1, prof)
    out = io.StringIO()
    st = pstats.Stats(prof, stream=out)
    st.sort_stats("tottime").print_stats(top)
    st.sort_stats("cumulative").print_stats(top)
    return out.getvalue()
