"""The admission core: token buckets, concurrency cap, KV reservation, wait queue, degradation.

Pure and clock-injected: no I/O, no asyncio, no HTTP. Every public method runs to completion
without yielding, so a check and its reservation are atomic on one event loop (no
check-then-register window). The asyncio driver in :mod:`kvgate_agent.admission.waiting` turns
queued :class:`Waiter` objects into awaitables.

Flow of :meth:`AdmissionController.submit`:

1. A request that can never fit (cost above a bucket's full capacity, reservation above the KV
   capacity) is clamped if the policy allows Degrade with ``minMaxTokens`` low enough, otherwise
   refused at once with 400: waiting could never help (field lesson L03).
2. If everything fits now (and nobody waits ahead for the same shared resources), the request is
   admitted and its reservations taken in the same call.
3. Otherwise the policy's overload actions are tried in order: Degrade (clamp max_tokens to what
   fits now, not below ``minMaxTokens``, else rewrite to ``fallbackModel``), Queue (bounded; on
   timeout the actions after Queue apply), Reject (429 with Retry-After from the real refill or
   drain time).

KV reservation = prompt + n × max_tokens rounded up to the block size (vLLM allocates KV in
blocks: PagedAttention, Kwon et al., SOSP 2023).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvgate_agent.admission.bucket import BucketMap, TokenBucket
from kvgate_agent.admission.config import AdmissionConfig, LimitThreshold
from kvgate_agent.admission.decision import (
    AdmissionRequest,
    Decision,
    Outcome,
    Reason,
    Ticket,
    Waiter,
)
from kvgate_agent.contract.policy import LimitScope, OverloadAction, QueueOrder

Clock = Callable[[], float]

#: Initial decode time per output token before any request has finished, seconds. 20 ms is a
#: typical inter-token latency of a loaded vLLM server (vLLM benchmarks report ITL of 10–50 ms);
#: it is replaced by the observed average as soon as responses complete.
DEFAULT_SECONDS_PER_TOKEN = 0.02
#: Weight of each new observation in the seconds-per-token moving average.
EMA_ALPHA = 0.2
#: Upper bound on a Retry-After, seconds (one day), so a tiny rate cannot produce absurd values.
MAX_RETRY_AFTER = 86_400

# Enum members bound once: attribute access on an Enum class is slow on the hot path.
_ADMITTED = Outcome.ADMITTED
_OK = Reason.OK
_DEGRADE = OverloadAction.DEGRADE.value
_QUEUE = OverloadAction.QUEUE.value
_REJECT = OverloadAction.REJECT.value


def round_up(tokens: int, block_size: int) -> int:
    """``tokens`` rounded up to a whole number of KV blocks of ``block_size`` tokens."""
    return -(-tokens // block_size) * block_size


def retry_after_seconds(wait: float) -> int:
    """An HTTP Retry-After value from a wait in seconds: integer ≥ 1, at most a day."""
    if not math.isfinite(wait):
        return MAX_RETRY_AFTER
    return min(MAX_RETRY_AFTER, max(1, math.ceil(wait)))


@dataclass(slots=True)
class _Blocker:
    """What stops a request now. ``bucket`` is set for rate limits; ``tenant_scoped`` when only
    this tenant's own bucket blocks (others need not wait behind it)."""

    reason: Reason
    limit: str
    tenant_scoped: bool = False
    bucket: TokenBucket | None = None
    amount: float = 0.0
    threshold: LimitThreshold | None = None


