"""The sidecars' exchange of service counters, in virtual time: the pool arm ``kvgate-exchange``.

``kvgate-exchange`` is the pool arm ``kvgate`` (the recommended policy,
:class:`~kvgate_bench.effectiveness.arms.kvgate_defaults.KvgateDefaultsArm`) with each replica's
admission core given the pool's view of the tenants' service
(:class:`~kvgate_agent.admission.PoolShare`), kept as the sidecar's exchange
(``kvgate_agent.sidecar.store.exchange``) keeps it: every sync period (0.5 s by default) a
replica adds what it charged since its last sync to the pool's sums and reads them back, in
one step (the store's one round trip, here taking no time). The sums are
:class:`MemoryExchange`'s, shared by the run's replicas: the Redis hash of the sidecars, in
memory. So a replica sees another's charges at most one sync period late, as in the fleet.

The replicas' syncs happen at their own events (an arrival, a step's tokens, a finish, a
wake-up) once the period has passed, and at a wake-up of their own each period while they have
requests waiting or in flight (the sidecar's loop runs on its own timer). Parameters
(``params``, for tuning only; the defaults are :mod:`kvgate_agent.admission.fairqueue.pool`'s):
``sync_s``, ``over``, ``reserve``, ``tau_s``, ``add_remote``, ``by_class``.
"""

from __future__ import annotations

import math
from typing import Any

from kvgate_agent.admission import PoolShare
from kvgate_bench.effectiveness.arms.context import ArmContext
from kvgate_bench.effectiveness.arms.kvgate_defaults import KvgateDefaultsArm
from kvgate_bench.effectiveness.model.schedule import Request

#: The pool arm's name (an interface: ``--arms``, JSON ``arm``).
EXCHANGE_ARM = "kvgate-exchange"
#: The parameters ``params`` may set (:class:`~kvgate_agent.admission.PoolShare`'s).
POOL_PARAMS = ("sync_s", "over", "reserve", "tau_s", "add_remote", "by_class")


class MemoryExchange:
    """The pool's sums of every replica's service counters, per tenant: (weighted units, raw
    units), only growing (the fleet store's hash, in memory)."""

    def __init__(self) -> None:
        self.totals: dict[str, tuple[float, float]] = {}
        #: Syncs taken (all replicas).
        self.syncs = 0

    def sync(self, deltas: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
        """Add one replica's ``deltas`` and return the sums after (a copy). O(tenants)."""
        totals = self.totals
        for t, (u, r) in deltas.items():
            u0, r0 = totals.get(t, (0.0, 0.0))
            totals[t] = (u0 + u, r0 + r)
        self.syncs += 1
        return dict(totals)


class KvgateExchangeArm(KvgateDefaultsArm):
    """``kvgate`` with the exchange of service counters on (see the module docstring).

    Args:
        ctx: the arm's context (as every arm's).
        exchange: the pool's sums, shared by the run's replicas.
        params: :data:`POOL_PARAMS` to override (tuning).
    """

    def __init__(self, ctx: ArmContext, exchange: MemoryExchange, params: dict[str, Any]) -> None:
        super().__init__(ctx, "recommended")
        self.name = EXCHANGE_ARM
        unknown = set(params) - set(POOL_PARAMS)
        if unknown:
            raise ValueError(f"unknown {EXCHANGE_ARM} parameters {sorted(unknown)}")
        self.exchange = exchange
        self.pool = PoolShare(**params)
        self.controller.attach_pool(self.pool)
        self.params = dict(params)

    def _sync(self, now: float) -> None:
        pool = self.pool
        if not pool.due(now):
            return
        sent = pool.take(now)
        remote = pool.update(self.exchange.sync(sent), sent, now)
        self.controller.pool_synced(remote)
        self.controller.pump()  # who is over its share may have changed
        self._settle(now)

    def on_arrival(self, req: Request, now: float) -> None:
        self.clock.now = now
        self._sync(now)
        super().on_arrival(req, now)

    def on_finish(self, req: Request, output_tokens: int, now: float) -> None:
        self.clock.now = now
        self._sync(now)
        super().on_finish(req, output_tokens, now)

    def on_tokens(self, new_tokens: dict[str, int], now: float) -> None:
        self.clock.now = now
        self._sync(now)
        super().on_tokens(new_tokens, now)

    def on_wake(self, now: float) -> None:
        self.clock.now = now
        self._sync(now)
        super().on_wake(now)

    def next_wake(self) -> float | None:
        w = self.controller.next_wake()
        if self._tickets or self._waiting:
            return min(math.inf if w is None else w, self.pool.next_sync)
        return w
