"""Fair shares across a pool of replicas: the service the same tenants get on other pods.

Each replica's fair queue (:mod:`.share`) sees only its own pod. Behind a router that pins each
tenant to a home replica (llm-d's prefix affinity), one pod's mix may be all one class: its
queue has no weights to hold, and a class of weight 4 against one of weight 1 was served about
2:1 pool-wide (docs/benchmarks.md, issue 34). NVIDIA Dynamo's per-router class queues show
the same (DEP #15187: a 4:1 policy delivered 163:162 with skewed ingress,
https://github.com/ai-dynamo/dynamo/pull/10744). :class:`PoolShare` is the pool's view, kept
beside one pod's :class:`~.share.FairShare` (its ``pool``; None, the default, changes nothing):

- **Published.** Every charge the fair share makes after credit (:meth:`charged`) adds to this
  replica's per-tenant *service counters*: weighted units (cost units / the tenant's weight,
  VTC's counter increments: Sheng et al., OSDI 2024,
  https://www.usenix.org/conference/osdi24/presentation/sheng) and raw units (cost units).
  Both only grow. Every :attr:`sync_s` the sidecar takes what grew since (:meth:`take`) and
  adds it to the pool's sums (the fleet store), then reads those sums back (:meth:`update`).
- **Read.** From two reads of the pool's sums ``dt`` apart, each tenant's pool-wide rate of
  weighted service (units/s, an exponential average over :attr:`tau_s`) and the *fair level*
  ``L = sum of raw rates / sum of weights`` over the tenants served in the pool (weights read
  off as raw rate / weighted rate): where every such tenant is served by its weight, each one's
  weighted rate is ``L``. A tenant's *excess* is its class's mean weighted rate / ``L`` (the
  tenants of one weight form a class; ``by_class`` False: its own rate); above :attr:`over`
  it is **over its pool-wide share**. By class, because behind an affinity router the tenants
  of one class are not served alike (one alone on its home replica, two sharing another): held
  to their own shares, the one alone was held back at home where nobody else came to use the
  room (measured: docs/benchmarks.md, issue 34).
- **Used.** (a) The weighted service a tenant got on the other replicas since the last read
  (the sums' growth less what this replica sent) is added to its counter here
  (:meth:`.share.FairShare.pool_synced`), so the order among this pod's waiters is the
  pool's (``add_remote``). (b) The fair reserve (:mod:`.reserve`) keeps the last
  :attr:`reserve` of the concurrency limit and of the KV capacity from a tenant over its
  pool-wide share even when it is alone here: behind an affinity router, the pod homing only
  regular tenants keeps room for premium requests that spill to it, rather than filling with
  the class already served beyond its share.

**Staleness and the store away.** The view is at most one sync old while syncs succeed. When
no read has come for :attr:`stale_s` (the store away or hanging), every tenant reads as within
its share: each pod decides on its own counters only, as with the exchange off, and nobody is
held back on stale figures. What was not sent stays pending (:meth:`unsent`) and goes with the
next successful sync; the rates then restart from that read (a gap counts as one long sample),
so shares are back a couple of syncs after the store returns. A pool sum that went down (the
store restarted empty) restarts that tenant's rate at the next read.

Invariant: pure (no I/O, no clock: times are passed in, seconds). :meth:`charged` and
:meth:`excess` are O(1); :meth:`take` and :meth:`update` O(tenants), once a sync.
"""

from __future__ import annotations

import math
from typing import Final

