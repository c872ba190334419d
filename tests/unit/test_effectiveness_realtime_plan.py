"""The real-time driver's plan (:mod:`kvgate_bench.effectiveness.realtime.plan`): the schedule and
arms' context are the virtual-time runner's, the ``isolation`` load and options, and the
short-run agreement rule on the well-behaved tenants."""

from __future__ import annotations

import pytest

from kvgate_bench.effectiveness.calibration import calibrate
from kvgate_bench.effectiveness.model.gate import REJECTED, SERVED, RequestRecord
from kvgate_bench.effectiveness.model.schedule import Request
from kvgate_bench.effectiveness.model.workloads import isolation_load
from kvgate_bench.effectiveness.realtime.__main__ import parse_args
from kvgate_bench.effectiveness.realtime.plan import (
    isolation_agree,
    isolation_ratios,
    plan,
    ratio,
    schedule_load,
    well_behaved_agree,
)
from kvgate_bench.effectiveness.realtime.run import steptime_with_pool
from kvgate_bench.effectiveness.realtime.servers import arm_policy
from kvgate_bench.effectiveness.runner import Task, arm_factory

PROFILE = "h100-llama3-8b"


def test_isolation_plan_is_the_runners_schedule_and_policy() -> None:
    """Both drivers get the same schedule and the same kvgate policy (runner.arm_factory)."""
    steptime = steptime_with_pool(PROFILE, None)
    sched, ctx = plan("isolation", PROFILE, steptime, 20.0, 1, noisy_load=3.0)
    cal = calibrate("isolation", PROFILE, 20.0, 1)
    task = Task("isolation", isolation_load(3.0), 1, "kvgate-bench-policy", (), PROFILE, 20.0, cal)
    theirs, make, _ = arm_factory(task)
    assert sched.requests == theirs.requests and sched.rate_rps == theirs.rate_rps
    assert sched.rate_rps == pytest.approx(3.6 * cal.load1_rate_rps)
    arm = make()
    assert arm_policy("kvgate-bench-policy", ctx) == arm.policy()  # type: ignore[attr-defined]
    noisy = [r for r in sched.requests if r.tenant == "noisy"]
    assert all(r.max_tokens == min(4096, 8192 - r.prompt_tokens) for r in noisy)
    assert {r.tier for r in sched.requests} == {"interactive"}


def test_isolation_plan_at_a_rate_takes_it_as_load_point_six_plus_k() -> None:
    steptime = steptime_with_pool(PROFILE, 49_152)
    sched, ctx = plan("isolation", PROFILE, steptime, 5.0, 1, rate=18.0, noisy_load=2.0)
    assert sched.rate_rps == 18.0
    assert ctx.capacity_rps == pytest.approx(18.0 / 2.6)


def test_load_options() -> None:
    assert schedule_load("isolation", None, None) == 3.6
    assert schedule_load("isolation", None, 10.0) == 10.6
    assert schedule_load("conversation", 2.0, None) == 2.0
    assert schedule_load("conversation", None, None) == 1.0
    with pytest.raises(ValueError, match="noisy-load"):
        schedule_load("isolation", 2.0, None)
    with pytest.raises(ValueError, match="isolation only"):
        schedule_load("code", None, 3.0)


def rec(tenant: str, i: int, met: bool) -> RequestRecord:
    r = RequestRecord(Request(f"{tenant}-{i}", 0.0, tenant, "interactive", 10, 100, 10))
    if met:
        r.outcome, r.admitted_at, r.first_token_at, r.finished_at = SERVED, 0.0, 0.1, 0.5
        r.output_tokens = r.max_tokens_sent = 10
    else:
        r.outcome, r.finished_at = REJECTED, 0.0
    return r


def records(met: dict[str, list[bool]]) -> list[RequestRecord]:
    return [rec(t, i, m) for t, ms in met.items() for i, m in enumerate(ms)] + [
        rec("noisy", 0, False)
    ]


def test_well_behaved_agreement_allows_two_requests_or_one_of_the_smallest_tenant() -> None:
    base = {"chat-0": [True] * 4, "chat-1": [True] * 10}
    assert well_behaved_agree(records(base), records(base))[0]
    one = {"chat-0": [True] * 3 + [False], "chat-1": [True] * 10}
    assert well_behaved_agree(records(base), records(one))[0]  # 1 of 14; worst 1.0 -> 0.75
    two = {"chat-0": [True] * 2 + [False] * 2, "chat-1": [True] * 10}
    ok, why = well_behaved_agree(records(base), records(two))
    assert not ok and "worst tenant 1.000 / 0.500; tenants that differ: chat-0 4/2 of 4" in why
    three = {"chat-0": [True] * 4, "chat-1": [True] * 7 + [False] * 3}
    assert not well_behaved_agree(records(base), records(three))[0]  # 3 > max(1.4, 2)
    # Two tenants one request each the other way: the total and the worst within, each within.
    swap = {"chat-0": [True] * 3 + [False], "chat-1": [True] * 9 + [False]}
    assert well_behaved_agree(records(one), records(swap))[0]
    # Two requests of one tenant of ten: 2 > max(1.0, 1) although the total (2) is within.
    big = {"chat-0": [True] * 4, "chat-1": [True] * 8 + [False] * 2}
    assert not well_behaved_agree(records(base), records(big))[0]
    assert not well_behaved_agree(records(base), records({"chat-0": [True] * 4}))[0]


def test_isolation_ratios() -> None:
    v = {"goodput_tokens_per_s": 100.0, "well_behaved_slo_attainment": 0.9}
    r = {"goodput_tokens_per_s": 95.0, "well_behaved_slo_attainment": 0.95}
    assert isolation_ratios(v, r)["goodput_tokens_per_s"] == pytest.approx(0.95)
    assert not isolation_agree(v, r)  # the worst tenant's figure is missing
    v["well_behaved_min_tenant_slo_attainment"] = r["well_behaved_min_tenant_slo_attainment"] = 0
    assert isolation_agree(v, r)
    assert ratio(0, 0) == 1.0 and ratio(0, 1) == float("inf") and ratio(None, 1) is None


def test_the_command_line_takes_the_isolation_options() -> None:
    args = parse_args(["--workload", "isolation", "--noisy-load", "3", "--arm", "kvgate"])
    assert (args.workload, args.noisy_load, args.arm) == ("isolation", 3.0, "kvgate")
    assert parse_args([]).noisy_load is None  # the workload's default (3) applies
