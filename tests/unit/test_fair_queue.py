"""The fair queue: VTC counters (lift, charge, true-up, credit, memory), the order it serves
tenants in, priority bands above fairness, bounded backfill, fair shedding, and hypothesis
properties (counters never decrease; a backlogged tenant is served within a bounded number of
admissions; nothing leaks)."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate_agent.admission import (
    AdmissionConfig,
    AdmissionController,
    AdmissionRequest,
    Decision,
    Reason,
    Ticket,
)
from kvgate_agent.admission.fairqueue import MAX_SKIPS, FairShare, WaitQueue
from kvgate_agent.admission.fairqueue.share import IN_FLIGHT_LAG
from kvgate_agent.admission.limits import Limits
from kvgate_agent.contract.policy import QueueOrder
from kvgate_bench.kit.toolkit import FakeClock


def ticket(tenant: str, prompt: int, out: int, weight: float = 1.0) -> Ticket:
    t = Ticket(tenant, prompt, out, 1, prompt + out, 0.0)
    t.weight = weight
    return t


def controller(**kw: Any) -> tuple[AdmissionController, FakeClock]:
    clock = FakeClock(1000.0)
    base: dict[str, Any] = {"max_concurrency": 1, "queue_max_length": 1000}
    base.update(kw)
    return AdmissionController(AdmissionConfig(**base), clock), clock


def req(tenant: str, prompt: int = 10, max_tokens: int = 10, **kw: Any) -> AdmissionRequest:
    return AdmissionRequest(tenant, prompt, max_tokens, predicted_output_tokens=max_tokens, **kw)


def drain(c: AdmissionController, held: Ticket, rounds: int) -> list[str]:
    """Release ``held`` and then each admitted one in turn (a server of one slot), ``rounds``
    times; the tenants in the order the queue admitted them."""
    order: list[str] = []
    for _ in range(rounds):
        c.release(held, completion_tokens=held.max_tokens)
        c.pump()
        done = c.take_resolved()
        if not done:
            break
        (w,) = done
        assert w.decision is not None and w.decision.ticket is not None
        order.append(w.request.tenant)
        held = w.decision.ticket
    return order


# ---------------------------------------------------------------------- counters


def test_a_new_tenant_starts_at_the_floor_not_at_zero() -> None:
    f = FairShare(1.0, 2.0, 100)
    f.join("a")
    f.admit(ticket("a", 100, 100))  # 300 units
    assert f.counter("a") == 300.0
    f.join("b")  # b is new: it starts at the smallest backlogged counter (a's), not at 0
    assert f.counter("b") == 300.0


def test_an_idle_tenant_is_lifted_and_an_over_served_one_is_not_forgiven() -> None:
    f = FairShare(1.0, 2.0, 100)
    f.join("a")
    f.join("b")
    f.admit(ticket("a", 1000, 0))  # a: 1000
    f.leave("a")
    f.admit(ticket("b", 10, 0))  # b: 10
    f.leave("b")  # nobody backlogged: the floor is the last departed's counter (b's 10)
    assert f.floor() == 10.0
    f.join("c")
    assert f.counter("c") == 10.0
    f.join("a")  # over-served earlier: keeps its 1000, not reset to the floor
    assert f.counter("a") == 1000.0
    f.join("b")
    assert f.counter("b") == 10.0


def test_a_heavier_tenant_still_in_flight_keeps_its_lag_behind_the_floor_up_to_a_bound() -> None:
    f = FairShare(1.0, 2.0, 100)
    f.join("idle")
    t = ticket("idle", 10, 0)
    f.admit(t)  # 10
    f.leave("idle")
    f.settle(t, 10, 0)  # and gone: nothing in flight
    f.join("gold", 4.0)
    f.admit(ticket("gold", 100, 100, weight=4.0))  # 10 + 75: in flight, its queue empty
    f.leave("gold")
    f.join("bronze")
    for _ in range(3):
        f.admit(ticket("bronze", 100, 100))  # from gold's 85 (the last departed) to 985
    # gold rejoins while its request runs: it was never idle, so the service it is behind by
    # (bronze's 900 units against its 75 x 4 weighted) is kept, not forgiven by a lift to 985,
    # up to IN_FLIGHT_LAG mean charges x (1 - the active tenants' mean weight 2.5 / its 4).
    lag = IN_FLIGHT_LAG * f.mean_charge * (1.0 - 2.5 / 4.0)
    assert f.floor() == 985.0
    assert f.counter("gold") < 985.0  # (lifted to the floor, it would read 985)
    assert f.counter("gold") == 985.0 - lag > 85.0
    f.join("gold", 4.0)
    assert f.counter("gold") < f.counter("bronze")
    # ... a tenant that lags further is lifted to the bound: it banks no more than that.
    for _ in range(40):
        f.admit(ticket("bronze", 100, 100))
    f.leave("gold")
    f.join("gold", 4.0)
    lag = IN_FLIGHT_LAG * f.mean_charge * (1.0 - 2.5 / 4.0)
    assert f.counter("gold") == f.floor() == f.counter("bronze") - lag
    # Idle (nothing in flight): lifted to the floor itself, as before.
    assert f.counter("idle") == f.floor() > 10.0
    f.join("idle")
    assert f.counter("idle") == f.floor()


def test_a_tenant_no_heavier_than_the_mean_is_lifted_to_the_floor_even_in_flight() -> None:
    f = FairShare(1.0, 2.0, 100)
    f.join("a")
    f.admit(ticket("a", 100, 100))  # 300, in flight
    f.leave("a")
    f.join("b")
    f.admit(ticket("b", 1000, 0))  # b: 300 + 1000
    f.join("a")  # equal weights: the lift forgives, as VTC's does
    assert f.counter("a") == f.counter("b") == 1300.0


def test_weights_hold_when_each_tenant_waits_one_request_at_a_time() -> None:
    # Queues as short as a TTFT budget makes them: each tenant has one waiter, and a new one as
    # soon as that one is admitted, while its earlier requests still run. Lifting gold to the
    # floor whenever its queue empties resets it to bronze's counter at every request (about
    # 3:1 here, less where the order's slack lets the shorter head go first); the weights say
    # 4:1.
    c, _ = controller(max_concurrency=4, queue_order=QueueOrder.FIFO)
    running: list[Ticket] = []
    waiting = {"gold": 0, "bronze": 0}
    served: list[str] = []

    def top_up() -> None:
        for t, n in waiting.items():
            if not n:
                d = c.submit(req(t, weight=4.0 if t == "gold" else 1.0))
                if d.ticket is not None:
                    running.append(d.ticket)
                else:
                    waiting[t] = 1

    top_up()
    top_up()
    for _ in range(200):
        c.release(running.pop(0), completion_tokens=10)
        c.pump()
        for w in c.take_resolved():
            assert w.decision is not None and w.decision.ticket is not None
            running.append(w.decision.ticket)
            waiting[w.request.tenant] -= 1
            served.append(w.request.tenant)
        top_up()
    tail = Counter(served[100:])
    assert 3.5 <= tail["gold"] / tail["bronze"] <= 4.5, tail


def test_weights_divide_the_charge() -> None:
    f = FairShare(1.0, 2.0, 100)
    f.admit(ticket("gold", 100, 100, weight=3.0))
    f.admit(ticket("bronze", 100, 100))
    assert f.counter("gold") == 100.0 and f.counter("bronze") == 300.0


def test_streamed_output_is_charged_and_usage_trues_up_without_lowering_the_counter() -> None:
    f = FairShare(1.0, 2.0, 100)
    t = ticket("a", 100, 50)  # charged 100 + 2 x 50 = 200
    f.admit(t)
    f.observe_output(t, 80)  # 30 tokens past the charge: +60
    assert f.counter("a") == 260.0
    f.settle(t, 100, 20)  # used 140: 120 charged too much becomes credit
    assert f.counter("a") == 260.0 and f.account("a") is not None
    acct = f.account("a")
    assert acct is not None and acct.credit == 120.0 and acct.attained == 140.0
    f.admit(ticket("a", 100, 0))  # 100 more: paid from the credit
    assert f.counter("a") == 260.0 and acct.credit == 20.0
    f.admit(ticket("a", 100, 0))
    assert f.counter("a") == 340.0 and acct.credit == 0.0


def test_a_request_that_never_reached_the_engine_is_credited_in_full() -> None:
    f = FairShare(1.0, 2.0, 100)
    t = ticket("a", 100, 100)
    f.admit(t)
    f.settle(t, 0, 0)
    acct = f.account("a")
    assert acct is not None and acct.credit == 300.0 and acct.attained == 0.0


def test_memory_is_bounded_and_forgets_what_equals_a_new_account_first() -> None:
    f = FairShare(1.0, 2.0, 10)
    f.join("hog")
    f.admit(ticket("hog", 10_000, 0))
    f.leave("hog")
    for i in range(50):
        t = ticket(f"t{i}", 1, 0)
        f.admit(t)
        f.settle(t, 1, 0)
    assert len(f.accounts()) <= 10
    assert f.account("hog") is not None  # far above the floor: kept, not forgiven


# ---------------------------------------------------------------------- the order


def test_a_flood_from_one_tenant_is_interleaved_with_the_others() -> None:
    c, _ = controller()
    held = c.submit(req("x")).ticket
    assert held is not None
    for _ in range(20):
        c.submit(req("noisy"))
    for t in ("a", "b"):
        c.submit(req(t))
    order = drain(c, held, 6)
    # The flood arrived first, but a and b (lifted to noisy's counter, and fewer waiting) go
    # first; then noisy has the server to itself (work-conserving).
    assert order == ["a", "b"] + ["noisy"] * 4


def test_weights_share_the_server_in_proportion() -> None:
    c, _ = controller()
    held = c.submit(req("x")).ticket
    assert held is not None
    for _ in range(30):
        c.submit(req("gold", weight=2.0))
        c.submit(req("bronze"))
    order = drain(c, held, 30)
    assert abs(order.count("gold") - 2 * order.count("bronze")) <= 2, order


def test_priority_bands_stay_strictly_above_fairness() -> None:
    c, _ = controller()
    held = c.submit(req("x")).ticket
    assert held is not None
    for _ in range(3):
        c.submit(req("low"))
    for _ in range(3):
        c.submit(req("vip", priority=5))
    assert drain(c, held, 6) == ["vip"] * 3 + ["low"] * 3


def test_small_heads_backfill_past_a_blocked_large_one_a_bounded_number_of_times() -> None:
    c, _ = controller(max_concurrency=None, kv_capacity_tokens=1000, block_size=10)
    held = c.submit(req("x", prompt=600, max_tokens=0 + 100)).ticket  # 700 of 1000
    assert held is not None
    big = c.submit(req("big", prompt=400, max_tokens=100)).waiter  # 500: does not fit
    assert big is not None
    admitted = []
    for _ in range(MAX_SKIPS + 3):
        d = c.submit(req("small", prompt=5, max_tokens=5))
        if d.ticket is not None:
            admitted.append(d.ticket)
            c.release(d.ticket, completion_tokens=5)
    assert len(admitted) == MAX_SKIPS and big.skips == MAX_SKIPS  # then the queue holds still
    c.release(held, completion_tokens=100)
    c.pump()
    assert big.decision is not None and big.decision.ticket is not None


def test_the_queue_full_refusal_falls_on_the_tenant_furthest_above_its_share() -> None:
    c, _ = controller(queue_max_length=4)
    held = c.submit(req("x")).ticket
    assert held is not None
    c.submit(req("noisy"))
    held2 = drain(c, held, 1)  # noisy served once: its counter is ahead
    assert held2 == ["noisy"]
    waiters = [c.submit(req("noisy")).waiter for _ in range(4)]
    assert all(w is not None for w in waiters)
    d = c.submit(req("quiet"))  # the queue is full: noisy's newest waiter is refused instead
    assert d.waiter is not None
    (out,) = c.take_resolved()
    assert out is waiters[-1] and out.decision is not None
    refused: Decision = out.decision
    assert refused.status == 429 and refused.reason is Reason.QUEUE_FULL
    assert refused.retry_after is not None and refused.retry_after >= 1
    d = c.submit(req("noisy"))  # noisy itself is refused when the queue is full
    assert d.status == 429 and d.reason is Reason.QUEUE_FULL


def test_expected_wait_counts_only_what_the_fair_order_serves_first() -> None:
    q = WaitQueue(Limits(AdmissionConfig(max_concurrency=1), 0.0, 100))
    for _ in range(10):
        q.add(req("noisy"), 0.0, 30.0, (), False)
    assert q.ahead_of(req("quiet")) == 1  # one of noisy's, then quiet's turn
    assert q.ahead_of(req("noisy")) == 10
    assert q.ahead_of(req("vip", priority=1)) == 0


def test_a_batch_class_is_never_shed_for_its_wait() -> None:
    c, clock = controller(ttft_slo_seconds=0.1, queue_max_wait_seconds=30)
    for _ in range(4):  # a service time of 1 s per request is learned
        t = c.submit(req("x")).ticket
        assert t is not None
        clock.advance(1.0)
        c.release(t, completion_tokens=10)
    assert c.submit(req("x")).ticket is not None
    for _ in range(5):
        c.submit(req("quiet"))
    d = c.submit(req("batch", ttft_slo_seconds=math.inf))
    assert d.waiter is not None and d.waiter.deadline - d.waiter.enqueued_at == 30


# ---------------------------------------------------------------------- properties

sizes = st.tuples(st.integers(1, 200), st.integers(1, 200))


@settings(max_examples=60, deadline=None)
@given(
    arrivals=st.lists(st.tuples(st.sampled_from("abcd"), sizes), min_size=5, max_size=60),
    used=st.lists(st.floats(0, 1), min_size=60, max_size=60),
)
def test_backlogged_tenants_are_served_within_a_bound_and_counters_never_fall(
    arrivals: list[tuple[str, tuple[int, int]]], used: list[float]
) -> None:
    """A server of one slot; everything arrives while it is busy. While a tenant stays
    backlogged, the others get at most a bounded number of admissions before its next one (VTC's
    bound: counters of backlogged tenants stay within twice the largest charge of each other),
    counters never decrease, and nothing is left reserved at the end."""
    c, _ = controller()
    held = c.submit(req("x")).ticket
    assert held is not None
    for tenant, (p, m) in arrivals:
        assert c.submit(req(tenant, prompt=p, max_tokens=m)).waiter is not None
    largest = max(p + 2 * m for _, (p, m) in arrivals)
    smallest = min(p + 2 * m for _, (p, m) in arrivals)
    bound = 3 * (math.ceil(2 * largest / smallest) + 1)
    last: dict[str, float] = {}
    since: dict[str, int] = {}
    queued = Counter(tenant for tenant, _ in arrivals)
    i = 0
    while True:
        c.release(held, completion_tokens=int(used[i % len(used)] * held.max_tokens))
        i += 1
        c.pump()
        done = c.take_resolved()
        for tenant, counter, _ in c.tenant_stats().fair_shares:
            assert counter >= last.get(tenant, 0.0) - 1e-9
            last[tenant] = counter
        if not done:
            break
        (w,) = done
        assert w.decision is not None and w.decision.ticket is not None
        held = w.decision.ticket
        served = w.request.tenant
        since[served] = 0
        queued[served] -= 1
        for t in {t for t, n in queued.items() if n} - {served}:
            since[t] = since.get(t, 0) + 1
            assert since[t] <= bound, (t, since[t], bound)
    assert c.stats().queue_length == 0
    c.release(held, completion_tokens=0)
    assert c.stats().in_flight == 0 and c.stats().kv_reserved_tokens == 0


# ---------------------------------------------------------------------- slack and reserve


def test_within_the_slack_the_shorter_head_goes_first_beyond_it_the_counter_decides() -> None:
    c, _ = controller(queue_order=QueueOrder.SHORTEST_FIRST)
    held = c.submit(req("x", prompt=100, max_tokens=100)).ticket
    assert held is not None
    c.submit(req("long", prompt=1000, max_tokens=100))
    c.submit(req("short", prompt=10, max_tokens=10))
    # Both at the floor: the short one first, though long came first.
    assert drain(c, held, 2) == ["short", "long"]
    # Short requests keep going first only while their tenant stays within the slack.
    c2, _ = controller(queue_order=QueueOrder.SHORTEST_FIRST)
    held2 = c2.submit(req("x", prompt=100, max_tokens=100)).ticket
    assert held2 is not None
    c2.submit(req("long", prompt=1000, max_tokens=100))
    for _ in range(20):
        c2.submit(req("short", prompt=10, max_tokens=10))
    order = drain(c2, held2, 21)
    assert order[0] == "short" and order.index("long") < 10, order


def test_a_hog_leaves_the_reserve_to_tenants_under_their_share() -> None:
    c, _ = controller(max_concurrency=10)
    assert all(c.submit(req("hog")).ticket is not None for _ in range(6))  # alone: any amount
    assert c.submit(req("q1")).ticket is not None
    assert c.submit(req("q2")).ticket is not None  # 8 of 10 in flight, three tenants active
    d = c.submit(req("hog"))  # 7 would be over twice its share (10 / 3): the reserve is theirs
    assert d.ticket is None and d.waiter is not None
    assert c.submit(req("q1")).ticket is not None
    assert c.submit(req("q2")).ticket is not None
    assert c.stats().in_flight == 10


def test_a_lone_tenant_is_never_held_back_by_the_reserve() -> None:
    c, _ = controller(max_concurrency=10, kv_capacity_tokens=1000, block_size=10)
    got = [c.submit(req("only", prompt=40, max_tokens=10)).ticket for _ in range(10)]
    assert all(t is not None for t in got) and c.stats().kv_reserved_tokens == 500
