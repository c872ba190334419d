"""The engine's own concurrency (llama.cpp's slots) as a ceiling on admission, and the requests
waiting in the engine's own queue counted in the expected wait: pure, on a fake clock."""

from __future__ import annotations

from typing import Any

import pytest

from kvgate_agent.admission import AdmissionController, Outcome, Reason
from kvgate_agent.admission.limits import ENGINE_KV_TTL_S
from kvgate_agent.admission.slo import SloState
from kvgate_bench.kit.toolkit import FakeClock
from tests.unit.test_admission import make, req


def _admit(c: AdmissionController, n: int) -> list[Any]:
    out = []
    for i in range(n):
        d = c.submit(req(f"t{i}"))
        assert d.ticket is not None, (i, d)
        out.append(d.ticket)
    return out


@pytest.mark.parametrize(
    ("spec", "slots", "limit"),
    [
        ({}, 4, 4),  # no cap of the policy's: the engine's
        ({"concurrency": {"maxRequests": 8}}, 4, 4),  # the lower of the two
        ({"concurrency": {"maxRequests": 2}}, 4, 2),
        ({"slo": {"tpotSeconds": 0.2}}, 4, 4),  # the adaptive limit starts at the ceiling
        ({"slo": {"tpotSeconds": 0.2}, "concurrency": {"maxRequests": 3}}, 4, 3),
    ],
)
def test_the_engines_slots_cap_the_concurrency_limit(
    spec: dict[str, Any], slots: int, limit: int
) -> None:
    c = make(spec)
    c.live.set_engine_concurrency(slots)
    assert c.stats().engine_concurrency == slots and c.stats().concurrency_limit == limit


def test_requests_above_the_slots_wait_in_kvgates_queue_in_order() -> None:
    clock = FakeClock(1000.0)
    c = make({"capacity": {"kvCacheTokens": 4096}, "slo": {"tpotSeconds": 0.2}}, clock)
    assert c.stats().concurrency_limit == SloState.DEFAULT_START  # 64 before the engine is read
    c.live.set_engine_concurrency(4)
    held = _admit(c, 4)
    waiters = [c.submit(req(f"w{i}")).waiter for i in range(4)]
    assert (
        all(w is not None for w in waiters)
        and c.stats().in_flight == 4
        and c.stats().queue_length == 4
    )
    order = []
    for t in held:
        clock.advance(0.1)
        c.release(t, completion_tokens=5)
        c.pump()
        got = c.take_resolved()
        assert len(got) == 1 and c.stats().in_flight == 4  # one out, one in: never above the slots
        order += got
    assert order == waiters
    assert all(w is not None and w.decision is not None for w in order)
    assert [w.decision.outcome for w in order if w and w.decision] == [Outcome.QUEUED] * 4


def test_the_adaptive_limit_stays_under_the_slots_and_the_policy_cap_returns_without_them() -> None:
    clock = FakeClock(1000.0)
    c = make({"slo": {"tpotSeconds": 0.2}, "concurrency": {"maxRequests": 16}}, clock)
    c.live.set_engine_concurrency(4)
    tickets = _admit(c, 4)
    for _ in range(40):  # fast tokens, the limit reached: the limit would rise
        clock.advance(0.25)
        for t in tickets:
            c.live.observe_tokens(t, t.generated + 5)
        assert c.stats().concurrency_limit == 4
    c.live.set_engine_concurrency(None)  # an engine that states no limit: the policy's cap again
    limit = c.stats().concurrency_limit
    assert limit is not None and 4 <= limit <= 16


def test_the_engines_own_waiting_requests_count_in_the_expected_wait() -> None:
    s = SloState(None, 1.0, None, 0.0)
    s.observe_departure(0.5)
    assert s.expected_wait(0, 4, now=10.0) == pytest.approx(0.125)
    s.observe_engine_waiting(3, until=10.0 + ENGINE_KV_TTL_S)
    assert s.engine_waiting(10.0) == 3
    assert s.expected_wait(0, 4, now=10.0) == pytest.approx(0.5)  # (0 + 3 + 1) x 0.5 / 4
    assert s.expected_wait(0, 4) == pytest.approx(0.125)  # no clock: not counted
    late = 10.0 + ENGINE_KV_TTL_S + 0.01
    assert s.engine_waiting(late) == 0  # a stale report counts for nothing
    assert s.expected_wait(0, 4, now=late) == pytest.approx(0.125)
    s.observe_engine_waiting(None, until=20.0)
    assert s.engine_waiting(10.0) == 0


def test_a_request_is_shed_when_the_engines_own_queue_makes_its_wait_hopeless() -> None:
    clock = FakeClock(1000.0)
    c = make({"concurrency": {"maxRequests": 2}, "slo": {"ttftSeconds": 1.0}}, clock)
    held = _admit(c, 2)
    clock.advance(1.0)
    c.release(held[0], completion_tokens=5)  # service time 1 s
    held += _admit(c, 1)
    # One place frees every 0.5 s: one waiting ahead is a 1 s wait, within 2 x the budget.
    assert c.submit(req("a")).waiter is not None
    c.live.observe_engine_waiting(6, running=2)  # six more queued: (1 + 6 + 1) x 0.5 = 4 s
    d = c.submit(req("b"))
    assert d.outcome is Outcome.REJECTED and d.reason is Reason.SLO
    assert d.retry_after is not None and d.retry_after >= 4.0
    clock.advance(ENGINE_KV_TTL_S + 0.1)  # the report went stale: queued again
    assert c.submit(req("c")).waiter is not None


def test_kvgates_own_requests_waiting_in_the_engine_are_not_counted_twice() -> None:
    # A cap of 16 above the engine's batch of 4: 12 of kvgate's own requests wait in the engine.
    clock = FakeClock(1000.0)
    c = make({"concurrency": {"maxRequests": 16}, "slo": {"ttftSeconds": 1.0}}, clock)
    held = _admit(c, 16)
    clock.advance(3.0)
    c.release(held[0], completion_tokens=5)  # service time 3 s
    held[0] = _admit(c, 1)[0]
    c.live.observe_engine_waiting(12, running=4)  # all twelve are kvgate's: nothing more ahead
    assert c.slo.engine_waiting(clock()) == 0
    assert c.submit(req("new")).waiter is not None  # (0 + 1) x 3 / 16 s: queued, not shed
    c.live.observe_engine_waiting(15, running=4)  # three more than kvgate's own: sent around it
    assert c.slo.engine_waiting(clock()) == 3
    c.live.observe_engine_waiting(5, running=None)  # running unknown: all in flight may be waiting
    assert c.slo.engine_waiting(clock()) == 0
