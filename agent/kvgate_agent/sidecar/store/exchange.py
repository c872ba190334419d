"""The exchange of service counters between sidecars, through the fleet store: pool-wide fair
shares (issue 34, item 3).

Each sidecar's admission core keeps a :class:`~kvgate_agent.admission.PoolShare` (the pool's view
of what the same tenants were served on other replicas; the core stays pure). :class:`ShareExchange`
is its I/O: every sync period (``--share-sync``, 0.5 s recommended) one pipelined round
trip to the store adds what this replica charged since its last sync to the pool's sums and
reads them back, and the core takes the read in (:meth:`AsyncAdmission.pool_synced`).

**One hash per policy, HINCRBYFLOAT of this replica's deltas** (``kvgate:{ns/name}:shares``,
fields ``u:<tenant>``, the weighted units, and ``r:<tenant>``, the raw cost units; the policy's
hash tag keeps it in one Redis Cluster slot beside its buckets), rather than one key per replica
with a TTL: the store sums the pool (one ``HGETALL`` of O(tenants) fields, whatever the number of
replicas, and no peer list to read), a replica that restarts or leaves loses nothing the others
count (its past service stays in the sums), and there is nothing to expire per replica. The
price: a sync whose answer is lost after the store applied it is sent again, so up to one sync
period of this replica's service may be counted twice; that only holds a tenant back a little
longer, and the rates are averaged over fifteen seconds. The hash expires a day after the last
sync (:data:`TTL_S`); until then it keeps a pair of fields for every tenant the policy's sidecars
charged (two per tenant: the hash grows with the tenants seen, until it expires).

**The store away or hanging.** Nothing on a request's path waits on the store: the loop runs
on its own task, each round trip bounded by the store's timeout (``--store-timeout``), and a
failed sync keeps its deltas for the next (:meth:`PoolShare.unsent`). Once no read has
succeeded for :data:`~kvgate_agent.admission.fairqueue.pool.STALE_S` (5 s) the core decides on its
local counters only, as with the exchange off: no request is refused for the store (no 5xx),
none is held back on stale figures. When the store answers again the next sync sends what
accumulated and reads the sums; the rates restart from that read (a store restarted empty
restarts each tenant's rate at its next read), so the shares hold again within a few sync
periods (the integration test asks for 30 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import redis.asyncio as aioredis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvgate_agent.admission import AsyncAdmission, PoolShare
from kvgate_agent.sidecar.store.buckets import connect, key_prefix
from kvgate_agent.sidecar.store.settings import StoreSettings
from kvgate_agent.tasks import cancel_and_wait, every

log = logging.getLogger("kvgate.store.shares")

#: How often the loop asks the pool's view whether a sync is due, seconds.
TICK_S = 0.05
#: The pool's hash expires this long after its last sync, seconds.
TTL_S = 86400

#: A tenant's service counters: (weighted units, raw cost units).
Counters = tuple[float, float]


def shares_key(policy: str) -> str:
    """The pool's hash of service counters for ``policy`` (``namespace/name``)."""
    return key_prefix(policy) + "shares"


def parse_totals(raw: Mapping[Any, Any]) -> dict[str, Counters]:
    """The pool's sums per tenant from the hash's fields (``HGETALL``'s answer, bytes or str:
    ``u:<tenant>``, ``r:<tenant>``, numbers as text); a tenant with only one of the two reads 0
    for the other; unknown fields are ignored.

    Raises:
        ValueError: a value is not a number.
    """
    out: dict[str, list[float]] = {}
    for k, v in raw.items():
        key = k.decode() if isinstance(k, bytes) else k
        kind, _, tenant = key.partition(":")
        if kind not in ("u", "r") or not tenant:
            continue
        pair = out.setdefault(tenant, [0.0, 0.0])
        pair[0 if kind == "u" else 1] = float(v)
    return {t: (u, r) for t, (u, r) in out.items()}


