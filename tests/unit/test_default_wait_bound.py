"""The default bound on queue delay: with neither ``slo.ttftSeconds`` nor
``queue.maxWaitSeconds`` stated, a request under no TTFT SLO waits at most
``DEFAULT_WAIT_SECONDS`` and one expected to wait more than twice that is refused at once, with
Retry-After and the reason of what blocks it (no SLO is set: not ``slo``); explicit settings
win."""

from __future__ import annotations

import math
from typing import Any

import pytest

from kvgate_agent.admission import AdmissionConfig, AdmissionController, AdmissionRequest, Outcome
from kvgate_agent.admission.decision import Reason
from kvgate_agent.admission.slo import UNLOADED_WAIT_FACTOR
from kvgate_agent.contract.policy import RateLimitPolicySpec
from kvgate_agent.contract.queue import DEFAULT_WAIT_SECONDS, MAX_WAIT_CAP_SECONDS
from kvgate_bench.kit.toolkit import FakeClock


def config(spec: dict[str, Any]) -> AdmissionConfig:
    return AdmissionConfig.from_policy(RateLimitPolicySpec.model_validate(spec))


def make(spec: dict[str, Any], clock: FakeClock) -> AdmissionController:
    return AdmissionController(config({"concurrency": {"maxRequests": 1}, **spec}), clock)


def req(tenant: str = "a", **kw: Any) -> AdmissionRequest:
    return AdmissionRequest(tenant, 10, 10, **kw)


def test_the_empty_spec_bounds_the_wait() -> None:
    cfg = config({})
    assert cfg.default_wait_seconds == DEFAULT_WAIT_SECONDS == 0.5
    assert cfg.queue_max_wait_seconds == MAX_WAIT_CAP_SECONDS == 30.0
    assert RateLimitPolicySpec().queue.max_wait_seconds is None


@pytest.mark.parametrize(
    ("spec", "max_wait"),
    [
        ({"slo": {"ttftSeconds": 2}}, 30.0),
        ({"queue": {"maxWaitSeconds": 30}}, 30.0),
        ({"queue": {"maxWaitSeconds": 5}}, 5.0),
    ],
)
def test_explicit_settings_win(spec: dict[str, Any], max_wait: float) -> None:
    cfg = config(spec)
    assert cfg.default_wait_seconds is None
    assert cfg.queue_max_wait_seconds == max_wait


def test_a_waiter_is_refused_with_retry_after_at_the_bound() -> None:
    clock = FakeClock(100.0)
    c = make({}, clock)
    first = c.submit(req("a"))
    assert first.ticket is not None
    w = c.submit(req("b")).waiter
    assert w is not None
    clock.advance(DEFAULT_WAIT_SECONDS * 0.99)
    c.pump()
    assert w.decision is None
    clock.advance(DEFAULT_WAIT_SECONDS * 0.02)
    c.pump()
    d = w.decision
    assert d is not None and d.outcome is Outcome.REJECTED
    assert d.reason is Reason.QUEUE_TIMEOUT and d.status == 429
    assert d.retry_after is not None and d.retry_after >= 1
    assert d.queue_seconds == pytest.approx(DEFAULT_WAIT_SECONDS, rel=0.05)


def test_a_request_expected_to_wait_past_twice_the_bound_is_refused_at_once() -> None:
    clock = FakeClock(100.0)
    c = make({}, clock)
    t = c.submit(req("a")).ticket
    assert t is not None
    clock.advance(4.0)
    c.release(t, completion_tokens=10)  # each request holds its place 4 s
    assert c.submit(req("a")).ticket is not None
    d = c.submit(req("b"))
    assert d.waiter is None and d.outcome is Outcome.REJECTED
    # No SLO is set: the reason names what refused it (not slo)
    assert d.reason is Reason.CONCURRENCY and d.status == 429
    assert "a request under no time-to-first-token SLO may wait" in d.message
    assert d.retry_after is not None and d.retry_after >= 4


def test_a_batch_class_waits_up_to_thirty_seconds() -> None:
    clock = FakeClock(100.0)
    c = make({}, clock)
    assert c.submit(req("a")).ticket is not None
    w = c.submit(req("b", ttft_slo_seconds=math.inf)).waiter  # a batch class: no TTFT SLO
    assert w is not None
    clock.advance(MAX_WAIT_CAP_SECONDS - 1)
    c.pump()
    assert w.decision is None
    clock.advance(2)
    c.pump()
    assert w.decision is not None and w.decision.reason is Reason.QUEUE_TIMEOUT


def test_a_stated_max_wait_applies() -> None:
    clock = FakeClock(100.0)
    c = make({"queue": {"maxWaitSeconds": 5}}, clock)
    assert c.submit(req("a")).ticket is not None
    w = c.submit(req("b")).waiter
    assert w is not None
    clock.advance(4.9)
    c.pump()
    assert w.decision is None
    clock.advance(0.2)
    c.pump()
    assert w.decision is not None and w.decision.reason is Reason.QUEUE_TIMEOUT


def test_on_a_slow_first_token_the_bound_follows_the_engine() -> None:
    """A CPU server whose first token comes 2 s after admission: the empty spec's requests may
    wait UNLOADED_WAIT_FACTOR x 2 s, not 0.5 s (which would refuse every one that has to wait
    behind another)."""
    clock = FakeClock(100.0)
    c = make({}, clock)
    for _ in range(3):  # requests whose first token takes 2 s, one at a time
        t = c.submit(req("a")).ticket
        assert t is not None
        clock.advance(2.0)
        c.live.observe_tokens(t, 1)
        clock.advance(0.5)
        c.live.observe_tokens(t, 10)
        c.release(t, completion_tokens=10)
    c.pump()  # closes the interval: the table has the first-token times
    bound = UNLOADED_WAIT_FACTOR * 2.0
    assert c.slo.default_wait(DEFAULT_WAIT_SECONDS) == pytest.approx(bound)
    assert c.submit(req("a")).ticket is not None
    w = c.submit(req("b")).waiter
    assert w is not None  # queued, not refused: 2.5 s of service left < 2 x the bound
    assert w.deadline - w.enqueued_at == pytest.approx(bound)
    # Far behind a long queue it is refused, and the message names the bound applied.
    refused = None
    for _ in range(20):
        d = c.submit(req("c"))
        if d.waiter is None:
            refused = d
            break
    assert refused is not None and refused.outcome is Outcome.REJECTED
    assert f"exceeds the {bound:g}s a request under no time-to-first-token SLO" in refused.message
