"""Leases: how one sidecar holds its slices of the fleet-wide buckets of ``shared`` limits.

A shared limit's budget lives in one token bucket in the store (a Redis); each sidecar keeps a
local :class:`~kvgate_agent.admission.bucket.SharedBucket` per key, holding a slice (a lease) of
it, and admission decides on that local level alone: no request waits on the store. The
:class:`LeaseBook` here is pure (clock injected, no I/O): each :meth:`LeaseBook.tick` says
whether a sync is due and what it carries, the store module (``kvgate_agent.sidecar.store.buckets``)
sends it as one atomic script call and hands the answer to :meth:`LeaseBook.done` (or reports
:meth:`LeaseBook.failed`).

Sizing: a slice covers :data:`DEMAND_HORIZON_S` seconds of the key's recent demand (a
time-weighted moving average of what admission took), at least a quarter and at most
:data:`MAX_LEASE_FRACTION` of the burst; it is renewed once its level falls below half that
target, handed back after :data:`IDLE_SECONDS` without use and at shutdown. A request costing
more than that (a small burst, a large ``max_tokens``) leaves its amount in the slice's ``need``:
the next lease asks for what is missing of it (at most a burst), so it is admitted once the
shared bucket holds that much. A grant below what was asked (the shared bucket is drained) backs
off until the shared refill could cover the rest.

Overshoot bound: a slice is debited from the shared bucket when granted, so over any window the
fleet admits at most the shared bucket's own bound (burst + rate x window) plus what was
outstanding locally at the window's start: Σ over sidecars of their slices' positive levels and
their uncharged debt (:meth:`LeaseBook.outstanding`, exported as
``kvgate_shared_lease_outstanding``). Per key and sidecar that is at most
2 x ``MAX_LEASE_FRACTION`` x burst (a lease, and the first slice a new key starts with before
its first sync, charged then), or a lease the size of the largest request waiting; plus,
while the store is unreachable under FailOpen, the local share credited (charged once it
answers again). Usage beyond a reservation is owed by the slice (its
level goes below 0) and paid from its next lease.

Faults: a sync that fails twice in a row (each bounded by the store's timeout) marks the store
down, which with syncs at least every ``LEASE_SECONDS / 2`` happens within :data:`LEASE_SECONDS`
of the store going away. Then under FailOpen each slice is credited this pod's share of the
refill (rate / peers, up to burst / peers; peers as last seen in the store, or the operator's
split ``globalShare`` before any sync answered) and the credit is
recorded as debt; under FailClosed nothing is credited and the sidecar refuses new work (503).
Once the store answers again the debt is charged to the shared bucket first: what was spent
during the outage is not spent twice.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from kvgate_agent.admission.bucket import BucketMap, SharedBucket

#: Lease period, seconds: a sidecar holding or needing slices syncs at least every half of it,
#: and falls back (FailOpen/FailClosed) within it once the store stops answering.
LEASE_SECONDS: Final = 8.0
#: A slice covers this many seconds of the key's recent demand.
DEMAND_HORIZON_S: Final = 8.0
#: Time constant of the demand average, seconds.
DEMAND_TAU_S: Final = 2.0
#: A slice never exceeds this fraction of the shared burst (bounds the overshoot per sidecar).
MAX_LEASE_FRACTION: Final = 0.1
#: A slice is renewed once its level is below this fraction of its target.
LOW_WATER: Final = 0.5
#: A slice unused this long (seconds) is handed back.
IDLE_SECONDS: Final = 10.0
#: After a failed sync, the next try comes this soon, seconds.
RETRY_SECONDS: Final = 0.5
#: Consecutive failed syncs that mark the store down.
FAILURES_DOWN: Final = 2


class StoreState(StrEnum):
    """Where the shared budgets stand for this sidecar: ``shared`` (leases from the store),
    ``local`` (store unreachable, FailOpen: this pod's share of the budget), ``closed`` (store
    unreachable, FailClosed: new work refused)."""

    SHARED = "shared"
    LOCAL = "local"
    CLOSED = "closed"


@dataclass(slots=True)
class SliceOp:
    """One bucket's part in a sync.

    Attributes:
        name: ``limit:unit:tenant`` (the store key's tail).
        bucket: the local slice.
        want: units asked for (0: none).
        give_back: units handed back (already taken off the local level).
        debt: units to charge unconditionally (already spent here).
        final: the slice is gone here (its limit removed, or evicted by the key cap): this
            op is its last, retried until the store takes it.
    """

    name: str
    bucket: SharedBucket
    want: float
    give_back: float
    debt: float
    final: bool = False


@dataclass(slots=True)
class Grant:
    """The store's answer for one :class:`SliceOp`: units granted, and the shared bucket's
    level after the call (units; may be negative after debts)."""

    granted: float
    shared_level: float


def target(b: SharedBucket) -> float:
    """Units a slice of ``b`` should hold: :data:`DEMAND_HORIZON_S` of its demand, between a
    quarter of and the full :data:`MAX_LEASE_FRACTION` of the burst."""
    top = MAX_LEASE_FRACTION * b.capacity
    return min(top, max(0.25 * top, b.demand * DEMAND_HORIZON_S))


class LeaseBook:
    """The leases of one sidecar (see the module docstring).

    Args:
        maps: returns (limit, unit, bucket map) of every shared limit held now.
        fail_closed: returns whether the policy's ``failureMode`` is FailClosed.
        now: clock seconds at creation.
        retired: returns (and forgets) the slices of shared limits removed since the last
            call, as (``limit:unit:tenant``, slice): each gets a final hand-back.
    """

    def __init__(
        self,
        maps: Callable[[], list[tuple[str, str, BucketMap]]],
        fail_closed: Callable[[], bool],
        now: float,
        retired: Callable[[], list[tuple[str, SharedBucket]]] = list,
        share: Callable[[], float] = lambda: 1.0,
    ) -> None:
        self._maps = maps
        self._fail_closed = fail_closed
        self._retired = retired
        self._share = share
        self.peers_seen = False  # a sync answered with the peer count
        self._final: list[SliceOp] = []  # last ops of slices gone here, not yet taken
        self.peers = 1
        self.up = True  # until a sync says otherwise: the first try decides
        self.failures = 0
        self.last_tick = now
        self.last_sync = -math.inf
        self.next_try = now
        self.syncs = 0

    @property
    def state(self) -> StoreState:
        """The fault state now."""
        if self.up:
            return StoreState.SHARED
        return StoreState.CLOSED if self._fail_closed() else StoreState.LOCAL

    def slices(self) -> list[tuple[str, SharedBucket]]:
        """(``limit:unit:tenant``, slice) of every shared bucket held now."""
        out = []
        for limit, unit, bmap in self._maps():
            for key, b in bmap.items():
                if isinstance(b, SharedBucket):
                    out.append((f"{limit}:{unit}:{key}", b))
        return out

    def outstanding(self) -> float:
        """The fleet may overshoot by this sidecar's part of the bound: units it holds in slices
        plus units spent here not yet charged to the store."""
        return sum(max(0.0, b.level) + b.debt for _, b in self.slices())

    def tick(self, now: float) -> list[SliceOp] | None:
        """Advance to ``now``: learn each slice's demand, credit the local share while the
        store is down under FailOpen, size first slices; returns the ops of the sync due now
        (possibly empty: a heartbeat), or None when no sync is due. With no shared limit
        held the store counts as up (nothing to fall back from)."""
        dt = max(0.0, now - self.last_tick)
        self.last_tick = now
        maps = self._maps()
        self._collect_final(maps)
        if not maps:
            # nothing leased: no fault to fall back from (a FailClosed hold must lift)
            self.up, self.failures = True, 0
            return self._take_final() if self._final and now >= self.next_try else None
        slices = self.slices()
        local = self.state is StoreState.LOCAL
        for _, _, bmap in maps:
            top = MAX_LEASE_FRACTION * bmap.capacity
            bmap.first_slice = min(top, bmap.capacity * self.share()) if local or self.up else 0.0
        w = 1.0 - math.exp(-dt / DEMAND_TAU_S) if dt > 0 else 0.0
        for _, b in slices:
            used = b.mark - b.level
            if dt > 0:
                b.demand += w * (max(0.0, used) / dt - b.demand)
            b.mark = b.level
            if local and dt > 0:
                self._credit_share(b, dt)
        if now < self.next_try:
            return None
        ops = [op for name, b in slices if (op := self._op(name, b, now)) is not None]
        ops += self._take_final()
        if ops or not self.up or now - self.last_sync >= LEASE_SECONDS / 2:
            return ops  # while down, even an empty one: the probe that finds the store back
        return None

    def _collect_final(self, maps: list[tuple[str, str, BucketMap]]) -> None:
        gone = list(self._retired())
        for limit, unit, bmap in maps:
            gone += [(f"{limit}:{unit}:{key}", b) for key, b in bmap.evicted]
            bmap.evicted.clear()
        for name, b in gone:
            back, debt = max(0.0, b.level), b.debt + max(0.0, -b.level)
            b.level = b.mark = 0.0
            b.debt = 0.0
            if back or debt:
                self._final.append(SliceOp(name, b, 0.0, back, debt, final=True))

    def _take_final(self) -> list[SliceOp]:
        out, self._final = self._final, []
        return out

    def share(self) -> float:
        """This sidecar's fraction of a shared budget when on its own: 1 / the peers last seen
        in the store, or the operator's split (``share``) before any sync answered."""
        return 1.0 / self.peers if self.peers_seen else min(1.0, max(1e-9, self._share()))

    def _credit_share(self, b: SharedBucket, dt: float) -> None:
        share = self.share()
        cap = b.capacity * share
        if b.level < cap:
            add = min(cap - b.level, dt * b.rate * share)
            b.level += add
            b.mark += add
            b.debt += add

    def _op(self, name: str, b: SharedBucket, now: float) -> SliceOp | None:
        """What ``b`` asks of the next sync, taking a hand-back off its level now."""
        if b.level < 0 and now - b.last >= IDLE_SECONDS:
            b.debt -= b.level  # spent beyond its slice: charge the rest
            b.level = b.mark = 0.0
        give_back = 0.0
        want = 0.0
        if now - b.last >= IDLE_SECONDS:
            give_back = max(0.0, b.level)
            b.need = 0.0
        elif b.level < LOW_WATER * target(b) or b.level < b.need:
            # a request larger than the usual slice waits: ask for all of it (at most a burst)
            want = min(b.capacity, max(target(b), b.need) - b.level)
        if give_back == 0.0 and want == 0.0 and b.debt == 0.0:
            return None
        b.level -= give_back
        b.mark -= give_back
        return SliceOp(name, b, want if self.up else 0.0, give_back, b.debt)

    def done(self, ops: list[SliceOp], grants: list[Grant], peers: int, now: float) -> None:
        """The store answered the sync of ``ops`` (one :class:`Grant` each, in order)."""
        self.up = True
        self.failures = 0
        self.syncs += 1
        self.last_sync = now
        self.peers = max(1, peers)
        self.peers_seen = True
        self.next_try = now
        for op, g in zip(ops, grants, strict=True):
            b = op.bucket
            b.debt = max(0.0, b.debt - op.debt)
            b.level += g.granted
            b.mark += g.granted
            b.shared_level = g.shared_level
            b.synced = True
            if b.level >= b.need:
                b.need = 0.0
            if g.granted + 1e-9 < op.want:
                lacking = op.want - g.granted
                wait = min(1.0, max(0.1, lacking / b.rate))
                self.next_try = max(self.next_try, now + wait)
        for _, b in self.slices():
            b.sync_at = self.next_try

    def cancelled(self, ops: list[SliceOp]) -> None:
        """The sync of ``ops`` was cancelled (shutdown): hand-backs return to their slices, final
        ops wait for the last sync; no failure is counted."""
        for op in ops:
            if op.final:
                self._final.append(op)
            else:
                op.bucket.level += op.give_back
                op.bucket.mark += op.give_back

    def failed(self, ops: list[SliceOp], now: float) -> None:
        """The sync of ``ops`` failed (error or timeout): hand-backs return to their slices, and
        after :data:`FAILURES_DOWN` failures in a row the store counts as down."""
        for op in ops:
            if op.final:
                self._final.append(op)  # retried with the next sync
                continue
            op.bucket.level += op.give_back
            op.bucket.mark += op.give_back
        self.failures += 1
        if self.failures >= FAILURES_DOWN and self._maps():
            self.up = False  # with nothing leased any more there is nothing to fall back from
        self.next_try = now + RETRY_SECONDS
        for _, b in self.slices():
            b.sync_at = self.next_try

    def hand_back_all(self) -> list[SliceOp]:
        """The ops of a last sync at shutdown: every positive slice handed back, every debt
        charged (and the final ops still pending)."""
        ops = self._take_final()
        for name, b in self.slices():
            back = max(0.0, b.level)
            debt = b.debt + max(0.0, -b.level)
            if back or debt:
                b.level = b.mark = 0.0
                ops.append(SliceOp(name, b, 0.0, back, debt))
        return ops
