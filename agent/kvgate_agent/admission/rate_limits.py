"""The rate limits' buckets of one pod: built from the resolved limits, rebuilt in place on new
thresholds, and walked for a request.

A rate limit (:class:`~kvgate_agent.admission.config.ResolvedLimit`) has one bucket per tenant
(``per: Tenant``) or one for the pod, in up to two maps: ``requests`` (requests) and ``cost``
(cost units). A ``shared`` limit, once the sidecar has a store, holds slices of fleet-wide
buckets instead (:mod:`.lease`).

Invariant: on new thresholds a limit whose name, ``per`` scope and sharing are unchanged keeps
its bucket maps and every bucket in them (tickets hold references to them); only their numbers
change.
"""

from __future__ import annotations

from kvgate_agent.admission.bucket import BucketMap, SharedBucket
from kvgate_agent.admission.config import AdmissionConfig, ResolvedLimit
from kvgate_agent.admission.decision import AdmissionRequest, Blocker, BucketCharge, Reason
from kvgate_agent.contract.policy import LimitScope


class RateLimitBuckets:
    """The buckets of one rate limit: one per tenant (``per: Tenant``) or one for the pod.

    ``requests`` counts requests, ``cost`` cost units; either is None when the limit does not
    count that unit.
    """

    __slots__ = ("cost", "is_tenant", "max_keys", "requests", "resolved", "shared")

    def __init__(
        self, resolved: ResolvedLimit, now: float, max_tenants: int, shared: bool = False
    ) -> None:
        self.resolved = resolved
        self.is_tenant = resolved.per is LimitScope.TENANT
        #: The buckets are slices of a fleet-wide budget (a shared limit with a store attached).
        self.shared = shared
        self.max_keys = max_tenants if self.is_tenant else 1
        self.requests = _retune(
            None,
            resolved.request_capacity,
            resolved.request_rate,
            resolved.warmup_seconds,
            now,
            now,
            self.max_keys,
        )
        self.cost = _retune(
            None,
            resolved.cost_capacity,
            resolved.cost_rate,
            resolved.warmup_seconds,
            now,
            now,
            self.max_keys,
        )
        if shared:
            for bmap in (self.requests, self.cost):
                if bmap is not None:
                    bmap.first_slice = 0.0  # the lease book sizes first slices from its peers

    def key(self, tenant: str) -> str:
        """The bucket key for ``tenant``: the tenant itself, or "" for a pod-wide limit."""
        return tenant if self.is_tenant else ""

    def update(self, resolved: ResolvedLimit, now: float, warmup_start: float) -> None:
        """Take new numbers for the same limit (same name and scope) in place: the bucket maps
        and every bucket in them keep their identity (tickets hold references to them), their
        level carried over and clamped to the new capacity. A unit the limit no longer counts
        drops its map; a unit it newly counts starts a fresh one."""
        self.requests = _retune(
            self.requests,
            resolved.request_capacity,
            resolved.request_rate,
            resolved.warmup_seconds,
            now,
            warmup_start,
            self.max_keys,
        )
        self.cost = _retune(
            self.cost,
            resolved.cost_capacity,
            resolved.cost_rate,
            resolved.warmup_seconds,
            now,
            warmup_start,
            self.max_keys,
        )
        if self.shared:
            for bmap in (self.requests, self.cost):
                if bmap is not None and bmap.first_slice is None:
                    bmap.first_slice = 0.0
        self.resolved = resolved


def _retune(
    bmap: BucketMap | None,
    capacity: float | None,
    rate: float | None,
    warmup_seconds: float,
    now: float,
    warmup_start: float,
    max_keys: int,
) -> BucketMap | None:
    """``bmap`` with a new capacity and rate (units, units per second), updated in place; a new
    map when there was none; None when the unit is no longer limited. Each existing bucket is
    first refilled at its old rate up to ``now``, then takes the new numbers with its level
    clamped to the new (effective) capacity. A bucket's warm-up ramp stays as it was created
    (a changed ``warmupSeconds`` applies to buckets created afterwards)."""
    if capacity is None or rate is None:
        return None
    if bmap is None:
        return BucketMap(capacity, rate, warmup_start, warmup_seconds, max_keys)
    bmap.capacity = capacity
    bmap.rate = rate
    bmap.warmup_seconds = warmup_seconds
    for _, b in bmap.items():
        b.refill(now)
        b.capacity = capacity
        b.rate = rate
        b.level = min(b.level, b.capacity_at(now))
    return bmap


def _slices(lim: RateLimitBuckets) -> list[tuple[str, SharedBucket]]:
    """(``limit:unit:tenant``, slice) of the slices of ``lim`` holding or owing units."""
    out = []
    for unit, bmap in (("requests", lim.requests), ("cost", lim.cost)):
        if bmap is None:
            continue
        for key, b in bmap.items():
            if isinstance(b, SharedBucket) and not b.forgettable(0.0):
                out.append((f"{lim.resolved.name}:{unit}:{key}", b))
    return out


