"""The admission core, pure: fake clock, no I/O, no sleeping."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvgate_agent.admission import (
    AdmissionConfig,
    AdmissionController,
    AdmissionRequest,
    AsyncAdmission,
    BucketMap,
    Outcome,
    Reason,
    TokenBucket,
    retry_after_seconds,
    round_up,
)
from kvgate_agent.admission.bucket import WARMUP_START_FRACTION
from kvgate_agent.contract.policy import parse_policy
from kvgate_bench.kit.toolkit import FakeClock


def make(spec: dict[str, Any], clock: FakeClock | None = None, **kw: Any) -> AdmissionController:
    # Small buckets below need a small default request (policy rule: burstTokens must admit
    # one default request); these tests always send max_tokens explicitly.
    spec = {"tenants": {"defaultMaxTokens": 16}, **spec}
    # The queue's mechanics are tested under the 30 s bound stated explicitly (unset, a request
    # under no TTFT SLO waits at most the default bound: test_default_wait_bound.py).
    spec["queue"] = {"maxWaitSeconds": 30, **spec.get("queue", {})}
    doc = {
        "apiVersion": "kvgate.io/v1alpha1",
        "kind": "RateLimitPolicy",
        "metadata": {"name": "t"},
        "spec": spec,
    }
    cfg = AdmissionConfig.from_policy(parse_policy(doc).spec)
    return AdmissionController(cfg, clock or FakeClock(1000.0), **kw)


def req(tenant: str = "a", prompt: int = 10, max_tokens: int = 10, **kw: Any) -> AdmissionRequest:
    return AdmissionRequest(tenant, prompt, max_tokens, **kw)


# ---------------------------------------------------------------- token bucket


def test_bucket_never_negative_never_above_capacity() -> None:
    b = TokenBucket(10, 1, now=0)
    assert b.take(10, 0) and not b.take(0.5, 0)
    b.charge(100, 0)
    assert b.level == 0
    b.put_back(1000, 0)
    assert b.level == 10


def test_bucket_days_idle_refills_to_capacity_only() -> None:
    b = TokenBucket(5, 2, now=0)
    b.take(5, 0)
    assert b.refill(3 * 86400) == 5


def test_bucket_clock_stepping_back_adds_nothing() -> None:
    b = TokenBucket(10, 1, now=100)
    b.take(10, 100)
    assert b.refill(50) == 0  # clock stepped back 50 s
    assert b.refill(100) == 0  # and back to where it was: still nothing accrued
    assert b.refill(103) == pytest.approx(3)


def test_bucket_seconds_until_is_real_refill_time_and_infinite_above_capacity() -> None:
    b = TokenBucket(100, 10, now=0)
    b.take(100, 0)
    assert b.seconds_until(25, 0) == pytest.approx(2.5)
    assert b.seconds_until(101, 0) == math.inf  # can never fit: never "retry in 10 s"


def test_bucket_warmup_starts_partly_filled_and_ramps_linearly() -> None:
    b = TokenBucket(1000, 1e-9, now=0, warmup_start=0, warmup_seconds=100)
    assert b.level == pytest.approx(1000 * WARMUP_START_FRACTION)
    assert b.capacity_at(50) == pytest.approx(1000 * (0.25 + 0.75 * 0.5))
    assert b.capacity_at(100) == 1000
    # A 900-unit request during warm-up waits for the ramp, not forever.
    wait = b.seconds_until(900, 0)
    assert 0 < wait < math.inf
    assert b.capacity_at(wait) >= 900 - 1e-6


@given(
    st.lists(
        st.tuples(st.sampled_from(["take", "put", "charge", "tick", "back"]), st.floats(0, 1e4)),
        max_size=60,
    )
)
def test_bucket_invariants_hold_under_any_sequence(ops: list[tuple[str, float]]) -> None:
    now = 0.0
    b = TokenBucket(500, 7, now=0, warmup_start=0, warmup_seconds=30)
    for op, x in ops:
        if op == "take":
            b.take(x, now)
        elif op == "put":
            b.put_back(x, now)
        elif op == "charge":
            b.charge(x, now)
        elif op == "tick":
            now += x
        else:
            now -= x / 10
        level = b.refill(now)
        assert 0 <= level <= b.capacity + 1e-9
        assert math.isfinite(level)


def test_bucket_map_is_bounded_when_clients_send_endless_tenant_ids() -> None:
    m = BucketMap(100, 1, warmup_start=0, max_keys=1000)
    for i in range(50_000):
        m.get(f"tenant-{i}", now=i * 0.001).take(50, i * 0.001)
    assert len(m) <= 1000


def test_bucket_map_evicts_idle_full_buckets_but_not_pinned_ones() -> None:
    # idle_seconds defaults to 60: at t=100 both buckets are idle and refilled.
    m = BucketMap(10, 10, warmup_start=0)
    m.get("busy", 0).take(10, 0)
    m.get("busy", 0).pins = 1  # a reservation is held against it
    m.get("idle", 0).take(10, 0)
    for i in range(10):  # much later: both refilled; new arrivals trigger eviction
        m.get(f"new-{i}", 100 + i)
    keys = {k for k, _ in m.items()}
    assert "idle" not in keys
    assert "busy" in keys


# ---------------------------------------------------------------- KV arithmetic


def test_bytes_per_token_uses_kv_heads_and_dtype() -> None:
    base = {"numLayers": 32, "numKVHeads": 8, "headDim": 128}

    def bpt(**kw: Any) -> int | None:
        return make({"model": {**base, **kw}}).config.bytes_per_token

    assert bpt(kvCacheDtype="bf16") == 2 * 32 * 8 * 128 * 2 == 131072  # Llama-3.1-8B
    assert bpt(kvCacheDtype="fp8") == 65536
    assert bpt(kvCacheDtype="fp32") == 262144


def test_round_up_to_block() -> None:
    assert round_up(1, 16) == 16
    assert round_up(16, 16) == 16
    assert round_up(17, 16) == 32


def test_kv_reservation_is_block_rounded_atomic_and_released_once() -> None:
    c = make(
        {
            "capacity": {"kvCacheTokens": 64},
            "model": {"blockSize": 16},
            "overload": {"actions": ["Reject"]},
        }
    )
    d = c.submit(req(prompt=10, max_tokens=7))  # 17 tokens -> 32 reserved
    assert d.outcome is Outcome.ADMITTED and c.stats().kv_reserved_tokens == 32
    d2 = c.submit(req(prompt=20, max_tokens=12))  # 32 -> fits exactly
    assert d2.ticket is not None and c.stats().kv_reserved_tokens == 64
    d3 = c.submit(req(prompt=1, max_tokens=1))
    assert d3.outcome is Outcome.REJECTED and d3.reason is Reason.KV_CAPACITY
    assert d3.status == 429 and d3.retry_after is not None and d3.retry_after >= 1
    assert d.ticket is not None
    assert c.release(d.ticket, completion_tokens=7) is True
    assert c.release(d.ticket, completion_tokens=7) is False  # exactly once
    assert c.stats().kv_reserved_tokens == 32 and c.stats().in_flight == 1


def test_reservation_above_kv_capacity_is_refused_at_once_with_400() -> None:
    c = make({"capacity": {"kvCacheTokens": 1024}})
    d = c.submit(req(prompt=100, max_tokens=2000))
    assert d.outcome is Outcome.REJECTED and d.status == 400
    assert d.reason is Reason.EXCEEDS_CAPACITY and d.retry_after is None
    assert c.stats().queue_length == 0 and c.stats().in_flight == 0


# ---------------------------------------------------------------- cost and buckets


def test_cost_counts_prompt_and_output_tokens() -> None:
    c = make({"cost": {"perRequest": 5, "promptTokenWeight": 2, "outputTokenWeight": 0.5}})
    assert c.config.cost(100, 40) == 5 + 200 + 20


def test_cost_above_bucket_capacity_is_refused_at_once_never_queued() -> None:
    c = make({"rateLimits": [{"name": "t", "tokensPerMinute": 600, "burstTokens": 1000}]})
    d = c.submit(req(prompt=500, max_tokens=600))
    assert d.status == 400 and d.reason is Reason.EXCEEDS_CAPACITY and d.retry_after is None
    assert d.limit == "t" and c.stats().queue_length == 0


def test_cost_above_capacity_is_degraded_when_policy_allows() -> None:
    c = make(
        {
            "rateLimits": [{"name": "t", "tokensPerMinute": 600, "burstTokens": 1000}],
            "overload": {"actions": ["Degrade", "Reject"], "degrade": {"minMaxTokens": 100}},
        }
    )
    d = c.submit(req(prompt=500, max_tokens=600))
    assert d.outcome is Outcome.DEGRADED and d.reason is Reason.MAX_TOKENS_CLAMPED
    assert d.max_tokens == 500  # 500 prompt + 500 output = the whole burst


def test_retry_after_comes_from_the_refill_time() -> None:
    clock = FakeClock(1000.0)
    c = make(
        {
            "rateLimits": [{"name": "t", "tokensPerMinute": 600, "burstTokens": 1000}],
            "overload": {"actions": ["Reject"]},
        },
        clock,
    )
    assert c.submit(req(prompt=400, max_tokens=400)).admitted  # 800 of 1000 used
    d = c.submit(req(prompt=400, max_tokens=400))  # needs 800, has 200, refills 10/s
    assert d.status == 429 and d.reason is Reason.RATE_LIMIT_TOKENS
    assert d.retry_after == 60
    clock.advance(30)
    d = c.submit(req(prompt=400, max_tokens=400))
    assert d.retry_after == 30  # not a constant: it follows the bucket
    clock.advance(30)
    assert c.submit(req(prompt=400, max_tokens=400)).admitted


def test_retry_after_is_an_integer_at_least_one() -> None:
    assert retry_after_seconds(0.0) == 1
    assert retry_after_seconds(0.01) == 1
    assert retry_after_seconds(1.2) == 2
    assert retry_after_seconds(math.inf) >= 1


def test_settlement_refunds_unused_and_charges_excess() -> None:
    clock = FakeClock(1000.0)
    c = make({"rateLimits": [{"name": "t", "tokensPerMinute": 0.001, "burstTokens": 1000}]}, clock)
    d = c.submit(req(prompt=100, max_tokens=400))  # reserves 500
    assert d.ticket is not None
    c.release(d.ticket, completion_tokens=50)  # used 150: refund 350
    level = next(
        lvl for name, unit, key, lvl, cap in c.tenant_stats().bucket_levels if unit == "cost"
    )
    assert level == pytest.approx(850, abs=0.01)
    d = c.submit(req(prompt=100, max_tokens=100))  # reserves 200
    assert d.ticket is not None
    c.release(d.ticket, prompt_tokens=300, completion_tokens=100)  # server said 300 prompt
    level = next(
        lvl for name, unit, key, lvl, cap in c.tenant_stats().bucket_levels if unit == "cost"
    )
    assert level == pytest.approx(450, abs=0.01)


def test_request_that_never_reached_upstream_is_not_charged() -> None:
    c = make(
        {
            "rateLimits": [
                {
                    "name": "t",
                    "requestsPerMinute": 0.001,
                    "burstRequests": 1,
                    "tokensPerMinute": 0.001,
                    "burstTokens": 100,
                }
            ]
        }
    )
    d = c.submit(req(prompt=10, max_tokens=10))
    assert d.ticket is not None
    c.release(d.ticket, completion_tokens=0, reached_upstream=False)
    assert c.submit(req(prompt=10, max_tokens=10)).admitted  # the bucket got everything back


def test_tenants_have_separate_buckets_and_pod_limits_are_shared() -> None:
    c = make(
        {
            "rateLimits": [
                {"name": "tenant", "per": "Tenant", "requestsPerMinute": 0.001, "burstRequests": 1},
                {"name": "pod", "per": "Pod", "requestsPerMinute": 0.001, "burstRequests": 3},
            ],
            "overload": {"actions": ["Reject"]},
        }
    )
    assert c.submit(req("a")).admitted
    assert c.submit(req("a")).limit == "tenant"
    assert c.submit(req("b")).admitted
    assert c.submit(req("c")).admitted
    d = c.submit(req("d"))
    assert d.limit == "pod" and d.reason is Reason.RATE_LIMIT_REQUESTS


def test_global_limits_are_split_by_share() -> None:
    doc = {
        "apiVersion": "kvgate.io/v1alpha1",
        "kind": "RateLimitPolicy",
        "metadata": {"name": "t"},
        "spec": {
            "rateLimits": [
                {"name": "g", "per": "Global", "requestsPerMinute": 600, "burstRequests": 100}
            ]
        },
    }
    cfg = AdmissionConfig.from_policy(parse_policy(doc).spec, global_share=0.25)
    (lim,) = cfg.limits
    assert lim.request_rate == pytest.approx(2.5) and lim.request_capacity == 25


def test_warmup_protects_a_fresh_pod_from_a_full_burst() -> None:
    clock = FakeClock(1000.0)
    c = make(
        {
            "rateLimits": [
                {
                    "name": "t",
                    "per": "Pod",
                    "requestsPerMinute": 0.001,
                    "burstRequests": 100,
                    "warmupSeconds": 60,
                }
            ],
            "overload": {"actions": ["Reject"]},
        },
        clock,
    )
    admitted = sum(c.submit(req(str(i))).admitted for i in range(100))
    assert admitted == 25  # a quarter of the burst at start


# ---------------------------------------------------------------- concurrency and queue


def _tickets(c: AdmissionController, n: int, **kw: Any) -> list[Any]:
    out = []
    for i in range(n):
        d = c.submit(req(f"t{i}", **kw))
        assert d.ticket is not None
        out.append(d.ticket)
    return out


def test_concurrency_cap_queues_and_release_admits_in_fifo_order() -> None:
    clock = FakeClock(1000.0)
    c = make({"concurrency": {"maxRequests": 2}}, clock)
    held = _tickets(c, 2)
    w1 = c.submit(req("x")).waiter
    w2 = c.submit(req("y")).waiter
    assert w1 is not None and w2 is not None and c.stats().queue_length == 2
    clock.advance(0.5)
    c.release(held[0], completion_tokens=5)
    c.pump()
    done = c.take_resolved()
    assert done == [w1] and w1.decision is not None
    assert w1.decision.outcome is Outcome.QUEUED and w1.decision.queue_seconds == 0.5
    assert w2.decision is None and c.stats().in_flight == 2


def test_new_arrivals_do_not_overtake_the_queue() -> None:
    c = make({"concurrency": {"maxRequests": 1}})
    (held,) = _tickets(c, 1)
    w = c.submit(req("x")).waiter
    c.release(held, completion_tokens=1)
    # Capacity is free but not yet pumped: a newcomer must queue behind x, not jump it.
    d = c.submit(req("y"))
    assert w is not None and w.decision is not None and w.decision.admitted
    assert d.waiter is not None and not d.admitted


def test_priority_order() -> None:
    c = make({"concurrency": {"maxRequests": 1}, "queue": {"order": "Priority"}})
    (held,) = _tickets(c, 1)
    low = c.submit(req("l", priority=0)).waiter
    high = c.submit(req("h", priority=5)).waiter
    c.release(held, completion_tokens=1)
    c.pump()
    assert c.take_resolved() == [high]
    assert low is not None and low.decision is None


def test_shortest_first_with_aging_cannot_starve_long_requests() -> None:
    clock = FakeClock(1000.0)
    c = make(
        {
            "concurrency": {"maxRequests": 1},
            "model": {"maxModelLen": 8192},
            "queue": {"order": "ShortestFirst", "maxWaitSeconds": 20, "maxLength": 1000},
        },
        clock,
    )
    (held,) = _tickets(c, 1)
    long_w = c.submit(req("long", prompt=4000, max_tokens=4000)).waiter
    assert long_w is not None
    # A steady stream of short requests arrives; one slot frees per second.
    for _ in range(30):
        c.submit(req("short", prompt=10, max_tokens=10))
        clock.advance(1)
        c.release(held, completion_tokens=1)
        c.pump()
        won = [w for w in c.take_resolved() if w.decision is not None and w.decision.admitted]
        assert len(won) == 1
        assert won[0].decision is not None and won[0].decision.ticket is not None
        held = won[0].decision.ticket
        if won[0] is long_w:
            break
    assert long_w.decision is not None and long_w.decision.admitted
    assert long_w.decision.queue_seconds <= 11  # overtook the shorts by half the max wait


def test_queue_timeout_falls_through_to_the_next_action() -> None:
    clock = FakeClock(1000.0)
    c = make({"concurrency": {"maxRequests": 1}, "queue": {"maxWaitSeconds": 2}}, clock)
    _tickets(c, 1, max_tokens=100)
    w = c.submit(req("x")).waiter
    assert w is not None
    assert c.next_wake() == pytest.approx(clock.now + 2)
    clock.advance(2)
    c.pump()
    assert c.take_resolved() == [w] and w.decision is not None
    assert w.decision.outcome is Outcome.REJECTED and w.decision.reason is Reason.QUEUE_TIMEOUT
    assert w.decision.status == 429 and w.decision.retry_after is not None
    assert w.decision.retry_after >= 1 and c.stats().queue_length == 0


def test_queue_full_rejects_with_retry_after_from_drain_time() -> None:
    clock = FakeClock(1000.0)
    c = make({"concurrency": {"maxRequests": 1}, "queue": {"maxLength": 1}}, clock)
    _tickets(c, 1, max_tokens=100)
    assert c.submit(req("q")).waiter is not None
    d = c.submit(req("z"))
    assert d.reason is Reason.QUEUE_FULL and d.status == 429
    # drain estimate: ~2 in-flight completions of ~101 tokens at 20 ms/token, ≥ 1 s
    assert d.retry_after is not None and 2 <= d.retry_after <= 10


def test_sheddable_requests_are_never_queued() -> None:
    c = make({"concurrency": {"maxRequests": 1}})
    _tickets(c, 1)
    d = c.submit(req("x", priority=-1))
    assert d.outcome is Outcome.REJECTED and d.reason is Reason.SHEDDABLE
    assert c.stats().queue_length == 0


def test_waiter_blocked_by_its_own_tenant_bucket_does_not_block_others() -> None:
    clock = FakeClock(1000.0)
    c = make(
        {
            "rateLimits": [
                {"name": "t", "per": "Tenant", "requestsPerMinute": 6, "burstRequests": 1}
            ]
        },
        clock,
    )
    assert c.submit(req("a")).admitted
    wa = c.submit(req("a")).waiter  # a's bucket is empty: waits ~10 s
    assert wa is not None
    assert c.submit(req("b")).admitted  # b is not stuck behind a
    assert c.next_wake() == pytest.approx(clock.now + 10, abs=0.01)
    clock.advance(10)
    c.pump()
    assert c.take_resolved() == [wa]


def test_next_wake_never_asks_for_a_pump_in_the_past_behind_a_shared_blocker() -> None:
    # A waits on its own bucket (refill at +10 s). Then a higher-priority waiter that the KV
    # pool blocks ranks ahead of it: a pump stops there, and A's refill time from the earlier
    # pass must not be left behind for next_wake, or the asyncio driver would re-pump at once
    # forever (a busy loop until a release).
    clock = FakeClock(1000.0)
    c = make(
        {
            "capacity": {"kvCacheTokens": 1024},
            "model": {"blockSize": 16},
            "queue": {"order": "Priority", "maxWaitSeconds": 60},
            "rateLimits": [
                {"name": "t", "per": "Tenant", "requestsPerMinute": 6, "burstRequests": 1}
            ],
        },
        clock,
    )
    held = c.submit(req("big", prompt=500, max_tokens=300)).ticket  # 800 of 1024 reserved
    assert held is not None
    assert c.submit(req("a")).ticket is not None
    wa = c.submit(req("a")).waiter  # a's bucket is empty: waits ~10 s
    assert wa is not None and c.next_wake() == pytest.approx(clock.now + 10, abs=0.01)
    vip = c.submit(req("vip", prompt=200, max_tokens=200, priority=5)).waiter  # KV-blocked
    assert vip is not None
    clock.advance(10)
    c.pump()
    # vip is ahead and blocked by the shared KV pool; A fits now and goes past it, one of the
    # bounded backfills (the queue is work-conserving).
    assert [w.request.tenant for w in c.take_resolved()] == ["a"] and vip.skips == 1
    wake = c.next_wake()
    assert wake is not None and wake > clock.now  # the deadlines, not a time already past
    clock.advance(1)
    c.pump()
    wake = c.next_wake()
    assert wake is not None and wake > clock.now
    c.release(held, completion_tokens=300)
    c.pump()
    assert [w.request.tenant for w in c.take_resolved()] == ["vip"]
    assert c.stats().queue_length == 0 and c.next_wake() is None


def test_cancel_removes_a_waiter() -> None:
    c = make({"concurrency": {"maxRequests": 1}})
    _tickets(c, 1)
    w = c.submit(req("x")).waiter
    assert w is not None
    c.cancel(w)
    assert c.stats().queue_length == 0 and c.next_wake() is None


# ---------------------------------------------------------------- degrade


def test_degrade_clamps_max_tokens_to_the_kv_that_is_free() -> None:
    c = make(
        {
            "capacity": {"kvCacheTokens": 1024},
            "model": {"blockSize": 16},
            "overload": {"actions": ["Degrade", "Reject"], "degrade": {"minMaxTokens": 64}},
        }
    )
    _tickets(c, 1, prompt=500, max_tokens=400)  # 912 reserved, 112 free
    d = c.submit(req("x", prompt=20, max_tokens=500))
    assert d.outcome is Outcome.DEGRADED and d.reason is Reason.MAX_TOKENS_CLAMPED
    assert d.max_tokens == 92  # 20 + 92 = 112 = 7 blocks
    assert c.stats().kv_reserved_tokens == 1024


def test_degrade_never_clamps_below_min_max_tokens() -> None:
    c = make(
        {
            "capacity": {"kvCacheTokens": 1024},
            "overload": {"actions": ["Degrade", "Reject"], "degrade": {"minMaxTokens": 200}},
        }
    )
    _tickets(c, 1, prompt=500, max_tokens=400)
    d = c.submit(req("x", prompt=20, max_tokens=500))
    assert d.outcome is Outcome.REJECTED and d.reason is Reason.KV_CAPACITY


def test_degrade_to_fallback_model_when_over_rate_limit() -> None:
    c = make(
        {
            "rateLimits": [{"name": "t", "requestsPerMinute": 0.001, "burstRequests": 1}],
            "overload": {"actions": ["Degrade", "Reject"], "degrade": {"fallbackModel": "small"}},
        }
    )
    assert c.submit(req("a", model="big")).admitted
    d = c.submit(req("a", model="big"))
    assert d.outcome is Outcome.DEGRADED and d.reason is Reason.FALLBACK_MODEL
    assert d.model == "small" and d.ticket is not None and d.ticket.holds == []


def test_degrade_does_not_let_a_newcomer_overtake_waiters() -> None:
    clock = FakeClock(1000.0)
    c = make(
        {
            "capacity": {"kvCacheTokens": 1024},
            "model": {"blockSize": 16},
            "overload": {
                "actions": ["Degrade", "Queue", "Reject"],
                "degrade": {"minMaxTokens": 128},
            },
        },
        clock,
    )
    _tickets(c, 1, prompt=100, max_tokens=620)  # 720 reserved
    (small,) = _tickets(c, 1, prompt=4, max_tokens=92)  # 96 more: 208 free
    b = c.submit(req("b", prompt=150, max_tokens=100))  # needs 256, cannot clamp below 128
    assert b.waiter is not None
    clock.advance(1)
    newcomer = c.submit(req("c", prompt=10, max_tokens=1000))
    assert newcomer.waiter is not None  # queued behind b, not clamped into b's capacity
    c.release(small, completion_tokens=92)
    c.pump()
    assert b.waiter.decision is not None and b.waiter.decision.admitted


def test_a_waiter_may_still_degrade_when_its_wait_times_out() -> None:
    clock = FakeClock(1000.0)
    c = make(
        {
            "capacity": {"kvCacheTokens": 1024},
            "model": {"blockSize": 16},
            "queue": {"maxWaitSeconds": 5},
            "overload": {
                "actions": ["Queue", "Degrade", "Reject"],
                "degrade": {"minMaxTokens": 64},
            },
        },
        clock,
    )
    _tickets(c, 1, prompt=100, max_tokens=700)  # 800 reserved, 224 free
    w = c.submit(req("x", prompt=20, max_tokens=500)).waiter
    assert w is not None
    clock.advance(5)
    c.pump()
    assert w.decision is not None and w.decision.outcome is Outcome.DEGRADED
    assert w.decision.max_tokens == 204 and w.decision.queue_seconds == 5


def test_retry_after_counts_the_demand_queued_on_the_same_bucket() -> None:
    clock = FakeClock(1000.0)
    c = make(
        {
            "rateLimits": [{"name": "t", "requestsPerMinute": 60, "burstRequests": 1}],
            "queue": {"maxLength": 3},
        },
        clock,
    )
    assert c.submit(req("a")).admitted
    for _ in range(3):  # three more of a's requests wait for the same bucket, 1 s apart
        assert c.submit(req("a")).waiter is not None
    d = c.submit(req("a"))
    assert d.reason is Reason.QUEUE_FULL
    assert d.retry_after == 4  # its turn comes after the three queued ones
    other = c.submit(req("b"))
    assert other.admitted  # another tenant's bucket is untouched


def test_passing_through_the_queue_without_waiting_is_admitted() -> None:
    c = make(
        {
            "capacity": {"kvCacheTokens": 1024},
            "model": {"blockSize": 16},
            "queue": {"order": "Priority"},
        }
    )
    _tickets(c, 1, prompt=500, max_tokens=300)  # 800 reserved
    assert c.submit(req("big", prompt=200, max_tokens=200)).waiter is not None
    d = c.submit(req("vip", prompt=10, max_tokens=10, priority=5))  # ranks first, fits now
    assert d.outcome is Outcome.ADMITTED and d.queue_seconds == 0 and d.ticket is not None


# ---------------------------------------------------------------- asyncio driver


async def test_async_waiter_wakes_on_release_without_polling() -> None:
    c = make({"concurrency": {"maxRequests": 1}})
    a = AsyncAdmission(c)
    first = await a.admit(req("a"))
    assert first.ticket is not None
    task = asyncio.create_task(a.admit(req("b")))
    await asyncio.sleep(0)
    assert c.stats().queue_length == 1 and not task.done()
    a.release(first.ticket, completion_tokens=1)
    second = await asyncio.wait_for(task, 1)
    assert second.outcome is Outcome.QUEUED and c.stats().in_flight == 1


async def test_async_cancelled_waiter_leaves_nothing_behind() -> None:
    c = make({"concurrency": {"maxRequests": 1}})
    a = AsyncAdmission(c)
    first = await a.admit(req("a"))
    task = asyncio.create_task(a.admit(req("b")))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert c.stats().queue_length == 0
    assert first.ticket is not None
    a.release(first.ticket, completion_tokens=1)
    assert c.stats().in_flight == 0 and c.stats().kv_reserved_tokens == 0


async def test_async_waiter_admitted_then_cancelled_releases_its_ticket() -> None:
    c = make({"concurrency": {"maxRequests": 1}, "capacity": {"kvCacheTokens": 4096}})
    a = AsyncAdmission(c)
    first = await a.admit(req("a"))
    assert first.ticket is not None
    task = asyncio.create_task(a.admit(req("b")))
    await asyncio.sleep(0)
    a.release(first.ticket, completion_tokens=1)  # b is admitted (future resolved) ...
    task.cancel()  # ... but its client left before the task resumed
    with pytest.raises(asyncio.CancelledError):
        await task
    assert c.stats().in_flight == 0 and c.stats().kv_reserved_tokens == 0


# ---------------------------------------------------------------- state machine


class AdmissionMachine(RuleBasedStateMachine):
    """Random submit / release / cancel / time steps; the accounting must always add up."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock(1000.0)
        self.c = make(
            {
                "capacity": {"kvCacheTokens": 2048},
                "model": {"blockSize": 16},
                "concurrency": {"maxRequests": 4},
                "rateLimits": [
                    {
                        "name": "t",
                        "per": "Tenant",
                        "requestsPerMinute": 120,
                        "tokensPerMinute": 30000,
                        "burstTokens": 3000,
                    }
                ],
                "queue": {"maxLength": 5, "maxWaitSeconds": 3, "order": "ShortestFirst"},
                "overload": {
                    "actions": ["Degrade", "Queue", "Reject"],
                    "degrade": {"minMaxTokens": 16},
                },
            },
            self.clock,
        )
        self.tickets: list[Any] = []
        self.waiters: list[Any] = []

    def _collect(self) -> None:
        for w in self.c.take_resolved():
            self.waiters.remove(w)
            if w.decision is not None and w.decision.ticket is not None:
                self.tickets.append(w.decision.ticket)

    @rule(
        tenant=st.sampled_from("abc"),
        prompt=st.integers(1, 1500),
        max_tokens=st.integers(1, 1500),
        priority=st.integers(-1, 2),
    )
    def submit(self, tenant: str, prompt: int, max_tokens: int, priority: int) -> None:
        d = self.c.submit(req(tenant, prompt, max_tokens, priority=priority))
        if d.waiter is not None:
            self.waiters.append(d.waiter)
        elif d.ticket is not None:
            self.tickets.append(d.ticket)
        else:
            assert d.status in (400, 429)
            assert d.status == 400 or (d.retry_after is not None and d.retry_after >= 1)
        self._collect()

    @precondition(lambda self: self.tickets)
    @rule(i=st.integers(0, 100), used=st.integers(0, 2000), reached=st.booleans())
    def release(self, i: int, used: int, reached: bool) -> None:
        t = self.tickets.pop(i % len(self.tickets))
        self.c.release(t, completion_tokens=used, reached_upstream=reached)
        self.c.pump()
        self._collect()

    @precondition(lambda self: self.waiters)
    @rule(i=st.integers(0, 100))
    def cancel(self, i: int) -> None:
        w = self.waiters.pop(i % len(self.waiters))
        self.c.cancel(w)

    @rule(dt=st.floats(0, 5))
    def tick(self, dt: float) -> None:
        self.clock.advance(dt)
        self.c.pump()
        self._collect()

    @invariant()
    def accounting_adds_up(self) -> None:
        c = self.c
        assert c.stats().in_flight == len(self.tickets) <= 4
        assert c.stats().kv_reserved_tokens == sum(t.kv_tokens for t in self.tickets) <= 2048
        assert c.stats().queue_length == len(self.waiters) <= 5
        for *_, level, cap in c.tenant_stats().bucket_levels:
            assert -1e-9 <= level <= cap + 1e-9

    def teardown(self) -> None:
        for t in self.tickets:
            self.c.release(t, completion_tokens=0)
        for w in self.waiters:
            self.c.cancel(w)
        self.c.pump()
        for w in self.c.take_resolved():
            if w.decision is not None and w.decision.ticket is not None:
                self.c.release(w.decision.ticket, completion_tokens=0)
        assert self.c.stats().in_flight == 0 and self.c.stats().kv_reserved_tokens == 0
        assert self.c.stats().queue_length == 0


