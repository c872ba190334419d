"""The sidecar's view of its node agent, pure: fake clock, no HTTP, no sleeping."""

from __future__ import annotations

from typing import Any

import pytest

from kvgate_agent.admission import AdmissionRequest, Outcome, Reason
from kvgate_agent.contract.policy import FailureMode
from kvgate_agent.contract.sync import SyncAnswer, SyncReport
from kvgate_agent.sidecar.agent_link import (
    MIN_SYNC_GAP_SECONDS,
    AgentSettings,
    Mode,
    SyncResult,
    ThresholdsLink,
    broken_hold_credit,
    gpu_uuids_from_env,
    material_change,
    sidecar_metrics_url,
)
from kvgate_agent.sidecar.app import Sidecar, SidecarSettings
from kvgate_bench.kit.toolkit import FakeClock


def answer(
    thresholds: dict[str, Any] | None = None,
    *,
    managed: bool = True,
    etag: str = "e1",
    ttl: float = 10.0,
    interval: float = 1.0,
    safety_net: dict[str, Any] | None = None,
    generation: int = 3,
) -> SyncAnswer:
    pod = None
    if managed:
        pod = {
            "namespace": "ns",
            "name": "model-0",
            "uid": "u-1",
            "policy": {"namespace": "ns", "name": "pol", "generation": generation},
            "thresholds": thresholds or {},
        }
    return SyncAnswer.model_validate(
        {
            "etag": etag,
            "pod": pod,
            "safetyNet": safety_net or {"open": True},
            "ttlSeconds": ttl,
            "syncIntervalSeconds": interval,
        }
    )


# ---------------------------------------------------------------- ThresholdsLink


def test_waiting_until_the_first_answer_and_ready_after_the_ttl_anyway() -> None:
    clock = FakeClock(500.0)
    link = ThresholdsLink(clock, failure_mode=FailureMode.FAIL_CLOSED, ttl_override=5)
    assert link.mode() is Mode.WAITING and not link.ready()
    assert link.failure_mode is FailureMode.FAIL_CLOSED
    link.record_failure(SyncResult.ERROR)
    clock.advance(4.9)
    assert link.mode() is Mode.WAITING and not link.ready()
    clock.advance(0.1)  # a pod whose agent is down still becomes Ready
    assert link.mode() is Mode.WAITING and link.ready()
    assert link.age_seconds() is None


def test_default_ttl_is_30s_before_any_answer_then_the_answers() -> None:
    clock = FakeClock(500.0)
    link = ThresholdsLink(clock)
    assert link.ttl_seconds == 30 and link.sync_interval_seconds == 1
    link.record_answer(answer(ttl=7, interval=0.25))
    assert link.ttl_seconds == 7 and link.sync_interval_seconds == 0.25
    assert link.ready() and link.etag == "e1"
    link.record_answer(answer(etag="e2"), '"e2-header"')
    assert link.etag == '"e2-header"'  # If-None-Match echoes the ETag header as received


def test_live_stale_fail_open_and_back_to_live() -> None:
    clock = FakeClock(500.0)
    link = ThresholdsLink(clock)
    link.record_answer(answer({"failureMode": "FailOpen"}, ttl=10))
    assert link.mode() is Mode.LIVE
    clock.advance(1)
    link.record_not_modified()
    assert link.mode() is Mode.LIVE and link.age_seconds() == 0
    clock.advance(1)
    link.record_failure(SyncResult.TIMEOUT)
    assert link.mode() is Mode.STALE
    clock.advance(9)  # 10 s since the last success: still within the TTL
    link.record_failure(SyncResult.ERROR)
    assert link.mode() is Mode.STALE and link.age_seconds() == 10
    clock.advance(0.01)
    assert link.mode() is Mode.FAIL_OPEN
    link.record_not_modified()  # the agent is back with the same answer
    assert link.mode() is Mode.LIVE
    assert link.counts[SyncResult.NOT_MODIFIED] == 2 and link.counts[SyncResult.ERROR] == 1


def test_fail_closed_past_the_ttl_when_the_policy_says_so() -> None:
    clock = FakeClock(500.0)
    link = ThresholdsLink(clock, failure_mode=FailureMode.FAIL_OPEN, ttl_override=2)
    link.record_answer(answer({"failureMode": "FailClosed"}, ttl=60))
    assert link.ttl_seconds == 2  # the override wins over the answer
    link.record_failure(SyncResult.UNAUTHORIZED)
    assert link.mode() is Mode.STALE
    clock.advance(2.5)
    assert link.mode() is Mode.FAIL_CLOSED
    link.record_answer(answer({"failureMode": "FailClosed"}, etag="e2"))
    assert link.mode() is Mode.LIVE


