"""The virtual/real agreement: one schedule through one arm in virtual time and in real time
(:func:`compare`), and whether the two agree on goodput, preemptions and the well-behaved
tenants' SLO attainment (:class:`Agreement`, within :data:`GOODPUT_TOLERANCE`). See
:mod:`kvgate_bench.effectiveness.realtime`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvgate_bench.effectiveness.arms.context import ArmContext
from kvgate_bench.effectiveness.arms.registry import make_arm
from kvgate_bench.effectiveness.model.driver import simulate
from kvgate_bench.effectiveness.model.gate import (
    RunResult,
)
from kvgate_bench.effectiveness.model.metrics import summarize
from kvgate_bench.effectiveness.model.schedule import Schedule
from kvgate_bench.effectiveness.realtime.plan import (
    isolation_ratios,
)
from kvgate_bench.effectiveness.realtime.run import RealtimeRun, run_realtime
from kvgate_bench.effectiveness.realtime.servers import kvgate_arm
from kvgate_bench.sim.steptime import StepTimeModel

#: The arm that stands for kvgate in :func:`compare` and the test (switch when ``kvgate`` lands).
DEFAULT_KVGATE_ARM = "kvgate-bench-policy"


#: Relative tolerance of the virtual/real agreement on goodput and on preemptions.
GOODPUT_TOLERANCE = 0.10
#: Absolute tolerance on preemptions, counts: a request that joins the engine one step earlier
#: or later over HTTP can add or save a preemption or two; on a handful of preemptions 10 % is
#: below one.
PREEMPTIONS_ABS_TOLERANCE = 2


def preemptions_agree(virtual: int, real: int) -> bool:
    """``|real - virtual| <= max(10 % of the larger, 2)`` (counts over the whole run)."""
    tol = max(GOODPUT_TOLERANCE * max(virtual, real), PREEMPTIONS_ABS_TOLERANCE)
    return abs(real - virtual) <= tol


def well_behaved_agree(virtual: dict[str, Any], real: dict[str, Any]) -> bool:
    """The well-behaved tenants' SLO attainment (``summarize``'s
    ``well_behaved_slo_attainment``, 0..1) of the real run within :data:`GOODPUT_TOLERANCE` of
    the virtual one, relative; True when the schedule has no noisy tenant (None)."""
    v, r = virtual.get("well_behaved_slo_attainment"), real.get("well_behaved_slo_attainment")
    if v is None or r is None:
        return v is None and r is None
    return bool(abs(float(r) - float(v)) <= GOODPUT_TOLERANCE * float(v))


@dataclass(frozen=True)
class Agreement:
    """Virtual- and real-time figures of one arm on one schedule (``summarize`` rows)."""

    arm: str
    virtual: dict[str, Any]
    real: dict[str, Any]
    virtual_preemptions: int
    real_preemptions: int
    run: RealtimeRun
    #: The virtual-time run (its per-request records), when kept.
    virtual_run: RunResult | None = None

    @property
    def agree(self) -> bool:
        """Goodput within :data:`GOODPUT_TOLERANCE`, preemptions within
        :func:`preemptions_agree` and, for a schedule with a noisy tenant, the well-behaved
        tenants' SLO attainment within :func:`well_behaved_agree`."""
        return (
            abs(self.goodput_ratio - 1.0) <= GOODPUT_TOLERANCE
            and preemptions_agree(self.virtual_preemptions, self.real_preemptions)
            and well_behaved_agree(self.virtual, self.real)
        )

    @property
    def goodput_ratio(self) -> float:
        """Real-time goodput / virtual-time goodput (1.0 when both are 0)."""
        v, r = self.virtual["goodput_tokens_per_s"], self.real["goodput_tokens_per_s"]
        return 1.0 if v == r == 0 else (r / v if v else float("inf"))

    @property
    def isolation_ratios(self) -> dict[str, float | None]:
        """Real / virtual goodput and well-behaved SLO attainment (all, worst tenant):
        :func:`~kvgate_bench.effectiveness.realtime.plan.isolation_ratios`."""
        return isolation_ratios(self.virtual, self.real)


async def compare(
    schedule: Schedule,
    arm: str,
    ctx: ArmContext,
    profile_name: str,
    steptime: StepTimeModel,
    *,
    time_scale: float = 1.0,
    sim_subprocess: bool = True,
    sidecar_process: bool = False,
    chat: bool = False,
    real_profile: str | None = None,
) -> Agreement:
    """Run ``schedule`` through ``arm`` in virtual time (``steptime``, ``ctx.engine``) and in
    real time (kvgate-sim on ``real_profile`` or ``profile_name``, same engine). Raises
    ``ValueError`` for an arm with no real-time counterpart (see :func:`arm_policy`)."""
    kvgate_arm(arm, ctx)  # refuse a baseline before running anything
    run_v = simulate(schedule, make_arm(arm, ctx, {}), steptime, ctx.engine)
    run_r = await run_realtime(
        schedule,
        arm,
        ctx,
        real_profile or profile_name,
        time_scale=time_scale,
        sim_subprocess=sim_subprocess,
        sidecar_process=sidecar_process,
        chat=chat,
    )
    return Agreement(
        arm,
        summarize(run_v),
        summarize(run_r.result),
        sum(r.preemptions for r in run_v.records),
        sum(r.preemptions for r in run_r.result.records),
        run_r,
        run_v,
    )
