"""The field's new fair queues as baselines (issue 34): Dynamo's policy-class queues
(``dynamo-drr``) and hivenet_router's occupancy budget (``occupancy-budget``), on a virtual
clock (times passed in; the engine never steps)."""

from __future__ import annotations

import pytest

from kvgate_bench.effectiveness.arms.context import ArmContext
from kvgate_bench.effectiveness.arms.dynamo_drr import DynamoDrrArm
from kvgate_bench.effectiveness.arms.occupancy_budget import OccupancyBudgetArm
from kvgate_bench.effectiveness.arms.registry import BASELINES, candidates, make_arm
from kvgate_bench.effectiveness.model.gate import PENDING, REJECTED
from kvgate_bench.effectiveness.model.schedule import BATCH, INTERACTIVE, Request, Tenant
from kvgate_bench.effectiveness.model.workloads import tenants_of
from tests.order_gate import ENGINE, OrderGate


def ctx(*tenants: Tenant) -> ArmContext:
    return ArmContext(ENGINE, {t.name: t for t in tenants}, 4.0, 4.0 * 1400)


def req(
    rid: str,
    tenant: str = "a",
    prompt: int = 100,
    tier: str = INTERACTIVE,
    max_tokens: int | None = 64,
) -> Request:
    return Request(rid, 0.0, tenant, tier, prompt, max_tokens, 32)


# --- dynamo-drr -----------------------------------------------------------------------------


class Held(DynamoDrrArm):
    """Dynamo's queues with the worker held busy: everything waits, pop_next gives the order."""

    def busy(self) -> bool:
        return True


def started(arm: DynamoDrrArm, rs: list[Request], at: list[float] | None = None) -> OrderGate:
    gate = OrderGate(rs)
    arm.start(gate, 0.0)
    for i, r in enumerate(rs):
        arm.on_arrival(r, 0.0 if at is None else at[i])
    return gate


def drain(arm: DynamoDrrArm) -> list[str]:
    out: list[str] = []
    while (r := arm.pop_next()) is not None:
        out.append(r.rid)
    return out


def test_drr_serves_classes_by_weight_in_uncached_tokens() -> None:
    c = ctx(Tenant("a", INTERACTIVE, weight=1.0), Tenant("b", INTERACTIVE, weight=2.0))
    arm = Held(c, classes="tenant", quantum=100)
    rs = [req(f"a{i}", "a") for i in (1, 2, 3)] + [req(f"b{i}", "b") for i in (1, 2, 3, 4)]
    gate = started(arm, rs)
    assert gate.order == [] and arm.queued() == 7
    # Each round a pays one 100-token prompt, b (weight 2) two.
    assert drain(arm) == ["a1", "b1", "b2", "a2", "b3", "b4", "a3"]


def test_drr_charges_the_prompt_so_a_long_one_waits_its_rounds() -> None:
    c = ctx(Tenant("a", INTERACTIVE), Tenant("b", INTERACTIVE))
    arm = Held(c, classes="tenant", quantum=100)
    rs = [req("a1", "a", prompt=250)] + [req(f"b{i}", "b") for i in (1, 2, 3)]
    started(arm, rs)
    assert drain(arm) == ["b1", "b2", "a1", "b3"]  # a saves up three rounds for 250 tokens
    # Rounds where no head is affordable are added in bulk: a huge prompt costs no spinning.
    big = Held(c, classes="tenant", quantum=1)
    started(big, [req("a1", "a", prompt=8000), req("b1", "b", prompt=7000)])
    assert drain(big) == ["b1", "a1"]


def test_drr_is_edf_within_a_class_and_fcfs_among_equal_slos() -> None:
    c = ctx(*tenants_of("multi-tenant"))
    arm = Held(c, classes="default")
    rs = [
        req("batch1", "batch", tier=BATCH),
        req("chat1", "chat-a"),
        req("chat2", "chat-b"),
        req("chat3", "chat-a"),
    ]
    started(arm, rs, at=[0.0, 0.2, 0.1, 0.3])
    # One class: deadline = arrival + TTFT SLO (0.5 s), batch's 600 s bound puts it last.
    assert drain(arm) == ["chat2", "chat1", "chat3", "batch1"]


def test_drr_refuses_over_the_class_queue_limit_and_dispatches_while_not_busy() -> None:
    c = ctx(Tenant("a", INTERACTIVE), Tenant("b", INTERACTIVE))
    held = Held(c, classes="tenant", queue_limit=2)
    rs = [req("a1", "a"), req("a2", "a"), req("a3", "a"), req("b1", "b")]
    gate = started(held, rs)
    assert gate.record("a3").outcome == REJECTED and held.refused == 1
    assert gate.record("b1").outcome == PENDING  # b's queue has its own limit
    # Room: dispatch while active prefill tokens <= busy_frac x max_num_batched_tokens.
    arm = DynamoDrrArm(c, classes="tenant", busy_frac=0.25)  # 2048 tokens
    rs = [req(f"r{i}", "a", prompt=1000) for i in range(5)]
    gate = started(arm, rs)
    assert gate.order == ["r0", "r1", "r2"] and arm.active_prefill == 3000  # 2000 <= 2048
    arm.on_tokens({"r0": 0, "r1": 0}, 0.1)  # two prefills done: 1000 in prefill, room again
    assert gate.order == ["r0", "r1", "r2", "r3", "r4"] and arm.queued() == 0


