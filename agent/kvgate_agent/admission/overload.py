"""The overload actions of the admission controller: Degrade, Queue, Reject, and the 400 for a
request that can never fit.

:class:`OverloadActions` is a mixin of the :class:`AdmissionController` (the state it reads is
the controller's); it is split out so each module keeps one job. The
actions are tried in the policy's order; a request under a TTFT SLO (``slo.ttftSeconds``) whose
expected queue wait already exceeds its wait budget skips Queue and is refused with that wait as
its Retry-After (:mod:`.slo`).

Invariant: pure and clock-injected, like the controller; a reservation is taken only after
:meth:`~kvgate_agent.admission.limits.Limits.blocker` found that it fits, in the same call.
"""

from __future__ import annotations

from kvgate_agent.admission.decision import AdmissionRequest, Decision, Outcome, Reason, Waiter
from kvgate_agent.admission.limits import Blocker, Limits
from kvgate_agent.admission.retry import DecodeSpeed, refusal, wait_seconds
from kvgate_agent.admission.slo import SHED_FACTOR, SloState
from kvgate_agent.contract.policy import OverloadAction, QueueOrder

_DEGRADE = OverloadAction.DEGRADE.value
_QUEUE = OverloadAction.QUEUE.value


class OverloadActions:
    """What to do with a request that does not fit now (see the module docstring)."""

    _limits: Limits
    _queue: dict[int, Waiter]
    _slo: SloState
    _speed: DecodeSpeed
    _head_blocked_shared: bool
    _waiting_by_priority: dict[int, int]

    def _enqueue(
        self,
        req: AdmissionRequest,
        remaining: tuple[str, ...],
        now: float,
        clamped: bool,
        budget: float | None = None,
    ) -> Decision:
        raise NotImplementedError

    def _head_blocker(self, now: float) -> Blocker | None:
        raise NotImplementedError

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
        slo_wait: float | None = None
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
                budget = self._wait_budget(req)
                if budget is not None:
                    expected = self._expected_wait(req, blocker, now)
                    if expected is not None and expected > budget * SHED_FACTOR:
                        slo_wait = expected
                        continue
                return self._enqueue(req, actions[i + 1 :], now, clamped, budget)
            else:
                break
        return self._reject(req, blocker, now, waited, queue_full, slo_wait)

    def _expected_wait(
        self, req: AdmissionRequest, blocker: Blocker | None, now: float
    ) -> float | None:
        """Seconds ``req`` would wait in the queue: its own bucket's refill time when only that
        blocks it, else the drain time of the waiters ahead (:meth:`SloState.expected_wait`;
        under Priority order only those of at least its priority are ahead; the engine's own
        waiting requests are ahead of all). O(distinct priorities waiting)."""
        if blocker is not None and blocker.tenant_scoped and blocker.bucket is not None:
            return blocker.bucket.seconds_until(blocker.amount, now)
        ahead = len(self._queue)
        if self._limits.config.queue_order is QueueOrder.PRIORITY:
            ahead = sum(n for p, n in self._waiting_by_priority.items() if p >= req.priority)
        return self._slo.expected_wait(ahead, self._limits.in_flight, now)

    def _wait_budget(self, req: AdmissionRequest) -> float | None:
        """Seconds ``req`` may wait under its TTFT SLO; None when no TTFT SLO applies to it."""
        if req.priority < self._limits.config.slo_min_priority:
            return None
        return self._slo.wait_budget()

    def _degrade(
        self, req: AdmissionRequest, blocker: Blocker | None, now: float, waited: float
    ) -> Decision | None:
        """Admit ``req`` degraded if the policy allows: max_tokens clamped to what fits now
        (not below ``minMaxTokens``), else the fallback model, else send it to the fallback
        pool; None when none applies."""
        if blocker is None:
            return None
        if not (waited == 0 and self._queue and self._head_blocked_shared):
            # (Else others already wait for the same capacity: a newcomer must not take it
            # first, not even a degraded one; another pool's capacity is not theirs.)
            local = self._degrade_here(req, blocker, now, waited)
            if local is not None:
                return local
        pool = self._limits.config.fallback_pool_model
        if (
            pool is not None
            and req.model_rewritable
            and not req.degraded
            and blocker.reason in _POOL_REASONS
        ):
            d = Decision(Outcome.DEGRADED, Reason.FALLBACK_POOL, max_tokens=req.max_tokens)
            d.model = pool
            d.limit = blocker.limit
            d.queue_seconds = waited
            d.refusal = self._reject(req, blocker, now, waited)
            return d
        return None

    def _degrade_here(
        self, req: AdmissionRequest, blocker: Blocker, now: float, waited: float
    ) -> Decision | None:
        """Admit ``req`` degraded on this pod: max_tokens clamped (1.), or the fallback model
        on the same server (2.); None when neither applies."""
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
            and req.model_rewritable
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
        slo_wait: float | None = None,
    ) -> Decision:
        """The 429 for ``req``, its Retry-After from the blocking resource's refill or drain
        time (or the expected queue wait, when that is what refused it) and, for a rate limit,
        the refusing bucket's state for the RateLimit headers."""
        if blocker is None:
            blocker = self._head_blocker(now) or Blocker(Reason.QUEUE_FULL, "queue")
        if slo_wait is not None:
            wait = slo_wait
        else:
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
        elif slo_wait is not None:
            reason = Reason.SLO
            message = (
                f"the expected queue wait ({slo_wait:.2f}s) exceeds the time-to-first-token SLO: "
                f"{message}"
            )
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


#: What may send a request to the fallback pool: this pod's capacity (KV, concurrency) or the
#: tenant's budget here. A queue that is full or timed out, SLO shedding and fail-closed refuse
#: as before (the pool's own sidecar applies its own admission to what it receives).
_POOL_REASONS = frozenset(
    (
        Reason.KV_CAPACITY,
        Reason.CONCURRENCY,
        Reason.RATE_LIMIT_REQUESTS,
        Reason.RATE_LIMIT_TOKENS,
    )
)

_REFUSAL_TEXT = {
    Reason.RATE_LIMIT_REQUESTS: "request rate limit '{limit}' exceeded",
    Reason.RATE_LIMIT_TOKENS: "token rate limit '{limit}' exceeded",
    Reason.CONCURRENCY: "the model server is at its concurrency limit",
    Reason.KV_CAPACITY: "the model server's KV cache is fully reserved",
    Reason.QUEUE_FULL: "requests are waiting ahead for the same capacity",
}
