"""The node agent's NodeAdmission status: written when the
:class:`~kvgate_agent.node.state.StatusGate` says so (a meaningful change, a heartbeat), with
each condition's transition time kept across writes, and a last ``Ready=False`` write on
shutdown.

Invariant: one write at a time, and none lands after the final one (a write under way when the
agent stops is waited for, never left running unseen).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from collections.abc import Callable
from typing import Any

from kvgate_agent.contract.nodeadmission import Condition, NodeAdmissionStatus
from kvgate_agent.node.metrics import NodeMetrics
from kvgate_agent.node.state import NodeState, PodKey, StatusGate

log = logging.getLogger("kvgate.node")


def _rfc3339(ts: dt.datetime) -> str:
    return ts.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class StatusPublisher:
    """Writes the node's NodeAdmission status.

    Holds the :class:`StatusGate` (when the last write was, and what it wrote), the conditions
    last written (their transition times, RFC 3339), the write under way (at most one) and the
    event that wakes :meth:`run` early (a condition changed, the object was recreated).

    Args:
        writer: ``write(status_dict) -> "ok" | "absent"`` (blocking, run in a thread), or None
            to keep the status local (no cluster: nothing is written).
        state: the node's state the status is read from.
        metrics: counts writes by result.
        min_interval: the fewest seconds between two writes (and :meth:`run`'s period).
        heartbeat_seconds: the most seconds between two writes.
        clock: monotonic seconds.
        wall: wall-clock time for the timestamps.
    """

    def __init__(
        self,
        writer: Any | None,
        state: NodeState,
        metrics: NodeMetrics,
        min_interval: float,
        heartbeat_seconds: float,
        clock: Callable[[], float],
        wall: Callable[[], dt.datetime],
    ) -> None:
        self.writer = writer
        self.state = state
        self.metrics = metrics
        self.min_interval = min_interval
        self.clock = clock
        self.wall = wall
        self.gate = StatusGate(min_interval, heartbeat_seconds)
        self._conditions: dict[str, Condition] = {}
        self._wake = asyncio.Event()
        self._write_lock = asyncio.Lock()  # one status write at a time (the final one last)
        self._inflight: asyncio.Future[str] | None = None

    def wake(self) -> None:
        """Consider a write now rather than at the next period (the gate still decides)."""
        self._wake.set()

    def recreated(self) -> None:
        """The NodeAdmission object is new (its status is empty): write at once."""
        self.gate.last_write = None
        self._wake.set()

    async def run(self) -> None:
        """Write when due, every ``min_interval`` seconds or when woken, until cancelled."""
        while True:
            await self.write()
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.min_interval)

    def document(self) -> tuple[NodeAdmissionStatus, dict[str, Any]]:
        """The status to write now, with heartbeat and condition transition times."""
        status = self.state.status()
        now_s = _rfc3339(self.wall())
        conds = []
        for c in status.conditions:
            prev = self._conditions.get(c.type)
            same = prev is not None and (prev.status, prev.reason) == (c.status, c.reason)
            stamped = c.model_copy(
                update={
                    "last_transition_time": prev.last_transition_time if same and prev else now_s
                }
            )
            conds.append(stamped)
        status = status.model_copy(update={"conditions": conds, "heartbeat_time": now_s})
        return status, status.model_dump(mode="json", by_alias=True, exclude_none=True)

    async def write(self, force: bool = False) -> str | None:
        """Write the status if the gate says so (or ``force``); returns the result or None."""
        if self.writer is None:
            return None
        if self.state.spec_known and self.state.spec is None:
            return None  # no object for this node (no governed pod): the watch wakes us
        now = self.clock()
        status = self.state.status()
        caps = {
            (p.namespace, p.name): self.state.kv_capacity((p.namespace, p.name))
            for p in status.pods
        }
        if not force and not self.gate.due(status, caps, now):
            return None
        async with self._write_lock:
            return await self._write(status, caps, now)

    async def write_final(self, within: float = 3.0) -> str | None:
        """On shutdown: say so in the status (``Ready=False``, reason ``AgentStopped``), so
        nobody reads the last GPU figures as live; bounded by ``within`` seconds."""
        if self.writer is None or self.state.spec is None:
            return None
        self.state.stopped = True
        if self._inflight is not None and not self._inflight.done():
            await asyncio.wait({self._inflight}, timeout=within)  # a write begun before stop()
        try:
            return await asyncio.wait_for(self.write(force=True), within)
        except TimeoutError:
            return "timeout"

    async def _write(
        self, status: NodeAdmissionStatus, caps: dict[PodKey, int | None], now: float
    ) -> str:
        assert self.writer is not None
        stamped, doc = self.document()
        # Shielded: a cancelled status loop must not leave a write running unseen, which could
        # land after the final AgentStopped status (write_final waits for it).
        self._inflight = asyncio.ensure_future(asyncio.to_thread(self.writer.write, doc))
        self._inflight.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            result: str = await asyncio.shield(self._inflight)
        except Exception as exc:
            self.metrics.status_writes.labels("error").inc()
            log.warning("NodeAdmission status write failed: %s", exc)
            return "error"
        self.metrics.status_writes.labels(result).inc()
        if result == "ok":
            self.gate.wrote(status, now)
            self._conditions = {c.type: c for c in stamped.conditions}
        return result