TestAdmissionMachine = AdmissionMachine.TestCase
TestAdmissionMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)


# ---------------------------------------------------------------- reconfigure (new thresholds)


def config_of(spec: dict[str, Any]) -> AdmissionConfig:
    doc = {
        "apiVersion": "kvgate.io/v1alpha1",
        "kind": "RateLimitPolicy",
        "metadata": {"name": "t"},
        "spec": {"tenants": {"defaultMaxTokens": 16}, **spec},
    }
    return AdmissionConfig.from_policy(parse_policy(doc).spec)


def test_reconfigure_keeps_in_flight_tickets_and_kv_and_releases_them_afterwards() -> None:
    base = {
        "capacity": {"kvCacheTokens": 1000},
        "model": {"blockSize": 1},
        "overload": {"actions": ["Reject"]},
    }
    c = make({**base, "concurrency": {"maxRequests": 4}})
    t1 = c.submit(req("a", 100, 100)).ticket
    t2 = c.submit(req("b", 50, 50)).ticket
    assert t1 is not None and t2 is not None
    c.reconfigure(config_of({**base, "concurrency": {"maxRequests": 2}}))
    assert c.stats().in_flight == 2 and c.stats().kv_reserved_tokens == 300
    assert c.config.max_concurrency == 2
    d = c.submit(req("c", 10, 10))  # the new cap counts the old tickets
    assert d.reason is Reason.CONCURRENCY
    assert c.release(t1, completion_tokens=5) and c.release(t2, completion_tokens=5)
    assert not c.release(t1, completion_tokens=5)  # still exactly once
    assert c.stats().in_flight == 0 and c.stats().kv_reserved_tokens == 0


