"""The admission controller of one pod: admit each request now, queue it, degrade it or refuse it.

It composes the limit bookkeeping (:mod:`.limits`), the holds (:mod:`.holds`) and the
Retry-After computation (:mod:`.retry`) with the wait queue and the policy's overload actions
(Degrade, Queue, Reject, in the policy's order). A request that can never fit is refused with 400
at once, never told to retry (https://github.com/bucket4j/bucket4j/issues/220).

Invariant: pure and clock-injected (no I/O, no asyncio); every public method runs to completion
without yielding, so a check and its reservation are atomic on one event loop. The asyncio side
is :mod:`kvgate_agent.admission.waiting`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

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
from kvgate_agent.admission.holds import Hold, Holds
from kvgate_agent.admission.limits import Blocker, Limits
from kvgate_agent.admission.retry import DecodeSpeed, refusal, wait_seconds
from kvgate_agent.contract.policy import OverloadAction, QueueOrder

Clock = Callable[[], float]

# Enum members bound once: attribute access on an Enum class is slow on the hot path.
_ADMITTED = Outcome.ADMITTED
_OK = Reason.OK
_DEGRADE = OverloadAction.DEGRADE.value
_QUEUE = OverloadAction.QUEUE.value
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
        self._queue: dict[int, Waiter] = {}
        self._seq = 0
        self._head_blocked_shared = False
        self._resolved: list[Waiter] = []
        self._aging_rate = _aging_rate(config)

    # ------------------------------------------------------------------ observation

    @property
    def config(self) -> AdmissionConfig:
        """The thresholds enforced now."""
        return self._limits.config

    @property
    def in_flight(self) -> int:
        """Admitted requests not yet released."""
        return self._limits.in_flight

    @property
    def kv_reserved_tokens(self) -> int:
        """KV tokens reserved by the requests in flight (block-rounded)."""
        return self._limits.kv_reserved_tokens

    @property
    def seconds_per_token(self) -> float:
        """Observed decode time per output token, seconds (the drain estimate's speed)."""
        return self._speed.seconds_per_token

    @property
    def queue_length(self) -> int:
        """Requests waiting now."""
        return len(self._queue)

    @property
    def kv_capacity_tokens(self) -> int | None:
        """KV capacity enforced, tokens (None: not enforced)."""
        return self._limits.config.kv_capacity_tokens

    def bucket_levels(self) -> list[tuple[str, str, str, float, float]]:
        """(limit name, unit, key, level, capacity) for every bucket held in memory now.
        ``unit`` is ``requests`` or ``cost``; ``key`` is the tenant, or "" for pod-wide buckets."""
        return self._limits.bucket_levels(self.clock())

    def tenants_tracked(self) -> int:
        """Number of tenant buckets held in memory (bounded by ``max_tenants`` per limit)."""
        return self._limits.tenants_tracked()

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
        on the next :meth:`pump` (``AsyncAdmission.kick``); nothing is decided here.
        """
        self._limits.reconfigure(config, self.clock())
        self._aging_rate = _aging_rate(config)

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

    # ------------------------------------------------------------------ submit

    def submit(self, req: AdmissionRequest) -> Decision:
        """Decide on one request now.

        1. A request that can never fit (cost above a bucket's full capacity, reservation above
           the KV capacity) has its max_tokens clamped if the policy has Degrade with
           ``minMaxTokens`` low enough, else is refused with 400 (``param`` says what to change).
        2. If it fits now and nobody waits ahead for the same shared resources, it is admitted
           and its reservations are taken in this call.
        3. Otherwise the overload actions are tried in order: Degrade (clamp max_tokens to what
           fits now, not below ``minMaxTokens``, else the ``fallbackModel``), Queue (bounded; on
           timeout the actions after Queue apply), Reject (429 with Retry-After).

        Returns a :class:`Decision`: admitted/degraded with a ticket, rejected with status and
        Retry-After, or queued with a waiter (await it through the asyncio driver, or call
        :meth:`pump` and read ``waiter.decision``). ``req.max_tokens`` must be ≥ 1; it is
        lowered in place when clamped.
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
                    return self._exceeds_capacity(req, max_fit)
                req.max_tokens = max_fit
                clamped = True
                kv = limits.kv_tokens(req.prompt_tokens, max_fit, req.n)
                cost = cfg.cost(req.prompt_tokens, req.n * max_fit)
        found: list[BucketCharge] = []
        blocker = limits.blocker(req, req.max_tokens, now, found=found, kv=kv, cost=cost)
        if blocker is None and not (self._queue and self._head_blocked_shared):
            ticket = limits.reserve(req, req.max_tokens, now, found=found, kv=kv)
            if clamped:
                return Decision(
                    Outcome.DEGRADED,
                    Reason.MAX_TOKENS_CLAMPED,
                    ticket=ticket,
                    max_tokens=req.max_tokens,
                )
            return Decision(_ADMITTED, _OK, ticket, req.max_tokens)
        return self._overload(req, blocker, cfg.actions, now, clamped, 0.0)

    def _exceeds_capacity(self, req: AdmissionRequest, max_fit: int) -> Decision:
        """The 400 for a request that can never fit (no Retry-After: waiting cannot help)."""
        fix = f"lower max_tokens to at most {max_fit}" if max_fit >= 1 else "shorten the prompt"
        d = refusal(
            Reason.EXCEEDS_CAPACITY,
            self._limits.exceeding_limit(req),
            400,
            None,
            req.max_tokens,
            f"request needs more than this server's capacity allows "
            f"(prompt {req.prompt_tokens} tokens + max_tokens {req.max_tokens}"
            + ("" if req.n == 1 else f" × n {req.n}")
            + f"); {fix}",
        )
        d.param = "max_tokens" if max_fit >= 1 else "prompt"
        return d

    # ------------------------------------------------------------------ overload actions

    def _overload(
        self,
        req: AdmissionRequest,
        blocker: Blocker | None,
        actions: tuple[str, ...],
        now: float,
        clamped: bool,
        waited: float,
    ) -> Decision:
        """Try the overload actions in order. ``blocker`` None means "fits, but others wait
        ahead for the same resources"."""
        queue_full = False
        for i, action in enumerate(actions):
            if action == _DEGRADE:
                d = self._degrade(req, blocker, now, waited)
                if d is not None:
                    return d
            elif action == _QUEUE:
                if req.priority < 0 or waited > 0:  # sheddable, or already timed out once
                    continue
                if len(self._queue) >= self._limits.config.queue_max_length:
                    queue_full = True
                    continue
                return self._enqueue(req, actions[i + 1 :], now, clamped)
            else:
                break
        return self._reject(req, blocker, now, waited, queue_full)

    def _degrade(
        self, req: AdmissionRequest, blocker: Blocker | None, now: float, waited: float
    ) -> Decision | None:
        """Admit ``req`` degraded if the policy allows: max_tokens clamped to what fits now
        (not below ``minMaxTokens``), else the fallback model; None when neither applies."""
        if blocker is None:
            return None
        if waited == 0 and self._queue and self._head_blocked_shared:
            # Others already wait for the same capacity: a newcomer must not take it first,
            # not even a degraded one.
            return None
        limits = self._limits
        cfg = limits.config
        # 1. Clamp max_tokens to what fits now (not below minMaxTokens).
        if cfg.min_max_tokens is not None and blocker.reason in (
            Reason.KV_CAPACITY,
            Reason.RATE_LIMIT_TOKENS,
        ):
            m = limits.max_fit_now(req, now)
            if (
                m is not None
                and cfg.min_max_tokens <= m < req.max_tokens
                and limits.blocker(req, m, now) is None
            ):
                req.max_tokens = m
                ticket = limits.reserve(req, m, now)
                return Decision(
                    Outcome.DEGRADED,
                    Reason.MAX_TOKENS_CLAMPED,
                    ticket=ticket,
                    max_tokens=m,
                    queue_seconds=waited,
                    limit=blocker.limit,
                )
        # 2. Serve a tenant over its rate limit with the fallback model: rate-limit buckets are
        #    skipped, the GPU protections (concurrency, KV) still apply.
        if (
            cfg.fallback_model is not None
            and req.model != cfg.fallback_model
            and blocker.reason in (Reason.RATE_LIMIT_REQUESTS, Reason.RATE_LIMIT_TOKENS)
            and limits.blocker(req, req.max_tokens, now, with_buckets=False) is None
        ):
            ticket = limits.reserve(req, req.max_tokens, now, with_buckets=False)
            return Decision(
                Outcome.DEGRADED,
                Reason.FALLBACK_MODEL,
                ticket=ticket,
                max_tokens=req.max_tokens,
                model=cfg.fallback_model,
                queue_seconds=waited,
                limit=blocker.limit,
            )
        return None

    def _reject(
        self,
        req: AdmissionRequest,
        blocker: Blocker | None,
        now: float,
        waited: float,
        queue_full: bool = False,
    ) -> Decision:
        """The 429 for ``req``, its Retry-After from the blocking resource's refill or drain
        time and, for a rate limit, the refusing bucket's state for the RateLimit headers."""
        if blocker is None:
            blocker = self._head_blocker(now) or Blocker(Reason.QUEUE_FULL, "queue")
        wait = wait_seconds(
            req, blocker, now, self._limits, self._queue.values(), self._speed.seconds_per_token
        )
        message = _REFUSAL_TEXT[blocker.reason].format(limit=blocker.limit)
        reason = blocker.reason
        if waited > 0:
            reason = Reason.QUEUE_TIMEOUT
            message = f"timed out after {waited:.1f}s in the admission queue: {message}"
        elif req.priority < 0 and _QUEUE in self._limits.config.actions:
            reason = Reason.SHEDDABLE
            message = f"sheddable request (negative priority) not queued: {message}"
        elif queue_full:
            reason = Reason.QUEUE_FULL
            message = f"the admission queue is full: {message}"
        d = refusal(reason, blocker.limit, 429, wait, req.max_tokens, message)
        d.queue_seconds = waited
        if blocker.bucket is not None and blocker.threshold is not None:
            t = blocker.threshold
            cost_unit = blocker.reason is Reason.RATE_LIMIT_TOKENS
            d.bucket_remaining = blocker.bucket.refill(now)
            d.bucket_capacity = blocker.bucket.capacity
            rate = t.cost_rate if cost_unit else t.request_rate
            d.bucket_window = 60.0 if rate is None else blocker.bucket.capacity / rate
            d.unit = "tokens" if cost_unit else "requests"
        return d

    # ------------------------------------------------------------------ queue

    def _enqueue(
        self, req: AdmissionRequest, remaining: tuple[str, ...], now: float, clamped: bool
    ) -> Decision:
        self._seq += 1
        w = Waiter(
            req,
            self._seq,
            now,
            now + self._limits.config.queue_max_wait_seconds,
            self._limits.kv_tokens(req.prompt_tokens, req.max_tokens, req.n),
            remaining or (_REJECT,),
            clamped,
        )
        self._queue[w.seq] = w
        self.pump()
        if w.decision is not None:  # admitted at once: the caller gets it directly
            self._resolved.remove(w)
            if w.decision.outcome is Outcome.QUEUED:
                w.decision.outcome = Outcome.ADMITTED  # it never waited
            return w.decision
        return Decision(Outcome.QUEUED, Reason.OK, waiter=w, max_tokens=req.max_tokens)

    def _ordered(self, now: float) -> list[Waiter]:
        waiters = list(self._queue.values())
        order = self._limits.config.queue_order
        if order is QueueOrder.PRIORITY:
            waiters.sort(key=lambda w: (-w.request.priority, w.seq))
        elif order is QueueOrder.SHORTEST_FIRST:
            rate = self._aging_rate
            waiters.sort(key=lambda w: (w.kv_tokens - (now - w.enqueued_at) * rate, w.seq))
        return waiters

    def _head_blocker(self, now: float) -> Blocker | None:
        for w in self._ordered(now):
            b = self._limits.blocker(w.request, w.request.max_tokens, now)
            if b is not None and not b.tenant_scoped:
                return b
        return None

    def take_resolved(self) -> list[Waiter]:
        """Waiters that left the queue (``decision`` set) since the last call, in order."""
        done, self._resolved = self._resolved, []
        return done

    def pump(self) -> None:
        """Move waiters out of the queue: expire those past their deadline (their remaining
        overload actions decide), admit those that fit now in queue order. Waiters whose
        ``decision`` got set are collected for :meth:`take_resolved`. A waiter blocked by a
        shared resource (the concurrency cap, KV, a pod-wide bucket) stops the scan so later
        ones cannot overtake it; one blocked only by its own tenant's bucket is skipped."""
        if not self._queue:
            self._head_blocked_shared = False
            return
        now = self.clock()
        held = self._holds.active(now) if self._holds else None
        self._expire(now, held)
        self._head_blocked_shared = False
        if held is None:
            self._admit_waiting(now)

    def _expire(self, now: float, held: Hold | None) -> None:
        """Decide on every waiter past its deadline: refused with ``held``'s 503 while a hold
        is active (no admission of any kind, not even degraded), else by its remaining overload
        actions (Degrade first, if the policy has it: having waited its turn, it may)."""
        actions_cfg = self._limits.config.actions
        for w in [w for w in self._queue.values() if now >= w.deadline]:
            del self._queue[w.seq]
            waited = now - w.enqueued_at
            if held is not None:
                d = held.refusal(now, w.request.max_tokens)
                d.message = f"timed out after {waited:.1f}s in the admission queue: {d.message}"
                d.queue_seconds = waited
                w.decision = d
                self._resolved.append(w)
                continue
            blocker = self._limits.blocker(w.request, w.request.max_tokens, now)
            actions = w.remaining_actions
            if _DEGRADE in actions_cfg and _DEGRADE not in actions:
                actions = (_DEGRADE, *actions)
            w.decision = self._overload(
                w.request, blocker, actions, now, w.clamped, max(waited, 1e-9)
            )
            self._resolved.append(w)

    def _admit_waiting(self, now: float) -> None:
        """Admit the waiters that fit now, in queue order, until one blocked by a shared
        resource (see :meth:`pump`)."""
        limits = self._limits
        waiters = iter(self._ordered(now))
        for w in waiters:
            b = limits.blocker(w.request, w.request.max_tokens, now)
            if b is None:
                del self._queue[w.seq]
                ticket = limits.reserve(w.request, w.request.max_tokens, now)
                outcome = Outcome.DEGRADED if w.clamped else Outcome.QUEUED
                reason = Reason.MAX_TOKENS_CLAMPED if w.clamped else Reason.OK
                w.decision = Decision(
                    outcome,
                    reason,
                    ticket=ticket,
                    max_tokens=w.request.max_tokens,
                    queue_seconds=now - w.enqueued_at,
                )
                self._resolved.append(w)
                continue
            w.retry_at = (
                None if b.bucket is None else now + max(1e-3, b.bucket.seconds_until(b.amount, now))
            )
            if not b.tenant_scoped:
                self._head_blocked_shared = True
                # Those behind it cannot go first, whatever their own bucket says: a release
                # pumps again. A refill time left from an earlier pass would be in the past and
                # make next_wake() ask for a pump at once, again and again.
                for behind in waiters:
                    behind.retry_at = None
                break

    def reject_waiting(self, reason: Reason, status: int, retry_after: float, message: str) -> None:
        """Refuse everybody still waiting (e.g. shutting down): each waiter's decision becomes
        a rejection with ``status`` and ``retry_after`` seconds, collected for
        :meth:`take_resolved`."""
        now = self.clock()
        for w in list(self._queue.values()):
            del self._queue[w.seq]
            d = refusal(reason, "queue", status, retry_after, w.request.max_tokens, message)
            d.queue_seconds = now - w.enqueued_at
            w.decision = d
            self._resolved.append(w)
        self._head_blocked_shared = False

    def cancel(self, waiter: Waiter) -> None:
        """Remove a waiter whose client went away. If it had already been admitted, the caller
        must :meth:`release` its ticket (this method does not, to keep ownership clear)."""
        if self._queue.pop(waiter.seq, None) is not None and not self._queue:
            self._head_blocked_shared = False

    def next_wake(self) -> float | None:
        """Clock time at which :meth:`pump` should next run even if nothing is released: the
        earliest queue deadline or bucket refill a waiter needs, or the end of a hold that ends
        by itself (it lets waiters in); None when nobody waits."""
        t: float | None = None
        for w in self._queue.values():
            c = w.deadline if w.retry_at is None else min(w.deadline, w.retry_at)
            t = c if t is None else min(t, c)
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
        below 0). Returns False (and does nothing) if the ticket was already released: release
        happens exactly once whatever path calls it.
        """
        if ticket.released:
            return False
        ticket.released = True
        now = self.clock()
        limits = self._limits
        if reached_upstream:
            prompt = ticket.prompt_tokens if prompt_tokens is None else prompt_tokens
            limits.release(ticket, now, limits.config.cost(prompt, completion_tokens), 1.0)
            if completion_tokens > 0:
                self._speed.observe(now - ticket.admitted_at, completion_tokens)
        else:
            limits.release(ticket, now, 0.0, 0.0)
        return True

    def observe_tokens(self, ticket: Ticket, generated: int) -> None:
        """Live correction: ``generated`` output tokens (all choices) produced so far by
        ``ticket``'s request, as its stream passes. O(1); a no-op after release."""
        return None  # lead replaces


def _aging_rate(config: AdmissionConfig) -> float:
    """ShortestFirst aging, KV tokens per second: after half the maximum wait, a waiting
    request outranks any new one."""
    ref = config.max_model_len or config.kv_capacity_tokens or 8192
    return ref / max(1e-3, config.queue_max_wait_seconds / 2)


_REFUSAL_TEXT = {
    Reason.RATE_LIMIT_REQUESTS: "request rate limit '{limit}' exceeded",
    Reason.RATE_LIMIT_TOKENS: "token rate limit '{limit}' exceeded",
    Reason.CONCURRENCY: "the model server is at its concurrency limit",
    Reason.KV_CAPACITY: "the model server's KV cache is fully reserved",
    Reason.QUEUE_FULL: "requests are waiting ahead for the same capacity",
}
