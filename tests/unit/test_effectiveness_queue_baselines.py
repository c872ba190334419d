"""The new baselines' mechanics on a virtual clock (times passed in; the engine never steps)
and the day-one kvgate arms' configuration."""

from __future__ import annotations

import math

import pytest

from kvgate_bench.effectiveness.arms.codel_gate import CodelGateArm
from kvgate_bench.effectiveness.arms.context import ArmContext
from kvgate_bench.effectiveness.arms.flow_control import FlowControlArm
from kvgate_bench.effectiveness.arms.kvgate_defaults import KvgateDefaultsArm
from kvgate_bench.effectiveness.arms.registry import candidates, make_arm
from kvgate_bench.effectiveness.arms.vllm_queue_limit import VllmQueueLimitArm
from kvgate_bench.effectiveness.model.gate import PENDING, REJECTED
from kvgate_bench.effectiveness.model.schedule import BATCH, INTERACTIVE, Request
from kvgate_bench.effectiveness.model.workloads import tenants_of
from tests.order_gate import ENGINE, OrderGate


def req(
    rid: str, tenant: str = "a", t: float = 0.0, tier: str = INTERACTIVE, prompt: int = 100
) -> Request:
    return Request(rid, t, tenant, tier, prompt, 64, 32)


# --- flow-control ---------------------------------------------------------------------------


class Blockable(FlowControlArm):
    """Flow control whose saturation detector the test sets."""

    blocked = True

    def saturated(self, now: float) -> bool:
        return self.blocked


def test_flow_control_round_robins_flows_fcfs_within_and_bands_first() -> None:
    rs = [
        req("d1", "d", tier=BATCH),
        req("a1", "a"), req("a2", "a"), req("a3", "a"),
        req("b1", "b"), req("b2", "b"),
        req("c1", "c"),
    ]  # fmt: skip
    gate = OrderGate(rs)
    arm = Blockable()
    arm.start(gate, 0.0)
    for r in rs:
        arm.on_arrival(r, 0.0)
    assert gate.order == []  # saturated: everything waits
    arm.blocked = False
    arm.on_wake(0.01)
    assert gate.order == ["a1", "b1", "c1", "a2", "b2", "a3", "d1"]


def test_flow_control_evicts_at_the_ttl_with_a_refusal() -> None:
    rs = [req("a1", "a", 0.0), req("a2", "a", 1.0)]
    gate = OrderGate(rs)
    arm = Blockable(ttl_s=5.0)
    arm.start(gate, 0.0)
    arm.on_arrival(rs[0], 0.0)
    arm.on_arrival(rs[1], 1.0)
    wake = arm.next_wake()
    assert wake is not None and wake <= 5.0
    arm.on_wake(4.99)
    assert gate.outcome("a1") == PENDING
    arm.on_wake(5.0)
    assert gate.outcome("a1") == REJECTED and gate.outcome("a2") == PENDING
    assert arm.evicted == 1
    arm.blocked = False
    arm.on_wake(5.5)
    assert gate.order == ["a2"]


def test_flow_control_dispatches_only_while_not_saturated() -> None:
    rs = [req(f"r{i}", f"t{i % 3}") for i in range(10)]
    gate = OrderGate(rs)
    arm = FlowControlArm(queue_threshold=5)
    arm.start(gate, 0.0)
    for r in rs:
        arm.on_arrival(r, 0.0)
    # The engine never steps: what is dispatched waits there; the detector stops at 5.
    assert len(gate.order) == 5 and gate.engine.num_waiting == 5
    arm.on_wake(0.05)  # a fresh scrape reads 5 waiting: still saturated
    assert len(gate.order) == 5
    assert arm.saturated(0.05) and arm.saturated(0.2501)  # and stale after 200 ms


# --- vllm-queue-limit -----------------------------------------------------------------------


def test_vllm_queue_limit_refuses_past_the_request_cap_at_once() -> None:
    rs = [req(f"r{i}") for i in range(5)]
    gate = OrderGate(rs)
    arm = VllmQueueLimitArm(3, None)
    arm.start(gate, 0.0)
    for r in rs[:4]:
        arm.on_arrival(r, 0.0)
    assert gate.order == ["r0", "r1", "r2"] and gate.outcome("r3") == REJECTED
    arm.on_finish(rs[0], 32, 1.0)
    arm.on_arrival(rs[4], 1.0)
    assert gate.order[-1] == "r4" and arm.in_flight == 3


def test_vllm_queue_limit_counts_prompt_tokens_until_the_first_token() -> None:
    rs = [req("r0", prompt=600), req("r1", prompt=500), req("r2", prompt=10), req("r3")]
    gate = OrderGate(rs)
    arm = VllmQueueLimitArm(None, 1000)
    arm.start(gate, 0.0)
    arm.on_arrival(rs[0], 0.0)
    arm.on_arrival(rs[1], 0.0)  # 600 < 1000: admitted (the new prompt is not counted)
    assert arm.prefill_tokens == 1100
    arm.on_arrival(rs[2], 0.0)  # the backlog reached the cap: refused, however small
    assert gate.outcome("r2") == REJECTED
    arm.on_tokens({"r0": 0}, 0.1)  # r0 left its prefill
    assert arm.prefill_tokens == 500
    arm.on_arrival(rs[3], 0.2)
    assert gate.order == ["r0", "r1", "r3"]


