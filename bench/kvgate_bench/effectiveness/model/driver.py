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

Sessions (``Schedule.sessions``, the ``multi-turn`` workload): when a session's turn finishes,
its next turn (:func:`kvgate_bench.effectiveness.model.sessions.next_turn`) joins the arrivals at
its
own time and gets a record of its own; :attr:`RunResult.records` then holds every turn sent, in
arrival order. A turn goes to the engine with its session's content keys
(:class:`kvgate_bench.sim.prefix_cache.SessionKeys`), so its leading blocks are found in the
engine's prefix cache while they stay there; a request of another workload describes no content
and is never found there.

Every request ends ``served``, ``degraded`` (served with max_tokens lowered by the arm) or
``rejected``; :func:`simulate` raises if one is left pending.

Two replay options serve the counterfactual figures of
:mod:`kvgate_bench.effectiveness.replay` (they leave a plain run unchanged):

* ``force_dispatch``: these requests bypass the arm: the driver dispatches each to the engine
  at its arrival time itself (the client's max_tokens, or the engine's default), and the arm
  never sees it (no :meth:`Arm.on_arrival`, no :meth:`Arm.on_finish`).
* ``probes``: for a request the arm rejects, copies of it are offered to the arm as new
  arrivals (ids ``<rid>~<k>``) at ``t_reject + delta`` for the given deltas, one outstanding
  at a time (a probe time that comes while the previous copy is still undecided is skipped),
  until the arm admits one; the admitted copy runs in the engine like any request (a client
  that honoured a Retry-After). :attr:`RunResult.probe_waits` holds, per original id, the
  delta of the copy that was admitted, or None when none was.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import replace

from kvgate_bench.effectiveness.model.gate import (
    PENDING,
    SERVED,
    Arm,
    Gate,
    RequestRecord,
    RunResult,
)
from kvgate_bench.effectiveness.model.schedule import Request, Schedule
from kvgate_bench.effectiveness.model.sessions import next_turn
from kvgate_bench.sim.engine import SimEngine
from kvgate_bench.sim.sequences import EngineConfig
from kvgate_bench.sim.steptime import StepTimeModel

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


class _Probes:
    """The probe copies of :func:`simulate`'s ``probes`` option (see the module docstring)."""

    def __init__(self, deltas: Mapping[str, Seq[float]], records: dict[str, RequestRecord]) -> None:
        self.deltas = {rid: sorted(d) for rid, d in deltas.items()}
        self.records = records
        self.heap: list[tuple[float, int, Request]] = []  # (offer time, order, copy)
        self.rejected_at: dict[str, float] = {}
        self.next_k: dict[str, int] = {}
        self.origin: dict[str, str] = {}  # copy id -> original id
        self.waits: dict[str, float | None] = {}
        self.offered: list[RequestRecord] = []
        #: Originals whose wait is not known yet (not admitted, deltas not exhausted).
        self.open = set(self.deltas)
        self._order = 0

    def _offer_next(self, rid: str, after: float) -> None:
        """Queue the next copy of ``rid`` at the first probe time after ``after``."""
        t0 = self.rejected_at[rid]
        deltas = self.deltas[rid]
        k = self.next_k.get(rid, 0)
        while k < len(deltas) and t0 + deltas[k] <= after:
            k += 1
        self.next_k[rid] = k + 1
        if k >= len(deltas):
            self.open.discard(rid)
            return
        orig = self.records[rid].request
        copy = replace(orig, rid=f"{rid}~{k}", arrival_s=t0 + deltas[k])
        self.origin[copy.rid] = rid
        self._order += 1
        heapq.heappush(self.heap, (copy.arrival_s, self._order, copy))

    def decided(self, req: Request, admitted: bool, now: float) -> None:
        """Gate hook: an original rejected, or a copy admitted or rejected, at ``now``."""
        rid = self.origin.get(req.rid)
        if rid is None:
            if req.rid not in self.deltas:
                return
            if admitted:  # the arm admitted the original: nothing to probe
                self.open.discard(req.rid)
                return
            self.rejected_at[req.rid] = now
            self.waits[req.rid] = None
            self._offer_next(req.rid, now)  # deltas are > 0: the first one
        elif admitted:
            self.waits[rid] = req.arrival_s - self.rejected_at[rid]
            self.open.discard(rid)
        else:
            self._offer_next(rid, now)

    def pop(self) -> Request:
        """The next copy to offer, registered as a request."""
        copy = heapq.heappop(self.heap)[2]
        rec = RequestRecord(copy)
        self.records[copy.rid] = rec
        self.offered.append(rec)
        return copy


