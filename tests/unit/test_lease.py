"""Leases of shared limits, pure: the lease book against an in-memory model of the store's script
(the same arithmetic as ``sidecar/store/buckets.py``'s Lua), on a fake clock."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate_agent.admission import AdmissionConfig, AdmissionController, AdmissionRequest, Outcome
from kvgate_agent.admission.bucket import WARMUP_START_FRACTION, BucketMap, SharedBucket
from kvgate_agent.admission.lease import (
    IDLE_SECONDS,
    LEASE_SECONDS,
    MAX_LEASE_FRACTION,
    Grant,
    LeaseBook,
    SliceOp,
    StoreState,
)
from kvgate_agent.contract.nodeadmission import PodThresholds
from kvgate_agent.contract.policy import PolicyError, parse_policy
from kvgate_bench.kit.toolkit import FakeClock


class ModelStore:
    """The store's script in Python: one bucket per name, refilled on the store's clock."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.buckets: dict[str, tuple[float, float]] = {}
        self.peers: dict[str, float] = {}
        self.up = True
        self.calls = 0
        self.log: list[tuple[str, SliceOp, Grant]] = []  # (member, op, grant) of every call

    def call(self, member: str, ops: list[SliceOp]) -> tuple[int, list[Grant]]:
        if not self.up:
            raise ConnectionError("store down")
        self.calls += 1
        now = self.clock()
        self.peers[member] = now
        self.peers = {m: t for m, t in self.peers.items() if t >= now - 2 * LEASE_SECONDS}
        grants = []
        for op in ops:
            cap, rate = op.bucket.capacity, op.bucket.rate
            level, last = self.buckets.get(op.name, (cap * WARMUP_START_FRACTION, now))
            level = min(cap, level + max(0.0, now - last) * rate)
            level = max(-cap, min(cap, level + op.give_back) - op.debt)
            grant = min(op.want, level) if op.want > 0 and level > 0 else 0.0
            level -= grant
            self.buckets[op.name] = (level, now)
            grants.append(Grant(grant, level))
            self.log.append((member, op, grants[-1]))
        return len(self.peers), grants


def controller(spec: dict[str, Any], clock: FakeClock) -> AdmissionController:
    doc = {
        "apiVersion": "kvgate.io/v1alpha1",
        "kind": "RateLimitPolicy",
        "metadata": {"name": "t"},
        "spec": {"tenants": {"defaultMaxTokens": 16}, **spec},
    }
    c = AdmissionController(AdmissionConfig.from_policy(parse_policy(doc).spec), clock)
    c.attach_store()
    return c


class Sidecar:
    """One admission core with its lease book, synced against ``store`` on each step."""

    def __init__(
        self,
        name: str,
        spec: dict[str, Any],
        clock: FakeClock,
        store: ModelStore,
        share: float = 1.0,
    ) -> None:
        self.name = name
        self.clock = clock
        self.store = store
        self.c = controller(spec, clock)
        fail_closed = spec.get("failureMode") == "FailClosed"
        self.book = LeaseBook(
            self.c.shared_maps,
            lambda: fail_closed,
            clock(),
            retired=self.c.take_retired_slices,
            share=lambda: share,
        )
        self.admitted = 0

    def step(self) -> None:
        ops = self.book.tick(self.clock())
        if ops is None:
            return
        try:
            peers, grants = self.store.call(self.name, ops)
        except ConnectionError:
            self.book.failed(ops, self.clock())
        else:
            self.book.done(ops, grants, peers, self.clock())

    def send(self, tenant: str = "a") -> bool:
        d = self.c.submit(AdmissionRequest(tenant, 0, 1))
        if d.ticket is None:
            return False
        self.c.release(d.ticket, completion_tokens=1)
        self.admitted += 1
        return d.outcome is Outcome.ADMITTED

    def drain_queue(self) -> None:
        """Pump the queue; count (and release) the waiters it admitted."""
        self.c.pump()
        for w in self.c.take_resolved():
            if w.decision is not None and w.decision.ticket is not None:
                self.c.release(w.decision.ticket, completion_tokens=1)
                self.admitted += 1


RPM = {"rateLimits": [{"name": "r", "per": "Tenant", "shared": True, "requestsPerMinute": 600}]}


def run(sidecars: list[Sidecar], clock: FakeClock, seconds: float, rates: list[float]) -> None:
    """Advance ``seconds`` in 0.2 s ticks, each sidecar offered ``rates[i]`` requests/second."""
    debt = [0.0] * len(sidecars)
    for _ in range(round(seconds / 0.2)):
        clock.advance(0.2)
        for i, s in enumerate(sidecars):
            s.step()
            debt[i] += rates[i] * 0.2
            while debt[i] >= 1:
                debt[i] -= 1
                s.send()