def test_drr_with_a_kv_threshold_holds_while_the_engine_reports_more() -> None:
    c = ctx(Tenant("a", INTERACTIVE))
    arm = DynamoDrrArm(c, classes="tenant", busy_frac=16.0, kv_frac=0.01)  # 327 tokens of KV
    rs = [req("r0", prompt=1000), req("r1", prompt=1000)]
    gate = started(arm, rs[:1])
    assert gate.order == ["r0"] and not arm.busy()
    gate.engine.step()  # r0's prompt takes its blocks: KV usage 1000 / 32768 > 0.01
    arm.on_arrival(rs[1], 0.1)
    assert arm.busy() and arm.queued() == 1 and gate.order == ["r0"]


# --- occupancy-budget -----------------------------------------------------------------------


def test_occupancy_admits_while_the_weighted_sum_stays_under_085_of_the_budget() -> None:
    c = ctx(Tenant("a", INTERACTIVE))
    arm = OccupancyBudgetArm(c, budget_kv=10_000 / c.kv_capacity_tokens)  # 8,500 tokens usable
    assert arm.budget_tokens == 10_000
    rs = [
        req("r0", prompt=3000, max_tokens=1000),  # weight 4000
        req("r1", prompt=4000, max_tokens=None),  # weight 4000, grows with its output
        req("r2", prompt=400, max_tokens=100),  # 8000 + 500 = 8500: fits exactly
        req("r3", prompt=1, max_tokens=None),  # 8501: does not
    ]
    gate = OrderGate(rs)
    arm.start(gate, 0.0)
    for r in rs:
        arm.on_arrival(r, 0.0)
    assert gate.order == ["r0", "r1", "r2"] and arm.in_flight_tokens == 8500
    assert gate.record("r3").outcome == PENDING  # held for its retry
    arm.on_tokens({"r1": 9, "r0": 9}, 0.05)  # r1 has written 10 tokens; r0 declared its 1000
    assert arm.in_flight_tokens == 8510


def test_occupancy_retries_once_after_250_ms_then_refuses_with_retry_after_1() -> None:
    c = ctx(Tenant("a", INTERACTIVE))
    arm = OccupancyBudgetArm(c, budget_kv=1000 / c.kv_capacity_tokens)  # 850 usable
    rs = [req("big", prompt=800), req("late", prompt=100, max_tokens=None)]
    rs += [req("fits", prompt=100, max_tokens=None), req("never", prompt=100)]
    gate = OrderGate(rs)
    arm.start(gate, 0.0)
    arm.on_arrival(rs[0], 0.0)  # 864 > 850: held
    assert gate.order == [] and arm.next_wake() == pytest.approx(0.25)
    arm.on_wake(0.25)  # still does not fit: 429, Retry-After 1
    assert gate.record("big").outcome == REJECTED
    assert gate.record("big").retry_after_s == 1.0 and gate.record("big").finished_at == 0.25
    arm.on_arrival(rs[1], 1.0)  # 100
    arm.on_arrival(rs[2], 1.0)  # 200
    arm.on_tokens({"late": 599}, 1.1)  # late grows to 700: the sum is 800
    arm.on_arrival(rs[3], 1.2)  # 164 would make 964: held until 1.45
    arm.on_finish(rs[1], 600, 1.3)  # late ends: the sum is 100
    assert arm.next_wake() == pytest.approx(1.45) and gate.record("never").outcome == PENDING
    arm.on_wake(1.45)  # admitted on its retry
    assert gate.order == ["late", "fits", "never"] and arm.refused == 1


def test_the_new_baselines_are_swept_registered_and_default() -> None:
    ten = {t.name: t for t in tenants_of("multi-tenant")}
    assert {"dynamo-drr", "occupancy-budget"} <= set(BASELINES)
    dd = candidates("dynamo-drr", ten, short=True)
    assert {c["classes"] for c in dd} == {"default", "tier", "tenant"}
    assert {c["kv_frac"] for c in dd} == {0.3, 0.5} and len({c["queue_limit"] for c in dd}) > 1
    assert {c["quantum"] for c in candidates("dynamo-drr", ten, short=False)} >= {256, 16384}
    ob = candidates("occupancy-budget", ten, short=False)
    assert {c["budget_kv"] for c in ob} >= {0.5, 1.0, 2.0}
    arm = make_arm("occupancy-budget", ctx(*ten.values()), {"budget_kv": 0.5})
    assert isinstance(arm, OccupancyBudgetArm) and arm.budget_tokens == 2048 * 16 // 2