def test_unmanaged_pod_then_the_configured_failure_mode_past_the_ttl() -> None:
    clock = FakeClock(500.0)
    link = ThresholdsLink(clock, failure_mode=FailureMode.FAIL_CLOSED)
    link.record_answer(answer(managed=False, ttl=5))
    assert link.mode() is Mode.UNMANAGED and link.thresholds is None
    link.record_failure(SyncResult.ERROR)
    assert link.mode() is Mode.UNMANAGED  # nothing to enforce either way within the TTL
    clock.advance(6)
    assert link.mode() is Mode.FAIL_CLOSED  # no policy: the configured mode decides


def test_link_refuses_nonsense() -> None:
    link = ThresholdsLink(FakeClock(500.0))
    with pytest.raises(ValueError):
        link.record_not_modified()  # 304 before any answer
    with pytest.raises(ValueError):
        link.record_failure(SyncResult.OK)
    with pytest.raises(ValueError):
        ThresholdsLink(FakeClock(500.0), ttl_override=0)


def test_long_poll_wait_stays_within_the_ttl_and_needs_an_etag() -> None:
    clock = FakeClock(500.0)
    link = ThresholdsLink(clock)
    assert link.wait_seconds(25, 2) == 0  # no answer yet: nothing to wait on
    link.record_answer(answer(ttl=30))
    assert link.wait_seconds(25, 2) == 25  # 25 + 2 s answer bound < 30 s TTL
    link.record_answer(answer(ttl=20, etag="e2"))
    assert link.wait_seconds(25, 2) == 16  # TTL - 2 x timeout: a hang still fails in time
    link.record_answer(answer(ttl=4, etag="e3"))
    assert link.wait_seconds(25, 2) == 0  # under a second left: plain polling
    assert link.wait_seconds(0, 2) == 0


def test_next_sync_at_once_after_a_held_answer_else_every_interval() -> None:
    clock = FakeClock(500.0)
    link = ThresholdsLink(clock)
    # An agent that does not hold syncs: one interval after each, success or not.
    link.record_answer(answer(interval=1.0))
    assert link.next_sync_delay(500.0, SyncResult.OK) == 1.0
    # A held call that ran its course (20 s): the next one at once.
    link.record_not_modified(held=True)
    clock.advance(20)
    assert link.next_sync_delay(500.0, SyncResult.NOT_MODIFIED) == 0
    # A held call ended early (agent stopping): no faster than the interval.
    started = clock()
    clock.advance(0.2)
    link.record_not_modified(held=True)
    assert link.next_sync_delay(started, SyncResult.NOT_MODIFIED) == pytest.approx(0.8)
    # A change: at once, bounded below by the minimal gap.
    started = clock()
    link.record_answer(answer(etag="e2"), held=True)
    assert link.next_sync_delay(started, SyncResult.OK) == pytest.approx(MIN_SYNC_GAP_SECONDS)
    clock.advance(1)
    assert link.next_sync_delay(started, SyncResult.OK) == 0
    # A failure: back to the interval (the grace/failureMode logic is unchanged).
    link.record_failure(SyncResult.TIMEOUT)
    assert link.next_sync_delay(clock(), SyncResult.TIMEOUT) == 1.0


def test_a_held_call_broken_by_the_agent_credits_its_start_plus_the_sync_timeout() -> None:
    clock = FakeClock(500.0)
    link = ThresholdsLink(clock)
    link.record_answer(answer({"failureMode": "FailClosed"}, ttl=30))
    started = clock()
    clock.advance(24)  # held 24 s (frozen, say), then the connection is reset
    alive_until = broken_hold_credit(started, clock(), wait=20, sync_timeout=5)
    assert alive_until == started + 5  # when the agent took the call, not when it broke
    link.record_failure(SyncResult.ERROR, alive_until=alive_until)
    clock.advance(10)
    assert link.mode() is Mode.STALE
    assert link.age_seconds() == 34  # since the last answer
    clock.advance(1.5)  # 35.5 s after the answer: the TTL from started + 5 is over
    assert link.mode() is Mode.FAIL_CLOSED
    # Credit never runs ahead of the clock.
    link.record_answer(answer({"failureMode": "FailClosed"}, ttl=30, etag="e1"))
    link.record_failure(SyncResult.ERROR, alive_until=clock() + 100)
    clock.advance(30.5)
    assert link.mode() is Mode.FAIL_CLOSED
    # A held call that times out (a silent agent) gets no credit: TTL from the last answer.
    link.record_answer(answer({"failureMode": "FailClosed"}, ttl=30, etag="e2"))
    clock.advance(27)
    link.record_failure(SyncResult.TIMEOUT)
    clock.advance(3.5)
    assert link.mode() is Mode.FAIL_CLOSED


