"""Token buckets for request and cost budgets, and a bounded keyed set of them.

:class:`Bucket` is what admission asks of any bucket; :class:`TokenBucket` is the local one,
:class:`SharedBucket` this pod's slice of a fleet-wide one (it never refills by itself).

A bucket holds up to ``capacity`` units and refills at ``rate`` units per second (the classic token
bucket, e.g. RFC 2697's committed-burst bucket). Units are whatever the limit counts: requests, or
cost units (see ``CostSpec``). All times are seconds on a monotonic clock the caller passes in.

Invariants kept on every path: ``0 <= level <= capacity(now)``; a clock that steps back adds
nothing; days of idleness refill to capacity, never beyond (no float overflow: the refill is
``min(capacity, level + elapsed * rate)``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Final

#: A warming bucket starts at this fraction of its capacity and ramps linearly to full over
#: ``warmup_seconds`` (cold-start protection; the fraction is kvgate's choice, documented in
#: ``RateLimitSpec``).
WARMUP_START_FRACTION: Final = 0.25
#: A slice holding less than a request asks never offers a wait below this (seconds): only a
#: sync can top it up, so looking again sooner is wasted work.
SHORT_SLICE_WAIT_S: Final = 0.05


class Bucket(ABC):
    """What admission asks of a bucket: units (requests or cost units) taken by an admission,
    put back or charged at settlement, and the wait until an amount is there (Retry-After).

    ``capacity``: full capacity, units; ``rate``: units per second; ``level``: units held now;
    ``last``: clock seconds of the last look; ``pins``: reservations held against it (a pinned
    bucket is in use and never evicted).
    """

    __slots__ = ("capacity", "last", "level", "pins", "rate")

    capacity: float
    rate: float
    level: float
    last: float
    pins: int

    @abstractmethod
    def capacity_at(self, now: float) -> float:
        """The capacity in force at ``now``, units (below ``capacity`` only while warming)."""

    @abstractmethod
    def refill(self, now: float) -> float:
        """The level at ``now`` (units), after adding what accrued (if the bucket refills)."""

    @abstractmethod
    def peek(self, now: float) -> float:
        """The level at ``now`` (units) without changing any state (for metrics)."""

    @abstractmethod
    def put_back(self, amount: float, now: float) -> None:
        """Return ``amount`` units (a refund)."""

    @abstractmethod
    def charge(self, amount: float, now: float) -> None:
        """Take ``amount`` units unconditionally (usage beyond what was reserved)."""

    @abstractmethod
    def seconds_until(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` units could be taken; ``inf`` when never."""

    @abstractmethod
    def forgettable(self, now: float) -> bool:
        """True when the bucket's state carries nothing a new one would not (it may be
        evicted)."""

    def fleet_lacks(self, amount: float) -> bool:
        """True when a fleet-wide budget this bucket is a slice of cannot cover ``amount`` units
        on any replica either; always False for a bucket of this pod's own."""
        return False

    def take(self, amount: float, now: float) -> bool:
        """Take ``amount`` units if the bucket holds them; returns whether it did."""
        if self.refill(now) >= amount:
            self.level -= amount
            return True
        return False


