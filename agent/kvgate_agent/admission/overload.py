"""The overload actions of the admission controller: Degrade, Queue, Reject, and the 400 for a
request that can never fit.

Plain functions over one pod's :class:`Resources` (its limits, wait queue, SLO state and decode
speed). The actions are tried in the policy's order; a request under a TTFT SLO
(``slo.ttftSeconds``) whose expected queue wait already exceeds its wait budget skips Queue and
is refused with that wait as its Retry-After (:mod:`.slo`). Queue itself is not done here:
:func:`act` answers :class:`Enqueue` and the controller queues the request.

Invariant: pure and clock-injected, like the controller; a reservation is taken only after
:func:`~kvgate_agent.admission.fairqueue.what_blocks` found that it fits, in the same call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

from kvgate_agent.admission.decision import (
    AdmissionRequest,
    Blocker,
    Decision,
    Outcome,
    Reason,
    Waiter,
)
from kvgate_agent.admission.fairqueue import WaitQueue, what_blocks
from kvgate_agent.admission.limits import Limits
from kvgate_agent.admission.retry import DecodeSpeed, refusal, wait_seconds
from kvgate_agent.admission.slo import SHED_FACTOR, SloState
from kvgate_agent.contract.policy import OverloadAction

_DEGRADE: Final = OverloadAction.DEGRADE.value
_QUEUE: Final = OverloadAction.QUEUE.value


@dataclass(frozen=True, slots=True)
class Resources:
    """What the overload actions read and reserve from: one pod's admission state."""

    limits: Limits
    queue: WaitQueue
    slo: SloState
    speed: DecodeSpeed


@dataclass(frozen=True, slots=True)
class Enqueue:
    """The Queue action's answer: queue the request, with the actions after Queue for its
    timeout (``remaining``) and its TTFT SLO's wait budget, seconds (None: the policy's maximum
    wait alone). ``evict``: a waiter of a tenant further above its fair share to refuse in its
    place (reason ``evict_reason``: the queue is full, or the newcomer would wait past its SLO),
    so such refusals fall on the tenant furthest above its share first."""

    remaining: tuple[str, ...]
    budget: float | None
    evict: Waiter | None = None
    evict_reason: Reason = Reason.QUEUE_FULL