def test_reconfigure_keeps_buckets_carries_the_level_over_and_clamps_it() -> None:
    clock = FakeClock(1000.0)
    limit = {"name": "t", "per": "Tenant", "tokensPerMinute": 600, "burstTokens": 400}
    c = make({"rateLimits": [limit]}, clock)
    t = c.submit(req("a", 100, 100)).ticket  # 200 of 400 taken
    assert t is not None
    bucket = t.holds[0][0]
    c.reconfigure(config_of({"rateLimits": [{**limit, "burstTokens": 300}]}))
    assert t.holds[0][0] is bucket  # the very bucket the ticket holds
    assert bucket.capacity == 300 and bucket.level == pytest.approx(200)  # carried over
    c.reconfigure(config_of({"rateLimits": [{**limit, "tokensPerMinute": 60, "burstTokens": 50}]}))
    assert bucket.level == pytest.approx(50) and bucket.rate == pytest.approx(1.0)  # clamped
    assert [(n, lvl) for n, _, k, lvl, _ in c.tenant_stats().bucket_levels if k == "a"] == [
        ("t", 50)
    ]
    clock.advance(10)  # refills at the new rate
    assert bucket.refill(clock()) == pytest.approx(50)
    c.release(t, completion_tokens=0)  # refund of 100 into the retuned bucket, clamped
    assert bucket.level == pytest.approx(50) and bucket.pins == 0