def test_broken_hold_credit_only_for_a_call_held_past_the_sync_timeout() -> None:
    assert broken_hold_credit(100.0, 104.9, wait=20, sync_timeout=5) is None  # quick break
    assert broken_hold_credit(100.0, 130.0, wait=0, sync_timeout=5) is None  # not a hold
    assert broken_hold_credit(100.0, 105.0, wait=20, sync_timeout=5) == 105.0
    assert broken_hold_credit(100.0, 124.0, wait=20, sync_timeout=5) == 105.0


def test_material_changes_of_the_report() -> None:
    base = SyncReport(namespace="ns", name="model-0", kv_capacity_tokens=1000, in_flight=2)
    same = base.model_copy(update={"decisions": {"admitted": 9}, "in_flight": 5})
    assert not material_change(base, same)  # counters and busy -> busier ride along
    for update in (
        {"in_flight": 0},  # went idle
        {"queue_length": 3},  # began queueing
        {"kv_reserved_tokens": 101},  # moved by > 10 % of the capacity
        {"kv_capacity_tokens": 2000},
        {"thresholds_etag": "e2"},
        {"metrics_url": "http://10.0.0.1:8080/metrics"},
        {"gpu_uuids": ["GPU-1"]},
    ):
        assert material_change(base, base.model_copy(update=update)), update
    assert not material_change(base, base.model_copy(update={"kv_reserved_tokens": 100}))
    no_cap = SyncReport(namespace="ns", name="model-0")
    assert material_change(no_cap, no_cap.model_copy(update={"kv_reserved_tokens": 1}))


def test_gpu_uuids_only_when_they_look_like_uuids() -> None:
    uuid = "GPU-5e1b2c3d-0000-1111-2222-333344445555"
    mig = "MIG-9f8e7d6c-aaaa-bbbb-cccc-ddddeeeeffff"
    assert gpu_uuids_from_env({"NVIDIA_VISIBLE_DEVICES": f"{uuid}, {mig}"}) == (uuid, mig)
    assert gpu_uuids_from_env({"KVGATE_GPU_UUIDS": mig, "NVIDIA_VISIBLE_DEVICES": uuid}) == (mig,)
    for value in ("all", "0,1", "none", "void", "", f"{uuid},0"):
        assert gpu_uuids_from_env({"NVIDIA_VISIBLE_DEVICES": value}) == ()
    assert gpu_uuids_from_env({}) == ()


def test_metrics_url_needs_a_pod_ip_reachable_listener() -> None:
    assert sidecar_metrics_url("10.0.3.7", "0.0.0.0", 8081) == "http://10.0.3.7:8081/metrics"
    assert sidecar_metrics_url("fd00::7", "::", 8081) == "http://[fd00::7]:8081/metrics"
    assert sidecar_metrics_url(None, "0.0.0.0", 8081) is None
    assert sidecar_metrics_url("10.0.3.7", "127.0.0.1", 8081) is None  # loopback only


# ---------------------------------------------------------------- the sidecar enforcing modes


def agent_sidecar(clock: FakeClock, **agent: Any) -> Sidecar:
    settings = AgentSettings(
        url="http://127.0.0.1:1", pod_namespace="ns", pod_name="model-0", **agent
    )
    return Sidecar(SidecarSettings(upstream="http://127.0.0.1:2", agent=settings), clock)


def sync(sc: Sidecar, a: SyncAnswer | None, result: SyncResult = SyncResult.OK) -> None:
    """What AgentLink does after a call: record in the link, then tell the sidecar."""
    assert sc.policy.link is not None
    if a is not None:
        sc.policy.link.record_answer(a)
    elif result is SyncResult.NOT_MODIFIED:
        sc.policy.link.record_not_modified()
    else:
        sc.policy.link.record_failure(result)
    assert sc.policy.thresholds is not None
    sc.policy.thresholds.on_sync(result, a)


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
    assert sc.policy.current_mode() is Mode.STALE
    assert ask(sc).ticket is not None  # refilled: the last thresholds still apply
    assert ask(sc).reason is Reason.CONCURRENCY  # 3 in flight
    clock.advance(5)  # past the TTL: FailOpen keeps only the local caps
    assert sc.policy.current_mode() is Mode.FAIL_OPEN
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
    assert sc.policy.thresholds is not None
    r = sc.policy.thresholds.sync_report()
    assert (r.namespace, r.name, r.uid) == ("ns", "model-0", "u-1")
    assert r.in_flight == 1 and r.kv_reserved_tokens == 32 and r.kv_capacity_tokens == 4096
    assert r.decisions == {"admitted": 1} and r.thresholds_etag == "e1"
    assert r.metrics_url == "http://10.0.0.7:8080/metrics" and r.gpu_uuids == ["GPU-1"]