# --- codel-gate -----------------------------------------------------------------------------


def test_codel_drops_once_the_queue_stood_an_interval_and_sojourn_passed_target() -> None:
    rs = [req("r0", t=0.0), req("r1", t=0.0), req("r2", t=0.12), req("r3", t=0.19)]
    gate = OrderGate(rs)
    arm = CodelGateArm(cap=1, target_s=0.1, interval_s=0.2)
    arm.start(gate, 0.0)
    for r in rs:
        arm.on_arrival(r, r.arrival_s)
    assert gate.order == ["r0"]
    # r1 has waited past the target, but the queue has not stood an interval yet.
    assert not arm.congested(0.15)
    arm.on_wake(0.15)
    assert gate.outcome("r1") == PENDING
    assert arm.next_wake() == pytest.approx(0.2)
    arm.on_wake(0.2)  # congested: the prefix past the target (r1) is dropped, r2/r3 are not
    assert arm.congested(0.2)
    assert gate.outcome("r1") == REJECTED and arm.dropped == 1
    assert gate.outcome("r2") == PENDING and gate.outcome("r3") == PENDING
    arm.on_wake(0.221)  # r2 has now waited 0.101 s
    assert gate.outcome("r2") == REJECTED and gate.outcome("r3") == PENDING


def test_codel_serves_newest_first_while_congested_oldest_first_otherwise() -> None:
    rs = [req("r0"), req("r1", t=0.01), req("r2", t=0.02), req("r3", t=0.5), req("r4", t=0.51)]
    gate = OrderGate(rs)
    arm = CodelGateArm(cap=1, target_s=1.0, interval_s=1.0)
    arm.start(gate, 0.0)
    for r in rs[:3]:
        arm.on_arrival(r, r.arrival_s)
    arm.on_finish(rs[0], 32, 0.05)  # queued since 0.01: not congested, FIFO
    assert gate.order == ["r0", "r1"]
    for r in rs[3:]:
        arm.on_arrival(r, r.arrival_s)
    arm.on_finish(rs[1], 32, 1.2)  # the queue has stood since 0.02: congested, LIFO
    assert gate.order == ["r0", "r1", "r4"]
    assert gate.outcome("r2") == REJECTED  # waited 1.18 s > the 1 s target
    assert gate.outcome("r3") == PENDING


def test_new_baselines_sweep_their_knobs() -> None:
    ten = {t.name: t for t in tenants_of("multi-tenant")}
    fc = candidates("flow-control", ten, short=False)
    assert {c["ttl_s"] for c in fc} >= {60.0, 1.0} and {c["queue_threshold"] for c in fc} >= {5}
    vq = candidates("vllm-queue-limit", ten, short=True)
    assert {"max_num_queued_reqs": None, "max_num_queued_tokens": None} not in vq
    cg = candidates("codel-gate", ten, short=False)
    assert {c["target_s"] for c in cg} == {0.05, 0.1, 0.25, 0.5, 1.0}
    assert make_arm("codel-gate", CTX, cg[0]).params["interval_s"] == pytest.approx(0.1)


# --- the day-one kvgate arms ----------------------------------------------------------------

CTX = ArmContext(ENGINE, {t.name: t for t in tenants_of("multi-tenant")}, 4.0, 4.0 * 1400)


def test_kvgate_empty_takes_only_what_the_engine_reports() -> None:
    arm = make_arm("kvgate-empty", CTX, {})
    assert isinstance(arm, KvgateDefaultsArm) and arm.name == "kvgate-empty"
    cfg = arm.controller.config
    assert cfg.kv_capacity_tokens == 2048 * 16 and cfg.max_concurrency == ENGINE.max_num_seqs
    assert cfg.limits == () and cfg.ttft_slo_seconds is None and cfg.tpot_slo_seconds is None
    ar = arm.admission_request(req("x", "batch", tier=BATCH))
    assert ar.priority == 0 and ar.ttft_slo_seconds is None


def test_kvgate_slo_only_and_classes() -> None:
    slo = make_arm("kvgate-slo-only", CTX, {})
    assert isinstance(slo, KvgateDefaultsArm)
    cfg = slo.controller.config
    assert cfg.ttft_slo_seconds == 0.5 and cfg.tpot_slo_seconds == 0.05
    assert cfg.slo_min_priority == 0 and cfg.limits == ()
    assert slo.admission_request(req("x", "chat-a")).priority == 0
    cls = make_arm("kvgate", CTX, {})  # the README's recommended policy and its classes
    assert isinstance(cls, KvgateDefaultsArm) and cls.name == "kvgate"
    assert [c.name for c in cls.spec.tenants.classes] == ["batch-w100", "interactive-w100"]
    batch = cls.admission_request(req("y", "batch", tier=BATCH))
    chat = cls.admission_request(req("z", "chat-a"))
    assert batch.ttft_slo_seconds == math.inf and chat.ttft_slo_seconds == 0.5
    assert batch.weight == chat.weight == 1.0 and batch.priority == chat.priority == 0
    with pytest.raises(ValueError, match="unknown mode"):
        KvgateDefaultsArm(CTX, "nope")