def test_reconfigure_adds_fresh_limits_and_drops_removed_ones() -> None:
    old = {"name": "old", "per": "Pod", "requestsPerMinute": 1, "burstRequests": 1}
    new = {"name": "new", "per": "Tenant", "requestsPerMinute": 60, "burstRequests": 2}
    reject = {"overload": {"actions": ["Reject"]}}
    c = make({"rateLimits": [old], **reject})
    t = c.submit(req("a")).ticket
    assert t is not None
    assert c.submit(req("a")).reason is Reason.RATE_LIMIT_REQUESTS
    c.reconfigure(config_of({"rateLimits": [new], **reject}))
    assert {
        n for n, *_ in c.tenant_stats().bucket_levels
    } == set()  # nothing touched the new limit yet
    assert c.submit(req("a")).ticket is not None  # "old" is gone; "new" starts full (2)
    assert c.submit(req("a")).ticket is not None
    assert c.submit(req("a")).reason is Reason.RATE_LIMIT_REQUESTS
    assert c.release(t, completion_tokens=1)  # into the detached "old" bucket: harmless
    assert c.stats().in_flight == 2
    # Same name, other scope: a different limit, fresh buckets.
    c.reconfigure(config_of({"rateLimits": [{**new, "per": "Pod"}], **reject}))
    assert c.submit(req("z")).ticket is not None


