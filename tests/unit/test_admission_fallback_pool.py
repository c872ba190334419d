"""Degrading to another pool (``overload.degrade.fallback``), the admission core's part: which
refusals become a "send to the pool" decision, with this pod's own refusal kept for when the pool
refuses too. Pure: fake clock, no I/O."""

from __future__ import annotations

from typing import Any

import pytest

from kvgate_agent.admission import (
    AdmissionConfig,
    AdmissionController,
    AdmissionRequest,
    Outcome,
    Reason,
)
from kvgate_agent.contract.policy import PolicyError, parse_policy
from kvgate_bench.kit.toolkit import FakeClock

POOL = {"model": "small-q4", "upstream": "http://small.models.svc:8000"}


def doc(spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "kvgate.io/v1alpha1",
        "kind": "RateLimitPolicy",
        "metadata": {"name": "t"},
        "spec": {"tenants": {"defaultMaxTokens": 16}, **spec},
    }


def make(spec: dict[str, Any], clock: FakeClock | None = None) -> AdmissionController:
    cfg = AdmissionConfig.from_policy(parse_policy(doc(spec)).spec)
    return AdmissionController(cfg, clock or FakeClock(1000.0))


def req(tenant: str = "a", **kw: Any) -> AdmissionRequest:
    return AdmissionRequest(tenant, 10, 10, model="big", **kw)


def test_a_full_pod_sends_the_request_to_the_pool_with_its_own_refusal_kept() -> None:
    c = make(
        {
            "concurrency": {"maxRequests": 1},
            "overload": {"actions": ["Degrade", "Reject"], "degrade": {"fallback": POOL}},
        }
    )
    first = c.submit(req())
    assert first.ticket is not None
    d = c.submit(req("b"))
    assert d.outcome is Outcome.DEGRADED and d.reason is Reason.FALLBACK_POOL
    assert d.ticket is None and d.model == "small-q4"  # nothing reserved here
    assert d.refusal is not None and d.refusal.status == 429
    assert d.refusal.reason is Reason.CONCURRENCY and d.refusal.retry_after is not None
    assert c.stats().in_flight == 1


def test_the_pool_takes_a_tenant_over_its_budget() -> None:
    c = make(
        {
            "rateLimits": [{"name": "t", "requestsPerMinute": 0.001, "burstRequests": 1}],
            "overload": {"actions": ["Degrade", "Reject"], "degrade": {"fallback": POOL}},
        }
    )
    assert c.submit(req()).admitted
    d = c.submit(req())
    assert d.reason is Reason.FALLBACK_POOL and d.limit == "t"
    assert d.refusal is not None and d.refusal.reason is Reason.RATE_LIMIT_REQUESTS


def test_an_already_degraded_request_is_never_sent_on() -> None:
    c = make(
        {
            "concurrency": {"maxRequests": 1},
            "overload": {"actions": ["Degrade", "Reject"], "degrade": {"fallback": POOL}},
        }
    )
    assert c.submit(req()).admitted
    d = c.submit(req("b", degraded=True))
    assert d.outcome is Outcome.REJECTED and d.reason is Reason.CONCURRENCY


def test_an_api_without_a_model_field_is_not_sent_to_another_model() -> None:
    c = make(
        {
            "concurrency": {"maxRequests": 1},
            "overload": {"actions": ["Degrade", "Reject"], "degrade": {"fallback": POOL}},
        }
    )
    assert c.submit(req()).admitted
    d = c.submit(req("b", model_rewritable=False))
    assert d.outcome is Outcome.REJECTED


def test_without_degrade_in_actions_the_pool_is_not_used() -> None:
    c = make(
        {
            "concurrency": {"maxRequests": 1},
            "overload": {"actions": ["Reject"], "degrade": {"fallback": POOL}},
        }
    )
    assert c.submit(req()).admitted
    assert c.submit(req("b")).outcome is Outcome.REJECTED


def test_clamping_here_comes_before_the_pool() -> None:
    c = make(
        {
            "capacity": {"kvCacheTokens": 256},
            "model": {"blockSize": 16},
            "overload": {
                "actions": ["Degrade", "Reject"],
                "degrade": {"minMaxTokens": 16, "fallback": POOL},
            },
        }
    )
    d = c.submit(AdmissionRequest("a", 100, 400, model="big"))
    assert d.reason is Reason.MAX_TOKENS_CLAMPED and d.ticket is not None


def test_queue_first_then_the_pool_when_the_wait_times_out() -> None:
    clock = FakeClock(1000.0)
    c = make(
        {
            "concurrency": {"maxRequests": 1},
            "queue": {"maxWaitSeconds": 5},
            "overload": {"actions": ["Queue", "Degrade", "Reject"], "degrade": {"fallback": POOL}},
        },
        clock,
    )
    assert c.submit(req()).admitted
    w = c.submit(req("b")).waiter
    assert w is not None
    clock.advance(6)
    c.pump()
    assert w.decision is not None and w.decision.reason is Reason.FALLBACK_POOL
    assert w.decision.queue_seconds == 6 and c.stats().queue_length == 0
    assert w.decision.refusal is not None and w.decision.refusal.reason is Reason.QUEUE_TIMEOUT


def test_a_newcomer_may_go_to_the_pool_while_others_wait_here() -> None:
    clock = FakeClock(1000.0)
    c = make(
        {
            "concurrency": {"maxRequests": 1},
            "overload": {
                "actions": ["Degrade", "Queue", "Reject"],
                "degrade": {"minMaxTokens": 8, "fallback": POOL},
            },
        },
        clock,
    )
    assert c.submit(req()).admitted
    d = c.submit(req("b"))  # the pool is not this pod's capacity: nobody here is overtaken
    assert d.reason is Reason.FALLBACK_POOL


@pytest.mark.parametrize(
    "upstream",
    ["ftp://x", "http://x/path", "http://user@x", "small.svc:8000", "http://x:8000?q=1", ""],
)
def test_the_pool_upstream_must_be_a_base_url(upstream: str) -> None:
    pool = {"model": "s", "upstream": upstream}
    with pytest.raises(PolicyError, match=r"fallback\.upstream"):
        parse_policy(doc({"overload": {"actions": ["Degrade"], "degrade": {"fallback": pool}}}))


def test_degrade_with_only_a_pool_is_a_valid_policy() -> None:
    p = parse_policy(doc({"overload": {"actions": ["Degrade"], "degrade": {"fallback": POOL}}}))
    assert p.spec.overload.degrade is not None and p.spec.overload.degrade.fallback is not None
    assert p.spec.overload.degrade.fallback.upstream == POOL["upstream"]