# ---------------------------------------------------------------- policy


def test_shared_needs_tenant_or_global() -> None:
    doc = {
        "apiVersion": "kvgate.io/v1alpha1",
        "kind": "RateLimitPolicy",
        "metadata": {"name": "t"},
        "spec": {
            "rateLimits": [{"name": "r", "per": "Pod", "shared": True, "requestsPerMinute": 1}]
        },
    }
    with pytest.raises(PolicyError, match="shared needs per Tenant or per Global"):
        parse_policy(doc)
    doc["spec"]["rateLimits"][0]["per"] = "Global"  # type: ignore[index]
    assert parse_policy(doc).spec.rate_limits[0].shared


def test_without_a_store_a_shared_limit_is_per_pod() -> None:
    clock = FakeClock(0.0)
    doc = {
        "apiVersion": "kvgate.io/v1alpha1",
        "kind": "RateLimitPolicy",
        "metadata": {"name": "t"},
        "spec": RPM,
    }
    c = AdmissionController(AdmissionConfig.from_policy(parse_policy(doc).spec), clock)
    assert c.shared_maps() == []
    assert c.submit(AdmissionRequest("a", 0, 1)).ticket is not None  # a full local bucket


# ---------------------------------------------------------------- the slice bucket


def test_slice_never_refills_by_itself_and_owes_usage_beyond_it() -> None:
    b = SharedBucket(100, 10, now=0.0, level=5.0)
    assert b.refill(1000.0) == 5.0 and b.debt == 5.0
    b.charge(30, 0.0)
    assert b.level == -25.0
    b.charge(1000, 0.0)
    assert b.level == -100.0  # never more than one capacity owed
    b.level, b.shared_level = 0.0, 40.0
    assert b.seconds_until(50, 0.0) == pytest.approx(1.0)  # 10 lacking at 10/s
    assert b.seconds_until(101, 0.0) == math.inf


def test_a_new_key_starts_with_a_first_slice_charged_later() -> None:
    clock = FakeClock(0.0)
    store = ModelStore(clock)
    s = Sidecar("p", RPM, clock, store)
    s.step()  # sizes first slices: one peer, so a tenth of the burst of 600
    assert s.send()
    (_, b) = s.book.slices()[0]
    assert isinstance(b, SharedBucket) and b.debt == pytest.approx(60 * 1.0)
    clock.advance(0.2)
    s.step()
    assert b.debt == 0 and store.buckets["r:requests:a"][0] < 600 * WARMUP_START_FRACTION


# ---------------------------------------------------------------- fleet accuracy


@settings(max_examples=12, deadline=None)
@given(
    n=st.integers(1, 4),
    rates=st.lists(st.floats(0, 30), min_size=4, max_size=4),
    seconds=st.floats(5, 15),
)
def test_fleet_admits_within_budget_plus_leases(n: int, rates: list[float], seconds: float) -> None:
    """Whatever the spread of load, the fleet admits at most the shared bucket's bound (warm
    start + rate x time) plus the slices outstanding (at most a tenth of the burst per sidecar:
    first slices and leases)."""
    clock = FakeClock(0.0)
    store = ModelStore(clock)
    fleet = [Sidecar(f"p{i}", RPM, clock, store) for i in range(n)]
    run(fleet, clock, seconds, rates[:n])
    admitted = sum(s.admitted for s in fleet)
    bound = 600 * WARMUP_START_FRACTION + 10 * seconds + n * MAX_LEASE_FRACTION * 600 * 2
    assert admitted <= bound + 1e-6
    offered = sum(math.floor(r * seconds) for r in rates[:n])
    if offered > 3 * (600 * WARMUP_START_FRACTION + 10 * seconds):  # demand far above budget
        assert admitted >= 0.7 * (10 * seconds)  # and most of the budget is used


def test_all_traffic_on_one_replica_gets_nearly_the_whole_budget() -> None:
    clock = FakeClock(0.0)
    store = ModelStore(clock)
    fleet = [Sidecar(f"p{i}", RPM, clock, store) for i in range(3)]
    run(fleet, clock, 60.0, [30.0, 0.0, 0.0])
    budget = 600 * WARMUP_START_FRACTION + 10 * 60
    assert fleet[0].admitted >= 0.85 * budget  # not a third of it
    assert fleet[0].admitted <= budget + 60 * 3


