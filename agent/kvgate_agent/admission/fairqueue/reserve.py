"""The fair reserve, and the one check every admission passes through: what stops a request now.

**The reserve.** A queue that is fair among waiters cannot take back what a tenant already
holds: a tenant flooding an idle server fills its KV and its concurrency limit, and a quiet
tenant's request then waits for a departure, past a TTFT budget of a few hundred milliseconds.
So the last :data:`KV_RESERVE` of the KV capacity and of the concurrency limit are kept from a
tenant holding more than :data:`HOG` times its fair share (capacity x its weight / the active
tenants' weights, from :mod:`.share`'s accounts), and while the engine's prefill is congested
(:data:`PREFILL_SHARE`, flagged by :mod:`.ceiling`) such a tenant waits at any level. A tenant
alone, or holding nothing, is never held back: the server stays work-conserving for whoever is
there.

**The pool's reserve.** With the pool's view attached (:mod:`.pool`, the exchange of service
counters between replicas), the last :attr:`~.pool.PoolShare.reserve` of the concurrency limit
and of the KV capacity are also kept from a tenant over its *pool-wide* share, alone here or
not: behind a router that pins tenants to home replicas, the room is left for the requests of
tenants under their share that spill here. Not work-conserving on its own pod, by design; off
(nothing held) while the pool's figures are stale (:attr:`~.pool.PoolShare.stale_s`). A newcomer
held back by it is refused at once rather than queued (``Blocker.pool_share``;
:mod:`kvgate_agent.admission.overload`): a router retries it on another pod at once instead of
it waiting out its budget on the pod that keeps its room for others, and such waiters do not
count in the queue depth the router scores pods by (on the benchmark's ``tiers``, no worse than
queueing them: docs/benchmarks.md, issue 34).

**The lent slot.** Where the adaptive concurrency limit is small (one or two requests on a
slow server: a llama.cpp CPU server, issue 33), the reserve has no room to keep: a tenant
flooding it holds the one slot, and a quiet tenant's request waits out that request's service
time, past its TTFT budget, and is refused. A newcomer that would be refused for its TTFT SLO
(:func:`kvgate_agent.admission.overload.act`) whose tenant holds nothing may take one slot
above the adaptive limit (never above the policy's or the engine's cap) when a tenant far above
its share holds the slots (:func:`slot_lent`).

**The check.** :func:`what_blocks` asks, in this order: the concurrency limit, its reserve, the
KV capacity, its reserve, then the rate limits' buckets (:mod:`.rate_limits`); the first that
stops the request is its :class:`~kvgate_agent.admission.decision.Blocker`. The controller, the
queue and the overload actions all decide through it, so every admission meets the reserve.

Invariant: pure, no clock of its own (``now`` is passed in, seconds); O(rate limits) per check.
"""

from __future__ import annotations

from typing import Final

from kvgate_agent.admission.decision import AdmissionRequest, Blocker, BucketCharge, Reason
from kvgate_agent.admission.fairqueue.share import FairShare
from kvgate_agent.admission.limits import Limits

#: Share of the KV capacity (and of the concurrency limit) a tenant above its fair share of it
#: may not take: kept for the tenants under theirs, whose requests then find room at once
#: instead of waiting for a departure (a queue that is fair only among waiters cannot take back
#: what a tenant already holds). Work-conserving for a tenant alone (it is never above its
#: share). Chosen on the effectiveness benchmark's ``isolation`` workload, seed 1
#: (docs/benchmarks.md, issue 22).
KV_RESERVE: Final = 0.2
#: A tenant holding more than this many times its fair share is held back by the reserve
#: (tenants about even with their shares are not: the reserve would idle capacity they share).
HOG: Final = 2.0
#: The engine's prefill is congested when a prompt admitted now would wait more than this
#: share of the TTFT SLO behind the prompts admitted before it (:mod:`.prefill`): then a
#: tenant above twice its share of the concurrency limit is not admitted (its prefills would
#: delay everyone's first token; the engine serves prefills in arrival order). Chosen with
#: :data:`KV_RESERVE`.
PREFILL_SHARE: Final = 0.5


def kv_held_back(
    fair: FairShare, tenant: str, weight: float, kv_tokens: int, used: int, kv_capacity: int
) -> bool:
    """Whether a request of ``tenant`` (of ``weight``) needing ``kv_tokens`` must leave the
    reserve (:data:`KV_RESERVE`) to others: ``used`` (KV tokens in use with it) reaches into
    the reserve and the tenant would hold more than :data:`HOG` times its fair share, its
    share being ``kv_capacity x weight / (the active tenants' weights)``. A tenant alone, or
    holding nothing, never is held back. O(1)."""
    if used <= kv_capacity * (1.0 - KV_RESERVE):
        return False
    a = fair.account(tenant)
    if a is None or not a.in_flight:
        return False
    return (a.kv_tokens + kv_tokens) * fair.active_weight > HOG * kv_capacity * weight