def simulate(
    schedule: Schedule,
    arm: Arm,
    steptime: StepTimeModel,
    config: EngineConfig | None = None,
    *,
    max_virtual_s: float = math.inf,
    force_dispatch: frozenset[str] = frozenset(),
    probes: Mapping[str, Seq[float]] | None = None,
    stop_when_known: bool = False,
) -> RunResult:
    """Run ``schedule`` through ``arm`` into a fresh engine until every request has ended.

    ``force_dispatch``: ids of requests that bypass the arm; ``probes``: id -> retry deltas,
    seconds (> 0), for the copies offered after the arm rejects that request (both: see the
    module docstring). ``stop_when_known``: return as soon as every forced request has ended
    and every probed request's wait is known (what follows cannot change them); the result's
    ``stopped_early`` is then True and other requests may still be pending (and
    ``end_s``, ``kv_busy_s`` cover the part run).

    Raises ``RuntimeError`` if a request is left pending when nothing more can happen, or the
    virtual clock passes ``max_virtual_s`` (a guard for tests); ``ValueError`` for a probe
    delta <= 0.
    """
    c0 = time.process_time()
    cfg = config if config is not None else engine_config(steptime)
    engine = SimEngine(cfg, steptime)
    records = {r.rid: RequestRecord(r) for r in schedule.requests}
    pr: _Probes | None = None
    if probes:
        if any(d <= 0 for ds in probes.values() for d in ds):
            raise ValueError("probe deltas must be > 0")
        pr = _Probes(probes, records)
    gate = Gate(engine, records, pr.decided if pr is not None else None)
    forced = force_dispatch
    extra = pr.heap if pr is not None else []
    watch = list(forced) if stop_when_known else []
    turns: list[tuple[float, int, Request]] = []  # sessions' next turns: (arrival, order, turn)
    later: list[Request] = []  # the turns released, in arrival order
    made = 0  # turns made so far (the heap's tie-break)
    stopped = False
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
        if stop_when_known and (
            all(rid in records and records[rid].finished_at is not None for rid in watch)
            and (pr is None or not pr.open)
        ):
            stopped = True
            break
        if engine.has_work:
            result = engine.step()
            steps += 1
            t1 = t + result.duration_s
        else:
            result = None
            na = arrivals[i].arrival_s if i < n else inf
            if extra and extra[0][0] < na:
                na = extra[0][0]
            if turns and turns[0][0] < na:
                na = turns[0][0]
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
            probe = bool(extra) and extra[0][0] < na
            if probe:
                na = extra[0][0]
            turn = bool(turns) and turns[0][0] < na
            if turn:
                na = turns[0][0]
            w = arm.next_wake()
            nw = inf if w is None else max(w, wake_floor, t)
            if na <= nw:
                if na > t1:
                    break
                if turn:
                    req = heapq.heappop(turns)[2]
                    records[req.rid] = RequestRecord(req)
                    later.append(req)
                elif probe and pr is not None:
                    req = pr.pop()
                else:
                    req = arrivals[i]
                    i += 1
                if forced and req.rid in forced:
                    gate.dispatch(req, max(na, t))
                else:
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
            rec.cached_tokens = seq.cached_tokens
            if rec.outcome == PENDING:
                rec.outcome = SERVED
            if rec.request.session is not None:
                nxt = next_turn(schedule, rec.request, seq.generated, t)
                if nxt is not None:
                    made += 1
                    heapq.heappush(turns, (nxt.arrival_s, made, nxt))
            if not (forced and rid in forced):
                arm.on_finish(rec.request, seq.generated, t)
    left = [r.request.rid for r in records.values() if r.outcome == PENDING]
    if left and not stopped:
        raise RuntimeError(f"{len(left)} requests never ended, e.g. {left[:3]}")
    end = max([t] + [r.finished_at for r in records.values() if r.finished_at is not None])
    sent = schedule.requests
    if later:
        sent = sorted([*sent, *later], key=lambda r: r.arrival_s)
    return RunResult(
        schedule,
        arm.name,
        dict(arm.params),
        [records[r.rid] for r in sent],
        end,
        kv_busy,
        steps,
        time.process_time() - c0,
        engine,
        pr.offered if pr is not None else [],
        dict(pr.waits) if pr is not None else {},
        stopped,
    )