def test_steady_state_needs_at_most_one_command_per_20_admitted() -> None:
    clock = FakeClock(0.0)
    store = ModelStore(clock)
    spec = {
        "rateLimits": [{"name": "r", "per": "Global", "shared": True, "requestsPerMinute": 60000}]
    }
    s = Sidecar("p", spec, clock, store)
    run([s], clock, 10.0, [50.0])  # warm up the demand estimate
    calls, admitted = store.calls, s.admitted
    run([s], clock, 30.0, [50.0])
    assert s.admitted - admitted == 1500
    assert (store.calls - calls) * 20 <= s.admitted - admitted


# ---------------------------------------------------------------- requests above a usual slice


def test_a_small_shared_burst_still_admits_whole_requests() -> None:
    """burstRequests 5: a tenth of the burst is half a request, yet requests are admitted at
    about the shared rate (the lease asks for what the blocked request needs)."""
    clock = FakeClock(0.0)
    store = ModelStore(clock)
    spec = {
        "rateLimits": [
            {
                "name": "r",
                "per": "Global",
                "shared": True,
                "requestsPerMinute": 60,
                "burstRequests": 5,
            }
        ]
    }
    s = Sidecar("p", spec, clock, store)
    for _ in range(300):  # 60 s, two requests a second
        clock.advance(0.2)
        s.step()
        s.drain_queue()
        if _ % 5 == 0:
            s.send()
            s.send()
    assert 0.7 * 60 <= s.admitted <= 60 + 5 + 1


def test_a_request_costing_a_fifth_of_the_burst_is_admitted_from_the_queue() -> None:
    """Cost capacity 1000 units, one request costing 200 (above the 100 of a usual slice): it
    waits in the queue, the slice grows to 200 and it is admitted; meanwhile the queue is not
    looked at again every millisecond."""
    clock = FakeClock(0.0)
    store = ModelStore(clock)
    spec = {
        "rateLimits": [
            {
                "name": "c",
                "per": "Global",
                "shared": True,
                "tokensPerMinute": 6000,
                "burstTokens": 1000,
            }
        ],
    }
    s = Sidecar("p", spec, clock, store)
    s.step()
    req = AdmissionRequest("a", 0, 200)
    d = s.c.submit(req)
    assert d.outcome is Outcome.QUEUED and d.waiter is not None
    wake = s.c.next_wake()
    assert wake is not None and wake - clock() >= 0.04  # not a pump every millisecond
    for _ in range(50):
        clock.advance(0.2)
        s.step()
        s.c.pump()
        if d.waiter.decision is not None:
            break
    assert d.waiter.decision is not None and d.waiter.decision.ticket is not None


# ---------------------------------------------------------------- idle, shutdown


def test_idle_slices_are_handed_back_and_shutdown_returns_all() -> None:
    clock = FakeClock(0.0)
    store = ModelStore(clock)
    s = Sidecar("p", RPM, clock, store)
    run([s], clock, 5.0, [10.0])
    assert s.book.outstanding() > 0
    run([s], clock, IDLE_SECONDS + 1.0, [0.0])
    assert s.book.outstanding() == 0
    run([s], clock, 2.0, [1.0])
    ops = s.book.hand_back_all()
    assert ops and sum(op.give_back for op in ops) > 0
    store.call("p", ops)
    assert s.book.outstanding() == 0


# ---------------------------------------------------------------- faults


def test_store_down_falls_back_to_the_local_share_within_a_lease_period() -> None:
    clock = FakeClock(0.0)
    store = ModelStore(clock)
    fleet = [Sidecar(f"p{i}", RPM, clock, store) for i in range(2)]
    run(fleet, clock, 5.0, [5.0, 5.0])
    assert fleet[0].book.peers == 2
    store.up = False
    run(fleet, clock, LEASE_SECONDS, [5.0, 5.0])
    assert fleet[0].book.state.value == "local"
    before = fleet[0].admitted
    run(fleet, clock, 20.0, [20.0, 0.0])
    got = fleet[0].admitted - before
    assert 0.6 * 20 * 5 <= got <= 20 * 5 + 300 + 60  # half the rate (2 peers) + burst share
    debt = fleet[0].book.outstanding()
    assert debt > 0
    store.up = True
    key = "r:requests:a"
    level_before, written = store.buckets[key]
    store.log.clear()
    for _ in range(5):  # the next try comes within RETRY_SECONDS: one sync of p0 alone
        clock.advance(0.2)
        fleet[0].step()
        if store.log:
            break
    assert fleet[0].book.state is StoreState.SHARED
    assert fleet[0].book.outstanding() < debt  # the debt was charged
    [(_, op, grant)] = [e for e in store.log if e[1].name == key]
    # what was spent during the outage is charged: less what the slice held before, at most
    # a lease of a tenth of the burst
    assert op.debt >= got - MAX_LEASE_FRACTION * 600 - 1
    refilled = min(600.0, level_before + 10 * (clock() - written))
    expected = refilled + op.give_back - op.debt - grant.granted
    assert store.buckets[key][0] == pytest.approx(expected, abs=1e-6)


