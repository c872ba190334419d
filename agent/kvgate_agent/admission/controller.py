"""The admission controller of one pod: admit each request now, queue it, degrade it or refuse it.

It composes the limit bookkeeping (:mod:`.limits`), the holds (:mod:`.holds`), the wait queue
(:mod:`.queue`), the concurrency ceiling (:mod:`.ceiling`) and the policy's overload actions
(:mod:`.overload`: Degrade, Queue, Reject, in the policy's order, with Retry-After from
:mod:`.retry`). A request that can never fit is refused with 400 at once, never told to retry
(https://github.com/bucket4j/bucket4j/issues/220).

Invariant: pure and clock-injected (no I/O, no asyncio); every public method runs to completion
without yielding, so a check and its reservation are atomic on one event loop. The asyncio side
is :mod:`kvgate_agent.admission.async_admission`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvgate_agent.admission.bucket import BucketMap, SharedBucket
from kvgate_agent.admission.ceiling import ConcurrencyCeiling
from kvgate_agent.admission.config import AdmissionConfig
from kvgate_agent.admission.decision import (
    AdmissionRequest,
    Blocker,
    BucketCharge,
    Decision,
    Outcome,
    Reason,
    Ticket,
    Waiter,
)
from kvgate_agent.admission.fair_reserve import what_blocks
from kvgate_agent.admission.holds import Hold, Holds
from kvgate_agent.admission.limits import ENGINE_KV_TTL_S, Limits
from kvgate_agent.admission.overload import (
    Enqueue,
    Resources,
    act,
    evicted,
    exceeds_capacity,
    refused_by_count,
)
from kvgate_agent.admission.queue import WaitQueue
from kvgate_agent.admission.retry import DecodeSpeed
from kvgate_agent.admission.slo import SloState
from kvgate_agent.admission.stats import AdmissionStats, TenantStats
from kvgate_agent.contract.policy import OverloadAction

Clock = Callable[[], float]

# Enum members bound once: attribute access on an Enum class is slow on the hot path.
_ADMITTED = Outcome.ADMITTED
_OK = Reason.OK
_DEGRADE = OverloadAction.DEGRADE.value
_REJECT = OverloadAction.REJECT.value


class AdmissionController:
    """Admission state of one pod.

    Args:
        config: resolved thresholds.
        clock: monotonic seconds (injected; ``time.monotonic`` by default).
        max_tenants: bound on per-tenant bucket state kept in memory.

    All counts are tokens unless named otherwise; costs are cost units (see ``CostSpec``).
    """

    def __init__(
        self,
        config: AdmissionConfig,
        clock: Clock = time.monotonic,
        *,
        max_tenants: int = 100_000,
    ) -> None:
        self.clock = clock
        self.started_at = clock()
        self._limits = Limits(config, self.started_at, max_tenants)
        self._holds = Holds()
        self._speed = DecodeSpeed()
        self._queue = WaitQueue(self._limits)
        self._slo = SloState(
            config.tpot_slo_seconds,
            config.ttft_slo_seconds,
            config.max_concurrency,
            self.started_at,
        )
        self._ceiling = ConcurrencyCeiling(self._limits, self._slo)
        self._r = Resources(self._limits, self._queue, self._slo, self._speed)

    # ------------------------------------------------------------------ observation

    @property
    def config(self) -> AdmissionConfig:
        """The thresholds enforced now."""
        return self._limits.config

    def stats(self) -> AdmissionStats:
        """The admission state now (see :class:`AdmissionStats`)."""
        limits = self._limits
        return AdmissionStats(
            in_flight=limits.in_flight,
            queue_length=len(self._queue),
            kv_reserved_tokens=limits.kv_reserved_tokens,
            kv_capacity_tokens=limits.config.kv_capacity_tokens,
            kv_headroom_tokens=limits.headroom,
            concurrency_limit=limits.concurrency_limit,
            engine_concurrency=self._ceiling.engine_slots,
            seconds_per_token=self._speed.seconds_per_token,
            inter_token_seconds=self._slo.gap_s,
        )

    @property
    def idle(self) -> bool:
        """Nothing in flight and nobody waiting."""
        return self._limits.in_flight == 0 and not self._queue

    def set_engine_concurrency(self, slots: int | None) -> None:
        """The engine serves at most ``slots`` requests at once (llama.cpp's ``total_slots``;
        None: no such limit): see :meth:`ConcurrencyCeiling.set_engine_slots`."""
        self._ceiling.set_engine_slots(slots)

    def observe_engine_waiting(self, waiting: int | None, running: int | None = None) -> None:
        """The engine reports ``waiting`` requests in its own queue, ``running`` in its batch
        (None: unknown). kvgate's own requests not running may be among the waiting (a cap above
        vLLM's ``max_num_seqs``), so only ``waiting - (in_flight - running)`` count ahead of a
        newcomer, for :data:`~kvgate_agent.admission.limits.ENGINE_KV_TTL_S` seconds."""
        ours = max(0, self._limits.in_flight - (running or 0))
        others = None if waiting is None else max(0, waiting - ours)
        self._slo.observe_engine_waiting(others, self.clock() + ENGINE_KV_TTL_S)

    @property
    def slo(self) -> SloState:
        """The SLO measurements (inter-token time, departure rate, prefill time) and the
        adaptive limit, read only."""
        return self._slo

    def predicted_output_tokens(
        self, tenant: str, model: str | None, max_tokens: int
    ) -> int | None:
        """The length predictor's output tokens per choice for such a request (None: not enough
        samples yet)."""
        return self._limits.predictor.predict(tenant, model, max_tokens)

    def tenant_stats(self) -> TenantStats:
        """The per-tenant state now (see :class:`TenantStats`)."""
        rates, shares = self._limits.rates, self._limits.fair.shares()
        return TenantStats(rates.bucket_levels(self.clock()), rates.tenants_tracked(), shares)

    def set_kv_capacity(self, tokens: int | None) -> None:
        """Enforce a new KV capacity (tokens; None = not enforced), e.g. the engine's own report.
        Reservations already held stay; waiters are re-examined on the next pump."""
        self._limits.set_kv_capacity(tokens)

    def reconfigure(self, config: AdmissionConfig) -> None:
        """Enforce new thresholds from now on without dropping in-flight work.

        Admitted tickets, their KV reservations, ``in_flight`` and the wait queue all stay. A
        rate limit whose name and ``per`` scope are unchanged keeps its buckets (the very
        objects tickets hold): their capacity and rate (units, units per second) change in
        place and each level is carried over, clamped to the new capacity. New limits start
        with fresh (full) buckets; removed limits are dropped, and tickets still holding their
        buckets release into them harmlessly. A new KV capacity or concurrency cap below what
        is already reserved admits nothing until enough is released. Waiters are re-examined
        on the next :meth:`pump` (``AsyncAdmission`` runs it at once); nothing is decided here.
        """
        self._limits.reconfigure(config, self.clock())
        self._queue.retune(config)
        self._ceiling.retune(config)

    def attach_store(self) -> None:
        """Hold shared limits as slices of fleet-wide budgets (see
        :class:`~kvgate_agent.admission.lease.LeaseBook`), from now on and across
        :meth:`reconfigure`."""
        self._limits.rates.attach_store(self.clock())

    def shared_maps(self) -> list[tuple[str, str, BucketMap]]:
        """(limit, unit, bucket map) of the limits held as fleet-wide slices."""
        return self._limits.rates.shared_maps()

    def take_retired_slices(self) -> list[tuple[str, SharedBucket]]:
        """(``limit:unit:tenant``, slice) of shared limits removed since the last call, still
        holding or owing units (for a final hand-back to the store)."""
        out, self._limits.rates.retired = self._limits.rates.retired, []
        return out

    # ------------------------------------------------------------------ holds

    def hold(
        self,
        reason: Reason,
        *,
        retry_after: float,
        message: str,
        key: str | None = None,
        until: float | None = None,
    ) -> None:
        """Refuse every new request with 503 and a Retry-After until lifted (or until clock
        time ``until``, when given): e.g. ``Reason.FAIL_CLOSED`` (stale thresholds or unknown
        KV capacity under FailClosed) or ``Reason.GPU_MEMORY_LOW`` (the GPU safety net closed).

        Args:
            reason: the refusal reason reported.
            retry_after: seconds a refused client should wait (> 0); with ``until`` the
                remaining time is used instead.
            message: the explanation for error bodies.
            key: names this hold for :meth:`lift` (default: the reason's value), so holds from
                different sources do not lift each other.
            until: clock time at which the hold ends by itself; None = until lifted.

        While any hold is active, :meth:`pump` admits nobody from the queue: waiters stay until
        their deadline (then they are refused with the hold's 503) or until every hold is lifted.
        In-flight requests are not touched. Raises ``ValueError`` if ``retry_after`` ≤ 0.
        """
        name = key if key is not None else reason.value
        self._holds.put(name, Hold(reason, retry_after, message, until))

    def lift(self, key: str | Reason) -> bool:
        """End the hold named ``key`` (a key given to :meth:`hold`, or the reason it defaulted
        to). Returns whether one was active. Waiters are admitted on the next :meth:`pump`."""
        return self._holds.lift(key.value if isinstance(key, Reason) else key)

    def active_hold(self) -> Hold | None:
        """The hold that decides now: of all active holds, the one with the longest remaining
        wait (no request is admitted before every hold ends); None when admission is open.
        Holds past their ``until`` are forgotten."""
        if not self._holds:
            return None
        return self._holds.active(self.clock())

    def refused_whatever_the_prompt(self, req: AdmissionRequest) -> bool:
        """True when :meth:`submit` would refuse ``req`` now for a reason its prompt's size
        cannot change: an active hold (FailClosed, GPU memory low, ...), or its request-count
        rate limit under a policy that has neither Queue (for ``req``: a sheddable request is
        never queued) nor a fallback (model or pool) to serve it otherwise. A caller may then
        skip an exact prompt count (an engine round trip) and submit the estimate. False means
        "maybe admitted" (never a promise)."""
        if self.active_hold() is not None:
            return True
        return refused_by_count(self._limits, req, self.clock())

    # ------------------------------------------------------------------ submit

    def submit(self, req: AdmissionRequest) -> Decision:
        """Decide on one request now.

        1. A request that can never fit (cost above a bucket's full capacity, reservation above
           the KV capacity) has its max_tokens clamped if the policy has Degrade with
           ``minMaxTokens`` low enough; else, when its prompt was estimated
           (``req.prompt_tokens_min`` set and lower), it is decided on that lowest count; else
           it is refused with 400 (``param`` says what to change).
        2. If it fits now and nobody waits ahead for the same shared resources, it is admitted
           and its reservations are taken in this call.
        3. Otherwise the overload actions are tried in order: Degrade (clamp max_tokens to what
           fits now, not below ``minMaxTokens``, else the ``fallbackModel``), Queue (bounded; on
           timeout the actions after Queue apply), Reject (429 with Retry-After).

        Returns a :class:`Decision`: admitted/degraded with a ticket, rejected with status and
        Retry-After, or queued with a waiter (await it through the asyncio driver, or call
        :meth:`pump` and read ``waiter.decision``). ``req.max_tokens`` must be ≥ 1; it is
        lowered in place when clamped, and ``req.prompt_tokens`` when the lowest count decides.
        """
        now = self.clock()
        limits = self._limits
        cfg = limits.config
        if self._holds:
            h = self._holds.active(now)
            if h is not None:
                return h.refusal(now, req.max_tokens)
        clamped = False
        kv = limits.kv_tokens(req.prompt_tokens, req.max_tokens, req.n)
        cost = cfg.cost(req.prompt_tokens, req.n * req.max_tokens)
        if not limits.fits_ever(kv, cost):
            max_fit = limits.max_fit_ever(req)
            if max_fit is not None and req.max_tokens > max_fit:
                floor = cfg.min_max_tokens
                if not (_DEGRADE in cfg.actions and floor is not None and max_fit >= floor):
                    low = req.prompt_tokens_min
                    if low is not None and low < req.prompt_tokens:
                        # "Never fits" must not rest on a cautious estimate: decide on the
                        # prompt's lowest count (the server's reported usage settles the charge).
                        req.prompt_tokens, req.prompt_tokens_min = low, None
                        return self.submit(req)
                    return exceeds_capacity(limits, req, max_fit)
                req.max_tokens = max_fit
                clamped = True
                kv = limits.kv_tokens(req.prompt_tokens, max_fit, req.n)
                cost = cfg.cost(req.prompt_tokens, req.n * max_fit)
        self._ceiling.tick(now)
        q = self._queue
        if q.blocked_head is not None:
            self.pump()  # what was freed since the last pass goes to those who waited first
        found: list[BucketCharge] = []
        kv = limits.reservation(req, req.max_tokens)
        blocker = what_blocks(limits, req, req.max_tokens, now, found=found, kv=kv, cost=cost)
        if blocker is None and q.may_backfill():
            q.backfilled()  # (a no-op unless a head waits for a shared resource)
            ticket = limits.reserve(req, req.max_tokens, now, found=found, kv=kv)
            if clamped:
                return Decision(
                    Outcome.DEGRADED,
                    Reason.MAX_TOKENS_CLAMPED,
                    ticket=ticket,
                    max_tokens=req.max_tokens,
                )
            return Decision(_ADMITTED, _OK, ticket, req.max_tokens)
        if blocker is not None and blocker.reason is Reason.CONCURRENCY:
            self._slo.reached()
        return self._act(req, blocker, cfg.actions, now, clamped, 0.0)

    # ------------------------------------------------------------------ queue

    def _act(
        self,
        req: AdmissionRequest,
        blocker: Blocker | None,
        actions: tuple[str, ...],
        now: float,
        clamped: bool,
        waited: float,
    ) -> Decision:
        """The overload actions' decision for ``req`` (:func:`.overload.act`), queueing it when
        that is their answer."""
        d = act(self._r, req, blocker, actions, now, clamped, waited)
        if isinstance(d, Enqueue):
            if d.evict is not None:
                self._queue.evict(d.evict, evicted(self._r, d.evict, d.evict_reason, now))
            return self._enqueue(req, d.remaining, now, clamped, d.budget)
        return d

    def _enqueue(
        self,
        req: AdmissionRequest,
        remaining: tuple[str, ...],
        now: float,
        clamped: bool,
        budget: float | None,
    ) -> Decision:
        """Queue ``req`` until the policy's maximum wait, or its SLO's wait ``budget`` (seconds)
        when that is shorter."""
        max_wait = self._limits.config.queue_max_wait_seconds
        deadline = now + (max_wait if budget is None else min(max_wait, budget))
        w = self._queue.add(req, now, deadline, remaining or (_REJECT,), clamped)
        self.pump()
        if w.decision is not None:  # admitted at once: the caller gets it directly
            self._queue.unresolve(w)
            if w.decision.outcome is Outcome.QUEUED:
                w.decision.outcome = Outcome.ADMITTED  # it never waited
            return w.decision
        return Decision(Outcome.QUEUED, Reason.OK, waiter=w, max_tokens=req.max_tokens)

    def take_resolved(self) -> list[Waiter]:
        """Waiters that left the queue (``decision`` set) since the last call, in order."""
        return self._queue.take_resolved()

    def pump(self) -> None:
        """Move waiters out of the queue: expire those past their deadline (their remaining
        overload actions decide), admit those that fit now in queue order. Waiters whose
        ``decision`` got set are collected for :meth:`take_resolved`. A waiter blocked by a
        shared resource (the concurrency cap, KV, a pod-wide bucket) stops the scan so later
        ones cannot overtake it; one blocked only by its own tenant's bucket is skipped."""
        q = self._queue
        if not q:
            return  # (no blocked head either: it leaves with its waiter)
        now = self.clock()
        self._ceiling.tick(now)
        held = self._holds.active(now) if self._holds else None
        self._expire(now, held)
        if held is None:
            q.admit_fitting(now)  # (the head blocked at the last pass first)
        else:
            q.unblock()

    def _expire(self, now: float, held: Hold | None) -> None:
        """Decide on every waiter past its deadline: refused with ``held``'s 503 while a hold
        is active (no admission of any kind, not even degraded), else by its remaining overload
        actions (Degrade first, if the policy has it: having waited its turn, it may)."""
        q = self._queue
        actions_cfg = self._limits.config.actions
        for w in q.expired(now):
            q.remove(w)
            waited = now - w.enqueued_at
            if held is not None:
                d = held.refusal(now, w.request.max_tokens)
                d.message = f"timed out after {waited:.1f}s in the admission queue: {d.message}"
                d.queue_seconds = waited
                q.resolve(w, d)
                continue
            blocker = what_blocks(self._limits, w.request, w.request.max_tokens, now)
            actions = w.remaining_actions
            if _DEGRADE in actions_cfg and _DEGRADE not in actions:
                actions = (_DEGRADE, *actions)
            q.resolve(w, self._act(w.request, blocker, actions, now, w.clamped, max(waited, 1e-9)))

    def reject_waiting(self, reason: Reason, status: int, retry_after: float, message: str) -> None:
        """Refuse everybody still waiting (e.g. shutting down): each waiter's decision becomes
        a rejection with ``status`` and ``retry_after`` seconds, collected for
        :meth:`take_resolved`."""
        self._queue.reject_all(self.clock(), reason, status, retry_after, message)

    def cancel(self, waiter: Waiter) -> None:
        """Remove a waiter whose client went away. If it had already been admitted, the caller
        must :meth:`release` its ticket (this method does not, to keep ownership clear)."""
        self._queue.cancel(waiter)

    def next_wake(self) -> float | None:
        """Clock time at which :meth:`pump` should next run even if nothing is released: the
        earliest queue deadline or bucket refill a waiter needs, or the end of a hold that ends
        by itself (it lets waiters in); None when nobody waits."""
        t = self._queue.next_wake()
        if t is not None:
            end = self._holds.next_end()
            if end is not None:
                t = min(t, end)
        return t

    # ------------------------------------------------------------------ release

    def release(
        self,
        ticket: Ticket,
        *,
        completion_tokens: int,
        prompt_tokens: int | None = None,
        reached_upstream: bool = True,
    ) -> bool:
        """Release everything ``ticket`` holds and settle its buckets to real usage.

        Args:
            completion_tokens: output tokens actually produced (all choices).
            prompt_tokens: prompt tokens the server reported, if it did (else the estimate).
            reached_upstream: False when the request never reached the model server: then no
                request and no prompt tokens are charged.

        The cost bucket is refunded what was reserved but not used, or charged the excess (never
        below 0). A request that reached upstream and produced output also teaches the length
        predictor (a stream cut short, by the client or a timeout, is learned at the length it
        reached: what it held in the engine's KV) and the SLO state (its time in flight). Returns
        False (and does nothing) if the ticket was already released: release happens exactly once
        whatever path calls it.
        """
        if ticket.released:
            return False
        ticket.released = True
        now = self.clock()
        limits = self._limits
        slo = self._slo
        if reached_upstream:
            prompt = ticket.prompt_tokens if prompt_tokens is None else prompt_tokens
            limits.release(ticket, now, limits.config.cost(prompt, completion_tokens), 1.0)
            limits.fair.settle(ticket, prompt, completion_tokens)
            if completion_tokens > 0:
                self._speed.observe(now - ticket.admitted_at, completion_tokens)
                limits.learn(ticket, completion_tokens)
            slo.observe_departure(now - ticket.admitted_at)
        else:
            limits.release(ticket, now, 0.0, 0.0)
            limits.fair.settle(ticket, 0, 0)
        self._ceiling.tick(now)
        return True

    # ------------------------------------------------------------------ live correction

    def observe_tokens(self, ticket: Ticket, generated: int) -> None:
        """``ticket``'s request has produced ``generated`` output tokens so far (all choices), as
        its stream passes. Measures the time to first token and between tokens (the adaptive
        limit's input, :mod:`.slo`) and grows a predicted reservation block by block once the
        sequence outgrows it (never past prompt + n x max_tokens). O(1); a no-op after release
        or when ``generated`` did not increase."""
        prev = ticket.generated
        if ticket.released or generated <= prev:
            return
        now = self.clock()
        last = ticket.last_token_at
        if last is None:
            self._slo.observe_first_token(now - ticket.admitted_at)
        else:
            self._slo.observe_gap(now - last, (generated - prev) / ticket.n)
        ticket.generated = generated
        ticket.last_token_at = now
        self._limits.fair.observe_output(ticket, generated)
        if ticket.prompt_tokens + generated >= ticket.kv_tokens:
            self._limits.grow(ticket, generated)
        self._ceiling.tick(now)

    def observe_engine_kv(self, used_tokens: int | None) -> None:
        """The engine reports ``used_tokens`` KV tokens in use (None: unknown). Where that is
        more than kvgate has reserved (plus headroom), admission counts the engine's figure,
        for :data:`~kvgate_agent.admission.limits.ENGINE_KV_TTL_S` seconds from now."""
        self._limits.engine_kv_used = used_tokens
        self._limits.engine_kv_until = self.clock() + ENGINE_KV_TTL_S