class _Limit:
    __slots__ = ("cost", "is_tenant", "max_keys", "requests", "threshold")

    def __init__(self, threshold: LimitThreshold, now: float, max_tenants: int) -> None:
        self.threshold = threshold
        self.is_tenant = threshold.per is LimitScope.TENANT
        keys = max_tenants if threshold.per is LimitScope.TENANT else 1
        self.max_keys = keys
        self.requests: BucketMap | None = None
        self.cost: BucketMap | None = None
        if threshold.request_rate is not None and threshold.request_capacity is not None:
            self.requests = BucketMap(
                threshold.request_capacity,
                threshold.request_rate,
                now,
                threshold.warmup_seconds,
                keys,
            )
        if threshold.cost_rate is not None and threshold.cost_capacity is not None:
            self.cost = BucketMap(
                threshold.cost_capacity, threshold.cost_rate, now, threshold.warmup_seconds, keys
            )

    def key(self, tenant: str) -> str:
        return tenant if self.is_tenant else ""

    def update(self, threshold: LimitThreshold, now: float, warmup_start: float) -> None:
        """Take new numbers for the same limit (same name and scope) in place: the bucket maps
        and every bucket in them keep their identity (tickets hold references to them), their
        level carried over and clamped to the new capacity. A unit the limit no longer counts
        drops its map; a unit it newly counts starts a fresh one."""
        max_keys = self.max_keys
        self.requests = _retune(
            self.requests,
            threshold.request_capacity,
            threshold.request_rate,
            threshold.warmup_seconds,
            now,
            warmup_start,
            max_keys,
        )
        self.cost = _retune(
            self.cost,
            threshold.cost_capacity,
            threshold.cost_rate,
            threshold.warmup_seconds,
            now,
            warmup_start,
            max_keys,
        )
        self.threshold = threshold


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


