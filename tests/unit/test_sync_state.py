"""The sidecar's view of its sync with the node agent over time, pure: fake clock, no HTTP, no
sleeping."""

from __future__ import annotations

import pytest

from kvgate_agent.contract.policy import FailureMode
from kvgate_agent.sidecar.node_link.sync_state import (
    MIN_SYNC_GAP_SECONDS,
    Mode,
    SyncResult,
    SyncState,
    broken_hold_credit,
)
from kvgate_bench.kit.toolkit import FakeClock
from tests.sync_answers import answer

# ---------------------------------------------------------------- SyncState


def test_waiting_until_the_first_answer_and_ready_after_the_ttl_anyway() -> None:
    clock = FakeClock(500.0)
    link = SyncState(clock, failure_mode=FailureMode.FAIL_CLOSED, ttl_override=5)
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
    link = SyncState(clock)
    assert link.ttl_seconds == 30 and link.sync_interval_seconds == 1
    link.record_answer(answer(ttl=7, interval=0.25))
    assert link.ttl_seconds == 7 and link.sync_interval_seconds == 0.25
    assert link.ready() and link.etag == "e1"
    link.record_answer(answer(etag="e2"), '"e2-header"')
    assert link.etag == '"e2-header"'  # If-None-Match echoes the ETag header as received


def test_live_stale_fail_open_and_back_to_live() -> None:
    clock = FakeClock(500.0)
    link = SyncState(clock)
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
    link = SyncState(clock, failure_mode=FailureMode.FAIL_OPEN, ttl_override=2)
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
    link = SyncState(clock, failure_mode=FailureMode.FAIL_CLOSED)
    link.record_answer(answer(managed=False, ttl=5))
    assert link.mode() is Mode.UNMANAGED and link.thresholds is None
    link.record_failure(SyncResult.ERROR)
    assert link.mode() is Mode.UNMANAGED  # nothing to enforce either way within the TTL
    clock.advance(6)
    assert link.mode() is Mode.FAIL_CLOSED  # no policy: the configured mode decides


def test_link_refuses_nonsense() -> None:
    link = SyncState(FakeClock(500.0))
    with pytest.raises(ValueError):
        link.record_not_modified()  # 304 before any answer
    with pytest.raises(ValueError):
        link.record_failure(SyncResult.OK)
    with pytest.raises(ValueError):
        SyncState(FakeClock(500.0), ttl_override=0)


def test_long_poll_wait_stays_within_the_ttl_and_needs_an_etag() -> None:
    clock = FakeClock(500.0)
    link = SyncState(clock)
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
    link = SyncState(clock)
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
    link = SyncState(clock)
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


def test_next_change_at_is_the_end_of_the_ttl_while_an_answer_is_within_it() -> None:
    clock = FakeClock(500.0)
    state = SyncState(clock)
    assert state.next_change_at() is None  # waiting: only an answer changes the mode
    state.record_answer(answer({"failureMode": "FailClosed"}, ttl=10))
    assert state.next_change_at() == 510.0  # live -> fail_closed, unless a sync comes first
    clock.advance(3)
    state.record_failure(SyncResult.ERROR)  # stale: the TTL still counts from the answer
    assert state.mode() is Mode.STALE and state.next_change_at() == 510.0
    state.record_not_modified()  # a success moves it on
    assert state.next_change_at() == 513.0
    clock.advance(10)  # exactly at the deadline: the mode has not changed yet
    assert state.mode() is Mode.LIVE and state.next_change_at() == 513.0
    clock.advance(0.001)  # just past it: changed, and only a sync changes it back
    assert state.mode() is Mode.FAIL_CLOSED and state.next_change_at() is None
    state.record_answer(answer(managed=False, ttl=5, etag="e2"))
    assert state.mode() is Mode.UNMANAGED and state.next_change_at() == clock() + 5


def test_next_change_at_follows_a_broken_holds_credit() -> None:
    clock = FakeClock(500.0)
    state = SyncState(clock)
    state.record_answer(answer(ttl=30))
    clock.advance(24)
    state.record_failure(SyncResult.ERROR, alive_until=broken_hold_credit(500.0, 524.0, 20, 5))
    assert state.next_change_at() == 535.0  # 30 s from when the agent took the held call
    clock.advance(11)
    assert state.mode() is Mode.STALE
    clock.advance(0.001)
    assert state.mode() is Mode.FAIL_OPEN and state.next_change_at() is None


def test_the_mode_only_changes_by_time_at_next_change_at() -> None:
    """Sampled on a grid: the mode before the deadline is the mode now, after it another."""
    clock = FakeClock(500.0)
    state = SyncState(clock, ttl_override=2.0)
    state.record_answer(answer())
    state.record_failure(SyncResult.TIMEOUT)
    now_mode, at = state.mode(), state.next_change_at()
    assert at is not None
    for step in range(41):
        clock.now = 500.0 + step * 0.1
        assert (state.mode() is now_mode) is (clock() <= at), clock()