def test_reconfigure_recomputes_the_cheapest_capacity_for_never_fits() -> None:
    limit = {"name": "t", "per": "Tenant", "tokensPerMinute": 6000, "burstTokens": 1000}
    c = make({"rateLimits": [limit]})
    assert c.submit(req("a", 100, 500)).ticket is not None
    c.reconfigure(config_of({"rateLimits": [{**limit, "burstTokens": 100}]}))
    d = c.submit(req("b", 100, 500))
    assert d.status == 400 and d.reason is Reason.EXCEEDS_CAPACITY


def test_reconfigure_keeps_the_queue_and_the_next_pump_admits_what_now_fits() -> None:
    c = make({"concurrency": {"maxRequests": 1}})
    a = AsyncAdmission(c)
    first = c.submit(req("a"))
    w = c.submit(req("b")).waiter
    assert first.ticket is not None and w is not None
    c.reconfigure(config_of({"concurrency": {"maxRequests": 2}}))
    assert (
        c.stats().queue_length == 1 and w.decision is None
    )  # nothing decided by reconfigure itself
    c.pump()
    assert w.decision is not None and w.decision.outcome is Outcome.QUEUED
    assert c.take_resolved() == [w] and c.stats().in_flight == 2
    a.close()


# ---------------------------------------------------------------- holds (GPU memory, FailClosed)


