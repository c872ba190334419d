"""Held syncs (long polls) on the node agent, pure: an injected timer, no real waiting."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

import pytest

from kvgate_agent.contract.sync import SyncReport, parse_wait
from kvgate_agent.gpu.monitor import GpuSnapshot
from kvgate_agent.gpu.monitor import GpuStatus as GpuReading
from kvgate_agent.node.longpoll import Waiters, WaitOutcome, clamp_wait
from kvgate_agent.node.state import NodeState

KEY = ("ns", "model-0")


class FakeTimer:
    """``call_later`` stand-in: timers fire only when the test says so."""

    def __init__(self) -> None:
        self.pending: list[tuple[float, Callable[[], None], FakeTimer.Handle]] = []

    class Handle:
        def __init__(self) -> None:
            self.cancelled = False

        def cancel(self) -> None:
            self.cancelled = True

    def __call__(self, delay: float, cb: Callable[[], None]) -> FakeTimer.Handle:
        h = FakeTimer.Handle()
        self.pending.append((delay, cb, h))
        return h

    def live(self) -> list[float]:
        return [d for d, _, h in self.pending if not h.cancelled]

    def fire(self) -> None:
        for _, cb, h in list(self.pending):
            if not h.cancelled:
                cb()


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_parse_wait_and_clamp() -> None:
    assert parse_wait("wait=20") == 20.0
    assert parse_wait('respond-async, Wait = "2.5"') == 2.5
    assert parse_wait(None) is None and parse_wait("") is None
    assert parse_wait("respond-async") is None
    for bad in ("wait=-1", "wait=soon", "wait=nan", "wait=inf"):
        assert parse_wait(bad) is None, bad
    assert clamp_wait(None, 25) == 0 and clamp_wait(5, 0) == 0
    assert clamp_wait(60, 25) == 25 and clamp_wait(3, 25) == 3


async def test_a_held_sync_ends_on_change_timeout_and_leaves_nothing_behind() -> None:
    timer = FakeTimer()
    w = Waiters(timer)
    etag = {"now": "e1"}
    # Already changed: answered at once, nothing registered.
    assert await w.wait(KEY, "e0", lambda: etag["now"], 20) is WaitOutcome.CHANGED
    assert len(w) == 0 and timer.live() == []
    # Held until a notify sees a different ETag; a notify without change ends nothing.
    task = asyncio.create_task(w.wait(KEY, "e1", lambda: etag["now"], 20))
    await settle()
    assert w.held(KEY) and timer.live() == [20]
    assert w.notify() == 0 and not task.done()
    etag["now"] = "e2"
    assert w.notify() == 1
    assert await task is WaitOutcome.CHANGED
    assert len(w) == 0 and timer.live() == []  # the timer went with it
    # Nothing changes: the timer ends it.
    task = asyncio.create_task(w.wait(KEY, "e2", lambda: etag["now"], 7))
    await settle()
    timer.fire()
    assert await task is WaitOutcome.TIMEOUT
    assert len(w) == 0


async def test_disconnect_supersede_cancel_and_release_each_clean_up() -> None:
    timer = FakeTimer()
    w = Waiters(timer)
    gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(w.wait(KEY, "e1", lambda: "e1", 20, lambda: gone))
    await settle()
    gone.set_result(None)  # the client went away
    assert await task is WaitOutcome.DISCONNECTED
    assert len(w) == 0 and timer.live() == []

    # A newer sync of the same pod ends the older one: one held call per pod.
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    first = asyncio.create_task(w.wait(KEY, "e1", lambda: "e1", 20, lambda: never))
    await settle()
    second = asyncio.create_task(w.wait(KEY, "e1", lambda: "e1", 20))
    await settle()
    assert await first is WaitOutcome.SUPERSEDED
    assert len(w) == 1 and w.held(KEY) and timer.live() == [20]
    assert never.cancelled()  # the older call's disconnect watcher is gone too

    # The handler cancelled (e.g. the server dropped it): no leftover waiter or timer.
    second.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second
    assert len(w) == 0 and timer.live() == []

    # Shutdown: every held call answers now.
    other = ("ns", "model-1")
    a = asyncio.create_task(w.wait(KEY, "e1", lambda: "e1", 20))
    b = asyncio.create_task(w.wait(other, "x", lambda: "x", 20))
    await settle()
    w.release_all()
    assert [await a, await b] == [WaitOutcome.RELEASED, WaitOutcome.RELEASED]
    assert len(w) == 0 and timer.live() == []


def test_a_held_sidecar_stays_connected_and_is_heard_from_until_released() -> None:
    st = NodeState("n", report_expiry_seconds=10.0)
    st.set_spec(None, 0.0)
    st.record(SyncReport(namespace=KEY[0], name=KEY[1]), 100.0)
    v = st.version
    st.hold(KEY)
    assert st.is_held(KEY)
    assert st.connected(130.0) == 1 and st.expire(130.0) == []  # held 30 s: still connected
    st.release(KEY, 130.0)
    assert not st.is_held(KEY)
    assert st.connected(139.0) == 1 and st.expire(139.0) == []  # heard from until 130
    assert st.connected(141.0) == 0 and st.expire(141.0) == [KEY]
    assert st.version > v  # the expiry may change answers: held syncs are re-checked


def test_answer_inputs_bump_the_version_and_an_unchanged_gpu_poll_does_not() -> None:
    st = NodeState("n")
    v0 = st.version
    st.set_spec(None, 0.0)
    v1 = st.version
    assert v1 > v0
    st.set_engine(KEY, None)  # nothing known, nothing dropped
    assert st.version == v1
    gpu = GpuReading("GPU-0", 0, "Fake", False, None, True, total_bytes=80, free_bytes=40)
    st.set_gpus(GpuSnapshot((gpu,), True, None, taken_at=1.0), {})
    v2 = st.version
    assert v2 > v1
    st.set_gpus(GpuSnapshot((gpu,), True, None, taken_at=3.0), {})  # same readings, later
    assert st.version == v2 and st.gpus is not None and st.gpus.taken_at == 3.0
    fuller = dataclasses.replace(gpu, free_bytes=10)
    st.set_gpus(GpuSnapshot((fuller,), True, None, taken_at=5.0), {})
    assert st.version > v2