@dataclass(slots=True)
class Hold:
    """A stop on every new admission (see :meth:`AdmissionController.hold`).

    Attributes:
        reason: the refusal reason (``fail_closed``, ``gpu_memory_low``).
        retry_after: seconds a refused client should wait (used while ``until`` is None).
        message: the explanation put in error bodies.
        until: clock time at which the hold ends by itself; None = until lifted.
    """

    reason: Reason
    retry_after: float
    message: str
    until: float | None = None


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
        self.config = config
        self.clock = clock
        self.started_at = clock()
        self._max_tenants = max_tenants
        self._limits = [_Limit(t, self.started_at, max_tenants) for t in config.limits]
        self._min_cost_capacity: float | None = _min_cost_capacity(config)
        self.in_flight = 0
        self.kv_reserved_tokens = 0
        self._tickets: dict[int, Ticket] = {}
        self._queue: dict[int, Waiter] = {}
        self._seq = 0
        self._head_blocked_shared = False
        self._resolved: list[Waiter] = []
        self.seconds_per_token = DEFAULT_SECONDS_PER_TOKEN
        self._holds: dict[str, Hold] = {}
        self._aging_rate = _aging_rate(config)

    # ------------------------------------------------------------------ observation

    @property
    def queue_length(self) -> int:
        """Requests waiting now."""
        return len(self._queue)

    @property
    def kv_capacity_tokens(self) -> int | None:
        """KV capacity enforced, tokens (None: not enforced)."""
        return self.config.kv_capacity_tokens

    def bucket_levels(self) -> list[tuple[str, str, str, float, float]]:
        """(limit name, unit, key, level, capacity) for every bucket held in memory now.
        ``unit`` is ``requests`` or ``cost``; ``key`` is the tenant, or "" for pod-wide buckets."""
        now = self.clock()
        out = []
        for lim in self._limits:
            for unit, bmap in (("requests", lim.requests), ("cost", lim.cost)):
                if bmap is None:
                    continue
                for key, b in bmap.items():
                    out.append((lim.threshold.name, unit, key, b.peek(now), b.capacity_at(now)))
        return out

    def tenants_tracked(self) -> int:
        """Number of tenant buckets held in memory (bounded by ``max_tenants`` per limit)."""
        return sum(
            len(m)
            for lim in self._limits
            for m in (lim.requests, lim.cost)
            if m is not None and lim.threshold.per is LimitScope.TENANT
        )

    def set_kv_capacity(self, tokens: int | None) -> None:
        """Enforce a new KV capacity (tokens; None = not enforced), e.g. the engine's own report.
        Reservations already held stay; waiters are re-examined on the next pump."""
        self.config = dataclasses.replace(self.config, kv_capacity_tokens=tokens)

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
        now = self.clock()
        old = {(lim.threshold.name, lim.threshold.per): lim for lim in self._limits}
        limits: list[_Limit] = []
        for t in config.limits:
            lim = old.get((t.name, t.per))
            if lim is None:
                lim = _Limit(t, self.started_at, self._max_tenants)
            else:
                lim.update(t, now, self.started_at)
            limits.append(lim)
        self._limits = limits
        self.config = config
        self._min_cost_capacity = _min_cost_capacity(config)
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
        if not retry_after > 0:
            raise ValueError(f"retry_after must be > 0 seconds, got {retry_after}")
        self._holds[key if key is not None else reason.value] = Hold(
            reason, retry_after, message, until
        )

    def lift(self, key: str | Reason) -> bool:
        """End the hold named ``key`` (a key given to :meth:`hold`, or the reason it defaulted
        to). Returns whether one was active. Waiters are admitted on the next :meth:`pump`."""
        name = key.value if isinstance(key, Reason) else key
        return self._holds.pop(name, None) is not None

    def active_hold(self) -> Hold | None:
        """The hold that decides now: of all active holds, the one with the longest remaining
        wait (no request is admitted before every hold ends); None when admission is open.
        Holds past their ``until`` are forgotten."""
        if not self._holds:
            return None
        return self._active_hold(self.clock())

    def _active_hold(self, now: float) -> Hold | None:
        best: Hold | None = None
        best_wait = -1.0
        for key, h in list(self._holds.items()):
            if h.until is not None and now >= h.until:
                del self._holds[key]
                continue
            wait = h.retry_after if h.until is None else h.until - now
            if wait > best_wait:
                best, best_wait = h, wait
        return best

    def _hold_refusal(self, h: Hold, now: float, max_tokens: int) -> Decision:
        wait = h.retry_after if h.until is None else h.until - now
        return self._refuse(h.reason, h.reason.value, 503, wait, max_tokens, h.message)

    @property
    def fail_closed_until(self) -> float | None:
        """Clock time until which admission is held with ``fail_closed`` through this
        attribute (kept for compatibility: prefer :meth:`hold`); None when not held."""
        h = self._holds.get(_FAIL_CLOSED_UNTIL)
        return None if h is None else h.until

    @fail_closed_until.setter
    def fail_closed_until(self, until: float | None) -> None:
        if until is None:
            self._holds.pop(_FAIL_CLOSED_UNTIL, None)
            return
        self._holds[_FAIL_CLOSED_UNTIL] = Hold(
            Reason.FAIL_CLOSED,
            max(1e-3, until - self.clock()),
            "admission thresholds are stale and failureMode is FailClosed",
            until,
        )

    # ------------------------------------------------------------------ arithmetic

    def _kv_tokens(self, prompt: int, max_tokens: int, n: int) -> int:
        return round_up(prompt + n * max_tokens, self.config.block_size)

    def _max_tokens_within(
        self, prompt: int, n: int, kv_room: int | None, cost_room: float | None
    ) -> int | None:
        """Largest max_tokens whose reservation fits ``kv_room`` tokens and whose cost fits
        ``cost_room`` units; None = unbounded by both."""
        best: int | None = None
        if kv_room is not None:
            usable = (kv_room // self.config.block_size) * self.config.block_size
            best = (usable - prompt) // n
        cfg = self.config
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

    def _cost(self, req: AdmissionRequest, max_tokens: int) -> float:
        return self.config.cost(req.prompt_tokens, req.n * max_tokens)

    def _max_fit_ever(self, req: AdmissionRequest) -> int | None:
        """Largest max_tokens that could ever be admitted (full capacities); None = unbounded."""
        kv = self.config.kv_capacity_tokens
        cost_room: float | None = None
        for lim in self._limits:
            cap = lim.threshold.cost_capacity
            if lim.cost is not None and cap is not None:
                cost_room = cap if cost_room is None else min(cost_room, cap)
        return self._max_tokens_within(req.prompt_tokens, req.n, kv, cost_room)

    # ------------------------------------------------------------------ checks

    def _blocker(
        self,
        req: AdmissionRequest,
        max_tokens: int,
        now: float,
        with_buckets: bool = True,
        found: list[tuple[TokenBucket, float, bool]] | None = None,
        kv: int = -1,
        cost: float = -1.0,
    ) -> _Blocker | None:
        """What stops ``req`` with ``max_tokens`` now, or None if it fits. When ``found`` is
        given, the buckets checked are appended to it as (bucket, units, is_cost), so the
        reservation that follows in the same call needs no second lookup. ``kv`` and ``cost``
        may be passed in when the caller already computed them."""
        cfg = self.config
        if cfg.max_concurrency is not None and self.in_flight >= cfg.max_concurrency:
            return _Blocker(Reason.CONCURRENCY, "concurrency")
        if cfg.kv_capacity_tokens is not None:
            if kv < 0:
                kv = self._kv_tokens(req.prompt_tokens, max_tokens, req.n)
            if self.kv_reserved_tokens + kv > cfg.kv_capacity_tokens:
                return _Blocker(Reason.KV_CAPACITY, "kv")
        if not with_buckets:
            return None
        tenant = req.tenant
        for lim in self._limits:
            key = tenant if lim.is_tenant else ""
            if lim.requests is not None:
                b = lim.requests.get(key, now)
                if b.refill(now) < 1.0:
                    t = lim.threshold
                    return _Blocker(Reason.RATE_LIMIT_REQUESTS, t.name, lim.is_tenant, b, 1.0, t)
                if found is not None:
                    found.append((b, 1.0, False))
            if lim.cost is not None:
                if cost < 0:
                    cost = cfg.cost(req.prompt_tokens, req.n * max_tokens)
                b = lim.cost.get(key, now)
                if b.refill(now) < cost:
                    t = lim.threshold
                    return _Blocker(Reason.RATE_LIMIT_TOKENS, t.name, lim.is_tenant, b, cost, t)
                if found is not None:
                    found.append((b, cost, True))
        return None

    def _reserve(
        self,
        req: AdmissionRequest,
        max_tokens: int,
        now: float,
        with_buckets: bool = True,
        found: list[tuple[TokenBucket, float, bool]] | None = None,
        kv: int = -1,
    ) -> Ticket:
        """Take the reservations for ``req``; only after :meth:`_blocker` said it fits, in the
        same call (so every bucket holds at least what is taken)."""
        if kv < 0:
            kv = self._kv_tokens(req.prompt_tokens, max_tokens, req.n)
        if found is None:
            found = []
            if with_buckets:
                self._blocker(req, max_tokens, now, found=found)
        for b, amount, _ in found:
            b.level -= amount
            b.pins += 1
        ticket = Ticket(req.tenant, req.prompt_tokens, max_tokens, req.n, kv, now, found)
        self.in_flight += 1
        self.kv_reserved_tokens += kv
        self._tickets[id(ticket)] = ticket
        return ticket

    # ------------------------------------------------------------------ submit

    def submit(self, req: AdmissionRequest) -> Decision:
        """Decide on one request now.

        Returns a :class:`Decision`: admitted/degraded with a ticket, rejected with status and
        Retry-After, or queued with a waiter (await it through the asyncio driver, or call
        :meth:`pump` and read ``waiter.decision``). ``req.max_tokens`` must be ≥ 1.
        """
        now = self.clock()
        cfg = self.config
        if self._holds:
            h = self._active_hold(now)
            if h is not None:
                return self._hold_refusal(h, now, req.max_tokens)
        clamped = False
        kv = self._kv_tokens(req.prompt_tokens, req.max_tokens, req.n)
        cost = cfg.cost(req.prompt_tokens, req.n * req.max_tokens)
        cap = self._min_cost_capacity
        fits_ever = (cfg.kv_capacity_tokens is None or kv <= cfg.kv_capacity_tokens) and (
            cap is None or cost <= cap
        )
        max_fit = None if fits_ever else self._max_fit_ever(req)
        if max_fit is not None and req.max_tokens > max_fit:
            floor = cfg.min_max_tokens
            if _DEGRADE in cfg.actions and floor is not None and max_fit >= floor:
                req.max_tokens = max_fit
                clamped = True
                kv, cost = -1, -1.0
            else:
                refusal = self._refuse(
                    Reason.EXCEEDS_CAPACITY,
                    self._exceeding_limit(req),
                    400,
                    None,
                    req.max_tokens,
                    f"request needs more than this server's capacity allows "
                    f"(prompt {req.prompt_tokens} tokens + max_tokens {req.max_tokens}"
                    + ("" if req.n == 1 else f" × n {req.n}")
                    + "); "
                    + (
                        f"lower max_tokens to at most {max_fit}"
                        if max_fit >= 1
                        else "shorten the prompt"
                    ),
                )
                refusal.param = "max_tokens" if max_fit >= 1 else "prompt"
                return refusal

        found: list[tuple[TokenBucket, float, bool]] = []
        blocker = self._blocker(req, req.max_tokens, now, found=found, kv=kv, cost=cost)
        if blocker is None and not (self._queue and self._head_blocked_shared):
            ticket = self._reserve(req, req.max_tokens, now, found=found, kv=kv)
            if clamped:
                return Decision(
                    Outcome.DEGRADED,
                    Reason.MAX_TOKENS_CLAMPED,
                    ticket=ticket,
                    max_tokens=req.max_tokens,
                )
            return Decision(_ADMITTED, _OK, ticket, req.max_tokens)
        return self._overload(req, blocker, cfg.actions, now, clamped, 0.0)

    def _overload(
        self,
        req: AdmissionRequest,
        blocker: _Blocker | None,
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
                if len(self._queue) >= self.config.queue_max_length:
                    queue_full = True
                    continue
                return self._enqueue(req, actions[i + 1 :], now, clamped)
            else:
                break
        return self._reject(req, blocker, now, waited, queue_full)

    def _degrade(
        self, req: AdmissionRequest, blocker: _Blocker | None, now: float, waited: float
    ) -> Decision | None:
        cfg = self.config
        if blocker is None:
            return None
        if waited == 0 and self._queue and self._head_blocked_shared:
            # Others already wait for the same capacity: a newcomer must not take it first,
            # not even a degraded one.
            return None
        # 1. Clamp max_tokens to what fits now (not below minMaxTokens).
        if cfg.min_max_tokens is not None and blocker.reason in (
            Reason.KV_CAPACITY,
            Reason.RATE_LIMIT_TOKENS,
        ):
            kv_room = (
                None
                if cfg.kv_capacity_tokens is None
                else cfg.kv_capacity_tokens - self.kv_reserved_tokens
            )
            cost_room: float | None = None
            for lim in self._limits:
                if lim.cost is not None:
                    level = lim.cost.get(lim.key(req.tenant), now).refill(now)
                    cost_room = level if cost_room is None else min(cost_room, level)
            m = self._max_tokens_within(req.prompt_tokens, req.n, kv_room, cost_room)
            if (
                m is not None
                and cfg.min_max_tokens <= m < req.max_tokens
                and self._blocker(req, m, now) is None
            ):
                req.max_tokens = m
                ticket = self._reserve(req, m, now)
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
            and self._blocker(req, req.max_tokens, now, with_buckets=False) is None
        ):
            ticket = self._reserve(req, req.max_tokens, now, with_buckets=False)
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
        blocker: _Blocker | None,
        now: float,
        waited: float,
        queue_full: bool = False,
    ) -> Decision:
        if blocker is None:
            blocker = self._head_blocker(now) or _Blocker(Reason.QUEUE_FULL, "queue")
        wait = self._wait_for(req, blocker, now)
        message = _REFUSAL_TEXT[blocker.reason].format(limit=blocker.limit)
        reason = blocker.reason
        if waited > 0:
            reason = Reason.QUEUE_TIMEOUT
            message = f"timed out after {waited:.1f}s in the admission queue: {message}"
        elif req.priority < 0 and _QUEUE in self.config.actions:
            reason = Reason.SHEDDABLE
            message = f"sheddable request (negative priority) not queued: {message}"
        elif queue_full:
            reason = Reason.QUEUE_FULL
            message = f"the admission queue is full: {message}"
        d = self._refuse(reason, blocker.limit, 429, wait, req.max_tokens, message)
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

    @staticmethod
    def _refuse(
        reason: Reason, limit: str, status: int, wait: float | None, max_tokens: int, message: str
    ) -> Decision:
        return Decision(
            Outcome.REJECTED,
            reason,
            status=status,
            retry_after=None if wait is None else retry_after_seconds(wait),
            max_tokens=max_tokens,
            limit=limit,
            message=message,
        )

    def _exceeding_limit(self, req: AdmissionRequest) -> str:
        kv = self.config.kv_capacity_tokens
        if kv is not None and self._kv_tokens(req.prompt_tokens, req.max_tokens, req.n) > kv:
            return "kv"
        for lim in self._limits:
            cap = lim.threshold.cost_capacity
            if cap is not None and self._cost(req, req.max_tokens) > cap:
                return lim.threshold.name
        return "capacity"

    # ------------------------------------------------------------------ Retry-After

    def _wait_for(self, req: AdmissionRequest, blocker: _Blocker, now: float) -> float:
        """Seconds until the blocking resource could admit ``req``: bucket refill time, or the
        expected drain of in-flight (and already queued) work for concurrency and KV."""
        if blocker.bucket is not None:
            # Waiters drawing on the same bucket are served first: count their demand too.
            per_request = blocker.reason is Reason.RATE_LIMIT_REQUESTS
            queued = 0.0
            for w in self._queue.values():
                other = w.request
                if other is req or (blocker.tenant_scoped and other.tenant != req.tenant):
                    continue
                queued += (
                    1.0
                    if per_request
                    else self.config.cost(other.prompt_tokens, other.n * other.max_tokens)
                )
            b = blocker.bucket
            wait = b.seconds_until(blocker.amount, now)
            if queued:
                wait = max(wait, (blocker.amount + queued - b.refill(now)) / b.rate)
            return wait
        ends = sorted(
            (t.admitted_at + (t.max_tokens + 1) * self.seconds_per_token, t.kv_tokens)
            for t in self._tickets.values()
        )
        if not ends:
            return self.seconds_per_token * max(1, req.max_tokens)
        floor = self.seconds_per_token
        queued_kv = sum(w.kv_tokens for w in self._queue.values())
        if blocker.reason is Reason.KV_CAPACITY and self.config.kv_capacity_tokens is not None:
            need = (
                self.kv_reserved_tokens
                + queued_kv
                + self._kv_tokens(req.prompt_tokens, req.max_tokens, req.n)
                - self.config.kv_capacity_tokens
            )
            freed = 0
            for end, kv in ends:
                freed += kv
                if freed >= need:
                    return max(floor, end - now)
            return max(floor, ends[-1][0] - now)
        # Concurrency (or "others queued ahead"): the (queued + 1)-th completion frees our slot.
        slots_needed = len(self._queue) + 1
        if self.config.max_concurrency is not None:
            slots_needed += max(0, self.in_flight - self.config.max_concurrency)
        rounds, idx = divmod(slots_needed - 1, len(ends))
        span = ends[-1][0] - min(now, ends[0][0]) if rounds else 0.0
        return max(floor, ends[idx][0] - now + rounds * max(span, floor))

    # ------------------------------------------------------------------ queue

    def _enqueue(
        self, req: AdmissionRequest, remaining: tuple[str, ...], now: float, clamped: bool
    ) -> Decision:
        self._seq += 1
        w = Waiter(
            req,
            self._seq,
            now,
            now + self.config.queue_max_wait_seconds,
            self._kv_tokens(req.prompt_tokens, req.max_tokens, req.n),
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
        order = self.config.queue_order
        if order is QueueOrder.PRIORITY:
            waiters.sort(key=lambda w: (-w.request.priority, w.seq))
        elif order is QueueOrder.SHORTEST_FIRST:
            rate = self._aging_rate
            waiters.sort(key=lambda w: (w.kv_tokens - (now - w.enqueued_at) * rate, w.seq))
        return waiters

    def _head_blocker(self, now: float) -> _Blocker | None:
        for w in self._ordered(now):
            b = self._blocker(w.request, w.request.max_tokens, now)
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
        done = self._resolved
        held = self._active_hold(now) if self._holds else None
        for w in [w for w in self._queue.values() if now >= w.deadline]:
            del self._queue[w.seq]
            waited = now - w.enqueued_at
            if held is not None:  # no admission of any kind while held, not even degraded
                d = self._hold_refusal(held, now, w.request.max_tokens)
                d.message = f"timed out after {waited:.1f}s in the admission queue: {d.message}"
                d.queue_seconds = waited
                w.decision = d
                done.append(w)
                continue
            blocker = self._blocker(w.request, w.request.max_tokens, now)
            actions = w.remaining_actions
            if _DEGRADE in self.config.actions and _DEGRADE not in actions:
                actions = (_DEGRADE, *actions)  # having waited its turn, it may still degrade
            w.decision = self._overload(
                w.request, blocker, actions, now, w.clamped, max(waited, 1e-9)
            )
            done.append(w)
        self._head_blocked_shared = False
        if held is not None:
            return
        for w in self._ordered(now):
            b = self._blocker(w.request, w.request.max_tokens, now)
            if b is None:
                del self._queue[w.seq]
                ticket = self._reserve(w.request, w.request.max_tokens, now)
                outcome = Outcome.DEGRADED if w.clamped else Outcome.QUEUED
                reason = Reason.MAX_TOKENS_CLAMPED if w.clamped else Reason.OK
                w.decision = Decision(
                    outcome,
                    reason,
                    ticket=ticket,
                    max_tokens=w.request.max_tokens,
                    queue_seconds=now - w.enqueued_at,
                )
                done.append(w)
                continue
            w.retry_at = (
                None if b.bucket is None else now + max(1e-3, b.bucket.seconds_until(b.amount, now))
            )
            if not b.tenant_scoped:
                self._head_blocked_shared = True
                break

    def reject_waiting(self, reason: Reason, status: int, retry_after: float, message: str) -> None:
        """Refuse everybody still waiting (e.g. shutting down): each waiter's decision becomes
        a rejection with ``status`` and ``retry_after`` seconds, collected for
        :meth:`take_resolved`."""
        now = self.clock()
        for w in list(self._queue.values()):
            del self._queue[w.seq]
            d = self._refuse(reason, "queue", status, retry_after, w.request.max_tokens, message)
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
        earliest queue deadline or bucket refill a waiter needs; None when nobody waits."""
        t: float | None = None
        for w in self._queue.values():
            c = w.deadline if w.retry_at is None else min(w.deadline, w.retry_at)
            t = c if t is None else min(t, c)
        if t is not None:
            for h in self._holds.values():  # a hold that ends by itself lets waiters in
                if h.until is not None:
                    t = min(t, h.until)
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
        prompt = ticket.prompt_tokens if prompt_tokens is None else prompt_tokens
        cfg = self.config
        actual = cfg.cost(prompt, completion_tokens) if reached_upstream else 0.0
        for bucket, amount, is_cost in ticket.holds:
            used = actual if is_cost else (1.0 if reached_upstream else 0.0)
            if used < amount:
                bucket.put_back(amount - used, now)
            elif used > amount:
                bucket.charge(used - amount, now)
            bucket.pins -= 1
        self.in_flight -= 1
        self.kv_reserved_tokens -= ticket.kv_tokens
        del self._tickets[id(ticket)]
        if reached_upstream and completion_tokens > 0:
            per_token = (now - ticket.admitted_at) / completion_tokens
            self.seconds_per_token += EMA_ALPHA * (per_token - self.seconds_per_token)
        return True


#: Key of the hold set through the ``fail_closed_until`` compatibility attribute.
_FAIL_CLOSED_UNTIL = "fail_closed_until"


def _min_cost_capacity(config: AdmissionConfig) -> float | None:
    caps = [t.cost_capacity for t in config.limits if t.cost_capacity is not None]
    return min(caps) if caps else None


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
