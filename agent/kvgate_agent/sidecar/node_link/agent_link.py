"""The sidecar's link to the node agent: the HTTP sync loop (:class:`AgentLink`, an asyncio
task) that sends the pod's report and hands each outcome to a
:class:`~kvgate_agent.sidecar.node_link.sync_state.SyncState` (the pure view of the sync over time)
and to the sidecar; and the report's helpers (the pod's GPUs, its metrics URL, what counts as a
material change). Units: seconds; tokens in the report.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Mapping
from pathlib import Path

import aiohttp
from pydantic import ValidationError

from kvgate_agent.contract.sync import (
    APPLIED_HEADER,
    PREFER_HEADER,
    SYNC_PATH,
    SyncAnswer,
    SyncReport,
)
from kvgate_agent.sidecar.node_link.settings import AgentSettings as AgentSettings  # re-exported
from kvgate_agent.sidecar.node_link.sync_state import (
    SUCCESSES,
    SyncResult,
    SyncState,
    broken_hold_credit,
)
from kvgate_agent.tasks import cancel_and_wait

log = logging.getLogger("kvgate.sidecar.agent")

#: The reserved KV moving by more than this fraction of the KV capacity is a material change of
#: the report (sent at once); the agent's NodeAdmission status gate uses the same step
#: (``kvgate_agent.node.state.KV_RESERVED_STEP``).
REPORT_KV_STEP = 0.10

_GPU_UUID = re.compile(r"^(GPU|MIG)-[0-9A-Za-z][0-9A-Za-z/-]*$")
_LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})


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
    :meth:`SyncState.wait_seconds`): an agent that holds syncs answers when the answer
    changes or after N seconds, and the next call follows at once; otherwise it syncs every
    ``syncIntervalSeconds`` (from the last answer; 1 s until one arrives), see
    :meth:`SyncState.next_sync_delay`. Each call is bounded by N + the sync timeout (2 s
    by default): a held call that hangs past that is a failed sync. While a call is held, the
    report is re-read every sync interval; once the call outlived the sync timeout (so the agent
    holds it) and the report changed materially (:func:`material_change`), the call is dropped
    and the new report sent.

    Args:
        settings: the agent's URL and the pod's identity.
        state: the :class:`SyncState` to feed.
        report: builds the report to send (called before every sync).
        on_result: called after every sync with its result and, on 200, the new answer
            (already recorded in ``state``).

    :meth:`start` launches the loop, :meth:`stop` cancels it and closes its HTTP session. The
    loop never dies of a failed sync: every failure is counted and the loop carries on.
    """

    def __init__(
        self,
        settings: AgentSettings,
        state: SyncState,
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
        task, self._task = self._task, None
        await cancel_and_wait(task)
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
                    await cancel_and_wait(task)
                    return None
        finally:
            if not task.done():  # we were cancelled (stop()): so is the call
                await cancel_and_wait(task)

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
        self._log(result, "" if result in SUCCESSES else detail)
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
        key = (SyncResult.OK if result in SUCCESSES else result, detail.split(":", 1)[0])
        if key == self._last_logged:
            return
        self._last_logged = key
        if result in SUCCESSES:
            log.info("syncing with the node agent at %s", self.url)
        else:
            log.warning("sync with the node agent at %s failed: %s %s", self.url, result, detail)
