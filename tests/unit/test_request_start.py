"""A retry's earlier wait (the proxy's ``X-Request-Start``) comes off its TTFT wait budget."""

from __future__ import annotations

import pytest

from kvgate_agent.admission import AdmissionConfig, AdmissionController, AdmissionRequest, Outcome
from kvgate_agent.admission.decision import Reason
from kvgate_agent.contract.policy import RateLimitPolicySpec
from kvgate_agent.sidecar.reading.request_start import MAX_WAIT_S, stamp_seconds, waited_seconds
from kvgate_bench.kit.toolkit import FakeClock

NOW = 1_796_000_000.0  # epoch seconds, late 2026


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("t=1796000000.250", 1_796_000_000.25),  # Envoy's %START_TIME(%s.%3f)%
        ("t=1796000000250", 1_796_000_000.25),  # nginx's ${msec} without the dot: milliseconds
        ("1796000000250000", 1_796_000_000.25),  # microseconds, no t=
        (" t=1796000000 ", 1_796_000_000.0),
    ],
)
def test_the_stamps_forms_are_read(value: str, seconds: float) -> None:
    assert stamp_seconds(value) == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["", "t=", "t=abc", "t=-5", "t=0", "t=nan", "t=inf"])
def test_an_unreadable_stamp_is_none(value: str) -> None:
    assert stamp_seconds(value) is None


def test_the_wait_is_now_less_the_stamp_and_never_negative_nor_absurd() -> None:
    assert waited_seconds(None, NOW) == 0.0
    assert waited_seconds(f"t={NOW - 1.5:.3f}", NOW) == pytest.approx(1.5)
    assert waited_seconds(f"t={NOW + 2:.3f}", NOW) == 0.0  # the proxy's clock is ahead
    assert waited_seconds(f"t={NOW - MAX_WAIT_S - 1:.3f}", NOW) == 0.0
    assert waited_seconds("t=garbage", NOW) == 0.0


def controller(clock: FakeClock) -> AdmissionController:
    spec = RateLimitPolicySpec.model_validate(
        {"concurrency": {"maxRequests": 1}, "slo": {"ttftSeconds": 2}}
    )
    return AdmissionController(AdmissionConfig.from_policy(spec), clock)


def test_a_retry_whose_budget_is_spent_is_refused_at_once_and_a_fresh_one_queues() -> None:
    clock = FakeClock(100.0)
    c = controller(clock)
    t = c.submit(AdmissionRequest("a", 10, 10, 1)).ticket
    assert t is not None
    clock.advance(0.5)
    c.release(t, completion_tokens=10)  # each request holds the one slot 0.5 s
    assert c.submit(AdmissionRequest("a", 10, 10, 1)).ticket is not None
    fresh = c.submit(AdmissionRequest("b", 10, 10, 1))
    assert fresh.waiter is not None  # expected to wait about 0.5 s of its 2 s budget
    d = c.submit(AdmissionRequest("c", 10, 10, 1, waited_seconds=1.9))
    assert d.waiter is None and d.outcome is Outcome.REJECTED and d.reason is Reason.SLO
    assert "less the 1.90s it waited before reaching this pod" in d.message


def test_a_queued_retry_times_out_a_second_before_a_fresh_request() -> None:
    clock = FakeClock(100.0)
    c = controller(clock)
    assert c.submit(AdmissionRequest("a", 10, 10, 1)).ticket is not None  # holds the one slot
    fresh = c.submit(AdmissionRequest("b", 10, 10, 1)).waiter
    retry = c.submit(AdmissionRequest("c", 10, 10, 1, waited_seconds=1.0)).waiter
    assert fresh is not None and retry is not None
    ended: dict[str, float] = {}
    for _ in range(80):
        clock.advance(0.05)
        c.pump()
        for name, w in (("fresh", fresh), ("retry", retry)):
            if w.decision is not None and name not in ended:
                assert w.decision.outcome is Outcome.REJECTED
                ended[name] = clock() - 100.0
    assert ended["fresh"] - ended["retry"] == pytest.approx(1.0, abs=0.06)