class RateLimits:
    """Every rate limit's buckets on one pod, in the policy's order.

    Args:
        resolved: the resolved rate limits.
        started_at: the pod's start, clock seconds (the warm-up ramps begin there).
        max_tenants: bound on the tenant buckets kept per limit.

    Attributes:
        limits: the limits' buckets, in the policy's order (read only outside this class).
        min_cost_capacity: the smallest ``cost_capacity`` stated, cost units (None: none).
        store_attached: shared limits hold slices of fleet-wide buckets (:meth:`attach_store`).
        retired: (``limit:unit:tenant``, slice) of removed shared limits, for a final hand-back.
    """

    __slots__ = (
        "_max_tenants",
        "_resolved",
        "_started_at",
        "limits",
        "min_cost_capacity",
        "retired",
        "store_attached",
    )

    def __init__(
        self, resolved: tuple[ResolvedLimit, ...], started_at: float, max_tenants: int
    ) -> None:
        self._started_at = started_at
        self._max_tenants = max_tenants
        self._resolved = resolved
        self.store_attached = False
        self.retired: list[tuple[str, SharedBucket]] = []
        self.limits = [RateLimitBuckets(t, started_at, max_tenants) for t in resolved]
        self.min_cost_capacity = _min_cost_capacity(resolved)

    def reconfigure(self, resolved: tuple[ResolvedLimit, ...], now: float) -> None:
        """Count against ``resolved`` from now on. A rate limit whose name and ``per`` scope are
        unchanged keeps its buckets (see :meth:`RateLimitBuckets.update`); new limits start with
        fresh (full) buckets; removed ones are dropped (tickets still holding their buckets
        release into them harmlessly; a removed shared limit's slices go to :attr:`retired`)."""
        old = {(lim.resolved.name, lim.resolved.per, lim.shared): lim for lim in self.limits}
        limits: list[RateLimitBuckets] = []
        for t in resolved:
            shared = t.shared and self.store_attached
            lim = old.get((t.name, t.per, shared))
            if lim is None:
                lim = RateLimitBuckets(t, self._started_at, self._max_tenants, shared)
            else:
                lim.update(t, now, self._started_at)
            limits.append(lim)
        kept = {id(lim) for lim in limits}
        for lim in self.limits:
            if lim.shared and id(lim) not in kept:
                self.retired += _slices(lim)
        self.limits = limits
        self._resolved = resolved
        self.min_cost_capacity = _min_cost_capacity(resolved)

    def attach_store(self, now: float) -> None:
        """Hold every shared limit as slices of its fleet-wide budget from now on (the sidecar
        has a store): such limits start with fresh, empty slice buckets."""
        self.store_attached = True
        self.reconfigure(self._resolved, now)

    def shared_maps(self) -> list[tuple[str, str, BucketMap]]:
        """(limit name, unit, bucket map) of every limit held as fleet-wide slices; ``unit`` is
        ``requests`` or ``cost``."""
        out = []
        for lim in self.limits:
            if lim.shared:
                for unit, bmap in (("requests", lim.requests), ("cost", lim.cost)):
                    if bmap is not None:
                        out.append((lim.resolved.name, unit, bmap))
        return out

    # ------------------------------------------------------------------ observation

    def bucket_levels(self, now: float) -> list[tuple[str, str, str, float, float]]:
        """(limit name, unit, key, level, capacity) for every bucket held in memory now.
        ``unit`` is ``requests`` or ``cost``; ``key`` is the tenant, or "" for pod-wide buckets."""
        out = []
        for lim in self.limits:
            for unit, bmap in (("requests", lim.requests), ("cost", lim.cost)):
                if bmap is None:
                    continue
                for key, b in bmap.items():
                    out.append((lim.resolved.name, unit, key, b.peek(now), b.capacity_at(now)))
        return out

    def tenants_tracked(self) -> int:
        """Number of tenant buckets held in memory (bounded by ``max_tenants`` per limit)."""
        return sum(
            len(m)
            for lim in self.limits
            for m in (lim.requests, lim.cost)
            if m is not None and lim.is_tenant
        )

    # ------------------------------------------------------------------ a request

    def cost_capacity(self) -> float | None:
        """The smallest full capacity of the cost buckets, cost units; None: no cost bucket."""
        room: float | None = None
        for lim in self.limits:
            cap = lim.resolved.cost_capacity
            if lim.cost is not None and cap is not None:
                room = cap if room is None else min(room, cap)
        return room

    def cost_room(self, tenant: str, now: float) -> float | None:
        """The lowest level now of the cost buckets ``tenant`` draws on, cost units; None: no
        cost bucket."""
        room: float | None = None
        for lim in self.limits:
            if lim.cost is not None:
                level = lim.cost.get(lim.key(tenant), now).refill(now)
                room = level if room is None else min(room, level)
        return room

    def blocker(
        self,
        req: AdmissionRequest,
        max_tokens: int,
        now: float,
        config: AdmissionConfig,
        found: list[BucketCharge] | None = None,
        cost: float | None = None,
    ) -> Blocker | None:
        """The first bucket, in the policy's order, that cannot take ``req`` with
        ``max_tokens`` now (one request, and its cost units by ``config``, or ``cost`` when the
        caller has it); None when every one can. When ``found`` is given, the buckets checked
        are appended to it as (bucket, units, is the cost bucket)."""
        tenant = req.tenant
        for lim in self.limits:
            key = tenant if lim.is_tenant else ""
            if lim.requests is not None:
                b = lim.requests.get(key, now)
                if b.refill(now) < 1.0:
                    t = lim.resolved
                    return Blocker(Reason.RATE_LIMIT_REQUESTS, t.name, lim.is_tenant, b, 1.0, t)
                if found is not None:
                    found.append((b, 1.0, False))
            if lim.cost is not None:
                if cost is None:
                    cost = config.cost(req.prompt_tokens, req.n * max_tokens)
                b = lim.cost.get(key, now)
                if b.refill(now) < cost:
                    t = lim.resolved
                    return Blocker(Reason.RATE_LIMIT_TOKENS, t.name, lim.is_tenant, b, cost, t)
                if found is not None:
                    found.append((b, cost, True))
        return None


def _min_cost_capacity(resolved: tuple[ResolvedLimit, ...]) -> float | None:
    caps = [t.cost_capacity for t in resolved if t.cost_capacity is not None]
    return min(caps) if caps else None