class ShareExchange(Collector):
    """The background exchange of one sidecar's service counters (see the module docstring),
    and its metrics (a Prometheus collector): ``kvgate_share_exchange_fresh`` (1 while the
    pool's figures are used, 0 while each pod decides on its own counters),
    ``kvgate_share_exchange_syncs{result}`` and ``kvgate_share_exchange_over_share_tenants``
    (tenants over their pool-wide share now).

    Args:
        settings: the store (its URL, credentials and timeout).
        admission: the admission whose fair queue takes the pool's view in.
        policy: returns the governing policy's ``namespace/name`` (the key's hash tag).
        sync_s: the sync period, seconds (> 0).
        clock: monotonic seconds (the admission core's).
        client: an existing redis-py client to share (the leases'), else one is connected.
    """

    def __init__(
        self,
        settings: StoreSettings,
        admission: AsyncAdmission,
        policy: Callable[[], str],
        sync_s: float,
        clock: Callable[[], float] = time.monotonic,
        client: aioredis.Redis | None = None,
    ) -> None:
        self.settings = settings
        self.admission = admission
        self._policy = policy
        self.clock = clock
        self.pool = PoolShare(sync_s=sync_s)
        admission.attach_pool(self.pool)
        self.client = client
        self._own_client = client is None
        self._task: asyncio.Task[None] | None = None
        self.syncs_ok = 0
        self.syncs_failed = 0
        #: None until the first sync ends; then whether the last one reached the store (a
        #: warning is logged when the first fails and on every loss of the store, not at every
        #: failed sync).
        self._up: bool | None = None

    async def start(self) -> None:
        """Connect (lazily: an unreachable store only fails syncs) and start the loop."""
        if self.client is None:
            self.client = connect(self.settings)
        self._task = asyncio.create_task(
            every(self.step, TICK_S, log, "share exchange"), name="kvgate-share-exchange"
        )

    async def stop(self) -> None:
        """Stop the loop (what was not sent is dropped: the others' shares lose at most one
        sync period of this replica's service) and close a connection of its own."""
        task, self._task = self._task, None
        await cancel_and_wait(task)
        if self.client is not None and self._own_client:
            with contextlib.suppress(Exception):
                await self.client.aclose()
        self.client = None

    async def step(self) -> bool:
        """The sync due now, if one is: returns whether one was tried and succeeded."""
        pool = self.pool
        if not pool.due(self.clock()):
            return False
        sent = pool.take(self.clock())
        try:
            totals = await self._call(sent)
        except asyncio.CancelledError:
            pool.unsent(sent)
            raise
        except Exception as exc:  # any store failure is a failed sync
            pool.unsent(sent)
            self.syncs_failed += 1
            if self._up is not False:
                log.warning("store unreachable for the share exchange (%s): local shares", exc)
            self._up = False
            return False
        self.syncs_ok += 1
        if self._up is not True:
            log.info("share exchange synced with the store: pool-wide shares")
        self._up = True
        remote = pool.update(totals, sent, self.clock())
        self.admission.pool_synced(remote)
        return True

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        now, pool = self.clock(), self.pool
        yield GaugeMetricFamily(
            "kvgate_share_exchange_fresh",
            "1 while the pool's service counters are used (read within the staleness bound)",
            value=1.0 if pool.fresh(now) else 0.0,
        )
        c = CounterMetricFamily(
            "kvgate_share_exchange_syncs",
            "Share exchanges with the store by result",
            labels=["result"],
        )
        c.add_metric(["ok"], self.syncs_ok)
        c.add_metric(["failed"], self.syncs_failed)
        yield c
        yield GaugeMetricFamily(
            "kvgate_share_exchange_over_share_tenants",
            "Tenants over their pool-wide fair share now (held back from the pool's reserve)",
            value=sum(1 for t in pool.rates() if pool.over_share(t, now)),
        )

    async def _call(self, sent: dict[str, Counters]) -> dict[str, Counters]:
        """One round trip: add ``sent`` to the pool's hash, refresh its TTL, read it back."""
        assert self.client is not None
        key = shares_key(self._policy())
        pipe = self.client.pipeline(transaction=True)
        for tenant, (u, r) in sent.items():
            pipe.hincrbyfloat(key, "u:" + tenant, u)
            pipe.hincrbyfloat(key, "r:" + tenant, r)
        pipe.expire(key, TTL_S)
        pipe.hgetall(key)
        out = await asyncio.wait_for(pipe.execute(), self.settings.timeout * 2)
        return parse_totals(out[-1])


def share_exchange(
    settings: StoreSettings | None,
    admission: AsyncAdmission,
    policy: Callable[[], str],
    clock: Callable[[], float] = time.monotonic,
) -> ShareExchange | None:
    """The share exchange of a sidecar with the store ``settings``, when they ask for one
    (``share_sync`` > 0); None without a store or with the exchange off."""
    if settings is None or settings.share_sync <= 0:
        return None
    return ShareExchange(settings, admission, policy, settings.share_sync, clock)