def test_gpu_memory_hold_refuses_new_work_with_503_until_lifted() -> None:
    clock = FakeClock(1000.0)
    c = make({"concurrency": {"maxRequests": 4}}, clock)
    t = c.submit(req("a")).ticket
    assert t is not None
    c.holds.hold(Reason.GPU_MEMORY_LOW, retry_after=2.5, message="GPU memory low")
    assert c.active_hold() is not None
    d = c.submit(req("b"))
    assert d.outcome is Outcome.REJECTED and d.reason is Reason.GPU_MEMORY_LOW
    assert d.status == 503 and d.retry_after == 3 and d.message == "GPU memory low"
    assert c.release(t, completion_tokens=1)  # in-flight work finishes normally
    assert c.holds.lift(Reason.GPU_MEMORY_LOW) and not c.holds.lift(Reason.GPU_MEMORY_LOW)
    assert c.active_hold() is None and c.submit(req("b")).ticket is not None


def test_pump_admits_nobody_while_held_and_waiters_time_out_with_the_hold() -> None:
    clock = FakeClock(1000.0)
    c = make(
        {
            "concurrency": {"maxRequests": 1},
            "queue": {"maxWaitSeconds": 10},
            "overload": {"actions": ["Queue", "Degrade"], "degrade": {"fallbackModel": "small"}},
        },
        clock,
    )
    t = c.submit(req("a")).ticket
    w1 = c.submit(req("b")).waiter
    w2 = c.submit(req("c")).waiter
    assert t is not None and w1 is not None and w2 is not None
    c.holds.hold(Reason.GPU_MEMORY_LOW, retry_after=1, message="low")
    c.release(t, completion_tokens=1)
    c.pump()
    assert c.stats().queue_length == 2 and c.take_resolved() == []  # room, but held
    c.holds.lift(Reason.GPU_MEMORY_LOW)
    c.pump()
    assert w1.decision is not None and w1.decision.outcome is Outcome.QUEUED
    c.holds.hold(Reason.GPU_MEMORY_LOW, retry_after=1, message="low")
    clock.advance(11)  # w2's deadline passes while held: refused with the hold, never degraded
    c.pump()
    assert w2.decision is not None and w2.decision.status == 503
    assert w2.decision.reason is Reason.GPU_MEMORY_LOW and w2.decision.queue_seconds == 11
    assert c.stats().in_flight == 1


