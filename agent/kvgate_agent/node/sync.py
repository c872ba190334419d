"""The node agent's answer to ``POST /v1/sync`` (see :mod:`kvgate_agent.contract.sync`): a
sidecar's report in, its pod's thresholds out, held (a long poll) while the answer is the one
the sidecar already applies.

Invariant: a report is recorded only once it is valid and its token authenticated, and only
when the NodeAdmission has been read; the answer itself is the
:class:`~kvgate_agent.node.state.NodeState`'s (nothing is decided here).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from kvgate_agent.contract.sync import APPLIED_HEADER, SyncReport
from kvgate_agent.node.auth import Authenticator, AuthError
from kvgate_agent.node.longpoll import Waiters, WaitOutcome, clamp_wait
from kvgate_agent.node.metrics import NodeMetrics
from kvgate_agent.node.scrape import EngineScraper
from kvgate_agent.node.state import NodeState, PodKey

log = logging.getLogger("kvgate.node")


@dataclass(slots=True)
class SyncResult:
    """An HTTP answer to a sync: ``status``, JSON ``body`` (None for 304) and headers."""

    status: int
    body: dict[str, Any] | None
    headers: dict[str, str]


def _error(status: int, code: str, message: str, kind: str) -> SyncResult:
    return SyncResult(status, {"error": {"message": message, "type": kind, "code": code}}, {})


class SyncHandler:
    """Answers the sidecars' syncs.

    Holds :attr:`waiters` (the syncs held until their pod's answer changes: at most one per
    pod), the state version the held syncs were last told of, whether the agent is releasing
    them (shutting down: no sync is held any more), and when each refused pod and reason was
    last logged (at most once a minute each; the metric counts every refusal).

    Args:
        state: the node's state: reports are recorded in it, answers read from it.
        auth: checks each sidecar's token against its pod.
        scraper: told each pod's metrics URL as its sync reports it.
        metrics: counts syncs, held syncs' outcomes and the time to answer.
        max_wait_seconds: the longest a sync is held, seconds (a sidecar's ``Prefer: wait`` is
            capped at it).
        clock: monotonic seconds.
    """

    def __init__(
        self,
        state: NodeState,
        auth: Authenticator,
        scraper: EngineScraper,
        metrics: NodeMetrics,
        max_wait_seconds: float,
        clock: Callable[[], float],
    ) -> None:
        self.state = state
        self.auth = auth
        self.scraper = scraper
        self.metrics = metrics
        self.max_wait_seconds = max_wait_seconds
        self.clock = clock
        #: Syncs held until the pod's answer changes (long polls).
        self.waiters = Waiters()
        self._notified_version = -1
        self._releasing = False
        self._refusals_logged: dict[tuple[str, str, str], float] = {}

    async def handle(
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
        got = await self._record(body, authorization, peer)
        if isinstance(got, SyncResult):
            self.metrics.sync_seconds.observe(time.perf_counter() - started)
            return got
        hold = 0.0 if self._releasing else clamp_wait(wait, self.max_wait_seconds)
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

    def notify(self) -> None:
        """An input of the answers changed: end the held syncs whose answer now differs."""
        if self.state.version != self._notified_version:
            self._notified_version = self.state.version
            self.waiters.notify()

    def release_all(self) -> None:
        """On shutdown: answer every held sync now and hold no more (the server then stops at
        once instead of waiting out the long polls)."""
        self._releasing = True
        self.waiters.release_all()

    async def _record(
        self, body: bytes, authorization: str | None, peer: str | None
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
        self.state.record(report, self.clock())
        self.scraper.set_target(key, report.metrics_url, peer)
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