def exceeds_capacity(limits: Limits, req: AdmissionRequest, max_fit: int) -> Decision:
    """The 400 for a request that can never fit (no Retry-After: waiting cannot help)."""
    fix = f"lower max_tokens to at most {max_fit}" if max_fit >= 1 else "shorten the prompt"
    d = refusal(
        Reason.EXCEEDS_CAPACITY,
        _exceeding_limit(limits, req),
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


def _exceeding_limit(limits: Limits, req: AdmissionRequest) -> str:
    """Name of the capacity ``req`` can never fit: ``kv``, a rate limit, or ``capacity``."""
    cfg = limits.config
    kv = cfg.kv_capacity_tokens
    if kv is not None and limits.kv_tokens(req.prompt_tokens, req.max_tokens, req.n) > kv:
        return "kv"
    cost = cfg.cost(req.prompt_tokens, req.n * req.max_tokens)
    for lim in limits.rates.limits:
        cap = lim.resolved.cost_capacity
        if cap is not None and cost > cap:
            return lim.resolved.name
    return "capacity"


def refused_by_count(limits: Limits, req: AdmissionRequest, now: float) -> bool:
    """True when ``req``'s request-count rate limit refuses it now under a policy that has
    neither Queue (for ``req``: a sheddable request is never queued) nor a fallback (model or
    pool) to serve it otherwise: its prompt's size cannot change that."""
    cfg = limits.config
    queue = _QUEUE in cfg.actions and req.priority >= 0
    if queue or cfg.fallback_model or cfg.fallback_pool_model:
        return False
    b = what_blocks(limits, req, req.max_tokens, now)
    return b is not None and b.reason is Reason.RATE_LIMIT_REQUESTS


def act(
    r: Resources,
    req: AdmissionRequest,
    blocker: Blocker | None,
    actions: tuple[str, ...],
    now: float,
    clamped: bool,
    waited: float,
) -> Decision | Enqueue:
    """Try the overload actions in order for ``req`` (``clamped``: its max_tokens was already
    lowered; ``waited``: seconds it spent in the queue, 0 for a newcomer). ``blocker`` None
    means "fits, but others wait ahead for the same resources"."""
    queue_full = False
    slo_wait: float | None = None
    for i, action in enumerate(actions):
        if action == _DEGRADE:
            d = _degrade(r, req, blocker, now, waited)
            if d is not None:
                return d
        elif action == _QUEUE:
            if req.priority < 0 or waited > 0:  # sheddable, or already timed out once
                continue
            if blocker is not None and blocker.pool_share:  # over its pool-wide share
                continue
            evict: Waiter | None = None
            reason = Reason.QUEUE_FULL
            if len(r.queue) >= r.limits.config.queue_max_length:
                evict = r.queue.over_share(req)
                if evict is None:
                    queue_full = True
                    continue
            budget = _wait_budget(r, req)
            if budget is not None:
                expected = _expected_wait(r, req, blocker, now)
                if expected is not None and expected > budget * SHED_FACTOR:
                    # A tenant with nothing in flight, behind a flooding one: a lent slot.
                    lent = None if evict is not None else _lend(r, req, blocker, now)
                    if lent is not None:
                        return lent
                    # Refused for its SLO only when no other tenant is further above its share.
                    if evict is None:
                        evict, reason = r.queue.over_share(req), Reason.SLO
                    if evict is None:
                        slo_wait = expected
                        continue
            return Enqueue(actions[i + 1 :], budget, evict, reason)
        else:
            break
    return reject(r, req, blocker, now, waited, queue_full, slo_wait)


def _lend(
    r: Resources, req: AdmissionRequest, blocker: Blocker | None, now: float
) -> Decision | None:
    """``req`` admitted on a slot above the adaptive concurrency limit
    (:func:`~kvgate_agent.admission.fairqueue.reserve.slot_lent`: its tenant holds nothing
    and a tenant far above its share holds the slots), when that limit is what stops it and
    nothing else does; None otherwise."""
    if blocker is None or blocker.reason is not Reason.CONCURRENCY or blocker.pool_share:
        return None
    limits = r.limits
    if what_blocks(limits, req, req.max_tokens, now, lend=True) is not None:
        return None
    ticket = limits.reserve(req, req.max_tokens, now)
    return Decision(Outcome.ADMITTED, Reason.LENT_SLOT, ticket=ticket, max_tokens=req.max_tokens)


def evicted(r: Resources, w: Waiter, reason: Reason, now: float) -> Decision:
    """The refusal of waiter ``w``, evicted from the queue for a newcomer of a tenant under its
    fair share (``reason``: ``queue_full`` or ``slo``), with an honest Retry-After: its
    expected wait for an SLO eviction, the drain of the queue for a full one."""
    req = w.request
    slo_wait = _expected_wait(r, req, None, now) if reason is Reason.SLO else None
    d = reject(r, req, None, now, 0.0, reason is Reason.QUEUE_FULL, slo_wait)
    d.message = f"{d.message} (this tenant is furthest above its fair share)"
    d.queue_seconds = now - w.enqueued_at
    return d


def _expected_wait(
    r: Resources, req: AdmissionRequest, blocker: Blocker | None, now: float
) -> float | None:
    """Seconds ``req`` would wait in the queue: its own bucket's refill time when only that
    blocks it, else the drain time of the waiters the fair order serves before it
    (:meth:`WaitQueue.ahead_of`, :meth:`SloState.expected_wait`, from the mean age of the
    requests in flight; the engine's own waiting requests are ahead of all)."""
    if blocker is not None and blocker.tenant_scoped and blocker.bucket is not None:
        return blocker.bucket.seconds_until(blocker.amount, now)
    limits = r.limits
    return r.slo.expected_wait(r.queue.ahead_of(req), limits.in_flight, now, limits.mean_age(now))


def _wait_budget(r: Resources, req: AdmissionRequest) -> float | None:
    """Seconds ``req`` may still wait under its TTFT SLO: its class's (``req.ttft_slo_seconds``;
    infinite: none), else the policy's for priorities >= ``slo.minPriority``; where the policy
    states no TTFT SLO, the default wait bound (``AdmissionConfig.default_wait_seconds``, or
    longer on an engine whose first token is slow: :meth:`SloState.default_wait`); less
    what it waited before it reached this pod (``req.waited_seconds``, never below 0); None
    when no budget applies to it."""
    budget = _full_wait_budget(r, req)
    if budget is None or req.waited_seconds <= 0:
        return budget
    return max(0.0, budget - req.waited_seconds)


def _full_wait_budget(r: Resources, req: AdmissionRequest) -> float | None:
    ttft = req.ttft_slo_seconds
    if ttft is None:
        cfg = r.limits.config
        if cfg.default_wait_seconds is not None:
            return r.slo.default_wait(cfg.default_wait_seconds)
        if req.priority < cfg.slo_min_priority:
            return None
        return r.slo.wait_budget()
    if math.isinf(ttft):
        return None
    return r.slo.wait_budget(ttft)


def _degrade(
    r: Resources, req: AdmissionRequest, blocker: Blocker | None, now: float, waited: float
) -> Decision | None:
    """Admit ``req`` degraded if the policy allows: max_tokens clamped to what fits now (not
    below ``minMaxTokens``), else the fallback model, else send it to the fallback pool; None
    when none applies."""
    if blocker is None:
        return None
    if not (waited == 0 and len(r.queue) and r.queue.head_blocked_shared):
        # (Else others already wait for the same capacity: a newcomer must not take it first,
        # not even a degraded one; another pool's capacity is not theirs.)
        local = _degrade_here(r.limits, req, blocker, now, waited)
        if local is not None:
            return local
    pool = r.limits.config.fallback_pool_model
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
        d.refusal = reject(r, req, blocker, now, waited)
        return d
    return None


def _degrade_here(
    limits: Limits, req: AdmissionRequest, blocker: Blocker, now: float, waited: float
) -> Decision | None:
    """Admit ``req`` degraded on this pod: max_tokens clamped (1.), or the fallback model on
    the same server (2.); None when neither applies."""
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
            and what_blocks(limits, req, m, now) is None
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
        and what_blocks(limits, req, req.max_tokens, now, with_buckets=False) is None
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


def reject(
    r: Resources,
    req: AdmissionRequest,
    blocker: Blocker | None,
    now: float,
    waited: float,
    queue_full: bool = False,
    slo_wait: float | None = None,
) -> Decision:
    """The 429 for ``req``, its Retry-After from the blocking resource's refill or drain time
    (or the expected queue wait, when that is what refused it) and, for a rate limit, the
    refusing bucket's state for the RateLimit headers. ``fleet_wide`` is set when ``blocker``
    (the request's own, not the queue head's) is a slice of a fleet-wide budget that the whole
    budget could not cover either (:meth:`SharedBucket.fleet_lacks`)."""
    own = blocker is not None
    if blocker is None:
        blocker = r.queue.head_blocker(now) or Blocker(Reason.QUEUE_FULL, "queue")
    if slo_wait is not None:
        wait = slo_wait
    else:
        wait = wait_seconds(
            req, blocker, now, r.limits, r.queue.waiters(), r.speed.seconds_per_token
        )
    message = _REFUSAL_TEXT[blocker.reason].format(limit=blocker.limit)
    if blocker.pool_share:
        message += " (the rest is kept for tenants under their share of the pool)"
    reason = blocker.reason
    if waited > 0:
        reason = Reason.QUEUE_TIMEOUT
        message = f"timed out after {waited:.1f}s in the admission queue: {message}"
    elif req.priority < 0 and _QUEUE in r.limits.config.actions:
        reason = Reason.SHEDDABLE
        message = f"sheddable request (negative priority) not queued: {message}"
    elif queue_full:
        reason = Reason.QUEUE_FULL
        message = f"the admission queue is full: {message}"
    elif (
        slo_wait is not None
        and req.ttft_slo_seconds is None
        and r.limits.config.default_wait_seconds
    ):
        # No TTFT SLO applies: the default wait bound refused it, so the reason is what blocks.
        bound = r.slo.default_wait(r.limits.config.default_wait_seconds)  # the one applied
        message = (
            f"the expected wait ({slo_wait:.2f}s) exceeds the {bound:g}s a request under no "
            f"time-to-first-token SLO may wait: {message}"
        )
    elif slo_wait is not None:
        reason = Reason.SLO
        spent = (
            f" less the {req.waited_seconds:.2f}s it waited before reaching this pod"
            if req.waited_seconds > 0
            else ""
        )
        message = (
            f"the expected queue wait ({slo_wait:.2f}s) exceeds the time-to-first-token SLO"
            f"{spent}: {message}"
        )
    d = refusal(reason, blocker.limit, 429, wait, req.max_tokens, message)
    d.queue_seconds = waited
    # The request's own budget is fleet-wide and spent: another replica would refuse it alike.
    b = blocker.bucket
    d.fleet_wide = own and b is not None and b.fleet_lacks(blocker.amount)
    if blocker.bucket is not None and blocker.resolved is not None:
        t = blocker.resolved
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
_POOL_REASONS: Final = frozenset(
    (
        Reason.KV_CAPACITY,
        Reason.CONCURRENCY,
        Reason.RATE_LIMIT_REQUESTS,
        Reason.RATE_LIMIT_TOKENS,
    )
)

_REFUSAL_TEXT: Final = {
    Reason.RATE_LIMIT_REQUESTS: "request rate limit '{limit}' exceeded",
    Reason.RATE_LIMIT_TOKENS: "token rate limit '{limit}' exceeded",
    Reason.CONCURRENCY: "the model server is at its concurrency limit",
    Reason.KV_CAPACITY: "the model server's KV cache is fully reserved",
    Reason.QUEUE_FULL: "requests are waiting ahead for the same capacity",
}