def test_refused_whatever_the_prompt_only_when_no_count_could_change_it() -> None:
    clock = FakeClock(1000.0)
    rpm = {"name": "t", "requestsPerMinute": 0.01, "burstRequests": 1}
    reject = {"rateLimits": [rpm], "overload": {"actions": ["Reject"]}}
    c = make(reject, clock)
    assert not c.refused_whatever_the_prompt(req("a"))
    assert c.submit(req("a")).ticket is not None
    assert c.refused_whatever_the_prompt(req("a", prompt=1))  # out of requests: 429 anyway
    assert not c.refused_whatever_the_prompt(req("b"))
    c.holds.hold(Reason.FAIL_CLOSED, retry_after=1, message="stale")
    assert c.refused_whatever_the_prompt(req("b"))
    c.holds.lift(Reason.FAIL_CLOSED)
    # Queue (for a request that may queue) or a fallback model could still serve tenant a.
    queue = make({"rateLimits": [rpm]}, clock)
    assert queue.submit(req("a")).ticket is not None
    assert not queue.refused_whatever_the_prompt(req("a"))
    assert queue.refused_whatever_the_prompt(req("a", priority=-1))  # sheddable: never queued
    degrade = {"actions": ["Degrade", "Reject"], "degrade": {"fallbackModel": "small"}}
    fallback = make({"rateLimits": [rpm], "overload": degrade}, clock)
    assert fallback.submit(req("a")).ticket is not None
    assert not fallback.refused_whatever_the_prompt(req("a"))
    # A token-cost limit depends on the prompt: never refused by this check.
    tpm = {"name": "c", "tokensPerMinute": 0.01, "burstTokens": 100}
    cost = make({"rateLimits": [tpm], "overload": {"actions": ["Reject"]}}, clock)
    assert cost.submit(req("a", 50, 40)).ticket is not None
    assert not cost.refused_whatever_the_prompt(req("a", 50, 40))


