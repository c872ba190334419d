"""Between the virtual-time driver and an arm: what the driver offers an arm (:class:`Gate`: the
engine's gauges and two verbs, dispatch and reject), what it calls on one (:class:`Arm`) and what
it records (each request's :class:`RequestRecord`, the run's :class:`RunResult`).

Every request ends :data:`SERVED`, :data:`DEGRADED` (served with max_tokens lowered by the arm)
or :data:`REJECTED`; :data:`PENDING` only while the run goes. Times are virtual seconds from the
schedule's start, lengths tokens. The driver itself is
:mod:`kvgate_bench.effectiveness.model.driver`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvgate_bench.effectiveness.model.schedule import Request, Schedule, content_keys
from kvgate_bench.sim.engine import SimEngine
from kvgate_bench.sim.sequences import RequestRejected, Sequence

SERVED = "served"
DEGRADED = "degraded"
REJECTED = "rejected"
PENDING = "pending"


def engine_default_max_tokens(req: Request, max_model_len: int) -> int:
    """vLLM's max_tokens for a request that sets none: the rest of the context, tokens."""
    return max_model_len - req.prompt_tokens


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request. Times are virtual seconds from the schedule's start.

    Attributes:
        request: the request.
        outcome: ``served``, ``degraded``, ``rejected`` (``pending`` only while running).
        admitted_at: when the arm sent it to the engine.
        first_token_at: end of the step that produced its first output token.
        finished_at: end of the step that produced its last token (or the rejection time).
        output_tokens: tokens it produced.
        max_tokens_sent: the max_tokens the engine got (after the arm's default or clamp).
        preemptions: times the engine preempted it.
        retry_after_s: the Retry-After a rejection suggested, seconds, when it gave one.
        cached_tokens: prompt tokens the engine found in its prefix cache (not prefilled).
    """

    request: Request
    outcome: str = PENDING
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    output_tokens: int = 0
    max_tokens_sent: int | None = None
    preemptions: int = 0
    retry_after_s: float | None = None
    cached_tokens: int = 0

    @property
    def truncated_by_arm(self) -> bool:
        """A degraded request cut below the output it would have produced undegraded."""
        req = self.request
        if self.outcome != DEGRADED or self.max_tokens_sent is None:
            return False
        wanted = (
            req.output_tokens if req.max_tokens is None else min(req.output_tokens, req.max_tokens)
        )
        return self.output_tokens < wanted


class Gate:
    """What the driver offers an arm: the engine's gauges (read only) and two verbs."""

    def __init__(
        self,
        engine: SimEngine,
        records: dict[str, RequestRecord],
        on_decided: Callable[[Request, bool, float], None] | None = None,
    ) -> None:
        self.engine = engine
        self._records = records
        self.sequences: dict[str, Sequence] = {}
        #: Called with (request, admitted, now) on every dispatch and reject (replay probes).
        self._on_decided = on_decided

    def dispatch(
        self, req: Request, now: float, max_tokens: int | None = None, degraded: bool = False
    ) -> None:
        """Send ``req`` to the engine at ``now`` with ``max_tokens`` (default: the client's, or
        the engine's default when unset). A request the engine refuses (400) is rejected."""
        rec = self._records[req.rid]
        if rec.outcome != PENDING or rec.admitted_at is not None:
            raise RuntimeError(f"{req.rid} dispatched twice")
        mt = max_tokens
        if mt is None:
            mt = req.max_tokens
            if mt is None:
                mt = engine_default_max_tokens(req, self.engine.config.max_model_len)
        rec.admitted_at = now
        rec.max_tokens_sent = mt
        if self._on_decided is not None:
            self._on_decided(req, True, now)
        keys = content_keys(req, self.engine.config.block_size)
        try:
            seq = self.engine.submit(
                req.rid, req.prompt_tokens, mt, req.tenant, req.output_tokens, keys
            )
        except RequestRejected:
            rec.outcome = REJECTED
            rec.finished_at = now
            return
        self.sequences[req.rid] = seq
        if degraded:
            rec.outcome = DEGRADED

    def cached_tokens(self, rid: str) -> int:
        """Prompt tokens the engine reported found in its prefix cache for the request ``rid``
        (vLLM's ``usage.prompt_tokens_details.cached_tokens``); 0 before it ran."""
        return self._records[rid].cached_tokens

    def reject(self, req: Request, now: float, retry_after_s: float | None = None) -> None:
        """Refuse ``req`` at ``now`` (a 429 or 503, ``retry_after_s`` seconds suggested)."""
        rec = self._records[req.rid]
        if rec.outcome != PENDING or rec.admitted_at is not None:
            raise RuntimeError(f"{req.rid} rejected after it was decided")
        rec.outcome = REJECTED
        rec.finished_at = now
        rec.retry_after_s = retry_after_s
        if self._on_decided is not None:
            self._on_decided(req, False, now)


class Arm(ABC):
    """An admission arm in front of the engine. Subclasses set ``name`` and ``params``.

    The driver calls :meth:`start` once, then :meth:`on_arrival` for each request at its
    arrival time, :meth:`on_finish` when the engine finishes one the arm dispatched, and
    :meth:`on_wake` at (or after) the time :meth:`next_wake` returned. Every request must end
    dispatched or rejected by the time the schedule has drained.
    """

    name: str = "arm"

    def __init__(self) -> None:
        self.params: dict[str, Any] = {}
        self._gate: Gate | None = None

    @property
    def gate(self) -> Gate:
        """The gate given to :meth:`start`."""
        if self._gate is None:
            raise RuntimeError("arm not started")
        return self._gate

    def start(self, gate: Gate, now: float) -> None:
        """Bind to ``gate`` at virtual time ``now``."""
        self._gate = gate

    @abstractmethod
    def on_arrival(self, req: Request, now: float) -> None:
        """Decide on ``req``, arrived at ``now``."""

    def on_finish(self, req: Request, output_tokens: int, now: float) -> None:  # noqa: B027
        """``req`` finished at ``now`` having produced ``output_tokens``."""

    def on_tokens(self, new_tokens: dict[str, int], now: float) -> None:  # noqa: B027
        """An engine step ending at ``now`` produced output tokens: request id -> 0-based index
        of the token (what a proxy sees as the stream passes). Called before that step's
        :meth:`on_finish` calls."""

    def next_wake(self) -> float | None:
        """Virtual time at which the arm wants :meth:`on_wake` (None: no timer)."""
        return None

    def on_wake(self, now: float) -> None:  # noqa: B027
        """The timer asked for by :meth:`next_wake` fired at ``now``."""

    def queued(self) -> int:
        """Requests the arm holds, neither dispatched nor refused (0 for an arm that holds
        none): the pool benchmark's "room" test reads it."""
        return 0

    def router_gauges(self) -> tuple[float, float] | None:
        """What the arm's sidecar would expose to a router as (queue depth, KV fraction), or
        None when it exposes nothing (the router reads the engine's own gauges)."""
        return None

    def label(self) -> str:
        """``name`` and its parameters, for tables."""
        if not self.params:
            return self.name
        return self.name + " " + ",".join(f"{k}={v}" for k, v in self.params.items())


@dataclass
class RunResult:
    """One simulated run.

    Attributes:
        schedule: the schedule run.
        arm: the arm's name; ``params`` its parameters.
        records: one per request, in schedule order (with sessions: every turn sent, in
            arrival order).
        end_s: virtual time when the last request finished (or the last event).
        kv_busy_s: integral of the engine's KV usage (0..1) over virtual time, seconds.
        steps: engine steps taken.
        cpu_s: CPU seconds the simulation took (process time).
        probe_records: the records of the probe copies offered (``probes``), in offer order.
        probe_waits: original id -> seconds from its rejection to the offer of the copy the
            arm admitted, or None when none was (``probes`` only; ids the arm did not reject
            are absent).
        stopped_early: ``simulate(..., stop_when_known=True)`` returned before the drain.
    """

    schedule: Schedule
    arm: str
    params: dict[str, Any]
    records: list[RequestRecord]
    end_s: float
    kv_busy_s: float
    steps: int
    cpu_s: float
    engine: SimEngine = field(repr=False)
    probe_records: list[RequestRecord] = field(default_factory=list)
    probe_waits: dict[str, float | None] = field(default_factory=dict)
    stopped_early: bool = False

    def record(self, rid: str) -> RequestRecord:
        """The record of request ``rid`` of the schedule. Raises ``KeyError`` if absent."""
        for rec in self.records:
            if rec.request.rid == rid:
                return rec
        raise KeyError(rid)
