"""The node agent's wiring: :class:`NodeAgent` builds its parts around the pure
:class:`~kvgate_agent.node.state.NodeState` and runs their loops: the GPU poll (NVML in a worker
thread), the engine scrape (:mod:`kvgate_agent.node.scrape`), the NodeAdmission status
(:mod:`kvgate_agent.node.status`); it follows the NodeAdmission watch and answers liveness and
readiness. Sidecars' syncs are answered by :mod:`kvgate_agent.node.sync`.

Invariant: nothing here decides anything: the decisions are in ``node.state``, ``node.engine``,
``node.auth`` and ``node.podgpu``.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvgate_agent.contract.nodeadmission import NodeAdmissionSpec
from kvgate_agent.gpu.monitor import GpuMonitor
from kvgate_agent.node.auth import Authenticator
from kvgate_agent.node.metrics import NodeMetrics
from kvgate_agent.node.podgpu import gpus_by_pod
from kvgate_agent.node.scrape import EngineScraper
from kvgate_agent.node.settings import NodeSettings as NodeSettings  # re-exported
from kvgate_agent.node.state import NodeState
from kvgate_agent.node.status import StatusPublisher
from kvgate_agent.node.sync import SyncHandler
from kvgate_agent.tasks import cancel_and_wait

log = logging.getLogger("kvgate.node")

Clock = Callable[[], float]


class NodeAgent:
    """One node agent: its parts, built here, and the loops that drive them.

    Holds :attr:`state` (the node's inputs and answers), :attr:`scraper` (the engines),
    :attr:`syncs` (the sidecars' syncs, held or not), :attr:`status` (the NodeAdmission status
    writes), :attr:`metrics`, the running loops, the NVML worker thread and, while a deleted
    NodeAdmission's spec is still kept, its grace timer.

    Args:
        settings: see :class:`NodeSettings`.
        monitor: reads the GPUs (NVML, or a fake backend in tests).
        authenticator: checks sidecars' tokens.
        status_writer: ``write(status_dict) -> "ok" | "absent"`` (blocking), or None to keep
            the status local (no cluster).
        clock: monotonic seconds.
        wall: wall-clock time for the status timestamps.
    """

    def __init__(
        self,
        settings: NodeSettings,
        monitor: GpuMonitor,
        authenticator: Authenticator,
        status_writer: Any | None = None,
        clock: Clock = time.monotonic,
        wall: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
    ) -> None:
        self.settings = settings
        self.monitor = monitor
        self.auth = authenticator
        self.clock = clock
        self.state = NodeState(
            settings.node_name,
            ttl_seconds=settings.ttl_seconds,
            sync_interval_seconds=settings.sync_interval_seconds,
            report_expiry_seconds=settings.report_expiry_seconds,
        )
        self.metrics = NodeMetrics(self, clock)
        self.scraper = EngineScraper(
            self.state,
            self.metrics,
            settings.scrape_seconds,
            settings.engine_max_age_seconds,
            clock,
        )
        self.syncs = SyncHandler(
            self.state, authenticator, self.scraper, self.metrics, settings.max_wait_seconds, clock
        )
        self.status = StatusPublisher(
            status_writer,
            self.state,
            self.metrics,
            settings.status_min_interval,
            settings.heartbeat_seconds,
            clock,
            wall,
        )
        self.spec_error: str | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._grace: asyncio.TimerHandle | None = None  # set while a deleted object's spec lasts
        # NVML calls run here, never in the default executor: a hung driver call must not keep
        # asyncio.run() from returning on shutdown.
        self._gpu_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgate-poll")
        #: Seconds since the API server last answered (None: never): set with the watch.
        self.api_contact_age: Callable[[], float | None] | None = None
        #: Whether the NodeAdmission watch thread runs: set with the watch.
        self.watch_alive: Callable[[], bool] | None = None
        self._started_at = clock()

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Read the GPUs once, then start the loops."""
        self.scraper.open()
        await self.poll_gpus()
        for name, coro in (
            ("gpu", self._gpu_loop()),
            ("engine", self._engine_loop()),
            ("status", self.status.run()),
        ):
            self._tasks.append(asyncio.create_task(coro, name=name))

    @property
    def tasks(self) -> list[asyncio.Task[None]]:
        """The running loops (for liveness)."""
        return list(self._tasks)

    async def stop(self) -> None:
        """Stop the loops (a last status write is attempted by the status loop's owner)."""
        await cancel_and_wait(*self._tasks)
        await self.scraper.close()
        self._gpu_executor.shutdown(wait=False, cancel_futures=True)

    def on_spec(self, spec: NodeAdmissionSpec | None, error: str | None) -> None:
        """The NodeAdmission watch saw the object (runs on the event loop).

        An unchanged spec (e.g. the event of the agent's own status write) only refreshes the
        read time. A deleted object keeps the last spec for ``ttl_seconds`` (the operator
        recreates it within a pass; if the operator is down, sidecars keep their thresholds
        as if the agent were unreachable), then no pod on the node is governed. A recreated
        object gets its status written at once.
        """
        now = self.clock()
        if error is not None:
            self.spec_error = error
            log.error("%s; keeping the previous thresholds", error)
            return
        self.spec_error = None
        if spec is None and self.state.spec is not None:
            if self._grace is None:
                log.warning(
                    "NodeAdmission %s deleted: keeping its thresholds for %.0fs",
                    self.settings.node_name,
                    self.settings.ttl_seconds,
                )
                self._grace = asyncio.get_running_loop().call_later(
                    self.settings.ttl_seconds, self._deletion_grace_over
                )
            self.state.spec_read_at = now
            return
        recreated = self._grace is not None or (spec is not None and self.state.spec is None)
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None
        if recreated:
            self.status.recreated()  # a new object has an empty status: write it now
        if spec == self.state.spec and self.state.spec_known:
            self.state.spec_read_at = now
            return
        self.state.set_spec(spec, now)
        self.syncs.notify()
        log.info(
            "NodeAdmission %s: %d governed pods",
            self.settings.node_name,
            len(spec.pods) if spec else 0,
        )
        self.status.wake()

    def _deletion_grace_over(self) -> None:
        self._grace = None  # (a recreated object cancels this timer)
        self.state.set_spec(None, self.clock())
        self.syncs.notify()
        log.info("NodeAdmission %s gone: no pod here is governed", self.settings.node_name)

    def live(self) -> tuple[bool, str]:
        """Liveness: the loops and the watch run, and the API server answered within
        ``api_liveness_seconds`` (since start, before its first answer).

        The bound is well above what a partition the agent rides out costs: every call to the
        API server is bounded and the watch retries within seconds, so the agent reconnects by
        itself within a minute of the network healing; a restart would only lose the spec it
        keeps serving (a new agent cannot read it during the outage). Liveness fails when the
        agent has been cut off far longer than that, or its watch is gone: then a restart
        (fresh connections, fresh credentials) is the remedy left.
        """
        dead = [t.get_name() for t in self._tasks if t.done()]
        if dead:
            return False, f"loops ended: {', '.join(dead)}"
        if self.watch_alive is not None and not self.watch_alive():
            return False, "the NodeAdmission watch stopped"
        if self.api_contact_age is None:
            return True, "ok"
        age = self.api_contact_age()
        bound = self.settings.api_liveness_seconds
        since = max(0.0, self.clock() - self._started_at) if age is None else age
        if since > bound:
            return False, f"no answer from the API server for {since:.0f}s (bound {bound:g}s)"
        return True, "ok" if age is None else f"ok; the API server answered {age:.1f}s ago"

    def ready(self) -> tuple[bool, str]:
        """Readiness: the NodeAdmission was read, and at least one GPU is usable.

        Returns ``(ready, reason)``; when both are missing the reason names both (the GPU's
        first: a missing driver is what an operator can act on), so a probe's message does not
        depend on which of the two loops answered first.
        """
        reasons = []
        snap = self.state.gpus
        if snap is None:
            reasons.append("GPUs not read yet")
        elif not snap.ready:
            reasons.append(snap.reason or "no usable GPU")
        if not self.state.spec_known:
            reasons.append("NodeAdmission not read yet")
        return (False, "; ".join(reasons)) if reasons else (True, "ok")

    # ------------------------------------------------------------------ loops

    async def poll_gpus(self) -> None:
        """Read the GPUs once (in a worker thread) and map NVML processes to pods."""
        loop = asyncio.get_running_loop()
        snap = await loop.run_in_executor(self._gpu_executor, self.monitor.poll)
        pids = {g.uuid: [p.pid for p in (g.processes or ())] for g in snap.gpus}
        by_pod = await loop.run_in_executor(
            self._gpu_executor, gpus_by_pod, pids, self.settings.proc_root
        )
        before = self.state.conditions()
        self.state.set_gpus(snap, by_pod)
        self.syncs.notify()
        if before != self.state.conditions():
            self.status.wake()

    async def _gpu_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.gpu_poll_seconds)
            try:
                await self.poll_gpus()
            except Exception:  # never let one bad poll end the loop
                log.exception("GPU poll failed")

    async def scrape_engines(self) -> None:
        """Scrape every synced pod's engine once, then end the held syncs whose answer changed."""
        await self.scraper.scrape_all()
        self.syncs.notify()

    async def _engine_loop(self) -> None:
        while True:
            try:
                await self.scrape_engines()
            except Exception:
                log.exception("engine scrape failed")
            await asyncio.sleep(self.settings.scrape_seconds)