#: The sync period: how often a replica sends its counters and reads the pool's, seconds.
SYNC_S: Final = 0.5
#: With no read for this long, the pool's figures are not used (local counters only), seconds.
STALE_S: Final = 5.0
#: Time constant of the pool-wide rates' exponential average, seconds. Chosen on ``tiers``,
#: seed 1 (5, 10, 15, 20, 30 tried: shorter holds the class share less, longer costs goodput;
#: docs/benchmarks.md, issue 34).
TAU_S: Final = 15.0
#: A tenant whose pool-wide weighted rate is above this times the fair level is over its share.
#: Below 5/4.5 = 1.11 so that a 4:1 pair held at the threshold still splits >= 3.5:1
#: (premium p, regular r, four tenants each: L = (p + r) / 5, and r = OVER x L gives
#: p / r = (5 - OVER) / OVER). Chosen on the benchmark's ``tiers``, seed 1 (docs/benchmarks.md).
OVER: Final = 1.05
#: The share of the concurrency limit and of the KV capacity kept from a tenant over its
#: pool-wide share. Chosen on ``tiers``, seed 1 (0.3 to 0.7 tried: the class share for
#: goodput; docs/benchmarks.md, issue 34).
POOL_RESERVE: Final = 0.5
#: Weighted rates below this (units/s) count as not served (their weight is not read).
MIN_RATE: Final = 1e-9

#: One tenant's service counters: (weighted units, raw units).
Counters = tuple[float, float]


