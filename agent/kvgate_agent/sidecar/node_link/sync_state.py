"""The sidecar's view of its sync with the node agent over time (pure: no I/O, clock injected).

:class:`SyncState` remembers the last answer and when a sync last succeeded, and decides the
sidecar's :class:`Mode` now and when time alone next changes it (:meth:`SyncState.next_change_at`);
:class:`SyncResult` names each sync's outcome. The HTTP loop that feeds it is
:class:`kvgate_agent.sidecar.node_link.agent_link.AgentLink`; what enforces the mode is
:class:`kvgate_agent.sidecar.node_link.agent_enforcement.AgentEnforcement`. Units: seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import StrEnum

from kvgate_agent.contract.nodeadmission import PodThresholds
from kvgate_agent.contract.policy import FailureMode
from kvgate_agent.contract.sync import DEFAULT_SYNC_INTERVAL_SECONDS, SyncAnswer

Clock = Callable[[], float]

#: TTL used until an answer gives one (seconds): how long the sidecar keeps its last
#: thresholds without a successful sync, and how long it waits for a first answer before it
#: reports ready anyway.
DEFAULT_TTL_SECONDS = 30.0
#: Least time between the start of one held sync and the next after a 200 (seconds): a bound,
#: not a pace (the next call is held until the answer changes again).
MIN_SYNC_GAP_SECONDS = 0.05


class Mode(StrEnum):
    """What the sidecar enforces, as decided by :meth:`SyncState.mode`.

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


#: The results of a successful sync.
SUCCESSES = (SyncResult.OK, SyncResult.NOT_MODIFIED)


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


class SyncState:
    """The sidecar's view of its sync with the node agent over time: the last answer (and the
    thresholds in it), its age, the mode it implies (pure: no I/O, clock injected).

    Args:
        clock: monotonic seconds.
        failure_mode: the configured failure mode (``--failure-mode``): decides before the
            first answer, and past the TTL when the last answer carried no policy.
        ttl_override: TTL in seconds instead of the answer's ``ttlSeconds``.

    Feed it every sync outcome (:meth:`record_answer`, :meth:`record_not_modified`,
    :meth:`record_failure`); ask :meth:`mode` what to enforce now, :meth:`next_change_at`
    when time alone changes that, and :meth:`ready` whether the pod may be Ready.
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
        if result in SUCCESSES:
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
        if result not in SUCCESSES or not self.agent_holds:
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
        return Mode.LIVE if self.last_result in SUCCESSES else Mode.STALE

    def next_change_at(self) -> float | None:
        """When (clock seconds) time alone next changes :meth:`mode`: the end of the TTL,
        ``current_at + ttl_seconds`` (``mode`` changes just after it, to ``fail_open`` or
        ``fail_closed``, unless a sync comes first), while an answer is within its TTL
        (``live``, ``stale``, ``unmanaged``); None when only a sync can change the mode
        (``waiting``: no answer yet; ``fail_open``/``fail_closed``: already past the TTL).
        The sync outcomes (``record_*``) may move it: ask again after each."""
        if self.answer is None or self.current_at is None:
            return None
        if self.clock() - self.current_at > self.ttl_seconds:  # as in mode()
            return None
        return self.current_at + self.ttl_seconds

    def ready(self) -> bool:
        """Whether the pod may report Ready as far as thresholds go: once a first answer
        arrived, or once the TTL has passed since start (a pod whose agent is down must still
        become Ready eventually; its failure mode then decides)."""
        return self.answer is not None or self.clock() - self.started_at >= self.ttl_seconds