def test_holds_with_keys_do_not_lift_each_other_and_the_longest_wait_answers() -> None:
    clock = FakeClock(1000.0)
    c = make({}, clock)
    c.holds.hold(Reason.FAIL_CLOSED, retry_after=1, message="stale", key="thresholds")
    c.holds.hold(Reason.FAIL_CLOSED, retry_after=5, message="no capacity", key="engine", until=1005)
    c.holds.hold(Reason.GPU_MEMORY_LOW, retry_after=2, message="low")
    d = c.submit(req())
    assert (d.reason, d.retry_after, d.message) == (Reason.FAIL_CLOSED, 5, "no capacity")
    clock.advance(5)  # the timed hold ended by itself
    d = c.submit(req())
    assert (d.reason, d.retry_after) == (Reason.GPU_MEMORY_LOW, 2)
    c.holds.lift(Reason.GPU_MEMORY_LOW)
    assert c.submit(req()).reason is Reason.FAIL_CLOSED
    assert c.holds.lift("thresholds") and c.submit(req()).ticket is not None
    with pytest.raises(ValueError):
        c.holds.hold(Reason.FAIL_CLOSED, retry_after=0, message="x")


def test_a_timed_fail_closed_hold_wakes_waiters_when_it_ends() -> None:
    clock = FakeClock(1000.0)
    c = make({"concurrency": {"maxRequests": 1}}, clock)
    t = c.submit(req("a")).ticket
    w = c.submit(req("b")).waiter
    assert t is not None and w is not None
    c.holds.hold(Reason.FAIL_CLOSED, retry_after=2, message="stale", key="stale", until=clock() + 2)
    hold = c.active_hold()
    assert hold is not None and hold.until == 1002
    d = c.submit(req("c"))
    assert (d.status, d.reason, d.retry_after) == (503, Reason.FAIL_CLOSED, 2)
    c.release(t, completion_tokens=1)
    c.pump()
    assert c.stats().queue_length == 1
    assert c.next_wake() == 1002  # the hold's end, before the waiter's 30 s deadline
    clock.advance(2)
    c.pump()
    assert w.decision is not None and w.decision.ticket is not None
    c.holds.lift("stale")
    assert c.active_hold() is None


class ReconfiguringMachine(AdmissionMachine):
    """The same random steps, plus new thresholds and GPU-memory holds at random moments: the
    accounting must still add up and every reservation must come back."""

    @rule(burst=st.sampled_from([1500, 3000, 6000]), rpm=st.sampled_from([30, 120]))
    def retune(self, burst: int, rpm: int) -> None:
        spec = {
            "capacity": {"kvCacheTokens": 2048},
            "model": {"blockSize": 16},
            "concurrency": {"maxRequests": 4},
            "rateLimits": [
                {
                    "name": "t",
                    "per": "Tenant",
                    "requestsPerMinute": rpm,
                    "tokensPerMinute": 30000,
                    "burstTokens": burst,
                }
            ],
            "queue": {"maxLength": 5, "maxWaitSeconds": 3, "order": "ShortestFirst"},
            "overload": {
                "actions": ["Degrade", "Queue", "Reject"],
                "degrade": {"minMaxTokens": 16},
            },
        }
        self.c.reconfigure(config_of(spec))
        self.c.pump()
        self._collect()

    @rule(on=st.booleans())
    def gpu_memory(self, on: bool) -> None:
        if on:
            self.c.holds.hold(Reason.GPU_MEMORY_LOW, retry_after=1, message="low")
        else:
            self.c.holds.lift(Reason.GPU_MEMORY_LOW)
            self.c.pump()
            self._collect()

    @rule(
        tenant=st.sampled_from("abc"),
        prompt=st.integers(1, 1500),
        max_tokens=st.integers(1, 1500),
        priority=st.integers(-1, 2),
    )
    def submit(self, tenant: str, prompt: int, max_tokens: int, priority: int) -> None:
        d = self.c.submit(req(tenant, prompt, max_tokens, priority=priority))
        if d.waiter is not None:
            self.waiters.append(d.waiter)
        elif d.ticket is not None:
            self.tickets.append(d.ticket)
        else:
            assert d.status in (400, 429, 503)
            assert d.status == 400 or (d.retry_after is not None and d.retry_after >= 1)
        self._collect()

    def teardown(self) -> None:
        self.c.holds.lift(Reason.GPU_MEMORY_LOW)
        super().teardown()


TestReconfiguringMachine = ReconfiguringMachine.TestCase
TestReconfiguringMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
