"""The sidecar enforcing the node agent's answers in their modes: fake clock through the public
seams (a sync outcome, :meth:`EnforcedPolicy.refresh_mode`), and the mode pushed by the
enforcement's own timer on a real loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from kvgate_agent.admission import AdmissionRequest, Outcome, Reason
from kvgate_agent.contract.policy import FailureMode, parse_policy
from kvgate_agent.contract.sync import SyncAnswer
from kvgate_agent.sidecar.app import Sidecar, SidecarSettings
from kvgate_agent.sidecar.node_link.agent_link import AgentSettings
from kvgate_agent.sidecar.node_link.enforced import EnforcedPolicy
from kvgate_agent.sidecar.node_link.sync_state import Mode, SyncResult
from kvgate_bench.kit.toolkit import FakeClock
from tests.conftest import policy_doc
from tests.sync_answers import answer

# ---------------------------------------------------------------- the sidecar enforcing modes


def agent_sidecar(clock: FakeClock, **agent: Any) -> Sidecar:
    settings = AgentSettings(
        url="http://127.0.0.1:1", pod_namespace="ns", pod_name="model-0", **agent
    )
    return Sidecar(SidecarSettings(upstream="http://127.0.0.1:2", agent=settings), clock)


def sync(sc: Sidecar, a: SyncAnswer | None, result: SyncResult = SyncResult.OK) -> None:
    """What AgentLink does after a call: record in the sync state, then tell the sidecar."""
    state = sc.policy.sync_state
    assert state is not None
    if a is not None:
        state.record_answer(a)
    elif result is SyncResult.NOT_MODIFIED:
        state.record_not_modified()
    else:
        state.record_failure(result)
    assert sc.policy.enforcement is not None
    sc.policy.enforcement.on_sync(result, a)


def ask(sc: Sidecar, tenant: str = "a") -> Any:
    return sc.admission.core.submit(AdmissionRequest(tenant, 10, 10))


LIMITED = {
    "concurrency": {"maxRequests": 2},
    "capacity": {"kvCacheTokens": 4096},
    "tenants": {"defaultMaxTokens": 16},
    "rateLimits": [{"name": "rpm", "per": "Pod", "requestsPerMinute": 60, "burstRequests": 1}],
    "overload": {"actions": ["Reject"]},
}


def test_sidecar_needs_exactly_one_source_of_thresholds() -> None:
    with pytest.raises(ValueError):
        Sidecar(SidecarSettings(upstream="http://127.0.0.1:2"))


async def test_the_thresholds_header_says_the_mode_and_where_a_store_stands() -> None:
    standalone = EnforcedPolicy(parse_policy(policy_doc({})), None)
    assert not standalone.headed and standalone.header() is None
    standalone.attach_store(lambda: "local")
    assert standalone.headed and standalone.header() == "store=local"
    sc = agent_sidecar(FakeClock(500.0))
    assert sc.policy.headed and sc.policy.header() is None  # no mode before it starts
    sc.policy.refresh_mode(force=True)
    sync(sc, answer(LIMITED, ttl=5, interval=0.5))
    sc.policy.attach_store(lambda: "closed")
    assert sc.policy.header() == "live, store=closed"


async def test_sidecar_follows_the_modes_without_dropping_in_flight_work() -> None:
    clock = FakeClock(500.0)
    sc = agent_sidecar(clock)
    sc.policy.refresh_mode(force=True)
    early = ask(sc)
    assert sc.policy.mode is Mode.WAITING and early.ticket is not None  # FailOpen: no limits yet
    sync(sc, answer({**LIMITED, "concurrency": {"maxRequests": 3}}, ttl=5, interval=0.5))
    # mypy keeps the narrowing of sc.policy.mode across sync(), which changes it
    assert sc.policy.mode is Mode.LIVE and sc.admission.config.max_concurrency == 3  # type: ignore[comparison-overlap]
    first = ask(sc)
    assert first.ticket is not None and sc.admission.stats().in_flight == 2  # the early one counts
    assert ask(sc).reason is Reason.RATE_LIMIT_REQUESTS  # burst of 1
    clock.advance(1)
    sync(sc, None, SyncResult.ERROR)
    assert sc.policy.refresh_mode() is Mode.STALE
    assert ask(sc).ticket is not None  # refilled: the last thresholds still apply
    assert ask(sc).reason is Reason.CONCURRENCY  # 3 in flight
    clock.advance(5)  # past the TTL: FailOpen keeps only the local caps
    assert sc.policy.refresh_mode() is Mode.FAIL_OPEN
    assert sc.admission.config.limits == () and sc.admission.config.max_concurrency == 3
    assert sc.admission.config.kv_capacity_tokens == 4096
    assert sc.admission.stats().in_flight == 3  # nothing in flight was dropped
    sc.admission.release(first.ticket, completion_tokens=1)
    sc.admission.release(early.ticket, completion_tokens=1)
    assert sc.admission.stats().in_flight == 1 and sc.admission.stats().kv_reserved_tokens == 32
    sync(sc, None, SyncResult.NOT_MODIFIED)  # the agent is back
    assert sc.policy.mode is Mode.LIVE and len(sc.admission.config.limits) == 1


async def test_sidecar_fail_closed_holds_with_the_sync_interval_then_reopens() -> None:
    clock = FakeClock(500.0)
    sc = agent_sidecar(clock)
    sc.policy.refresh_mode(force=True)
    sync(sc, answer({**LIMITED, "failureMode": "FailClosed"}, ttl=5, interval=2.5))
    clock.advance(6)
    sync(sc, None, SyncResult.TIMEOUT)
    assert sc.policy.mode is Mode.FAIL_CLOSED
    d = ask(sc)
    assert (d.status, d.reason, d.retry_after) == (503, Reason.FAIL_CLOSED, 3)
    sync(sc, None, SyncResult.NOT_MODIFIED)
    # mypy keeps the narrowing of sc.policy.mode across sync(), which changes it
    assert sc.policy.mode is Mode.LIVE and ask(sc).ticket is not None  # type: ignore[comparison-overlap]


async def test_sidecar_waiting_under_a_configured_fail_closed_answers_503() -> None:
    clock = FakeClock(500.0)
    sc = agent_sidecar(clock, failure_mode=FailureMode.FAIL_CLOSED)
    sc.policy.refresh_mode(force=True)
    assert ask(sc).reason is Reason.FAIL_CLOSED
    sync(sc, answer(managed=False))
    assert sc.policy.mode is Mode.UNMANAGED
    assert ask(sc).ticket is not None and sc.admission.config.limits == ()


async def test_sidecar_safety_net_holds_with_gpu_memory_low_and_reopens() -> None:
    clock = FakeClock(500.0)
    sc = agent_sidecar(clock)
    sc.policy.refresh_mode(force=True)
    closed = {
        "open": False,
        "reason": "free memory below the margin",
        "gpuUuid": "GPU-1",
        "freeBytes": 100,
        "marginBytes": 1000,
        "retryAfterSeconds": 4,
    }
    sync(sc, answer(LIMITED, safety_net=closed, etag="e1"))
    d = ask(sc)
    assert (d.status, d.reason, d.retry_after) == (503, Reason.GPU_MEMORY_LOW, 4)
    assert "GPU-1" in d.message
    sync(sc, None, SyncResult.ERROR)  # stale: the last safety-net state still applies
    assert sc.policy.mode is Mode.STALE and ask(sc).reason is Reason.GPU_MEMORY_LOW
    sync(sc, answer(LIMITED, etag="e2"))
    assert ask(sc).outcome is Outcome.ADMITTED


async def test_sidecar_does_not_split_global_limits_twice_and_prefers_its_engine_reading() -> None:
    clock = FakeClock(500.0)
    sc = agent_sidecar(clock)
    sc.policy.refresh_mode(force=True)
    thresholds = {
        "globalShare": 0.25,
        "kvCapacityTokens": 1000,
        "capacity": {"fromEngineMetrics": True},
        "tenants": {"defaultMaxTokens": 16},
        # Already this pod's quarter (the operator split it).
        "rateLimits": [{"name": "g", "per": "Global", "requestsPerMinute": 60}],
    }
    sync(sc, answer(thresholds))
    (limit,) = sc.admission.config.limits
    assert limit.request_rate == pytest.approx(1.0) and limit.request_capacity == 60
    assert sc.admission.stats().kv_capacity_tokens == 1000 and sc.capacity_known
    sc.engine.kv_tokens = 5000  # what the sidecar read from the engine itself
    sync(sc, answer({**thresholds, "kvCapacityTokens": 1200}, etag="e2"))
    assert sc.admission.stats().kv_capacity_tokens == 5000


async def test_sync_report_reflects_the_admission_state() -> None:
    clock = FakeClock(500.0)
    sc = agent_sidecar(
        clock,
        pod_uid="u-1",
        metrics_url="http://10.0.0.7:8080/metrics",
        gpu_uuids=("GPU-1",),
    )
    sc.policy.refresh_mode(force=True)
    sync(sc, answer(LIMITED))
    assert ask(sc).ticket is not None
    sc.metrics.count_decision("admitted", "ok", "a")
    assert sc.policy.enforcement is not None
    r = sc.policy.enforcement.sync_report()
    assert (r.namespace, r.name, r.uid) == ("ns", "model-0", "u-1")
    assert r.in_flight == 1 and r.kv_reserved_tokens == 32 and r.kv_capacity_tokens == 4096
    assert r.decisions == {"admitted": 1} and r.thresholds_etag == "e1"
    assert r.metrics_url == "http://10.0.0.7:8080/metrics" and r.gpu_uuids == ["GPU-1"]


# ---------------------------------------------------------------- the mode pushed by its timer

#: A TTL short enough for a unit test, long enough for a busy machine to see "stale" first.
SHORT_TTL = 0.3


async def test_a_stale_link_fails_open_at_the_ttl_with_no_request_arriving() -> None:
    """Real loop and clock: nothing but the enforcement's timer moves the mode (no request, no
    sync, no scrape), and the rate limits are lifted at the TTL's end."""
    sc = agent_sidecar_real(FailureMode.FAIL_OPEN)
    enforcement = sc.policy.enforcement
    assert enforcement is not None
    reached = mode_reached(enforcement.listeners, Mode.FAIL_OPEN)
    enforcement.start()
    try:
        answered_at = time.monotonic()
        sync(sc, answer(LIMITED))
        assert ask(sc).ticket is not None and ask(sc).reason is Reason.RATE_LIMIT_REQUESTS
        sync(sc, None, SyncResult.ERROR)
        assert sc.policy.mode is Mode.STALE
        await asyncio.wait_for(reached, 5.0)
        assert time.monotonic() - answered_at > SHORT_TTL  # at the TTL, not before
        # mypy keeps the narrowing of sc.policy.mode across the wait, which changes it
        assert sc.policy.mode is Mode.FAIL_OPEN and sc.admission.config.limits == ()  # type: ignore[comparison-overlap]
        assert ask(sc).ticket is not None  # the rate limit no longer applies
    finally:
        enforcement.stop()