def test_store_down_from_the_start_credits_the_operators_split_not_the_whole_rate() -> None:
    """No peer count seen yet (the store never answered): one of four pods (globalShare 0.25)
    is credited a quarter of the rate, not all of it."""
    clock = FakeClock(0.0)
    store = ModelStore(clock)
    store.up = False
    s = Sidecar("p", RPM, clock, store, share=0.25)
    run([s], clock, 20.0, [20.0])
    assert s.book.state.value == "local"
    assert 0.6 * 2.5 * 20 <= s.admitted <= 60 + 2.5 * 20 + 10  # first slice + a quarter


def test_the_operators_split_reaches_the_config() -> None:
    thresholds = PodThresholds.model_validate({"globalShare": 0.25})
    assert AdmissionConfig.from_policy(thresholds).fleet_share == 0.25


def test_fail_closed_state_when_the_store_is_down() -> None:
    clock = FakeClock(0.0)
    store = ModelStore(clock)
    s = Sidecar("p", {**RPM, "failureMode": "FailClosed"}, clock, store)
    run([s], clock, 2.0, [5.0])
    store.up = False
    run([s], clock, LEASE_SECONDS, [0.0])
    assert s.book.state.value == "closed"
    store.up = True
    run([s], clock, 1.0, [0.0])
    assert s.book.state is StoreState.SHARED


def test_fail_closed_lifts_once_no_shared_limit_is_left() -> None:
    """Store down under FailClosed, then the policy drops its shared limit: nothing is leased,
    so nothing is closed (the sidecar must not refuse everything forever)."""
    clock = FakeClock(0.0)
    store = ModelStore(clock)
    spec = {**RPM, "failureMode": "FailClosed"}
    s = Sidecar("p", spec, clock, store)
    run([s], clock, 2.0, [5.0])
    store.up = False
    run([s], clock, LEASE_SECONDS, [0.0])
    assert s.book.state.value == "closed"
    local = {"failureMode": "FailClosed", "rateLimits": [{**RPM["rateLimits"][0], "shared": False}]}
    s.c.reconfigure(controller(local, clock).config)
    run([s], clock, 0.4, [0.0])
    assert s.book.state is StoreState.SHARED


def test_restarted_empty_store_starts_buckets_at_the_warmup_level() -> None:
    clock = FakeClock(0.0)
    store = ModelStore(clock)
    s = Sidecar("p", RPM, clock, store)
    run([s], clock, 30.0, [100.0])
    store.buckets.clear()  # restarted empty
    run([s], clock, 0.4, [0.0])
    level, _ = store.buckets["r:requests:a"]
    assert level <= 600 * WARMUP_START_FRACTION


def test_a_removed_shared_limit_hands_its_slices_back() -> None:
    clock = FakeClock(0.0)
    store = ModelStore(clock)
    s = Sidecar("p", RPM, clock, store)
    run([s], clock, 3.0, [10.0])
    held = s.book.outstanding()
    assert held > 0
    store.log.clear()
    local = {"rateLimits": [{**RPM["rateLimits"][0], "shared": False}]}
    s.c.reconfigure(controller(local, clock).config)
    store.up = False  # the first try fails: the final op is kept, and nothing falls back
    run([s], clock, 1.0, [0.0])
    assert s.book.state is StoreState.SHARED and not store.log
    store.up = True
    run([s], clock, 1.0, [0.0])
    [(_, op, _)] = store.log
    assert op.final and op.give_back + op.debt == pytest.approx(held)


def test_a_slice_evicted_by_the_key_cap_gets_a_final_op() -> None:
    m = BucketMap(10, 1, warmup_start=0.0, idle_seconds=100.0, max_keys=1)
    m.first_slice = 0.0
    a = m.get("a", 0.0)
    assert isinstance(a, SharedBucket)
    a.level, a.debt = 3.0, 2.0
    m.get("b", 1.0)  # over the cap: "a" goes although it holds units
    book = LeaseBook(lambda: [("r", "requests", m)], lambda: False, 0.0)
    ops = book.tick(1.0)
    assert ops is not None
    [op] = [op for op in ops if op.name == "r:requests:a"]
    assert op.final and (op.give_back, op.debt) == (3.0, 2.0)


def test_bucket_map_forgets_empty_slices() -> None:
    m = BucketMap(10, 1, warmup_start=0.0, idle_seconds=1.0, max_keys=10)
    m.first_slice = 0.0
    assert isinstance(m.get("a", 0.0), SharedBucket)
    m.get("b", 5.0)
    assert len(m) == 1  # "a" held nothing: evicted
