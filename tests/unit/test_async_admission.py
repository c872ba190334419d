"""The one admission API the sidecar drives: every call that may let a waiter in wakes the queue
itself (no caller pumps), and a request carries its prompt's bounds so one submit decides.

Each wake test queues a request behind something only that call removes, makes the call and
nothing else, and checks the waiter was admitted by it: with no wake (the core's own call, no
pump) the same waiter stays queued, which the test checks first.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from kvgate_agent.admission import (
    AdmissionConfig,
    AdmissionController,
    AdmissionRequest,
    AsyncAdmission,
    Outcome,
    Reason,
)
from kvgate_agent.contract.policy import parse_policy
from kvgate_bench.kit.toolkit import FakeClock
from tests.conftest import policy_doc


def config(spec: dict[str, Any]) -> AdmissionConfig:
    # The 30 s queue bound stated (unset, the default bound applies: test_default_wait_bound.py).
    spec = {"tenants": {"defaultMaxTokens": 16}, **spec}
    spec["queue"] = {"maxWaitSeconds": 30, **spec.get("queue", {})}
    doc = policy_doc(spec)
    return AdmissionConfig.from_policy(parse_policy(doc).spec)


async def queued_behind(
    a: AsyncAdmission, prompt: int = 10, max_tokens: int = 10
) -> asyncio.Task[Any]:
    """A request left waiting in the queue (asserted)."""
    task = asyncio.create_task(a.admit(AdmissionRequest("w", prompt, max_tokens)))
    await asyncio.sleep(0)
    assert a.stats().queue_length == 1 and not task.done()
    return task


async def admitted_by(task: asyncio.Task[Any]) -> None:
    d = await asyncio.wait_for(task, 1)
    assert d.outcome is Outcome.QUEUED and d.ticket is not None


def core_alone_leaves_it_waiting(
    spec: dict[str, Any], change: Callable[[AdmissionController], None], size: int = 10
) -> None:
    """The control: the same change made on the pure core, with no pump, admits nobody."""
    c = AdmissionController(config(spec), FakeClock(1000.0))
    blocker = c.submit(AdmissionRequest("a", 10, 10))
    w = c.submit(AdmissionRequest("w", size, size)).waiter
    assert blocker.ticket is not None and w is not None
    change(c)
    assert w.decision is None and c.stats().queue_length == 1


QUEUE = {"overload": {"actions": ["Queue", "Reject"]}, "queue": {"maxWaitSeconds": 300}}


async def test_new_thresholds_let_a_waiter_in_at_once() -> None:
    spec = {**QUEUE, "concurrency": {"maxRequests": 1}}
    core_alone_leaves_it_waiting(
        spec, lambda c: c.reconfigure(config({**spec, "concurrency": {"maxRequests": 2}}))
    )
    a = AsyncAdmission(AdmissionController(config(spec), FakeClock(1000.0)))
    assert (await a.admit(AdmissionRequest("a", 10, 10))).ticket is not None
    task = await queued_behind(a)
    a.reconfigure(config({**spec, "concurrency": {"maxRequests": 2}}))
    await admitted_by(task)
    a.close()


async def test_a_lifted_hold_lets_a_waiter_in_at_once() -> None:
    clock = FakeClock(1000.0)
    a = AsyncAdmission(AdmissionController(config(QUEUE), clock))
    task = asyncio.create_task(a.admit(AdmissionRequest("w", 10, 10)))
    await asyncio.sleep(0)
    assert task.done()  # nothing blocks: admitted at once
    a.hold(Reason.FAIL_CLOSED, retry_after=5.0, message="closed", key="k")
    refused = await a.admit(AdmissionRequest("x", 10, 10))
    assert refused.status == 503 and refused.reason is Reason.FAIL_CLOSED
    assert a.lift("k") is True and a.lift("k") is False
    assert (await a.admit(AdmissionRequest("y", 10, 10))).ticket is not None
    a.close()


async def test_a_hold_lifted_while_a_request_waits_admits_it() -> None:
    spec = {**QUEUE, "concurrency": {"maxRequests": 1}}
    a = AsyncAdmission(AdmissionController(config(spec), FakeClock(1000.0)))
    first = await a.admit(AdmissionRequest("a", 10, 10))
    assert first.ticket is not None
    task = await queued_behind(a)
    a.hold(Reason.GPU_MEMORY_LOW, retry_after=1.0, message="low", key="gpu")
    a.release(first.ticket, completion_tokens=1)  # a release under a hold admits nobody
    await asyncio.sleep(0)
    assert not task.done() and a.stats().queue_length == 1
    a.lift("gpu")
    await admitted_by(task)
    a.close()


async def test_a_larger_kv_capacity_lets_a_waiter_in_at_once() -> None:
    spec = {**QUEUE, "capacity": {"kvCacheTokens": 64}}
    core_alone_leaves_it_waiting(spec, lambda c: c.live.set_kv_capacity(4096), size=20)
    a = AsyncAdmission(AdmissionController(config(spec), FakeClock(1000.0)))
    assert (await a.admit(AdmissionRequest("a", 10, 10))).ticket is not None
    task = await queued_behind(a, 20, 20)
    a.set_kv_capacity(4096)
    await admitted_by(task)
    a.close()


async def test_a_higher_engine_ceiling_lets_a_waiter_in_at_once() -> None:
    a = AsyncAdmission(AdmissionController(config(QUEUE), FakeClock(1000.0)))
    a.set_engine_concurrency(1)
    assert a.stats().concurrency_limit == 1
    assert (await a.admit(AdmissionRequest("a", 10, 10))).ticket is not None
    task = await queued_behind(a)
    a.set_engine_concurrency(2)
    await admitted_by(task)
    a.close()


async def test_the_engine_freeing_kv_lets_a_waiter_in_at_once() -> None:
    spec = {**QUEUE, "capacity": {"kvCacheTokens": 4096}}

    def engine_full_then_free(c: AdmissionController) -> None:
        c.live.observe_engine_kv(0)

    core_alone_leaves_it_waiting_on_engine(spec, engine_full_then_free)
    a = AsyncAdmission(AdmissionController(config(spec), FakeClock(1000.0)))
    a.observe_engine_usage(4096, None, None)  # the engine's own report: its KV is all in use
    task = await queued_behind(a)
    a.observe_engine_usage(0, 0, 0)
    await admitted_by(task)
    a.close()


def core_alone_leaves_it_waiting_on_engine(
    spec: dict[str, Any], change: Callable[[AdmissionController], None]
) -> None:
    c = AdmissionController(config(spec), FakeClock(1000.0))
    c.live.observe_engine_kv(4096)
    w = c.submit(AdmissionRequest("w", 10, 10)).waiter
    assert w is not None
    change(c)
    assert w.decision is None


async def test_slices_granted_let_a_waiter_for_its_bucket_in() -> None:
    spec = {
        **QUEUE,
        "rateLimits": [{"name": "g", "per": "Pod", "requestsPerMinute": 1, "burstRequests": 1}],
    }
    clock = FakeClock(1000.0)
    a = AsyncAdmission(AdmissionController(config(spec), clock))
    assert (await a.admit(AdmissionRequest("a", 10, 10))).ticket is not None
    task = await queued_behind(a)
    # The bucket refills in 60 s of the core's clock, the queue's timer is 60 s away on the
    # loop's: only the store's grant can wake the waiter within this test.
    clock.advance(60.0)
    await asyncio.sleep(0)
    assert not task.done()
    a.slices_granted()
    await admitted_by(task)
    a.close()


# ---------------------------------------------------------------- one submit


def test_an_estimated_prompt_is_decided_on_its_lowest_count_when_the_estimate_never_fits() -> None:
    c = AdmissionController(config({"capacity": {"kvCacheTokens": 1024}}), FakeClock(1000.0))
    r = AdmissionRequest("a", 1100, 16, prompt_tokens_min=900)
    d = c.submit(r)
    assert d.outcome is Outcome.ADMITTED and d.ticket is not None
    assert d.ticket.prompt_tokens == 900 == r.prompt_tokens and r.prompt_tokens_min is None


def test_an_exact_prompt_that_never_fits_is_refused_400() -> None:
    c = AdmissionController(config({"capacity": {"kvCacheTokens": 1024}}), FakeClock(1000.0))
    d = c.submit(AdmissionRequest("a", 1100, 16))
    assert d.status == 400 and d.reason is Reason.EXCEEDS_CAPACITY and d.param == "prompt"
    assert c.stats().in_flight == 0 and c.stats().kv_reserved_tokens == 0


@pytest.mark.parametrize("low", [1100, 1050])
def test_a_prompt_too_long_even_at_its_lowest_count_is_refused_400_on_that_count(
    low: int,
) -> None:
    c = AdmissionController(config({"capacity": {"kvCacheTokens": 1024}}), FakeClock(1000.0))
    d = c.submit(AdmissionRequest("a", 1100, 16, prompt_tokens_min=low))
    assert d.status == 400 and d.reason is Reason.EXCEEDS_CAPACITY
    assert f"prompt {low} tokens" in d.message
    assert c.stats().in_flight == 0 and c.stats().kv_reserved_tokens == 0
