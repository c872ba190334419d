"""Held syncs (long polls): the node agent keeps a sidecar's ``POST /v1/sync`` open until the
pod's answer differs from the ETag the sidecar already applies, or until the wait is over.

Invariant: at most one held call per pod (a newer call from the same pod ends the older one),
and every held call ends, whatever happens (change, timeout, client gone, cancellation, agent
shutdown): its timer and its disconnect watcher go with it, nothing is left registered.
The timer is injected (``call_later``-like), so the logic is tested without a real clock.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

PodKey = tuple[str, str]  # (namespace, name)


class Cancellable(Protocol):
    """What a timer returns (``asyncio.TimerHandle`` in production)."""

    def cancel(self) -> None: ...


#: ``timer(delay_seconds, callback)``: run ``callback`` once after ``delay_seconds``.
Timer = Callable[[float, Callable[[], None]], Cancellable]


class WaitOutcome(StrEnum):
    """How a held sync ended (the ``outcome`` label of ``kvgate_node_sync_waits_total``).

    changed: the pod's answer differs from the sidecar's ETag (answer 200 now).
    timeout: the wait is over, nothing changed (304).
    superseded: a newer sync from the same pod arrived (304; the sidecar has moved on).
    disconnected: the sidecar closed the connection (nothing to answer).
    released: the agent is shutting down (304, so the sidecar learns of it at its next call).
    """

    CHANGED = "changed"
    TIMEOUT = "timeout"
    SUPERSEDED = "superseded"
    DISCONNECTED = "disconnected"
    RELEASED = "released"


@dataclass(slots=True)
class _Waiter:
    seen: str
    current: Callable[[], str]
    done: asyncio.Future[WaitOutcome]

    def end(self, outcome: WaitOutcome) -> None:
        if not self.done.done():
            self.done.set_result(outcome)


def clamp_wait(requested: float | None, max_wait: float) -> float:
    """Seconds to hold a sync: the sidecar's ``wait`` preference capped at ``max_wait``; 0 (answer
    at once) when it asked for none or the agent holds nothing (``max_wait`` <= 0)."""
    if requested is None or max_wait <= 0:
        return 0.0
    return max(0.0, min(requested, max_wait))


class Waiters:
    """The syncs the agent holds, one per pod.

    Args:
        timer: schedules the timeouts; default the running loop's ``call_later``.
    """

    def __init__(self, timer: Timer | None = None) -> None:
        self._timer = timer
        self._held: dict[PodKey, _Waiter] = {}

    def __len__(self) -> int:
        return len(self._held)

    def held(self, key: PodKey) -> bool:
        """Whether a sync of this pod is held now."""
        return key in self._held

    async def wait(
        self,
        key: PodKey,
        seen: str,
        current: Callable[[], str],
        hold: float,
        disconnected: Callable[[], Awaitable[object]] | None = None,
    ) -> WaitOutcome:
        """Hold until ``current()`` (the pod's answer's ETag, re-read at each :meth:`notify`)
        differs from ``seen``, ``hold`` seconds pass, ``disconnected()`` (called only when the
        sync is held) completes (the client went away), a newer wait for ``key`` starts, or
        :meth:`release_all`. Returns why it ended. A cancelled wait re-raises
        ``CancelledError`` after cleaning up."""
        if current() != seen:
            return WaitOutcome.CHANGED
        loop = asyncio.get_running_loop()
        waiter = _Waiter(seen, current, loop.create_future())
        old = self._held.get(key)
        if old is not None:
            old.end(WaitOutcome.SUPERSEDED)
        self._held[key] = waiter
        timer = self._timer or loop.call_later
        handle = timer(hold, lambda: waiter.end(WaitOutcome.TIMEOUT))
        watcher: asyncio.Future[object] | None = None
        if disconnected is not None:
            watcher = asyncio.ensure_future(disconnected())
            watcher.add_done_callback(lambda _f: waiter.end(WaitOutcome.DISCONNECTED))
        try:
            return await waiter.done
        finally:
            handle.cancel()
            if watcher is not None and not watcher.done():
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await watcher
            if self._held.get(key) is waiter:
                del self._held[key]

    def notify(self) -> int:
        """Something the answers depend on changed: end every held sync whose pod's answer now
        differs from what its sidecar has. Returns how many were ended."""
        ended = 0
        for w in list(self._held.values()):
            if not w.done.done() and w.current() != w.seen:
                w.end(WaitOutcome.CHANGED)
                ended += 1
        return ended

    def release_all(self) -> None:
        """End every held sync (agent shutdown: the HTTP server can then stop at once)."""
        for w in list(self._held.values()):
            w.end(WaitOutcome.RELEASED)


__all__ = ["Cancellable", "Timer", "WaitOutcome", "Waiters", "clamp_wait"]
