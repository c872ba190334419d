"""The node agent's I/O around the pure :class:`~kvgate_agent.node.state.NodeState`: the GPU
loop (NVML in a worker thread), the engine scrape loop, the NodeAdmission status loop and watch,
and :meth:`NodeAgent.sync` answering sidecars.

Invariant: nothing here decides anything: the decisions are in ``node.state``, ``node.engine``,
``node.auth`` and ``node.podgpu``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import ipaddress
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from pydantic import ValidationError

from kvgate_agent.contract.nodeadmission import Condition, NodeAdmissionSpec, NodeAdmissionStatus
from kvgate_agent.contract.sync import APPLIED_HEADER, SyncReport
from kvgate_agent.engines.scrape import parse_engine_metrics
from kvgate_agent.gpu.monitor import GpuMonitor
from kvgate_agent.node.auth import Authenticator, AuthError
from kvgate_agent.node.engine import EngineView
from kvgate_agent.node.longpoll import Waiters, WaitOutcome, clamp_wait
from kvgate_agent.node.metrics import NodeMetrics
from kvgate_agent.node.podgpu import gpus_by_pod
from kvgate_agent.node.settings import NodeSettings as NodeSettings  # re-exported
from kvgate_agent.node.state import EngineFacts, NodeState, PodKey, StatusGate

log = logging.getLogger("kvgate.node")

Clock = Callable[[], float]

#: Largest engine ``/metrics`` page read, bytes. vLLM's exposition is tens of KB; a page beyond
#: this is refused (the scrape counts as failed) rather than buffered.
MAX_SCRAPE_BYTES = 4 * 1024 * 1024


class _TooLarge(Exception):
    pass


@dataclass(slots=True)
class SyncResult:
    """An HTTP answer to a sync: ``status``, JSON ``body`` (None for 304) and headers."""

    status: int
    body: dict[str, Any] | None
    headers: dict[str, str]


def _error(status: int, code: str, message: str, kind: str) -> SyncResult:
    return SyncResult(status, {"error": {"message": message, "type": kind, "code": code}}, {})


def _rfc3339(ts: dt.datetime) -> str:
    return ts.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def metrics_url_allowed(url: str, peer: str | None) -> bool:
    """Whether the agent may scrape ``url`` reported by a sidecar connecting from ``peer``: only
    plain HTTP to the sidecar's own address (its pod IP), or loopback when the sidecar itself is
    on loopback. The agent never fetches an address a pod merely names (no request forgery
    towards the node or the cluster)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname
        if parts.scheme != "http" or host is None or peer is None:
            return False
        h = ipaddress.ip_address(host)
        p = ipaddress.ip_address(peer)
    except ValueError:
        return False
    return h == p