def slot_held_back(fair: FairShare, tenant: str, weight: float, in_flight: int, slots: int) -> bool:
    """The same for one more request in flight of ``slots`` (the concurrency limit), with
    ``in_flight`` now: held back in the reserve, or at any level while the engine's prefill
    is congested (``fair.congested``)."""
    if not fair.congested and in_flight + 1 <= slots * (1.0 - KV_RESERVE):
        return False
    a = fair.account(tenant)
    if a is None or not a.in_flight:
        return False
    return (a.in_flight + 1) * fair.active_weight > HOG * slots * weight


def slot_lent(limits: Limits, req: AdmissionRequest, limit: int) -> bool:
    """Whether ``req`` may take one slot above the adaptive concurrency ``limit`` (a *lent*
    slot; asked only for a request that would otherwise be refused for its TTFT SLO,
    :func:`kvgate_agent.admission.overload.act`): the adaptive limit alone stops it (the
    requests in flight are exactly ``limit``, below the hard cap, the policy's or the
    engine's slots), its tenant has nothing in flight or waiting, and a tenant in flight holds
    more than its fair share of the limit (``in_flight x active weights > limit x weight``)
    having received more than :data:`HOG` times its service (attained service per weight).
    A quiet tenant's request then starts at once beside a flooding tenant's instead of waiting
    out that tenant's request (on a server of one or two slots, a whole service time of a few
    seconds); the cost, the flooding tenant's request decoding beside it (and stalled by its
    prefill), falls on the tenant above its share. At most one slot is lent at a time.
    O(tenants kept)."""
    cap = limits.concurrency_cap
    if cap is None or limits.in_flight != limit or limit >= cap:
        return False
    fair = limits.fair
    a = fair.account(req.tenant)
    if a is not None and a.active:
        return False
    mine = 0.0 if a is None else a.attained / a.weight
    weights = fair.active_weight + req.weight
    return any(
        b.in_flight * weights > limit * b.weight and b.attained > HOG * mine * b.weight
        for _, b in fair.accounts()
    )


def pool_held_back(fair: FairShare, tenant: str, used: float, capacity: float, now: float) -> bool:
    """Whether a request of ``tenant`` bringing the pod's use of a limit to ``used`` (of
    ``capacity``: requests in flight, or KV tokens) must leave the pool's reserve to others:
    ``tenant`` is over its pool-wide share (:meth:`.pool.PoolShare.over_share`) and ``used``
    reaches into the last :attr:`~.pool.PoolShare.reserve` of ``capacity``. False without the
    pool's view. O(1)."""
    pool = fair.pool
    if pool is None or used <= capacity * (1.0 - pool.reserve):
        return False
    return pool.over_share(tenant, now)


def what_blocks(
    limits: Limits,
    req: AdmissionRequest,
    max_tokens: int,
    now: float,
    with_buckets: bool = True,
    found: list[BucketCharge] | None = None,
    kv: int | None = None,
    cost: float | None = None,
    lend: bool = False,
) -> Blocker | None:
    """What stops ``req`` with ``max_tokens`` now on the pod counted by ``limits``, or None if
    it fits (see the module docstring for the order). A reservation is taken only right after
    this said None, in the same call (:meth:`Limits.reserve`).

    Args:
        with_buckets: False checks only the GPU protections (concurrency, KV, their reserve).
        found: when given, the buckets checked are appended to it, so the reservation that
            follows in the same call needs no second lookup.
        kv, cost: the request's KV tokens and cost units, when the caller has them already.
        lend: a request the adaptive concurrency limit alone stops may take a lent slot
            (:func:`slot_lent`).
    """
    limit = limits.concurrency_limit
    if limit is not None:
        if limits.in_flight >= limit and not (lend and slot_lent(limits, req, limit)):
            return Blocker(Reason.CONCURRENCY, "concurrency")
        if slot_held_back(limits.fair, req.tenant, req.weight, limits.in_flight, limit):
            return Blocker(Reason.CONCURRENCY, "concurrency", True)
        if pool_held_back(limits.fair, req.tenant, limits.in_flight + 1, limit, now):
            return Blocker(Reason.CONCURRENCY, "concurrency", True, pool_share=True)
    cfg = limits.config
    cap = cfg.kv_capacity_tokens
    if cap is not None:
        if kv is None:
            kv = limits.reservation(req, max_tokens)
        used = limits.kv_in_use(now) + kv
        if used > cap:
            return Blocker(Reason.KV_CAPACITY, "kv")
        if kv_held_back(limits.fair, req.tenant, req.weight, kv, used, cap):
            return Blocker(Reason.KV_CAPACITY, "kv", True)
        if pool_held_back(limits.fair, req.tenant, used, cap, now):
            return Blocker(Reason.KV_CAPACITY, "kv", True, pool_share=True)
    if not with_buckets:
        return None
    return limits.rates.blocker(req, max_tokens, now, cfg, found, cost)
