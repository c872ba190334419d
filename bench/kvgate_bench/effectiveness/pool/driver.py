"""Virtual-time pool: one schedule through a router into N replicas, each with its own arm.

A production model runs as several replicas behind a Service (kube-proxy), an Envoy or Istio
route, or an InferencePool whose endpoint picker (llm-d's EPP) chooses the pod. Per-pod
admission (a sidecar) then decides with what its own pod knows, and a refusal at one replica
may come while another has room. This driver runs that: the single-engine driver's engine and
arms (:mod:`kvgate_bench.effectiveness.model.driver`), ``N`` times, behind a
:class:`~kvgate_bench.effectiveness.pool.routers.Router`, on one virtual clock.

The path of a request (a *client request*: one of the schedule's, or a session's next turn):

1. **The front** (an :class:`~kvgate_bench.effectiveness.model.gate.Arm` at the router; pass-through
   unless the router holds requests, as llm-d's flow control does) gets it at its arrival and
   dispatches it (to the pool) or refuses it.
2. **The router** picks a replica (:meth:`Router.pick`); the request is an *attempt* there,
   handed to that replica's arm at once (the hop costs no time).
3. **The replica's arm** sends it to its engine, later, or refuses it. A refusal goes back to the
   router: :class:`~kvgate_bench.effectiveness.pool.routers.RetryPolicy` (Envoy's, where the router
   retries) sends a new attempt to a replica not tried yet after its back-off, or the refusal
   reaches the client.

Each engine steps on its own: a replica with work starts a step as soon as its previous one
ended, and what its arm dispatches during a step joins its waiting queue for the next step (as
in the single-engine driver). Events at the same instant go in the order: arrivals (schedule,
turns, retries), then timers (the front's, the replicas' arms', the router's scrape), then step
ends.

**Figures.** :func:`simulate_pool` returns a
:class:`~kvgate_bench.effectiveness.model.gate.RunResult` whose records are the client requests'
(times from the client's first arrival, so a retry's wait counts in its TTFT), with
``kv_busy_s`` the replicas' mean KV-usage integral, and a :class:`PoolStats`:

* ``retries``: attempts after the first, over the run;
* ``refused_while_room``: client requests finally refused at a moment when another replica had
  room: its arm held nothing queued, its engine nothing waiting, a free sequence slot and free
  KV blocks for the request's prompt plus its output (a replica that would have started it in
  its next step).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from kvgate_bench.effectiveness.model.driver import engine_config
from kvgate_bench.effectiveness.model.gate import (
    PENDING,
    REJECTED,
    SERVED,
    Arm,
    Gate,
    RequestRecord,
    RunResult,
)
from kvgate_bench.effectiveness.model.schedule import Request, Schedule
from kvgate_bench.effectiveness.model.sessions import next_turn
from kvgate_bench.effectiveness.pool.routers import RetryPolicy, Router
from kvgate_bench.sim.engine import SimEngine
from kvgate_bench.sim.sequences import EngineConfig, StepResult
from kvgate_bench.sim.steptime import StepTimeModel


@dataclass
class PoolStats:
    """What the pool adds to a run's figures (see the module docstring).

    Attributes:
        replicas: N.
        retries: attempts after the first, over the run.
        refused_while_room: client requests finally refused while another replica had room.
        per_replica_requests: attempts each replica's arm was handed, by replica index.
    """

    replicas: int
    retries: int = 0
    refused_while_room: int = 0
    per_replica_requests: list[int] = field(default_factory=list)


class Replica:
    """One pod: its engine, the gate its arm uses, the arm, and its step in progress."""

    def __init__(self, index: int, engine: SimEngine, gate: Gate, arm: Arm) -> None:
        self.index = index
        self.engine = engine
        self.gate = gate
        self.arm = arm
        #: End of the step in progress (virtual seconds), None while idle; its outcome.
        self.step_end: float | None = None
        self.result: StepResult | None = None
        #: Attempts sent here and not ended (finished or refused): Envoy's active requests.
        self.outstanding = 0
        self.kv_busy = 0.0
        self.wake_floor = 0.0

    def has_room(self, req: Request) -> bool:
        """Would this replica start ``req`` in its next step: nothing queued in its arm or
        engine, a free slot, free KV blocks for the prompt and its output."""
        eng = self.engine
        cfg = eng.config
        if self.arm.queued() or eng.num_waiting or eng.num_running >= cfg.max_num_seqs:
            return False
        need = req.prompt_tokens + min(req.output_tokens, req.max_tokens or req.output_tokens)
        return eng.free_blocks * cfg.block_size >= need


class _ReplicaGate(Gate):
    """A replica's gate: a refusal goes back to the pool (retry or the client), and an attempt
    its engine refuses (400) ends there (not retried: the client's request is invalid)."""

    def __init__(self, engine: SimEngine, pool: _Pool, index: int) -> None:
        super().__init__(engine, pool.attempts)
        self.pool = pool
        self.index = index

    def dispatch(
        self, req: Request, now: float, max_tokens: int | None = None, degraded: bool = False
    ) -> None:
        super().dispatch(req, now, max_tokens, degraded)
        if req.rid not in self.sequences:  # the engine refused it
            self.pool.replicas[self.index].outstanding -= 1

    def reject(self, req: Request, now: float, retry_after_s: float | None = None) -> None:
        super().reject(req, now, retry_after_s)
        self.pool.refused_at_replica(req, now)


class FrontGate(Gate):
    """The gate of the front arm: ``dispatch`` hands the request to the pool's router,
    ``reject`` refuses it to the client. ``engine`` is replica 0's (for arms that read
    ``engine.has_work``; a pool-aware front reads :attr:`pool`)."""

    def __init__(self, pool: _Pool) -> None:
        super().__init__(pool.replicas[0].engine, pool.client)
        self.pool = pool

    def dispatch(
        self, req: Request, now: float, max_tokens: int | None = None, degraded: bool = False
    ) -> None:
        self.pool.route(req, now, 0, frozenset())

    def reject(self, req: Request, now: float, retry_after_s: float | None = None) -> None:
        self.pool.refuse(req, now, retry_after_s)


class _Pool:
    """The state :func:`simulate_pool` steps (see the module docstring)."""

    def __init__(
        self,
        schedule: Schedule,
        replicas: list[Replica],
        router: Router,
        retry: RetryPolicy | None,
    ) -> None:
        self.schedule = schedule
        self.replicas = replicas
        self.router = router
        self.retry = retry
        self.client: dict[str, RequestRecord] = {r.rid: RequestRecord(r) for r in schedule.requests}
        self.attempts: dict[str, RequestRecord] = {}
        #: attempt id -> (client request, replica index, attempt number from 0, hosts tried)
        self.origin: dict[str, tuple[Request, int, int, frozenset[int]]] = {}
        self.last_attempt: dict[str, str] = {}
        #: (arrival, order, request, attempt number, hosts tried) of turns and retries
        self.later: list[tuple[float, int, Request, int, frozenset[int]]] = []
        self.turns: list[Request] = []
        self.order = 0
        self.stats = PoolStats(len(replicas))

    def route(self, req: Request, now: float, attempt: int, tried: frozenset[int]) -> None:
        """Send attempt ``attempt`` of client request ``req`` to the replica the router picks
        among those not in ``tried``; refuse it to the client when none is left."""
        r = self.router.pick(req, now, tried)
        if r is None:
            self.refuse(req, now, None)
            return
        aid = req.rid if attempt == 0 else f"{req.rid}~r{attempt}"
        att = req if attempt == 0 else replace(req, rid=aid)  # arrival_s: the client's
        self.attempts[aid] = RequestRecord(att)
        self.origin[aid] = (req, r, attempt, tried | {r})
        self.last_attempt[req.rid] = aid
        rep = self.replicas[r]
        rep.outstanding += 1
        self.stats.per_replica_requests[r] += 1
        self.router.sent(r, att, now)
        rep.arm.on_arrival(att, now)

    def refused_at_replica(self, att: Request, now: float) -> None:
        """Attempt ``att`` was refused by its replica's arm at ``now``: retry or refuse."""
        req, r, attempt, tried = self.origin[att.rid]
        self.replicas[r].outstanding -= 1
        retry_after = self.attempts[att.rid].retry_after_s
        if self.retry is not None and attempt < self.retry.max_retries(len(self.replicas)):
            self.order += 1
            at = now + self.retry.backoff_s(attempt + 1, retry_after)
            heapq.heappush(self.later, (at, self.order, req, attempt + 1, tried))
            self.stats.retries += 1
            return
        self.refuse(req, now, retry_after, exclude=r)

    def refuse(
        self, req: Request, now: float, retry_after_s: float | None, exclude: int | None = None
    ) -> None:
        """Client request ``req`` is finally refused at ``now``."""
        rec = self.client[req.rid]
        rec.outcome = REJECTED
        rec.finished_at = now
        rec.retry_after_s = retry_after_s
        rec.admitted_at = None
        self.last_attempt.pop(req.rid, None)
        if any(rep.has_room(req) for rep in self.replicas if rep.index != exclude):
            self.stats.refused_while_room += 1

    def finish(self, rep: Replica, aid: str, t: float) -> None:
        """Attempt ``aid`` finished on ``rep`` at ``t``: its record, the arm, the next turn."""
        seq = rep.gate.sequences.pop(aid)
        rec = self.attempts[aid]
        rec.finished_at = t
        rec.output_tokens = seq.generated
        rec.cached_tokens = seq.cached_tokens
        if rec.outcome == PENDING:
            rec.outcome = SERVED
        rep.outstanding -= 1
        req = self.origin[aid][0]
        nxt = next_turn(self.schedule, req, seq.generated, t)
        if nxt is not None:
            self.order += 1
            heapq.heappush(self.later, (nxt.arrival_s, self.order, nxt, 0, frozenset()))
        rep.arm.on_finish(rec.request, seq.generated, t)

    def client_records(self) -> list[RequestRecord]:
        """Every client request's record, its last attempt's fields on the client's request,
        in arrival order."""
        out = []
        for rid, rec in self.client.items():
            aid = self.last_attempt.get(rid)
            if aid is not None:
                att = self.attempts[aid]
                rec = replace(att, request=rec.request)
            out.append(rec)
        out.sort(key=lambda r: r.request.arrival_s)
        return out


def _apply_step(pool: _Pool, rep: Replica, t: float) -> None:
    """The step of ``rep`` ending at ``t``: first tokens, preemptions, finishes."""
    result = rep.result
    assert result is not None
    rep.step_end, rep.result = None, None
    rep.kv_busy += rep.engine.kv_usage * result.duration_s
    for aid, index in result.new_tokens.items():
        if index == 0:
            pool.attempts[aid].first_token_at = t
    for aid in result.preempted:
        pool.attempts[aid].preemptions += 1
    if result.new_tokens:
        rep.arm.on_tokens(result.new_tokens, t)
    for aid in result.finished:
        pool.finish(rep, aid, t)


def simulate_pool(
    schedule: Schedule,
    make_arm: Callable[[int], Arm],
    router: Router,
    steptime: StepTimeModel,
    replicas: int,
    *,
    front: Arm | None = None,
    retry: RetryPolicy | None = None,
    config: EngineConfig | None = None,
    max_virtual_s: float = math.inf,
) -> tuple[RunResult, PoolStats]:
    """Run ``schedule`` through ``front`` (None: pass-through), ``router`` and ``replicas``
    engines, replica ``i`` guarded by ``make_arm(i)``, until every client request has ended.

    Returns the run (client requests' records; see the module docstring) and the pool's
    figures. Raises ``ValueError`` for ``replicas`` < 1; ``RuntimeError`` if a request is left
    pending or the virtual clock passes ``max_virtual_s``.
    """
    if replicas < 1:
        raise ValueError("replicas must be >= 1")
    c0 = time.process_time()
    cfg = config if config is not None else engine_config(steptime)
    pool = _Pool(schedule, [], router, retry)
    for i in range(replicas):
        engine = SimEngine(cfg, steptime)
        pool.replicas.append(Replica(i, engine, _ReplicaGate(engine, pool, i), make_arm(i)))
    pool.stats.replicas = replicas
    pool.stats.per_replica_requests = [0] * replicas
    reps = pool.replicas
    fr = front if front is not None else _PassThrough()
    fr.start(FrontGate(pool), 0.0)
    for rep in reps:
        rep.arm.start(rep.gate, 0.0)
    router.start(reps)
    t = _run(pool, fr, schedule, max_virtual_s)
    left = [r.request.rid for r in pool.client_records() if r.outcome == PENDING]
    if left:
        raise RuntimeError(f"{len(left)} requests never ended, e.g. {left[:3]}")
    records = pool.client_records()
    end = max([t] + [r.finished_at for r in records if r.finished_at is not None])
    run = RunResult(
        schedule,
        fr.name if front is not None else reps[0].arm.name,
        dict(fr.params if front is not None else reps[0].arm.params),
        records,
        end,
        sum(rep.kv_busy for rep in reps) / replicas,
        0,
        time.process_time() - c0,
        reps[0].engine,
    )
    return run, pool.stats


def _run(pool: _Pool, front: Arm, schedule: Schedule, max_virtual_s: float) -> float:
    """The event loop of :func:`simulate_pool`; returns the time of the last event."""
    inf = math.inf
    arrivals = schedule.requests
    n, i = len(arrivals), 0
    t = 0.0
    front_floor = 0.0
    reps = pool.replicas
    router = pool.router
    while True:
        na = arrivals[i].arrival_s if i < n else inf
        nl = pool.later[0][0] if pool.later else inf
        w = front.next_wake()
        nf = inf if w is None else max(w, front_floor, t)
        nr = inf
        wake_rep: Replica | None = None
        for rep in reps:
            rw = rep.arm.next_wake()
            if rw is not None and max(rw, rep.wake_floor, t) < nr:
                nr, wake_rep = max(rw, rep.wake_floor, t), rep
        ns = router.next_scrape(any(rep.engine.has_work for rep in reps))
        ns = inf if ns is None else max(ns, t)
        ne = inf
        end_rep: Replica | None = None
        for rep in reps:
            if rep.step_end is not None and rep.step_end < ne:
                ne, end_rep = rep.step_end, rep
        t1 = min(na, nl, nf, nr, ns, ne)
        if t1 == inf:
            return t
        if t1 > max_virtual_s:
            raise RuntimeError(f"virtual time passed {max_virtual_s} s")
        t = t1
        if na <= t1 or nl <= t1:
            if nl < na:
                _, _, req, attempt, tried = heapq.heappop(pool.later)
                if attempt == 0:  # a session's next turn: a client request of its own
                    pool.client[req.rid] = RequestRecord(req)
                    pool.turns.append(req)
                    front.on_arrival(req, t)
                else:
                    pool.route(req, t, attempt, tried)
            else:
                front.on_arrival(arrivals[i], t)
                i += 1
        elif nf <= t1:
            front.on_wake(t)
            front_floor = t + 1e-6
        elif nr <= t1 and wake_rep is not None:
            wake_rep.arm.on_wake(t)
            wake_rep.wake_floor = t + 1e-6
        elif ns <= t1:
            router.scrape(t)
        elif end_rep is not None:
            _apply_step(pool, end_rep, t)
        for rep in reps:
            if rep.step_end is None and rep.engine.has_work:
                rep.result = rep.engine.step()
                rep.step_end = t + rep.result.duration_s


class _PassThrough(Arm):
    """The front when the router holds nothing: every request goes to the pool at once."""

    name = "pass-through"

    def on_arrival(self, req: Request, now: float) -> None:
        self.gate.dispatch(req, now)


__all__ = ["FrontGate", "PoolStats", "Replica", "simulate_pool"]
