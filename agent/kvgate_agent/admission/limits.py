"""The limit bookkeeping of one pod: rate-limit buckets, the concurrency count, the KV reservation.

Invariant: a reservation is taken only right after :meth:`Limits.blocker` found that it fits, in
the same call (only live correction, :meth:`Limits.grow`, extends one unconditionally: its
sequence runs already), and given back exactly once by :meth:`Limits.release`; so ``in_flight`` and
``kv_reserved_tokens`` are always the sums over the live tickets, and no bucket goes below 0.

KV reservation = prompt + n × min(max_tokens, L) rounded up to the block size (vLLM allocates KV
in blocks: PagedAttention, Kwon et al., SOSP 2023, https://arxiv.org/abs/2309.06180), where L is
the predicted output length (:mod:`.predictor`; max_tokens under ``reservation: MaxTokens`` or
before enough samples). A reservation below the worst case grows block by block as its tokens
stream (:meth:`Limits.grow`); admission keeps :attr:`Limits.headroom` free for that growth, and
where the engine reports more KV in use than is reserved, the engine's figure counts.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from kvgate_agent.admission.bucket import Bucket, BucketMap, SharedBucket
from kvgate_agent.admission.config import AdmissionConfig, ResolvedLimit
from kvgate_agent.admission.decision import AdmissionRequest, BucketCharge, Reason, Ticket
from kvgate_agent.admission.fairness import FairShare
from kvgate_agent.admission.predictor import LengthPredictor
from kvgate_agent.contract.policy import LimitScope, ReservationMode

#: Weight of each settled request in the mean overrun (tokens a reservation grew by).
OVERRUN_ALPHA = 0.05
#: An engine KV report counts for this long, seconds (a stale one must not hold admission).
ENGINE_KV_TTL_S = 3.0
#: Keys the length predictor keeps (tenant x model x band, and the pooled ones), about 1.5 KB
#: each.
PREDICTOR_KEYS = 10_000
#: Headroom kept for the growth of predicted reservations never exceeds this share of the pool.
MAX_HEADROOM_SHARE = 0.2


def round_up(tokens: int, block_size: int) -> int:
    """``tokens`` rounded up to a whole number of KV blocks of ``block_size`` tokens."""
    return -(-tokens // block_size) * block_size


@dataclass(slots=True)
class Blocker:
    """What stops a request now.

    Attributes:
        reason: the refusal reason it would give.
        limit: the rate limit's name, or ``concurrency`` / ``kv`` / ``queue``.
        tenant_scoped: only this tenant's own bucket blocks (others need not wait behind it).
        bucket: the blocking bucket, for rate limits.
        amount: units the request needs from ``bucket``.
        resolved: the blocking rate limit, for rate limits.
    """

    reason: Reason
    limit: str
    tenant_scoped: bool = False
    bucket: Bucket | None = None
    amount: float = 0.0
    resolved: ResolvedLimit | None = None


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


class Limits:
    """Everything one pod's admission counts against: the rate limits' buckets, requests in
    flight (concurrency) and KV tokens reserved, with the live tickets.

    Args:
        config: resolved thresholds.
        started_at: the pod's start, clock seconds (the warm-up ramps begin there).
        max_tenants: bound on the tenant buckets kept per limit.

    Attributes:
        config: the thresholds enforced now.
        in_flight: admitted requests not yet released.
        kv_reserved_tokens: KV tokens reserved by them (block-rounded).
        tickets: the live tickets by ``id``.
        predictor: the output-length predictor (learned at release).
        concurrency_limit: the concurrency cap enforced now: the policy's, or the adaptive
            limit when lower (set by the controller); None = none.
        overrun_mean: mean tokens a predicted reservation grew by before release.
        predicted_in_flight: tickets in flight whose reservation is below their worst case.
        engine_kv_used: KV tokens the engine reports in use (None: not known).
        engine_kv_until: clock time after which that report is too old to count.
        fair: the tenants' fair-share counters, charged here at every reservation.
    """

    __slots__ = (
        "_max_tenants",
        "_started_at",
        "concurrency_limit",
        "config",
        "engine_kv_until",
        "engine_kv_used",
        "fair",
        "in_flight",
        "kv_reserved_tokens",
        "min_cost_capacity",
        "overrun_mean",
        "predicted",
        "predicted_in_flight",
        "predictor",
        "rate_limits",
        "retired",
        "store_attached",
        "tickets",
    )

    def __init__(self, config: AdmissionConfig, started_at: float, max_tenants: int) -> None:
        self._started_at = started_at
        self._max_tenants = max_tenants
        self.config = config
        #: Shared limits hold slices of fleet-wide buckets (:meth:`attach_store`).
        self.store_attached = False
        #: (``limit:unit:tenant``, slice) of removed shared limits, for a final hand-back.
        self.retired: list[tuple[str, SharedBucket]] = []
        self.rate_limits = [RateLimitBuckets(t, started_at, max_tenants) for t in config.limits]
        self.min_cost_capacity = _min_cost_capacity(config)
        self.in_flight = 0
        self.kv_reserved_tokens = 0
        self.tickets: dict[int, Ticket] = {}
        self.predictor = LengthPredictor(
            config.reservation_quantile, min(max_tenants, PREDICTOR_KEYS)
        )
        self.predicted = config.reservation is ReservationMode.PREDICTED
        self.concurrency_limit = config.max_concurrency
        self.overrun_mean = 0.0
        self.predicted_in_flight = 0
        self.engine_kv_used: int | None = None
        self.engine_kv_until = 0.0
        self.fair = FairShare(config.fair_prompt_weight, config.fair_output_weight, max_tenants)

    # ------------------------------------------------------------------ configuration

    def reconfigure(self, config: AdmissionConfig, now: float) -> None:
        """Count against ``config`` from now on. A rate limit whose name and ``per`` scope are
        unchanged keeps its buckets (see :meth:`RateLimitBuckets.update`); new limits start with
        fresh (full) buckets; removed ones are dropped (tickets still holding their buckets
        release into them harmlessly). Reservations and tickets stay."""
        old = {(lim.resolved.name, lim.resolved.per, lim.shared): lim for lim in self.rate_limits}
        limits: list[RateLimitBuckets] = []
        for t in config.limits:
            shared = t.shared and self.store_attached
            lim = old.get((t.name, t.per, shared))
            if lim is None:
                lim = RateLimitBuckets(t, self._started_at, self._max_tenants, shared)
            else:
                lim.update(t, now, self._started_at)
            limits.append(lim)
        kept = {id(lim) for lim in limits}
        for lim in self.rate_limits:
            if lim.shared and id(lim) not in kept:
                self.retired += _slices(lim)
        self.rate_limits = limits
        self.config = config
        self.min_cost_capacity = _min_cost_capacity(config)
        self.predictor.reset_quantile(config.reservation_quantile)
        self.predicted = config.reservation is ReservationMode.PREDICTED
        self.fair.retune(config.fair_prompt_weight, config.fair_output_weight)

    def attach_store(self, now: float) -> None:
        """Hold every shared limit as slices of its fleet-wide budget from now on (the sidecar
        has a store): such limits start with fresh, empty slice buckets."""
        self.store_attached = True
        self.reconfigure(self.config, now)

    def shared_maps(self) -> list[tuple[str, str, BucketMap]]:
        """(limit name, unit, bucket map) of every limit held as fleet-wide slices; ``unit`` is
        ``requests`` or ``cost``."""
        out = []
        for lim in self.rate_limits:
            if lim.shared:
                for unit, bmap in (("requests", lim.requests), ("cost", lim.cost)):
                    if bmap is not None:
                        out.append((lim.resolved.name, unit, bmap))
        return out

    def set_kv_capacity(self, tokens: int | None) -> None:
        """Enforce a new KV capacity (tokens; None = not enforced); reservations held stay."""
        self.config = dataclasses.replace(self.config, kv_capacity_tokens=tokens)

    # ------------------------------------------------------------------ observation

    def bucket_levels(self, now: float) -> list[tuple[str, str, str, float, float]]:
        """(limit name, unit, key, level, capacity) for every bucket held in memory now.
        ``unit`` is ``requests`` or ``cost``; ``key`` is the tenant, or "" for pod-wide buckets."""
        out = []
        for lim in self.rate_limits:
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
            for lim in self.rate_limits
            for m in (lim.requests, lim.cost)
            if m is not None and lim.is_tenant
        )

    # ------------------------------------------------------------------ arithmetic

    def kv_tokens(self, prompt: int, max_tokens: int, n: int) -> int:
        """KV tokens a request may ever hold: prompt + n × max_tokens, block-rounded."""
        return round_up(prompt + n * max_tokens, self.config.block_size)

    def reservation(self, req: AdmissionRequest, max_tokens: int) -> int:
        """KV tokens reserved for ``req`` admitted with ``max_tokens``: prompt + n x min(max_tokens,
        L), block-rounded, L the predicted output per choice (``req.predicted_output_tokens``
        when set, else the predictor's; max_tokens when neither, or under ``MaxTokens``)."""
        out = max_tokens
        if self.predicted:
            p = req.predicted_output_tokens
            if p is None:
                p = self.predictor.predict(req.tenant, req.model, max_tokens)
            if p is not None and p < max_tokens:
                out = max(1, p)
        return round_up(req.prompt_tokens + req.n * out, self.config.block_size)

    @property
    def headroom(self) -> int:
        """KV tokens kept free for the growth of predicted reservations in flight: their count x
        the mean overrun, at most :data:`MAX_HEADROOM_SHARE` of the pool."""
        cap = self.config.kv_capacity_tokens
        if cap is None or not self.predicted_in_flight:
            return 0
        return min(
            int(MAX_HEADROOM_SHARE * cap), math.ceil(self.predicted_in_flight * self.overrun_mean)
        )

    def kv_in_use(self, now: float) -> int:
        """KV tokens counted as taken: the reservations plus the headroom, or the engine's own
        figure when it reports more."""
        used = self.kv_reserved_tokens + self.headroom
        engine = self.engine_kv_used
        if engine is None or engine <= used or now > self.engine_kv_until:
            return used
        return engine

    def grow(self, ticket: Ticket, tokens: int) -> int:
        """Extend ``ticket``'s reservation to hold prompt + ``tokens`` output tokens (all
        choices) and the next token, block by block, never past its worst case; returns the
        tokens added (0 if it already held them). Taken unconditionally: the sequence runs
        already (the headroom is what keeps this inside the pool)."""
        need = min(
            ticket.kv_max, round_up(ticket.prompt_tokens + tokens + 1, self.config.block_size)
        )
        extra = need - ticket.kv_tokens
        if extra <= 0:
            return 0
        ticket.kv_tokens = need
        self.kv_reserved_tokens += extra
        return extra

    def fits_ever(self, kv: int, cost: float) -> bool:
        """Whether a reservation of ``kv`` tokens and ``cost`` units fits the full capacities."""
        cfg = self.config
        cap = self.min_cost_capacity
        return (cfg.kv_capacity_tokens is None or kv <= cfg.kv_capacity_tokens) and (
            cap is None or cost <= cap
        )

    def max_tokens_within(
        self, prompt: int, n: int, kv_room: int | None, cost_room: float | None
    ) -> int | None:
        """Largest max_tokens whose reservation fits ``kv_room`` tokens and whose cost fits
        ``cost_room`` units; None = unbounded by both. Negative when not even the prompt fits."""
        cfg = self.config
        best: int | None = None
        if kv_room is not None:
            usable = (kv_room // cfg.block_size) * cfg.block_size
            best = (usable - prompt) // n
        if cost_room is not None and cfg.output_token_weight > 0:
            by_cost = math.floor(
                (cost_room - cfg.cost_per_request - prompt * cfg.prompt_token_weight)
                / (n * cfg.output_token_weight)
                + 1e-9
            )
            best = by_cost if best is None else min(best, by_cost)
        elif cost_room is not None and cfg.cost(prompt, 0) > cost_room + 1e-9:
            best = -1
        return best

    def max_fit_ever(self, req: AdmissionRequest) -> int | None:
        """Largest max_tokens that could ever be admitted (full capacities); None = unbounded."""
        cost_room: float | None = None
        for lim in self.rate_limits:
            cap = lim.resolved.cost_capacity
            if lim.cost is not None and cap is not None:
                cost_room = cap if cost_room is None else min(cost_room, cap)
        return self.max_tokens_within(
            req.prompt_tokens, req.n, self.config.kv_capacity_tokens, cost_room
        )

    def max_fit_now(self, req: AdmissionRequest, now: float) -> int | None:
        """Largest max_tokens that fits the KV room and every cost bucket's level now."""
        kv = self.config.kv_capacity_tokens
        kv_room = None if kv is None else kv - self.kv_in_use(now)
        cost_room: float | None = None
        for lim in self.rate_limits:
            if lim.cost is not None:
                level = lim.cost.get(lim.key(req.tenant), now).refill(now)
                cost_room = level if cost_room is None else min(cost_room, level)
        return self.max_tokens_within(req.prompt_tokens, req.n, kv_room, cost_room)

    # ------------------------------------------------------------------ checks and reservations

    def blocker(
        self,
        req: AdmissionRequest,
        max_tokens: int,
        now: float,
        with_buckets: bool = True,
        found: list[BucketCharge] | None = None,
        kv: int | None = None,
        cost: float | None = None,
    ) -> Blocker | None:
        """What stops ``req`` with ``max_tokens`` now, or None if it fits.

        Args:
            with_buckets: False checks only the GPU protections (concurrency, KV).
            found: when given, the buckets checked are appended to it, so the reservation that
                follows in the same call needs no second lookup.
            kv, cost: the request's KV tokens and cost units, when the caller has them already.
        """
        cfg = self.config
        limit = self.concurrency_limit
        if limit is not None:
            if self.in_flight >= limit:
                return Blocker(Reason.CONCURRENCY, "concurrency")
            if self.fair.slot_held_back(req.tenant, req.weight, self.in_flight, limit):
                return Blocker(Reason.CONCURRENCY, "concurrency", True)
        cap = cfg.kv_capacity_tokens
        if cap is not None:
            if kv is None:
                kv = self.reservation(req, max_tokens)
            used = self.kv_in_use(now) + kv
            if used > cap:
                return Blocker(Reason.KV_CAPACITY, "kv")
            if self.fair.kv_held_back(req.tenant, req.weight, kv, used, cap):
                return Blocker(Reason.KV_CAPACITY, "kv", True)
        if not with_buckets:
            return None
        tenant = req.tenant
        for lim in self.rate_limits:
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
                    cost = cfg.cost(req.prompt_tokens, req.n * max_tokens)
                b = lim.cost.get(key, now)
                if b.refill(now) < cost:
                    t = lim.resolved
                    return Blocker(Reason.RATE_LIMIT_TOKENS, t.name, lim.is_tenant, b, cost, t)
                if found is not None:
                    found.append((b, cost, True))
        return None

    def reserve(
        self,
        req: AdmissionRequest,
        max_tokens: int,
        now: float,
        with_buckets: bool = True,
        found: list[BucketCharge] | None = None,
        kv: int | None = None,
    ) -> Ticket:
        """Take the reservations for ``req``; only after :meth:`blocker` said it fits, in the
        same call (so every bucket holds at least what is taken). ``found`` and ``kv`` as that
        call left them, when the caller has them."""
        if kv is None:
            kv = self.reservation(req, max_tokens)
        if found is None:
            found = []
            if with_buckets:
                self.blocker(req, max_tokens, now, found=found)
        for b, amount, _ in found:
            b.level -= amount
            b.pins += 1
        kv_max = self.kv_tokens(req.prompt_tokens, max_tokens, req.n)
        ticket = Ticket(
            req.tenant,
            req.prompt_tokens,
            max_tokens,
            req.n,
            kv,
            now,
            found,
            False,
            req.model,
            kv_max,
            kv,
        )
        ticket.weight = req.weight
        self.fair.admit(ticket)
        if kv < kv_max:
            self.predicted_in_flight += 1
        self.in_flight += 1
        self.kv_reserved_tokens += kv
        self.tickets[id(ticket)] = ticket
        return ticket

    def release(self, ticket: Ticket, now: float, cost: float, requests: float) -> None:
        """Give back what ``ticket`` holds, settling each bucket to real usage: ``cost`` units
        used of each cost bucket, ``requests`` (1 or 0) of each request bucket. A bucket is
        refunded what was reserved but not used, or charged the excess (never below 0). The
        caller makes sure this runs once per ticket."""
        for bucket, amount, is_cost in ticket.holds:
            used = cost if is_cost else requests
            if used < amount:
                bucket.put_back(amount - used, now)
            elif used > amount:
                bucket.charge(used - amount, now)
            bucket.pins -= 1
        self.in_flight -= 1
        self.kv_reserved_tokens -= ticket.kv_tokens
        if ticket.kv_reserved_at_admission < ticket.kv_max:
            self.predicted_in_flight -= 1
        del self.tickets[id(ticket)]

    def learn(self, ticket: Ticket, completion_tokens: int) -> None:
        """Learn from a settled ticket whose request produced ``completion_tokens`` (all choices):
        the length predictor's sample, and how far a predicted reservation had to grow."""
        self.predictor.observe(
            ticket.tenant, ticket.model, ticket.max_tokens, completion_tokens // max(1, ticket.n)
        )
        base = ticket.kv_reserved_at_admission
        if base < ticket.kv_max:
            final = min(
                ticket.kv_max,
                round_up(ticket.prompt_tokens + completion_tokens, self.config.block_size),
            )
            self.overrun_mean += OVERRUN_ALPHA * (max(0, final - base) - self.overrun_mean)


def _min_cost_capacity(config: AdmissionConfig) -> float | None:
    caps = [t.cost_capacity for t in config.limits if t.cost_capacity is not None]
    return min(caps) if caps else None