async def test_a_stale_link_fails_closed_at_the_ttl_with_no_request_arriving() -> None:
    sc = agent_sidecar_real(FailureMode.FAIL_CLOSED)
    enforcement = sc.policy.enforcement
    assert enforcement is not None
    reached = mode_reached(enforcement.listeners, Mode.FAIL_CLOSED)
    enforcement.start()
    try:
        sync(sc, answer({**LIMITED, "failureMode": "FailClosed"}, interval=2.5))
        sync(sc, None, SyncResult.TIMEOUT)
        assert sc.policy.mode is Mode.STALE and ask(sc).ticket is not None
        await asyncio.wait_for(reached, 5.0)
        d = ask(sc)
        assert (d.status, d.reason, d.retry_after) == (503, Reason.FAIL_CLOSED, 3)
    finally:
        enforcement.stop()


async def test_a_sync_within_the_ttl_rearms_the_timer_and_stop_cancels_it() -> None:
    sc = agent_sidecar_real(FailureMode.FAIL_OPEN)
    enforcement = sc.policy.enforcement
    assert enforcement is not None
    changes: list[Mode] = []
    enforcement.listeners.append(changes.append)
    enforcement.start()
    sync(sc, answer(LIMITED))
    reached = mode_reached(enforcement.listeners, Mode.FAIL_OPEN)
    await asyncio.sleep(SHORT_TTL / 2)
    sync(sc, None, SyncResult.NOT_MODIFIED)  # current again: the deadline moves on
    started = time.monotonic()
    await asyncio.wait_for(reached, 5.0)
    assert time.monotonic() - started > SHORT_TTL * 0.9  # from the 304, not the first answer
    sync(sc, None, SyncResult.NOT_MODIFIED)
    enforcement.stop()  # the sidecar stops: time alone changes nothing any more
    await asyncio.sleep(SHORT_TTL + 0.2)
    assert changes == [Mode.WAITING, Mode.LIVE, Mode.FAIL_OPEN, Mode.LIVE]
    assert sc.policy.mode is Mode.LIVE


def agent_sidecar_real(failure_mode: FailureMode) -> Sidecar:
    """An agent-mode sidecar on the real clock with a :data:`SHORT_TTL`, not started (no
    HTTP): only its enforcement runs."""
    settings = AgentSettings(
        url="http://127.0.0.1:1",
        pod_namespace="ns",
        pod_name="model-0",
        failure_mode=failure_mode,
        ttl_override=SHORT_TTL,
    )
    return Sidecar(SidecarSettings(upstream="http://127.0.0.1:2", agent=settings))


def mode_reached(listeners: list[Callable[[Mode], object]], mode: Mode) -> asyncio.Future[Mode]:
    """A future set when the enforcement first enforces ``mode``."""
    reached: asyncio.Future[Mode] = asyncio.get_running_loop().create_future()

    def listen(m: Mode) -> None:
        if m is mode and not reached.done():
            reached.set_result(m)

    listeners.append(listen)
    return reached
