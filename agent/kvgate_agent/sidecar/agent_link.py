"""The sidecar's link to the node agent: where its thresholds come from in a cluster.

:class:`ThresholdsLink` (pure, clock-injected) remembers the last answer and when a sync last
succeeded and decides the sidecar's :class:`Mode`; :class:`AgentLink` (an asyncio task) syncs
with the agent and hands each outcome to the sidecar. Units: seconds; tokens in the report.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Callable, Mapping
from enum import StrEnum
from pathlib import Path

import aiohttp
from pydantic import ValidationError

from kvgate_agent.contract.nodeadmission import PodThresholds
from kvgate_agent.contract.policy import FailureMode
from kvgate_agent.contract.sync import (
    APPLIED_HEADER,
    PREFER_HEADER,
    SYNC_PATH,
    SyncAnswer,
    SyncReport,
)
from kvgate_agent.sidecar.settings import DEFAULT_SYNC_INTERVAL_SECONDS
from kvgate_agent.sidecar.settings import AgentSettings as AgentSettings  # re-exported

log = logging.getLogger("kvgate.sidecar.agent")

Clock = Callable[[], float]

#: TTL used until an answer gives one (seconds): how long the sidecar keeps its last
#: thresholds without a successful sync, and how long it waits for a first answer before it
#: reports ready anyway.
DEFAULT_TTL_SECONDS = 30.0
#: Least time between the start of one held sync and the next after a 200 (seconds): a bound,
#: not a pace (the next call is held until the answer changes again).
MIN_SYNC_GAP_SECONDS = 0.05
#: The reserved KV moving by more than this fraction of the KV capacity is a material change of
#: the report (sent at once); the agent's NodeAdmission status gate uses the same step
#: (``kvgate_agent.node.state.KV_RESERVED_STEP``).
REPORT_KV_STEP = 0.10

_GPU_UUID = re.compile(r"^(GPU|MIG)-[0-9A-Za-z][0-9A-Za-z/-]*$")
_LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})


class Mode(StrEnum):
    """What the sidecar enforces, as decided by :meth:`ThresholdsLink.mode`.

    waiting: no answer yet; the configured failure mode decides (FailOpen: no limits,
        FailClosed: 503).
    live: the last sync succeeded and the thresholds are within their TTL: enforced in full,
        the GPU safety net included.
    stale: syncs fail, but the last success is within the TTL: the last thresholds (and the
        last safety-net state) stay enforced.
    fail_open: past the TTL under FailOpen: local caps only, i.e. the last thresholds' pod
        concurrency cap and KV capacity (with their queue and overload settings); the rate
        limits and the GPU safety net are lifted.
    fail_closed: past the TTL under FailClosed: every new request gets 503 with a Retry-After
        of the sync interval.
    unmanaged: the agent says no RateLimitPolicy selects this pod: no limits.
    """

    WAITING = "waiting"
    LIVE = "live"
    STALE = "stale"
    FAIL_OPEN = "fail_open"
    FAIL_CLOSED = "fail_closed"
    UNMANAGED = "unmanaged"


class SyncResult(StrEnum):
    """Outcome of one sync call (the ``result`` label of ``kvgate_agent_sync_total``).

    ok: 200 with new thresholds. not_modified: 304, the thresholds applied are current.
    unauthorized: 401 (token missing or refused). forbidden: 403 (the token is another pod's).
    error: connection refused or reset, any other status, or an unreadable answer.
    timeout: no answer within the call's timeout.
    """

    OK = "ok"
    NOT_MODIFIED = "not_modified"
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    ERROR = "error"
    TIMEOUT = "timeout"


_SUCCESS = (SyncResult.OK, SyncResult.NOT_MODIFIED)


def gpu_uuids_from_env(env: Mapping[str, str]) -> tuple[str, ...]:
    """The pod's GPU (or MIG) UUIDs from ``KVGATE_GPU_UUIDS``, else ``NVIDIA_VISIBLE_DEVICES``
    (comma-separated). Only values that look like UUIDs (``GPU-…``, ``MIG-…``) count: indices,
    ``all``, ``none`` or ``void`` give an empty tuple (the agent then maps the pod itself)."""
    for name in ("KVGATE_GPU_UUIDS", "NVIDIA_VISIBLE_DEVICES"):
        value = env.get(name, "").strip()
        if not value:
            continue
        items = [v.strip() for v in value.split(",") if v.strip()]
        if items and all(_GPU_UUID.match(v) for v in items):
            return tuple(items[:64])
        return ()
    return ()


def sidecar_metrics_url(pod_ip: str | None, listen_host: str, listen_port: int) -> str | None:
    """``http://<pod-ip>:<port>/metrics``: the engine's metrics as the sidecar passes them
    through, for the agent to scrape. None when the pod IP is unknown, or the sidecar listens
    on loopback only (then the pod IP cannot reach it)."""
    if not pod_ip:
        return None
    if listen_host in _LOOPBACK and pod_ip != listen_host:
        return None
    host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip
    return f"http://{host}:{listen_port}/metrics"


def broken_hold_credit(
    started: float, now: float, wait: float, sync_timeout: float
) -> float | None:
    """Until when (clock seconds) a held sync that broke with a connection error at ``now``
    proves the agent alive: ``started + sync_timeout`` when the call asked to be held
    (``wait`` > 0 seconds) and lasted at least ``sync_timeout`` seconds (longer than an unheld
    answer may take, so the agent took it and held it), else None (no credit).

    Never ``now``: an agent frozen (SIGSTOP) for most of the hold and then killed (RST) breaks
    the call just like one that crashed at ``now``, and crediting ``now`` would stretch the
    staleness to wait + TTL before ``failureMode`` applies."""
    if wait > 0 and now - started >= sync_timeout:
        return started + sync_timeout
    return None


class ThresholdsLink:
    """The sidecar's view of its thresholds over time (pure: no I/O, clock injected).

    Args:
        clock: monotonic seconds.
        failure_mode: the configured failure mode (``--failure-mode``): decides before the
            first answer, and past the TTL when the last answer carried no policy.
        ttl_override: TTL in seconds instead of the answer's ``ttlSeconds``.

    Feed it every sync outcome (:meth:`record_answer`, :meth:`record_not_modified`,
    :meth:`record_failure`); ask :meth:`mode` what to enforce now and :meth:`ready` whether
    the pod may be Ready.
    """

    def __init__(
        self,
        clock: Clock = time.monotonic,
        *,
        failure_mode: FailureMode = FailureMode.FAIL_OPEN,
        ttl_override: float | None = None,
        sync_interval: float = DEFAULT_SYNC_INTERVAL_SECONDS,
    ) -> None:
        if ttl_override is not None and not ttl_override > 0:
            raise ValueError(f"ttl_override must be > 0 seconds, got {ttl_override}")
        self.clock = clock
        self.default_failure_mode = FailureMode(failure_mode)
        self.ttl_override = ttl_override
        self.default_sync_interval = sync_interval
        self.started_at = clock()
        self.answer: SyncAnswer | None = None
        #: The ETag to send as ``If-None-Match`` (the answer's ``ETag`` header).
        self.etag: str | None = None
        self.last_ok_at: float | None = None
        #: When the last thresholds were last known current: the last success, or the start of
        #: a held sync the agent's side later closed plus the sync timeout (it took the call and
        #: held it, see :func:`broken_hold_credit`). The TTL counts from here.
        self.current_at: float | None = None
        self.last_result: SyncResult | None = None
        self.counts: dict[SyncResult, int] = dict.fromkeys(SyncResult, 0)
        #: Whether the agent held the last successful sync (``Preference-Applied: wait``).
        self.agent_holds = False

    # ------------------------------------------------------------------ inputs

    def record_answer(
        self, answer: SyncAnswer, etag: str | None = None, *, held: bool = False
    ) -> None:
        """A 200: ``answer`` is what to enforce from now on; ``etag`` is the ``ETag`` header
        (default: the answer's own ``etag``); ``held``: the agent holds syncs (long poll)."""
        self.answer = answer
        self.etag = etag or answer.etag
        self.agent_holds = held
        self._success(SyncResult.OK)

    def record_not_modified(self, *, held: bool = False) -> None:
        """A 304: the thresholds applied are still current (``held``: as for
        :meth:`record_answer`).

        Raises ``ValueError`` if no answer was ever recorded (a 304 then means nothing)."""
        if self.answer is None:
            raise ValueError("304 Not Modified before any answer")
        self.agent_holds = held
        self._success(SyncResult.NOT_MODIFIED)

    def record_failure(self, result: SyncResult, *, alive_until: float | None = None) -> None:
        """A failed sync (any result but ok / not_modified): the last thresholds stay.

        ``alive_until``: clock seconds until which the agent is known to have been alive, for a
        held call its side then broke (see :func:`broken_hold_credit`): the TTL counts from
        there (never from later than now), as when a plain sync fails right after a success.
        None (a timeout, a call not held): no credit, the TTL counts from the last success."""
        if result in _SUCCESS:
            raise ValueError(f"{result} is not a failure")
        if alive_until is not None and self.current_at is not None:
            self.current_at = max(self.current_at, min(alive_until, self.clock()))
        self.last_result = result
        self.counts[result] += 1

    def _success(self, result: SyncResult) -> None:
        self.last_ok_at = self.current_at = self.clock()
        self.last_result = result
        self.counts[result] += 1

    # ------------------------------------------------------------------ derived

    @property
    def thresholds(self) -> PodThresholds | None:
        """The last thresholds received, or None (no answer yet, or the pod is unmanaged)."""
        if self.answer is None or self.answer.pod is None:
            return None
        return self.answer.pod.thresholds

    @property
    def ttl_seconds(self) -> float:
        """Seconds the last thresholds stay enforced without a successful sync."""
        if self.ttl_override is not None:
            return self.ttl_override
        return DEFAULT_TTL_SECONDS if self.answer is None else self.answer.ttl_seconds

    @property
    def sync_interval_seconds(self) -> float:
        """Seconds between syncs: the last answer's, else the configured default."""
        if self.answer is None:
            return self.default_sync_interval
        return self.answer.sync_interval_seconds

    @property
    def failure_mode(self) -> FailureMode:
        """The last thresholds' ``failureMode``, else the configured one."""
        t = self.thresholds
        return self.default_failure_mode if t is None else t.failure_mode

    def wait_seconds(self, sync_wait: float, sync_timeout: float) -> float:
        """How long to ask the agent to hold the next sync (``Prefer: wait``), seconds: at most
        ``sync_wait``, and short enough that a held call that then hangs (answer bound: wait +
        ``sync_timeout``) still fails before the TTL ends (wait <= TTL − 2 × ``sync_timeout``);
        0 (plain polling) when that leaves under a second, or before the first answer (no ETag
        to wait on)."""
        if self.etag is None or self.answer is None:
            return 0.0
        wait = min(sync_wait, self.ttl_seconds - 2 * sync_timeout)
        return wait if wait >= 1.0 else 0.0

    def next_sync_delay(self, started: float, result: SyncResult) -> float:
        """Seconds to wait before the next sync, after one that started at ``started`` (clock
        seconds) ended with ``result``:

        - a failure, or an agent that does not hold syncs: the sync interval (plain polling);
        - a 200 from an agent that holds syncs: at once (:data:`MIN_SYNC_GAP_SECONDS` after the
          start at least): the next call waits for the next change;
        - a held 304: one sync interval after the start at least (a held call that ran out
          waited longer than that, so at once; one ended early, e.g. by the agent stopping,
          does not turn into a loop).
        """
        interval = self.sync_interval_seconds
        if result not in _SUCCESS or not self.agent_holds:
            return interval
        gap = MIN_SYNC_GAP_SECONDS if result is SyncResult.OK else interval
        return max(0.0, started + gap - self.clock())

    def age_seconds(self) -> float | None:
        """Seconds since the last successful sync; None before the first."""
        if self.last_ok_at is None:
            return None
        return max(0.0, self.clock() - self.last_ok_at)

    def mode(self) -> Mode:
        """What to enforce now.

        - no answer yet: ``waiting``;
        - last success (or the end of a held call the agent's side broke, see
          :meth:`record_failure`) older than the TTL: ``fail_open`` or ``fail_closed`` per
          :attr:`failure_mode`;
        - the answer says no policy selects the pod: ``unmanaged``;
        - the last sync succeeded: ``live``; else ``stale``.
        """
        if self.answer is None or self.current_at is None:
            return Mode.WAITING
        if self.clock() - self.current_at > self.ttl_seconds:
            if self.failure_mode is FailureMode.FAIL_CLOSED:
                return Mode.FAIL_CLOSED
            return Mode.FAIL_OPEN
        if self.answer.pod is None:
            return Mode.UNMANAGED
        return Mode.LIVE if self.last_result in _SUCCESS else Mode.STALE

    def ready(self) -> bool:
        """Whether the pod may report Ready as far as thresholds go: once a first answer
        arrived, or once the TTL has passed since start (a pod whose agent is down must still
        become Ready eventually; its failure mode then decides)."""
        return self.answer is not None or self.clock() - self.started_at >= self.ttl_seconds


def material_change(sent: SyncReport, now: SyncReport) -> bool:
    """Whether ``now`` differs from the report last ``sent`` enough to send it without waiting
    for the held sync to end: anything but the load figures changed (identity, KV capacity,
    metrics URL, GPUs, thresholds ETag); the pod went idle or busy (in-flight or queue length
    to or from zero); or the reserved KV moved by more than :data:`REPORT_KV_STEP` of the KV
    capacity (any move without a capacity). Other load changes and the decision counters ride
    on the next sync."""
    if (
        sent.namespace,
        sent.name,
        sent.uid,
        sent.kv_capacity_tokens,
        sent.metrics_url,
        sent.gpu_uuids,
        sent.thresholds_etag,
    ) != (
        now.namespace,
        now.name,
        now.uid,
        now.kv_capacity_tokens,
        now.metrics_url,
        now.gpu_uuids,
        now.thresholds_etag,
    ):
        return True
    if (sent.in_flight == 0) != (now.in_flight == 0):
        return True
    if (sent.queue_length == 0) != (now.queue_length == 0):
        return True
    cap = now.kv_capacity_tokens
    step = REPORT_KV_STEP * cap if cap else 0
    return abs(now.kv_reserved_tokens - sent.kv_reserved_tokens) > step


class AgentLink:
    """The sync loop against the node agent (an asyncio task on the sidecar's loop).

    It POSTs a :class:`~kvgate_agent.contract.sync.SyncReport` to ``<agent-url>/v1/sync`` with
    the pod's projected service-account token (read fresh from its file each time: kubelet
    rotates it), ``If-None-Match`` with the ETag it applies and ``Prefer: wait=N`` (long poll,
    :meth:`ThresholdsLink.wait_seconds`): an agent that holds syncs answers when the answer
    changes or after N seconds, and the next call follows at once; otherwise it syncs every
    ``syncIntervalSeconds`` (from the last answer; 1 s until one arrives), see
    :meth:`ThresholdsLink.next_sync_delay`. Each call is bounded by N + the sync timeout (2 s
    by default): a held call that hangs past that is a failed sync. While a call is held, the
    report is re-read every sync interval; once the call outlived the sync timeout (so the agent
    holds it) and the report changed materially (:func:`material_change`), the call is dropped
    and the new report sent.

    Args:
        settings: the agent's URL and the pod's identity.
        state: the :class:`ThresholdsLink` to feed.
        report: builds the report to send (called before every sync).
        on_result: called after every sync with its result and, on 200, the new answer
            (already recorded in ``state``).

    :meth:`start` launches the loop, :meth:`stop` cancels it and closes its HTTP session. The
    loop never dies of a failed sync: every failure is counted and the loop carries on.
    """

    def __init__(
        self,
        settings: AgentSettings,
        state: ThresholdsLink,
        report: Callable[[], SyncReport],
        on_result: Callable[[SyncResult, SyncAnswer | None], None],
    ) -> None:
        self.settings = settings
        self.state = state
        self.report = report
        self.on_result = on_result
        self.url = settings.url.rstrip("/") + SYNC_PATH
        self.session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._last_logged: tuple[SyncResult, str] | None = None  # (result, detail kind)
        self._token_warned = False

    async def start(self) -> None:
        """Open the HTTP session and start the loop (first sync at once)."""
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.settings.sync_timeout)
        )
        self._task = asyncio.create_task(self._run(), name="kvgate-agent-sync")

    async def stop(self) -> None:
        """Stop the loop and close the session."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.session is not None:
            await self.session.close()
            self.session = None

    async def _run(self) -> None:
        while True:
            started = self.state.clock()
            result = await self._sync_or_resend()
            if result is not None:
                await asyncio.sleep(self.state.next_sync_delay(started, result))

    async def _sync_or_resend(self) -> SyncResult | None:
        """One sync, or None when it was dropped for a materially newer report."""
        sent = self.report()
        wait = self.state.wait_seconds(self.settings.sync_wait, self.settings.sync_timeout)
        task = asyncio.create_task(self.sync_once(sent, wait))
        started = self.state.clock()
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.state.sync_interval_seconds)
                if done:
                    return task.result()
                held = self.state.clock() - started >= self.settings.sync_timeout
                if wait > 0 and held and material_change(sent, self.report()):
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                    return None
        finally:
            if not task.done():  # we were cancelled (stop()): so is the call
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    def _token(self) -> str | None:
        """The bearer token, read fresh (projected tokens rotate); None when unreadable."""
        try:
            token = Path(self.settings.token_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            if not self._token_warned:
                log.warning("cannot read token file %s: %s", self.settings.token_file, exc)
                self._token_warned = True
            return None
        self._token_warned = False
        return token or None

    async def sync_once(self, report: SyncReport | None = None, wait: float = 0.0) -> SyncResult:
        """One sync: send ``report`` (default: a fresh one), asking the agent to hold it up to
        ``wait`` seconds; record the outcome in ``state``, call ``on_result``. Returns the
        result; never raises (except ``CancelledError``)."""
        answer: SyncAnswer | None = None
        detail = ""
        held = False
        alive_until: float | None = None
        started = self.state.clock()
        try:
            result, answer, detail, held = await self._exchange(report or self.report(), wait)
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            bound = wait + self.settings.sync_timeout
            result, detail = SyncResult.TIMEOUT, f"no answer within {bound:g}s"
        except aiohttp.ClientError as exc:
            result, detail = SyncResult.ERROR, f"{type(exc).__name__}: {exc}"
            alive_until = broken_hold_credit(
                started, self.state.clock(), wait, self.settings.sync_timeout
            )
        except Exception as exc:  # a bug must not stop the loop: count it, log it, carry on
            log.exception("sync with the node agent failed unexpectedly")
            result, detail = SyncResult.ERROR, repr(exc)
        if answer is not None:
            self.state.record_answer(answer, detail or None, held=held)
        elif result is SyncResult.NOT_MODIFIED:
            self.state.record_not_modified(held=held)
        else:
            self.state.record_failure(result, alive_until=alive_until)
        self._log(result, "" if result in _SUCCESS else detail)
        self.on_result(result, answer)
        return result

    async def _exchange(
        self, report: SyncReport, wait: float
    ) -> tuple[SyncResult, SyncAnswer | None, str, bool]:
        """(result, answer on 200, ETag on 200 / detail on failure, whether the agent holds
        syncs)."""
        assert self.session is not None, "start() first"
        body = report.model_dump_json(by_alias=True, exclude_none=True)
        headers = {"Content-Type": "application/json"}
        token = self._token()
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        if self.state.etag is not None and self.state.answer is not None:
            headers["If-None-Match"] = self.state.etag
        if wait > 0:
            headers[PREFER_HEADER] = f"wait={wait:g}"
        # Always explicit (None would mean no bound at all): a hung call is a failed sync.
        timeout = aiohttp.ClientTimeout(total=wait + self.settings.sync_timeout)
        async with self.session.post(self.url, data=body, headers=headers, timeout=timeout) as resp:
            data = await resp.read()
            held = resp.headers.get(APPLIED_HEADER, "").strip().lower().startswith("wait=")
            if resp.status == 200:
                try:
                    answer = SyncAnswer.model_validate_json(data)
                except ValidationError as exc:
                    return SyncResult.ERROR, None, f"unreadable answer: {exc}", False
                return SyncResult.OK, answer, resp.headers.get("ETag", answer.etag), held
            if resp.status == 304:
                if self.state.answer is None:
                    return SyncResult.ERROR, None, "304 Not Modified before any answer", False
                return SyncResult.NOT_MODIFIED, None, "", held
            detail = f"HTTP {resp.status}: {data[:300].decode(errors='replace')}"
            if resp.status == 401:
                return SyncResult.UNAUTHORIZED, None, detail, False
            if resp.status == 403:
                return SyncResult.FORBIDDEN, None, detail, False
            return SyncResult.ERROR, None, detail, False

    def _log(self, result: SyncResult, detail: str) -> None:
        """Log changes of outcome only, not every failed second."""
        key = (SyncResult.OK if result in _SUCCESS else result, detail.split(":", 1)[0])
        if key == self._last_logged:
            return
        self._last_logged = key
        if result in _SUCCESS:
            log.info("syncing with the node agent at %s", self.url)
        else:
            log.warning("sync with the node agent at %s failed: %s %s", self.url, result, detail)
