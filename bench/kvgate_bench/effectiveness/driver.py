"""Virtual-time driver: one schedule through one arm into the engine model, in one process.

The engine is :class:`kvgate_bench.sim.engine.SimEngine` (vLLM V1's scheduler, chunked prefill,
recompute preemption, true output lengths) priced by a
:class:`kvgate_bench.sim.steptime.StepTimeModel`. An :class:`Arm` stands in front of it and
decides, for each arriving request, to send it to the engine now (:meth:`Gate.dispatch`), later,
or never (:meth:`Gate.reject`).

The clock is virtual: it moves by each engine step's modelled ``duration_s`` and, while the
engine is idle, jumps to the next arrival or the next time the arm asked to be woken
(:meth:`Arm.next_wake`). Nothing sleeps. Within one step ``[t, t + duration]`` the arrivals and
wake-ups that fall inside it are handed to the arm at their own times, in time order; what they
dispatch joins the engine's waiting queue and is scheduled from the next step on (as vLLM picks
up new requests only between steps). The step's outcome (first tokens, finishes, preemptions)
is applied at its end, ``t + duration``, and finished requests are reported to the arm then.

Every request ends ``served``, ``degraded`` (served with max_tokens lowered by the arm) or
``rejected``; :func:`simulate` raises if one is left pending.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from kvgate_bench.effectiveness.workloads import Request, Schedule
from kvgate_bench.sim.engine import EngineConfig, RequestRejected, Sequence, SimEngine
from kvgate_bench.sim.steptime import StepTimeModel

SERVED = "served"
DEGRADED = "degraded"
REJECTED = "rejected"
PENDING = "pending"

#: Engine shape of the benchmark (vLLM's defaults; the KV pool is the profile's).
BLOCK_SIZE = 16
MAX_MODEL_LEN = 8192
MAX_NUM_SEQS = 256
MAX_NUM_BATCHED_TOKENS = 8192


def engine_config(steptime: StepTimeModel) -> EngineConfig:
    """The engine of the benchmark for ``steptime``'s profile: its KV pool in 16-token blocks,
    max_model_len 8192, max_num_seqs 256, a token budget of 8192 per step, chunked prefill as
    the profile says."""
    return EngineConfig(
        num_gpu_blocks=steptime.kv_capacity_tokens // BLOCK_SIZE,
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        chunked_prefill=steptime.chunked_prefill,
    )


def engine_default_max_tokens(req: Request, max_model_len: int = MAX_MODEL_LEN) -> int:
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

    def __init__(self, engine: SimEngine, records: dict[str, RequestRecord]) -> None:
        self.engine = engine
        self._records = records
        self.sequences: dict[str, Sequence] = {}

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
            mt = req.max_tokens if req.max_tokens is not None else engine_default_max_tokens(req)
        rec.admitted_at = now
        rec.max_tokens_sent = mt
        try:
            seq = self.engine.submit(req.rid, req.prompt_tokens, mt, req.tenant, req.output_tokens)
        except RequestRejected:
            rec.outcome = REJECTED
            rec.finished_at = now
            return
        self.sequences[req.rid] = seq
        if degraded:
            rec.outcome = DEGRADED

    def reject(self, req: Request, now: float, retry_after_s: float | None = None) -> None:
        """Refuse ``req`` at ``now`` (a 429 or 503, ``retry_after_s`` seconds suggested)."""
        rec = self._records[req.rid]
        if rec.outcome != PENDING or rec.admitted_at is not None:
            raise RuntimeError(f"{req.rid} rejected after it was decided")
        rec.outcome = REJECTED
        rec.finished_at = now
        rec.retry_after_s = retry_after_s


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
        records: one per request, in schedule order.
        end_s: virtual time when the last request finished (or the last event).
        kv_busy_s: integral of the engine's KV usage (0..1) over virtual time, seconds.
        steps: engine steps taken.
        cpu_s: CPU seconds the simulation took (process time).
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


def simulate(
    schedule: Schedule,
    arm: Arm,
    steptime: StepTimeModel,
    config: EngineConfig | None = None,
    *,
    max_virtual_s: float = math.inf,
) -> RunResult:
    """Run ``schedule`` through ``arm`` into a fresh engine until every request has ended.

    Raises ``RuntimeError`` if a request is left pending when nothing more can happen, or the
    virtual clock passes ``max_virtual_s`` (a guard for tests).
    """
    c0 = time.process_time()
    cfg = config if config is not None else engine_config(steptime)
    engine = SimEngine(cfg, steptime)
    records = {r.rid: RequestRecord(r) for r in schedule.requests}
    gate = Gate(engine, records)
    arm.start(gate, 0.0)
    arrivals = schedule.requests
    n = len(arrivals)
    i = 0
    t = 0.0
    kv_busy = 0.0
    steps = 0
    wake_floor = 0.0
    inf = math.inf
    while True:
        if engine.has_work:
            result = engine.step()
            steps += 1
            t1 = t + result.duration_s
        else:
            result = None
            na = arrivals[i].arrival_s if i < n else inf
            w = arm.next_wake()
            nw = inf if w is None else max(w, wake_floor)
            t1 = max(t, min(na, nw))
            if t1 == inf:
                break
        if t1 > max_virtual_s:
            raise RuntimeError(f"virtual time passed {max_virtual_s} s")
        # Arrivals and wake-ups inside (t, t1], in time order, at their own times.
        while True:
            na = arrivals[i].arrival_s if i < n else inf
            w = arm.next_wake()
            nw = inf if w is None else max(w, wake_floor, t)
            if na <= nw:
                if na > t1:
                    break
                req = arrivals[i]
                i += 1
                arm.on_arrival(req, max(na, t))
            else:
                if nw > t1:
                    break
                arm.on_wake(nw)
                wake_floor = nw + 1e-6  # a timer that asks for the past again waits 1 us
        t = t1
        if result is None:
            continue
        kv_busy += engine.kv_usage * result.duration_s
        for rid, index in result.new_tokens.items():
            if index == 0:
                records[rid].first_token_at = t
        for rid in result.preempted:
            records[rid].preemptions += 1
        if result.new_tokens:
            arm.on_tokens(result.new_tokens, t)
        for rid in result.finished:
            rec = records[rid]
            seq = gate.sequences.pop(rid)
            rec.finished_at = t
            rec.output_tokens = seq.generated
            if rec.outcome == PENDING:
                rec.outcome = SERVED
            arm.on_finish(rec.request, seq.generated, t)
    left = [r.request.rid for r in records.values() if r.outcome == PENDING]
    if left:
        raise RuntimeError(f"{len(left)} requests never ended, e.g. {left[:3]}")
    end = max([t] + [r.finished_at for r in records.values() if r.finished_at is not None])
    return RunResult(
        schedule,
        arm.name,
        dict(arm.params),
        [records[r.rid] for r in schedule.requests],
        end,
        kv_busy,
        steps,
        time.process_time() - c0,
        engine,
    )