class PoolShare:
    """One replica's view of the pool's service counters (see the module docstring).

    Args:
        sync_s: the sync period (> 0), seconds.
        stale_s: past this without a read, local counters only (> 0), seconds.
        tau_s: the rates' averaging time constant (> 0), seconds.
        over: excess above which a tenant is over its pool-wide share (> 0).
        reserve: the share of the limits kept from such a tenant (0: none, < 1).
        add_remote: add the service got elsewhere to the local counters (the order's part).
        by_class: judge each tenant by its class's mean weighted rate (tenants of one weight
            form a class), not by its own.
    """

    __slots__ = (
        "_excess",
        "_last",
        "_next_sync",
        "_pending",
        "_rate",
        "_read_at",
        "add_remote",
        "by_class",
        "level",
        "over",
        "reserve",
        "stale_s",
        "sync_s",
        "syncs",
        "tau_s",
    )

    def __init__(
        self,
        sync_s: float = SYNC_S,
        stale_s: float = STALE_S,
        tau_s: float = TAU_S,
        over: float = OVER,
        reserve: float = POOL_RESERVE,
        add_remote: bool = True,
        by_class: bool = True,
    ) -> None:
        if sync_s <= 0 or stale_s <= 0 or tau_s <= 0 or over <= 0 or not 0 <= reserve < 1:
            raise ValueError("sync_s, stale_s, tau_s, over > 0 and 0 <= reserve < 1")
        self.sync_s, self.stale_s, self.tau_s = sync_s, stale_s, tau_s
        self.over, self.reserve, self.add_remote = over, reserve, add_remote
        self.by_class = by_class
        #: What this replica charged since the last :meth:`take`, per tenant: [weighted, raw].
        self._pending: dict[str, list[float]] = {}
        #: The pool's sums at the last read, per tenant.
        self._last: dict[str, Counters] = {}
        #: Pool-wide rates per tenant, units/s: [weighted, raw].
        self._rate: dict[str, list[float]] = {}
        self._excess: dict[str, float] = {}
        self._read_at: float | None = None
        self._next_sync = -math.inf
        #: The fair level ``L`` at the last read (weighted units/s; 0 before any).
        self.level = 0.0
        #: Reads taken in (:meth:`update`).
        self.syncs = 0

    # ------------------------------------------------------------------ this replica's counters

    def charged(self, tenant: str, units: float, raw: float) -> None:
        """This replica charged ``tenant`` ``units`` weighted (cost / weight, after credit)
        and ``raw`` cost units (both >= 0). O(1)."""
        p = self._pending.get(tenant)
        if p is None:
            self._pending[tenant] = [units, raw]
        else:
            p[0] += units
            p[1] += raw

    def due(self, now: float) -> bool:
        """Whether a sync is due at clock time ``now`` (seconds)."""
        return now >= self._next_sync

    @property
    def next_sync(self) -> float:
        """When the next sync is due, clock seconds (-inf before the first :meth:`take`)."""
        return self._next_sync

    def take(self, now: float) -> dict[str, Counters]:
        """What this replica charged since the last take, per tenant (to add to the pool's
        sums); the next sync is due :attr:`sync_s` after ``now``. O(tenants charged)."""
        out = {t: (p[0], p[1]) for t, p in self._pending.items()}
        self._pending = {}
        self._next_sync = now + self.sync_s
        return out

    def unsent(self, deltas: dict[str, Counters]) -> None:
        """``deltas`` (from :meth:`take`) did not reach the pool: they go with the next one."""
        for t, (u, r) in deltas.items():
            self.charged(t, u, r)

    # ------------------------------------------------------------------ the pool's counters

    def update(
        self, totals: dict[str, Counters], sent: dict[str, Counters], now: float
    ) -> dict[str, float]:
        """Take in the pool's sums read at ``now`` (``totals``, per tenant, this replica's
        ``sent`` deltas included); returns each tenant's weighted service on the other
        replicas since the previous read (for :meth:`.share.FairShare.pool_synced`; empty
        unless :attr:`add_remote`). Recomputes the rates, the fair level and each tenant's
        excess. A tenant missing from ``totals`` is forgotten. O(tenants)."""
        prev_at = self._read_at
        dt = 0.0 if prev_at is None else now - prev_at
        alpha = 1.0 - math.exp(-dt / self.tau_s) if dt > 0 else 0.0
        remote: dict[str, float] = {}
        last, rates = self._last, self._rate
        for t in [t for t in last if t not in totals]:
            del last[t]
            rates.pop(t, None)
        for t, (u, r) in totals.items():
            before = last.get(t)
            last[t] = (u, r)
            if before is None or u < before[0] - 1e-6 or r < before[1] - 1e-6 or dt <= 0:
                continue  # first sight, or the store restarted empty: the next read says
            du, dr = u - before[0], r - before[1]
            mine = sent.get(t)
            if self.add_remote:
                other = du - (mine[0] if mine is not None else 0.0)
                if other > 1e-9:
                    remote[t] = other
            rate = rates.get(t)
            if rate is None:
                rate = rates[t] = [0.0, 0.0]
            rate[0] += alpha * (du / dt - rate[0])
            rate[1] += alpha * (dr / dt - rate[1])
        self._read_at = now
        self.syncs += 1
        self._levels()
        return remote

    def _levels(self) -> None:
        raw = weights = 0.0
        #: weight (rounded) -> [sum of weighted rates, tenants]: the classes
        classes: dict[float, list[float]] = {}
        for u, r in self._rate.values():
            if u > MIN_RATE:
                raw += r
                weights += r / u
                c = classes.setdefault(round(r / u, 3), [0.0, 0.0])
                c[0] += u
                c[1] += 1
        self.level = lvl = raw / weights if weights > 0 else 0.0
        excess: dict[str, float] = {}
        for t, (u, r) in self._rate.items():
            if lvl <= 0 or u <= MIN_RATE:
                excess[t] = 0.0
            elif self.by_class:
                c = classes[round(r / u, 3)]
                excess[t] = c[0] / c[1] / lvl
            else:
                excess[t] = u / lvl
        self._excess = excess

    # ------------------------------------------------------------------ reading

    def fresh(self, now: float) -> bool:
        """Whether the last read is recent enough to use at ``now`` (:attr:`stale_s`)."""
        return self._read_at is not None and now - self._read_at <= self.stale_s

    def excess(self, tenant: str, now: float) -> float:
        """``tenant``'s pool-wide weighted rate / the fair level (0: unknown or stale). O(1)."""
        if not self.fresh(now):
            return 0.0
        return self._excess.get(tenant, 0.0)

    def over_share(self, tenant: str, now: float) -> bool:
        """Whether ``tenant`` is over its pool-wide share at ``now`` (:attr:`over`). O(1)."""
        return self.excess(tenant, now) > self.over

    def rates(self) -> dict[str, tuple[float, float]]:
        """Each tenant's pool-wide (weighted, raw) rate, units/s (for metrics and tests)."""
        return {t: (u, r) for t, (u, r) in self._rate.items()}