class TokenBucket(Bucket):
    """One local token bucket.

    Args:
        capacity: full capacity in units (> 0).
        rate: refill in units per second (> 0).
        now: creation time, seconds (monotonic).
        warmup_start: when the warm-up ramp began (the pod's start), seconds; None = no warm-up.
        warmup_seconds: length of the ramp, seconds.

    During warm-up the effective capacity is
    ``capacity × (f + (1 − f) × min(1, (now − warmup_start) / warmup_seconds))`` with
    ``f = WARMUP_START_FRACTION``, and a new bucket starts full at its effective capacity.
    """

    __slots__ = ("_ramp_end", "_ramp_start")

    def __init__(
        self,
        capacity: float,
        rate: float,
        now: float,
        warmup_start: float | None = None,
        warmup_seconds: float = 0.0,
    ) -> None:
        if capacity <= 0 or rate <= 0 or not math.isfinite(capacity) or not math.isfinite(rate):
            raise ValueError(
                f"bucket needs finite capacity > 0 and rate > 0, got {capacity}, {rate}"
            )
        self.capacity = capacity
        self.rate = rate
        self._ramp_start = warmup_start if warmup_start is not None else now
        self._ramp_end = self._ramp_start + warmup_seconds if warmup_seconds > 0 else -math.inf
        self.last = now
        self.level = self.capacity_at(now)
        self.pins = 0  # reservations held against this bucket (a pinned bucket is in use)

    def capacity_at(self, now: float) -> float:
        """Effective capacity at ``now`` (units), lower than ``capacity`` only during warm-up."""
        if now >= self._ramp_end:
            return self.capacity
        span = self._ramp_end - self._ramp_start
        frac = max(0.0, (now - self._ramp_start) / span)
        return self.capacity * (WARMUP_START_FRACTION + (1.0 - WARMUP_START_FRACTION) * frac)

    def refill(self, now: float) -> float:
        """Add what accrued since the last refill; returns the level (units)."""
        elapsed = now - self.last
        if elapsed > 0:
            self.last = now
            cap = self.capacity if now >= self._ramp_end else self.capacity_at(now)
            level = self.level + elapsed * self.rate
            self.level = cap if level > cap else level
        return self.level

    def peek(self, now: float) -> float:
        """The level at ``now`` (units) without changing any state (for metrics)."""
        elapsed = now - self.last
        if elapsed <= 0:
            return self.level
        return min(self.capacity_at(now), self.level + elapsed * self.rate)

    def put_back(self, amount: float, now: float) -> None:
        """Return ``amount`` units (a refund), never above the effective capacity."""
        cap = self.capacity_at(now)
        self.level = min(cap, self.refill(now) + amount)

    def charge(self, amount: float, now: float) -> None:
        """Take ``amount`` units unconditionally (usage beyond what was reserved), never below 0."""
        self.level = max(0.0, self.refill(now) - amount)

    def seconds_until(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` units are available, 0 if now; ``inf`` if ``amount`` exceeds
        the full capacity: waiting can never help, so no finite wait is offered
        (https://github.com/bucket4j/bucket4j/issues/220)."""
        if amount > self.capacity:
            return math.inf
        level = self.refill(now)
        wait = max(0.0, (amount - level) / self.rate)
        if amount > self.capacity_at(now):
            # Capacity itself must ramp up first: solve capacity_at(now + t) >= amount.
            span = self._ramp_end - self._ramp_start
            need_frac = (amount / self.capacity - WARMUP_START_FRACTION) / (
                1.0 - WARMUP_START_FRACTION
            )
            wait = max(wait, self._ramp_start + need_frac * span - now)
        return wait

    def forgettable(self, now: float) -> bool:
        """True when the bucket is back at full capacity (a new one starts full)."""
        return self.refill(now) >= self.capacity


class SharedBucket(Bucket):
    """This pod's slice (lease) of one fleet-wide bucket held in the store (:mod:`.lease`).

    It never refills by itself: ``level`` is what the leases granted (already debited from the
    shared bucket), plus refunds from settlement, minus what admission took; the lease book
    tops it up in the background. ``rate`` and ``capacity`` are the shared bucket's (units per
    second, units), used for Retry-After. Usage beyond a reservation may take ``level`` below 0
    (at most one capacity): the next leases pay it back, so nothing is spent twice.

    Attributes:
        debt: units credited here that the shared bucket has not been charged yet (the first
            slice of a new key, and the local share credited while the store is unreachable
            under FailOpen); charged at the next sync.
        mark: ``level`` right after the last sync (the demand since is ``mark - level``).
        demand: smoothed demand, units per second.
        shared_level: the shared bucket's level at the last sync (units; 0 before one).
        synced: a sync with the store has answered for this slice (``shared_level`` is the
            store's figure, not the initial 0).
        need: the largest amount (units) a request blocked by this slice asked of it since the
            slice last held that much: the next lease asks for at least that (a request costing
            more than a usual slice must still be admitted at some point).
        sync_at: clock seconds of the next sync that could top the slice up (set by the lease
            book).
    """

    __slots__ = ("debt", "demand", "mark", "need", "shared_level", "sync_at", "synced")

    def __init__(self, capacity: float, rate: float, now: float, level: float = 0.0) -> None:
        if capacity <= 0 or rate <= 0 or not math.isfinite(capacity) or not math.isfinite(rate):
            raise ValueError(
                f"bucket needs finite capacity > 0 and rate > 0, got {capacity}, {rate}"
            )
        self.capacity = capacity
        self.rate = rate
        self.last = now
        self.pins = 0
        self.level = level
        self.debt = level
        self.mark = level
        self.demand = 0.0
        self.shared_level = 0.0
        self.need = 0.0
        self.sync_at = now
        self.synced = False

    def capacity_at(self, now: float) -> float:
        """The shared bucket's capacity (a slice does not warm up)."""
        return self.capacity

    def refill(self, now: float) -> float:
        """The level (units); notes that admission looked at the slice (``last``: a slice a
        request asked for, even in vain, is not idle)."""
        self.last = now
        return self.level

    def peek(self, now: float) -> float:
        """The level (units)."""
        return self.level

    def put_back(self, amount: float, now: float) -> None:
        """Return ``amount`` units (a settlement refund), never above the capacity."""
        self.level = min(self.capacity, self.refill(now) + amount)

    def charge(self, amount: float, now: float) -> None:
        """Take ``amount`` units unconditionally, down to ``-capacity`` (a debt the next leases
        pay)."""
        self.level = max(-self.capacity, self.level - amount)

    def seconds_until(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` units could be here: what the shared bucket lacks (as of the
        last sync) at its refill rate, and never before the next sync (or
        :data:`SHORT_SLICE_WAIT_S`) while the slice holds less than ``amount``; ``inf`` above
        the full capacity. A short slice notes ``amount`` in :attr:`need`."""
        if amount > self.capacity:
            return math.inf
        lacking = amount - max(0.0, self.level) - max(0.0, self.shared_level)
        wait = max(0.0, lacking / self.rate)
        if self.level < amount:
            self.need = max(self.need, amount)
            wait = max(wait, self.sync_at - now, SHORT_SLICE_WAIT_S)
        return wait

    def fleet_lacks(self, amount: float) -> bool:
        """True when the whole fleet-wide budget, as of the last sync, cannot cover ``amount``
        units either (this slice's level plus the shared bucket's): every replica would refuse
        the request alike. False before any sync (unknown: another replica's slice may hold
        it) and when only this slice is short (the next sync may top it up)."""
        return self.synced and amount > max(0.0, self.level) + max(0.0, self.shared_level)

    def forgettable(self, now: float) -> bool:
        """True when the slice holds and owes nothing of the shared budget."""
        return self.level == 0.0 and self.debt == 0.0


class BucketMap:
    """Buckets keyed by tenant (or a fixed key for pod-wide limits), bounded in memory.

    A bucket untouched for ``idle_seconds``, back at full capacity and holding no reservation
    carries no information (a new one starts full), so it is evicted; the map is also capped at
    ``max_keys`` entries, evicting the least recently used, so endless new tenant ids cannot grow
    memory without bound. Eviction is amortised O(1): each new key examines at most two of the
    oldest entries.
    """

    __slots__ = (
        "_buckets",
        "_last",
        "_touch",
        "capacity",
        "evicted",
        "first_slice",
        "idle_seconds",
        "max_keys",
        "rate",
        "warmup_seconds",
        "warmup_start",
    )

    def __init__(
        self,
        capacity: float,
        rate: float,
        warmup_start: float,
        warmup_seconds: float = 0.0,
        max_keys: int = 100_000,
        idle_seconds: float = 60.0,
    ) -> None:
        self.capacity = capacity
        self.rate = rate
        self.warmup_start = warmup_start
        self.warmup_seconds = warmup_seconds
        self.max_keys = max_keys
        self.idle_seconds = idle_seconds
        self._buckets: OrderedDict[str, Bucket] = OrderedDict()
        # The bound method, kept: mypyc calls an OrderedDict's methods by name otherwise (a
        # method lookup on every admission, per bucket).
        self._touch: Callable[[str], None] = self._buckets.move_to_end
        #: The key last returned by :meth:`get`, at the end of the order (None: unknown): the
        #: same key again needs no move.
        self._last: str | None = None
        #: None: local buckets. A number: the buckets are :class:`SharedBucket` slices of a
        #: fleet-wide budget, a new one starting with this many units (charged later).
        self.first_slice: float | None = None
        #: Slices dropped by the hard cap while holding units or owing some: (key, slice), for
        #: the lease book's final hand-back.
        self.evicted: list[tuple[str, SharedBucket]] = []

    def get(self, key: str, now: float) -> Bucket:
        """The bucket for ``key``, created full (at its warm-up capacity) if absent."""
        b = self._buckets.get(key)
        if b is None:
            self._evict(now)
            if self.first_slice is None:
                b = TokenBucket(
                    self.capacity, self.rate, now, self.warmup_start, self.warmup_seconds
                )
            else:
                b = SharedBucket(self.capacity, self.rate, now, self.first_slice)
            self._buckets[key] = b
        elif key != self._last:
            self._touch(key)
        self._last = key
        return b

    def _evict(self, now: float) -> None:
        # Look at the two oldest entries: drop the idle ones, rotate busy ones to the back so an
        # in-use bucket at the front cannot shield idle ones behind it. Over the hard cap, the
        # least recently used goes regardless (its in-flight tickets keep their own reference).
        buckets = self._buckets
        self._last = None  # (the order changes here; get sets it again)
        for _ in range(2):
            if not buckets:
                return
            key, oldest = next(iter(buckets.items()))
            if len(buckets) >= self.max_keys or (
                oldest.pins == 0
                and now - oldest.last >= self.idle_seconds
                and oldest.forgettable(now)
            ):
                del buckets[key]
                if isinstance(oldest, SharedBucket) and not oldest.forgettable(now):
                    self.evicted.append((key, oldest))
            elif now - oldest.last >= self.idle_seconds or oldest.pins:
                buckets.move_to_end(key)
            else:
                return  # the oldest was touched recently: so were all the others

    def __len__(self) -> int:
        return len(self._buckets)

    def items(self) -> Iterator[tuple[str, Bucket]]:
        """(key, bucket) pairs, least recently used first."""
        return iter(list(self._buckets.items()))