class NodeAgent:
    """One node agent.

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
        self.status_writer = status_writer
        self.clock = clock
        self.wall = wall
        self.state = NodeState(
            settings.node_name,
            ttl_seconds=settings.ttl_seconds,
            sync_interval_seconds=settings.sync_interval_seconds,
            report_expiry_seconds=settings.report_expiry_seconds,
        )
        self.engines = EngineView(
            settings.scrape_seconds, settings.engine_max_age_seconds, clock=clock
        )
        self.gate = StatusGate(settings.status_min_interval, settings.heartbeat_seconds)
        self.metrics = NodeMetrics(self, clock)
        self.spec_error: str | None = None
        self._metrics_urls: dict[PodKey, str] = {}
        self._conditions: dict[str, Condition] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._status_wake = asyncio.Event()
        self._session: aiohttp.ClientSession | None = None
        self._refusals_logged: dict[tuple[str, str, str], float] = {}
        self._grace: asyncio.TimerHandle | None = None  # set while a deleted object's spec lasts
        self._write_lock = asyncio.Lock()  # one status write at a time (the final one last)
        self._inflight: asyncio.Future[str] | None = None
        # NVML calls run here, never in the default executor: a hung driver call must not keep
        # asyncio.run() from returning on shutdown.
        self._gpu_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgate-poll")
        #: Seconds since the API server last answered (None: never): set with the watch.
        self.api_contact_age: Callable[[], float | None] | None = None
        #: Whether the NodeAdmission watch thread runs: set with the watch.
        self.watch_alive: Callable[[], bool] | None = None
        self._started_at = clock()
        #: Syncs held until the pod's answer changes (long polls).
        self.waiters = Waiters()
        self._notified_version = -1
        self._releasing = False

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Read the GPUs once, then start the loops."""
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0))
        await self.poll_gpus()
        for name, coro in (
            ("gpu", self._gpu_loop()),
            ("engine", self._engine_loop()),
            ("status", self._status_loop()),
        ):
            self._tasks.append(asyncio.create_task(coro, name=name))

    @property
    def tasks(self) -> list[asyncio.Task[None]]:
        """The running loops (for liveness)."""
        return list(self._tasks)

    async def stop(self) -> None:
        """Stop the loops (a last status write is attempted by the status loop's owner)."""
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self._session is not None:
            await self._session.close()
        self._gpu_executor.shutdown(wait=False, cancel_futures=True)

    async def write_final_status(self, within: float = 3.0) -> str | None:
        """On shutdown: say so in the status (``Ready=False``, reason ``AgentStopped``), so
        nobody reads the last GPU figures as live; bounded by ``within`` seconds."""
        if self.status_writer is None or self.state.spec is None:
            return None
        self.state.stopped = True
        if self._inflight is not None and not self._inflight.done():
            await asyncio.wait({self._inflight}, timeout=within)  # a write begun before stop()
        try:
            return await asyncio.wait_for(self.write_status(force=True), within)
        except TimeoutError:
            return "timeout"

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
            self.gate.last_write = None  # a new object has an empty status: write it now
            self._status_wake.set()
        if spec == self.state.spec and self.state.spec_known:
            self.state.spec_read_at = now
            return
        self.state.set_spec(spec, now)
        self.notify_syncs()
        log.info(
            "NodeAdmission %s: %d governed pods",
            self.settings.node_name,
            len(spec.pods) if spec else 0,
        )
        self._status_wake.set()

    def _deletion_grace_over(self) -> None:
        self._grace = None  # (a recreated object cancels this timer)
        self.state.set_spec(None, self.clock())
        self.notify_syncs()
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
        """Readiness: the NodeAdmission was read, and at least one GPU is usable."""
        if not self.state.spec_known:
            return False, "NodeAdmission not read yet"
        snap = self.state.gpus
        if snap is None:
            return False, "GPUs not read yet"
        if not snap.ready:
            return False, snap.reason or "no usable GPU"
        return True, "ok"

    def engine_ages(self, now: float) -> dict[PodKey, float | None]:
        """Seconds since each scraped pod's last good engine sample."""
        out: dict[PodKey, float | None] = {}
        for pod, reading in self.engines.readings(now).items():
            ns, _, name = pod.partition("/")
            out[(ns, name)] = reading.age_seconds
        return out

    # ------------------------------------------------------------------ sync

    async def sync(
        self,
        body: bytes,
        authorization: str | None,
        if_none_match: str | None,
        peer: str | None,
        wait: float | None = None,
        disconnected: Callable[[], Awaitable[object]] | None = None,
    ) -> SyncResult:
        """Handle ``POST /v1/sync`` (see :mod:`kvgate_agent.contract.sync`).

        ``wait``: the sidecar's ``Prefer: wait`` (seconds): an answer equal to ``if_none_match``
        is held until it changes, for at most ``wait`` capped at ``max_wait_seconds``, and ends
        early when ``disconnected()`` completes (the client went away) or the agent stops.
        """
        started = time.perf_counter()
        got = await self._sync(body, authorization, if_none_match, peer)
        if isinstance(got, SyncResult):
            self.metrics.sync_seconds.observe(time.perf_counter() - started)
            return got
        hold = 0.0 if self._releasing else clamp_wait(wait, self.settings.max_wait_seconds)
        result = self._answer(got, if_none_match)
        self.metrics.sync_seconds.observe(time.perf_counter() - started)
        if result.status == 304 and hold > 0 and if_none_match is not None:
            self.state.hold(got)  # the sidecar counts as connected while held
            try:
                outcome = await self.waiters.wait(
                    got,
                    if_none_match.strip(),
                    lambda: self.state.answer(got).etag,
                    hold,
                    disconnected,
                )
            finally:
                self.state.release(got, self.clock())
            self.metrics.sync_waits.labels(outcome.value).inc()
            if outcome is WaitOutcome.CHANGED:
                result = self._answer(got, if_none_match)
        if hold > 0:
            result.headers[APPLIED_HEADER] = f"wait={hold:g}"
        self.metrics.syncs.labels("ok" if result.status == 200 else "not_modified").inc()
        return result

    def _answer(self, key: PodKey, if_none_match: str | None) -> SyncResult:
        """The pod's answer now: 304 when it is ``if_none_match``, else 200 with it."""
        answer = self.state.answer(key)
        headers = {"ETag": answer.etag, "Cache-Control": "no-cache"}
        if if_none_match is not None and if_none_match.strip() == answer.etag:
            return SyncResult(304, None, headers)
        return SyncResult(
            200, answer.model_dump(mode="json", by_alias=True, exclude_none=True), headers
        )

    def notify_syncs(self) -> None:
        """An input of the answers changed: end the held syncs whose answer now differs."""
        if self.state.version != self._notified_version:
            self._notified_version = self.state.version
            self.waiters.notify()

    def release_syncs(self) -> None:
        """On shutdown: answer every held sync now and hold no more (the server then stops at
        once instead of waiting out the long polls)."""
        self._releasing = True
        self.waiters.release_all()

    async def _sync(
        self, body: bytes, authorization: str | None, if_none_match: str | None, peer: str | None
    ) -> SyncResult | PodKey:
        """Validate, authenticate and record a report: an error answer, or the pod's key."""
        m = self.metrics
        try:
            report = SyncReport.model_validate_json(body)
        except ValidationError as exc:
            m.syncs.labels("invalid").inc()
            msg = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}"
                for e in exc.errors()[:5]
            )
            return _error(422, "invalid_report", msg, "invalid_request_error")
        try:
            await self.auth.verify(authorization, report.namespace, report.name, report.uid)
        except AuthError as exc:
            result = {401: "unauthorized", 403: "forbidden"}.get(exc.status, "unavailable")
            m.syncs.labels(result).inc()
            self._log_refusal(report.namespace, report.name, exc)
            res = _error(exc.status, exc.code, exc.message, "authentication_error")
            if exc.status == 503:
                res.headers["Retry-After"] = "1"
            return res
        if not self.state.spec_known:
            m.syncs.labels("unavailable").inc()
            res = _error(
                503, "not_ready", "the agent has not read its NodeAdmission yet", "unavailable"
            )
            res.headers["Retry-After"] = "1"
            return res
        key = (report.namespace, report.name)
        now = self.clock()
        self.state.record(report, now)
        url = report.metrics_url
        if url is not None and metrics_url_allowed(url, peer):
            self._metrics_urls[key] = url
        else:
            if url is not None:
                log.warning(
                    "%s/%s: not scraping %s (not the sidecar's own address %s)", *key, url, peer
                )
            self._metrics_urls.pop(key, None)
        return key

    def _log_refusal(self, namespace: str, name: str, exc: AuthError) -> None:
        """Log a refused sync at most once a minute per pod and reason (sidecars retry every
        second; the metric counts every one)."""
        key = (namespace, name, exc.code)
        now = self.clock()
        last = self._refusals_logged.get(key)
        if last is not None and now - last < 60.0:
            return
        if len(self._refusals_logged) > 4096:
            self._refusals_logged.clear()
        self._refusals_logged[key] = now
        log.warning("sync refused for %s/%s: %s (%s)", namespace, name, exc.message, exc.code)

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
        self.notify_syncs()
        if before != self.state.conditions():
            self._status_wake.set()

    async def _gpu_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.gpu_poll_seconds)
            try:
                await self.poll_gpus()
            except Exception:  # never let one bad poll end the loop
                log.exception("GPU poll failed")

    async def scrape_engines(self) -> None:
        """Scrape every synced pod's engine metrics once, concurrently, each bounded in time."""
        now = self.clock()
        for key in self.state.expire(now):
            self._metrics_urls.pop(key, None)
            self.engines.forget(f"{key[0]}/{key[1]}")
        await asyncio.gather(*(self._scrape(k, u) for k, u in list(self._metrics_urls.items())))
        for key in list(self._metrics_urls):
            sample = self.engines.current(f"{key[0]}/{key[1]}")
            self.state.set_engine(
                key,
                None
                if sample is None
                else EngineFacts(sample.kv_capacity_tokens, sample.kv_used_tokens),
            )
        self.notify_syncs()

    async def _scrape(self, key: PodKey, url: str) -> None:
        assert self._session is not None
        pod = f"{key[0]}/{key[1]}"
        try:
            async with self._session.get(url) as resp:
                if resp.status != 200:
                    self.engines.record_error(pod, f"http_{resp.status}")
                    self.metrics.scrapes.labels("error").inc()
                    return
                if (resp.content_length or 0) > MAX_SCRAPE_BYTES:
                    raise _TooLarge()
                raw = bytearray()
                async for chunk in resp.content.iter_chunked(65536):
                    raw += chunk
                    if len(raw) > MAX_SCRAPE_BYTES:
                        raise _TooLarge()
        except _TooLarge:
            self.engines.record_error(pod, "too_large")
            self.metrics.scrapes.labels("error").inc()
            return
        except (TimeoutError, aiohttp.ClientError) as exc:
            self.engines.record_error(
                pod, "timeout" if isinstance(exc, TimeoutError) else "connect"
            )
            self.metrics.scrapes.labels("error").inc()
            return
        # Parsing a big exposition takes a while: off the loop, so syncs are never delayed.
        text = raw.decode("utf-8", errors="replace")
        sample = await asyncio.to_thread(parse_engine_metrics, text)
        self.engines.record(pod, sample)
        self.metrics.scrapes.labels("ok" if sample.ok else "invalid").inc()

    async def _engine_loop(self) -> None:
        while True:
            try:
                await self.scrape_engines()
            except Exception:
                log.exception("engine scrape failed")
            await asyncio.sleep(self.settings.scrape_seconds)

    def status_document(self) -> tuple[NodeAdmissionStatus, dict[str, Any]]:
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

    async def write_status(self, force: bool = False) -> str | None:
        """Write the status if the gate says so (or ``force``); returns the result or None."""
        if self.status_writer is None:
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

    async def _write(
        self, status: NodeAdmissionStatus, caps: dict[PodKey, int | None], now: float
    ) -> str:
        assert self.status_writer is not None
        stamped, doc = self.status_document()
        # Shielded: a cancelled status loop must not leave a write running unseen, which could
        # land after the final AgentStopped status (write_final_status waits for it).
        self._inflight = asyncio.ensure_future(asyncio.to_thread(self.status_writer.write, doc))
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

    async def _status_loop(self) -> None:
        while True:
            await self.write_status()
            self._status_wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._status_wake.wait(), self.settings.status_min_interval)
