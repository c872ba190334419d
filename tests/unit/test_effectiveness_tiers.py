"""Issue 34's class shares across the pool, benchmark side: the ``tiers`` workload, the
``epp-affinity`` router and the ``class_service_ratio`` row field (no real clock)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, cast

import pytest

from kvgate_bench.effectiveness.arms.context import ArmContext
from kvgate_bench.effectiveness.arms.dynamo_drr import DynamoDrrArm
from kvgate_bench.effectiveness.arms.kvgate_defaults import KvgateDefaultsArm, recommended_policy
from kvgate_bench.effectiveness.arms.registry import make_arm
from kvgate_bench.effectiveness.model.driver import engine_config
from kvgate_bench.effectiveness.model.gate import REJECTED, SERVED, RequestRecord, RunResult
from kvgate_bench.effectiveness.model.metrics import class_service_ratio, summarize
from kvgate_bench.effectiveness.model.schedule import INTERACTIVE, Request, Schedule, Tenant
from kvgate_bench.effectiveness.model.workloads import (
    ALL_WORKLOADS,
    WORKLOADS,
    calibration_workload,
    generate,
    tenants_of,
)
from kvgate_bench.effectiveness.pool.driver import simulate_pool
from kvgate_bench.effectiveness.pool.routers import (
    AFFINITY_QUEUE_THRESHOLD,
    ALL_ROUTERS,
    ROUTER_NAMES,
    EppAffinityRouter,
    EppRouter,
    Host,
    make_router,
)
from kvgate_bench.effectiveness.pool.runner import (
    ALL_POOL_ARMS,
    POOL_ARMS,
    build_pool_tasks,
    pairs,
    pool_candidates,
)
from kvgate_bench.sim.engine import SimEngine
from kvgate_bench.sim.sequences import EngineConfig
from kvgate_bench.sim.steptime import profile

STEPTIME = profile("h100-llama3-8b")
SMALL = EngineConfig(
    num_gpu_blocks=2048, max_model_len=8192, max_num_batched_tokens=8192, chunked_prefill=True
)
TIERS = {t.name: t for t in tenants_of("tiers")}


def tiers_context() -> ArmContext:
    return ArmContext(SMALL, TIERS, 4.0, 4.0 * 1400)


# --- the workload -------------------------------------------------------------------------


def test_tiers_has_two_classes_of_several_tenants_weighted_four_to_one() -> None:
    by_class: dict[str | None, list[Tenant]] = {}
    for t in TIERS.values():
        by_class.setdefault(t.class_name, []).append(t)
    assert set(by_class) == {"premium", "regular"}
    assert len(by_class["premium"]) == len(by_class["regular"]) >= 3
    assert {t.weight for t in by_class["premium"]} == {4.0}
    assert {t.weight for t in by_class["regular"]} == {1.0}
    assert all(t.tier == INTERACTIVE for t in TIERS.values())
    # Run when named only; measured against conversation (same lengths).
    assert "tiers" not in WORKLOADS and "tiers" in ALL_WORKLOADS
    assert calibration_workload("tiers") == "conversation"
    # Every other workload declares no class.
    assert all(t.class_name is None for w in WORKLOADS for t in tenants_of(w))


def test_both_classes_are_offered_over_their_share_at_2x() -> None:
    total_w = sum(t.weight for t in TIERS.values())
    total_d = sum(t.demand for t in TIERS.values())
    load = 2.0
    for cls in ("premium", "regular"):
        members = [t for t in TIERS.values() if t.class_name == cls]
        share = sum(t.weight for t in members) / total_w
        offered = load * sum(t.demand for t in members) / total_d  # x the capacity
        assert offered > share, cls
    # The schedule: each class about half the arrivals, every tenant sending.
    sched = generate("tiers", 40.0, 300.0, 1)
    per_tenant = Counter(r.tenant for r in sched.requests)
    assert set(per_tenant) == set(TIERS)
    premium = sum(n for t, n in per_tenant.items() if TIERS[t].class_name == "premium")
    assert premium / len(sched.requests) == pytest.approx(0.5, abs=0.03)
    assert sched.tenants == TIERS
    assert generate("tiers", 40.0, 300.0, 1).requests == sched.requests  # seeded


def test_kvgate_declares_the_classes_and_weighs_each_tenant_by_its_class() -> None:
    spec = recommended_policy(tiers_context())
    classes = {c["name"]: c for c in spec["tenants"]["classes"]}
    assert set(classes) == {"premium", "regular"}
    assert classes["premium"]["weight"] == 4.0 and classes["regular"]["weight"] == 1.0
    assert classes["premium"]["match"]["tenants"] == [f"premium-{i}" for i in range(4)]
    arm = KvgateDefaultsArm(tiers_context(), "recommended")
    for name, weight in (("premium-2", 4.0), ("regular-1", 1.0)):
        ar = arm.admission_request(Request("r", 0.0, name, INTERACTIVE, 100, 256, 50))
        assert ar.weight == weight
    # A workload without declared classes keeps its (tier, weight) class names.
    plain = ArmContext(SMALL, {t.name: t for t in tenants_of("multi-tenant")}, 4.0, 5600.0)
    names = [c["name"] for c in recommended_policy(plain)["tenants"]["classes"]]
    assert names == ["batch-w100", "interactive-w100"]


def test_dynamo_drr_gets_the_declared_classes_with_their_weights() -> None:
    arm = make_arm("dynamo-drr", tiers_context(), {"classes": "tier"})
    assert isinstance(arm, DynamoDrrArm)
    classes = {(c.name, c.weight) for c in arm._class_of.values()}
    assert classes == {("premium", 4.0), ("regular", 1.0)}
    # In the pool it is swept with those classes only (as its users would declare them).
    cands = pool_candidates("dynamo-drr", True)
    assert cands and {c["classes"] for c in cands} == {"tier"}


# --- the router ---------------------------------------------------------------------------


@dataclass
class FakeEngine:
    num_waiting: int = 0
    kv_usage: float = 0.0


@dataclass
class FakeHost:
    index: int
    engine: FakeEngine
    outstanding: int = 0
    arm: Any = None


def bound(router: EppRouter, waiting: list[int], kv: list[float]) -> list[FakeHost]:
    gauges = zip(waiting, kv, strict=True)
    hosts = [FakeHost(i, FakeEngine(w, k)) for i, (w, k) in enumerate(gauges)]
    router.start(cast(list[Host], hosts))
    return hosts


def req(tenant: str, rid: str = "r") -> Request:
    return Request(rid, 0.0, tenant, INTERACTIVE, 500, 256, 100)


def test_a_tenant_stays_on_its_home_below_the_threshold_whatever_the_scores() -> None:
    r = EppAffinityRouter(1, 16)
    bound(r, [0, 4, 0, 0], [0.0, 0.9, 0.0, 0.0])
    home = r.home("regular-0")
    assert home == 1  # SHA-256 of the name mod 4
    # Replica 1 is the EPP's worst (queue 4, KV 0.9) but below the threshold: pinned.
    assert EppRouter.pick(r, req("regular-0"), 0.0, frozenset()) != home
    assert all(r.pick(req("regular-0"), 0.0, frozenset()) == home for _ in range(20))


def test_at_the_threshold_or_once_tried_the_home_gives_way_to_the_epp_choice() -> None:
    r = EppAffinityRouter(1, 16)
    threshold = int(AFFINITY_QUEUE_THRESHOLD)
    hosts = bound(r, [0, threshold, 3, 1], [0.5, 0.0, 0.1, 0.2])
    # The home (1) is at the threshold: the EPP's choice (replica 3: queue 1, KV 0.2).
    plain = EppRouter(1, 16)
    plain.start(cast(list[Host], hosts))
    choice = plain.pick(req("regular-0"), 0.0, frozenset())
    assert choice == 3
    assert r.pick(req("regular-0"), 0.0, frozenset()) == choice
    # Below it but already tried (a retry): the EPP's choice among the others (min-max over
    # replicas 0, 2, 3: replica 0 scores 2 x 1 + 2 x 0.5 = 3, replica 3 2 x 2/3 + 2 x 0.8).
    r2 = EppAffinityRouter(1, 16)
    bound(r2, [0, threshold - 1, 3, 1], [0.5, 0.0, 0.1, 0.2])
    assert r2.pick(req("regular-0"), 0.0, frozenset()) == 1
    assert r2.pick(req("regular-0"), 0.0, frozenset({1})) == 0
    assert r2.pick(req("regular-0"), 0.0, frozenset({0, 1, 2, 3})) is None


def test_the_gauge_is_the_last_scrapes() -> None:
    r = EppAffinityRouter(1, 16)
    hosts = bound(r, [0, 0, 0, 0], [0.0] * 4)
    hosts[1].engine.num_waiting = 50  # after the scrape at 0: not seen yet
    assert r.pick(req("regular-0"), 0.01, frozenset()) == 1
    r.scrape(0.05)
    assert r.pick(req("regular-0"), 0.06, frozenset()) != 1


def test_tiers_homes_are_skewed_on_four_replicas() -> None:
    r = EppAffinityRouter(1, 16)
    bound(r, [0] * 4, [0.0] * 4)
    homes: dict[int, set[str | None]] = {}
    for t in TIERS.values():
        homes.setdefault(r.home(t.name), set()).add(t.class_name)
    assert {"premium"} in homes.values() and {"regular"} in homes.values()


def test_a_light_pool_sends_every_request_home() -> None:
    sched = generate("tiers", 4.0, 20.0, 3)
    ctx = tiers_context()
    router = make_router("epp-affinity", 1, 16)
    assert isinstance(router, EppAffinityRouter)
    _, stats = simulate_pool(
        sched, lambda i: make_arm("none", ctx, {}), router, STEPTIME, 4, retry=None
    )
    want = Counter(router.home(r.tenant) for r in sched.requests)
    assert stats.per_replica_requests == [want[i] for i in range(4)]


def test_epp_affinity_and_dynamo_drr_run_when_named_only() -> None:
    assert "epp-affinity" in ALL_ROUTERS and "epp-affinity" not in ROUTER_NAMES
    assert "dynamo-drr" in ALL_POOL_ARMS and "dynamo-drr" not in POOL_ARMS
    assert ("epp-affinity", "flow-control") in pairs(["epp-affinity"], ["flow-control"])
    with pytest.raises(ValueError, match="epp-affinity"):
        build_pool_tasks(["tiers"], [2.0], [1], [4], ["nope"], ["none"], {}, "p", 10.0, True)


# --- class_service_ratio ------------------------------------------------------------------

HAND = {
    "p1": Tenant("p1", INTERACTIVE, weight=4.0, class_name="premium"),
    "p2": Tenant("p2", INTERACTIVE, weight=4.0, class_name="premium"),
    "r1": Tenant("r1", INTERACTIVE, weight=1.0, class_name="regular"),
}


def rec(
    tenant: str,
    arrival: float,
    first: float | None,
    finish: float | None,
    out: int,
    outcome: str = SERVED,
) -> RequestRecord:
    r = Request(f"{tenant}-{arrival}", arrival, tenant, INTERACTIVE, 10, None, max(1, out))
    return RequestRecord(r, outcome, None if outcome == REJECTED else arrival, first, finish, out)


def run_of(records: list[RequestRecord], tenants: dict[str, Tenant]) -> RunResult:
    sched = Schedule("hand", 1.0, 180.0, 0, tenants, [r.request for r in records])
    eng = SimEngine(engine_config(STEPTIME), STEPTIME)
    end = max(r.finished_at or 0.0 for r in records)
    return RunResult(sched, "hand", {}, records, end, 0.0, 0, 0.0, eng)


def hand_trace() -> list[RequestRecord]:
    return [
        # Window 0 (0-60 s): p1 waits 40 s (backlogged), then 300 tokens over 40-70 s
        # (200 in window 0, 100 in window 1); p2 is served at once (not backlogged, but its
        # 200 tokens are premium's); r1 waits 35 s (backlogged), 100 tokens in window 0.
        rec("p1", 0.0, 40.0, 70.0, 300),
        rec("p2", 10.0, 10.5, 20.5, 200),
        rec("r1", 0.0, 35.0, 55.0, 100),
        # Window 1 (60-120 s): p1 waits 40 s again (backlogged), r1 is served at once: only
        # premium is backlogged, so the window does not count (its tokens neither).
        rec("p1", 60.0, 100.0, 110.0, 1000),
        rec("r1", 70.0, 70.1, 80.1, 50),
        # Window 2 (120-180 s): each class had a request refused (backlogged); p2 100 tokens,
        # r1 50.
        rec("p2", 125.0, None, 125.0, 0, REJECTED),
        rec("r1", 130.0, None, 130.0, 0, REJECTED),
        rec("p2", 150.0, 150.2, 160.2, 100),
        rec("r1", 140.0, 140.1, 150.1, 50),
    ]


def test_the_ratio_is_premium_over_regular_service_in_windows_both_are_backlogged() -> None:
    records = hand_trace()
    got = class_service_ratio(records, HAND, 180.0)
    assert got == pytest.approx((200 + 200 + 100) / (100 + 50))
    assert summarize(run_of(records, HAND))["class_service_ratio"] == pytest.approx(got)


def test_no_window_with_both_backlogged_gives_none() -> None:
    records = [r for r in hand_trace() if r.request.tenant != "r1" or r.request.arrival_s == 70.0]
    assert class_service_ratio(records, HAND, 180.0) is None
    assert summarize(run_of(records, HAND))["class_service_ratio"] is None
    # Shorter than one window: none either.
    assert class_service_ratio(hand_trace(), HAND, 59.0) is None


def test_without_two_weighted_classes_there_is_no_ratio() -> None:
    same = {n: Tenant(n, INTERACTIVE, weight=1.0, class_name=t.class_name) for n, t in HAND.items()}
    assert class_service_ratio(hand_trace(), same, 180.0) is None
    plain = {n: Tenant(n, INTERACTIVE, weight=t.weight) for n, t in HAND.items()}
    assert class_service_ratio(hand_trace(), plain, 180.0) is None
    assert summarize(run_of(hand_trace(), plain))["class_service_ratio"] is None


def test_regular_served_nothing_while_backlogged_gives_none() -> None:
    records = [
        rec("p1", 0.0, 40.0, 50.0, 100),
        rec("r1", 0.0, None, 5.0, 0, REJECTED),
    ]
    assert class_service_ratio(records, HAND, 60.0) is None
