"""The admission controller of one pod: admit each request now, queue it, degrade it or refuse it.

It composes the limit bookkeeping (:mod:`.limits`, asked what stops a request through
:func:`.fairqueue.what_blocks`), the holds (:mod:`.holds`, public as :attr:`holds`), the fair
queue (:mod:`.fairqueue`'s wait queue) and its driving (:mod:`.waiting`), the concurrency ceiling
(:mod:`.ceiling`), the live corrections (:mod:`.live`, public as :attr:`live`) and the policy's
overload actions (:mod:`.overload`: Degrade, Queue, Reject, in the policy's order, with
Retry-After from :mod:`.retry`). A request that can never fit is refused with 400 at once, never
told to retry (https://github.com/bucket4j/bucket4j/issues/220).

Invariant: pure and clock-injected (no I/O, no asyncio); every public method runs to completion
without yielding, so a check and its reservation are atomic on one event loop. The asyncio side
is :mod:`kvgate_agent.admission.async_admission`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final

from kvgate_agent.admission.bucket import BucketMap, SharedBucket
from kvgate_agent.admission.ceiling import ConcurrencyCeiling
from kvgate_agent.admission.config import AdmissionConfig
from kvgate_agent.admission.decision import (
    AdmissionRequest,
    BucketCharge,
    Decision,
    Outcome,
    Reason,
    Ticket,
    Waiter,
)
from kvgate_agent.admission.fairqueue import PoolShare, WaitQueue, what_blocks
from kvgate_agent.admission.holds import Hold, Holds
from kvgate_agent.admission.limits import Limits, expect_prefix, settle_prefix
from kvgate_agent.admission.live import LiveCorrection
from kvgate_agent.admission.overload import (
    Resources,
    exceeds_capacity,
    refused_by_count,
)
from kvgate_agent.admission.retry import DecodeSpeed
from kvgate_agent.admission.slo import SloState
from kvgate_agent.admission.stats import AdmissionStats, TenantStats
from kvgate_agent.admission.waiting import Waiting
from kvgate_agent.contract.policy import OverloadAction

Clock = Callable[[], float]

# Enum members bound once: attribute access on an Enum class is slow on the hot path.
_ADMITTED: Final = Outcome.ADMITTED
_OK: Final = Reason.OK
_DEGRADE: Final = OverloadAction.DEGRADE.value
#: Output tokens (per choice) a streamed request needs before its TPOT is learned.
MIN_TPOT_TOKENS: Final = 5


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
        #: The holds: stops on every new admission (:meth:`Holds.hold`, :meth:`Holds.lift`).
        self.holds = Holds()
        self._speed = DecodeSpeed()
        self._queue = WaitQueue(self._limits)
        self._slo = SloState(
            config.tpot_slo_seconds,
            config.ttft_slo_seconds,
            config.max_concurrency,
            self.started_at,
        )
        self._ceiling = ConcurrencyCeiling(self._limits, self._slo)
        #: What the streams and the engine report while requests run (:mod:`.live`).
        self.live = LiveCorrection(self._limits, self._slo, self._ceiling, clock)
        r = Resources(self._limits, self._queue, self._slo, self._speed)
        #: The queue side: queueing, the passes over the queue, the next wake (:mod:`.waiting`).
        self._waiting = Waiting(r, self.holds, self._ceiling, clock)
        # The queue's wake cycle (pump, take the decisions, ask when to pump next) is asked of
        # the objects that know, handed out here rather than forwarded.
        #: Move waiters out of the queue now (:meth:`Waiting.pump`); their decisions are
        #: collected for :attr:`take_resolved`.
        self.pump: Callable[[], None] = self._waiting.pump
        #: Waiters that left the queue (``decision`` set) since the last call, in order
        #: (:meth:`WaitQueue.take_resolved`).
        self.take_resolved: Callable[[], list[Waiter]] = self._queue.take_resolved
        #: Clock time at which :attr:`pump` should next run even if nothing is released: a
        #: queue deadline, a bucket refill or the end of a hold (:meth:`Waiting.next_wake`);
        #: None when nobody waits.
        self.next_wake: Callable[[], float | None] = self._waiting.next_wake

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

    def reconfigure(self, config: AdmissionConfig) -> None:
        """Enforce new thresholds from now on without dropping in-flight work.

        Admitted tickets, their KV reservations, ``in_flight`` and the wait queue all stay. A
        rate limit whose name and ``per`` scope are unchanged keeps its buckets (the very
        objects tickets hold): their capacity and rate (units, units per second) change in
        place and each level is carried over, clamped to the new capacity. New limits start
        with fresh (full) buckets; removed limits are dropped, and tickets still holding their
        buckets release into them harmlessly. A new KV capacity or concurrency cap below what
        is already reserved admits nothing until enough is released. Waiters are re-examined
        on the next :attr:`pump` (``AsyncAdmission`` runs it at once); nothing is decided here.
        """
        self._limits.reconfigure(config, self.clock())
        self._queue.retune(config)
        self._ceiling.retune(config)

    def attach_store(self) -> None:
        """Hold shared limits as slices of fleet-wide budgets (see
        :class:`~kvgate_agent.admission.lease.LeaseBook`), from now on and across
        :meth:`reconfigure`."""
        self._limits.rates.attach_store(self.clock())

    def attach_pool(self, pool: PoolShare) -> None:
        """Decide with the pool's view of the tenants' service on other replicas from now on
        (:class:`~kvgate_agent.admission.fairqueue.PoolShare`: the order and the fair reserve
        read it); the caller keeps it synced (:meth:`pool_synced`)."""
        self._limits.fair.pool = pool

    def pool_synced(self, remote: dict[str, float]) -> None:
        """The pool's sums were read: add ``remote`` (weighted units per tenant got on other
        replicas, from :meth:`PoolShare.update`) to the counters here. Waiters are re-examined
        on the next :attr:`pump`."""
        self._limits.fair.pool_synced(remote)

    def shared_maps(self) -> list[tuple[str, str, BucketMap]]:
        """(limit, unit, bucket map) of the limits held as fleet-wide slices."""
        return self._limits.rates.shared_maps()

    def take_retired_slices(self) -> list[tuple[str, SharedBucket]]:
        """(``limit:unit:tenant``, slice) of shared limits removed since the last call, still
        holding or owing units (for a final hand-back to the store)."""
        out, self._limits.rates.retired = self._limits.rates.retired, []
        return out

    def active_hold(self) -> Hold | None:
        """The hold that decides now: of all active holds, the one with the longest remaining
        wait (no request is admitted before every hold ends); None when admission is open.
        Holds past their ``until`` are forgotten."""
        if not self.holds:
            return None
        return self.holds.active(self.clock())

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
        :attr:`pump` and read ``waiter.decision``). ``req.max_tokens`` must be ≥ 1; it is
        lowered in place when clamped, and ``req.prompt_tokens`` when the lowest count decides.
        """
        now = self.clock()
        limits = self._limits
        cfg = limits.config
        if self.holds:
            h = self.holds.active(now)
            if h is not None:
                return h.refusal(now, req.max_tokens)
        clamped = False
        if req.prefix_blocks is not None:
            expect_prefix(limits, req)
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
            self._waiting.pump()  # what was freed since the last pass goes to who waited first
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
        return self._waiting.act(req, blocker, cfg.actions, now, clamped, 0.0)

    # ------------------------------------------------------------------ queue
    # (pump, take_resolved and next_wake: the queue side's own, bound in __init__)

    def reject_waiting(self, reason: Reason, status: int, retry_after: float, message: str) -> None:
        """Refuse everybody still waiting (e.g. shutting down): each waiter's decision becomes
        a rejection with ``status`` and ``retry_after`` seconds, collected for
        :attr:`take_resolved`."""
        self._queue.reject_all(self.clock(), reason, status, retry_after, message)

    def cancel(self, waiter: Waiter) -> None:
        """Remove a waiter whose client went away. If it had already been admitted, the caller
        must :meth:`release` its ticket (this method does not, to keep ownership clear)."""
        self._queue.cancel(waiter)

    # ------------------------------------------------------------------ release

    def release(
        self,
        ticket: Ticket,
        *,
        completion_tokens: int,
        prompt_tokens: int | None = None,
        reached_upstream: bool = True,
        cached_tokens: int | None = None,
    ) -> bool:
        """Release everything ``ticket`` holds and settle its buckets to real usage.

        Args:
            completion_tokens: output tokens actually produced (all choices).
            prompt_tokens: prompt tokens the server reported, if it did (else the estimate).
            reached_upstream: False when the request never reached the model server: then no
                request and no prompt tokens are charged.
            cached_tokens: prompt tokens the server reported found in its prefix cache, if it
                did (else the cached prefix expected at admission, 0 without one): the
                fair-share counter is charged the rest of the prompt, and the report confirms
                the prefix index (:mod:`.prefix_index`).

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
            cached = settle_prefix(limits, ticket, cached_tokens)
            limits.fair.settle(ticket, prompt - cached, completion_tokens)
            if completion_tokens > 0:
                self._speed.observe(now - ticket.admitted_at, completion_tokens)
                limits.learn(ticket, completion_tokens, cached)
            slo.observe_departure(now - ticket.admitted_at)
            first, last = ticket.first_token_at, ticket.last_token_at
            per_choice = ticket.generated // ticket.n
            if first is not None and last is not None and per_choice >= MIN_TPOT_TOKENS:
                decode = last - first
                if decode > 0.0:
                    mean_n = ticket.inflight_seconds / decode
                    slo.observe_completion(mean_n, decode / (per_choice - 1), now)
        else:
            limits.release(ticket, now, 0.0, 0.0)
            limits.fair.settle(ticket, 0, 0)
        self._ceiling.tick(now)
        return True
