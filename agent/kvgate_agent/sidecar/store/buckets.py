"""The store of ``shared`` limits: a Redis (>= 6.2, or Valkey) holding one token bucket per key.

The sidecar never calls the store on a request's path: :class:`StoreLink` runs a background
loop that asks the pure :class:`~kvgate_agent.admission.lease.LeaseBook` every
:data:`TICK_S` whether a sync is due, and sends each sync as ONE ``EVALSHA`` of :data:`LUA`,
which registers this sidecar among the policy's peers and, for every slice in it, refills the
shared bucket on the server's clock (``TIME``, never the client's), hands back, charges debts and
grants. All keys of one policy carry the policy in a hash tag (``kvgate:{ns/name}:...``) so the
script's keys are in one slot of a Redis Cluster (https://redis.io/docs/latest/operate/oss_and_stack/reference/cluster-spec/#hash-tags).

A key the server does not hold starts full for a new tenant (as a new local bucket does), and at
:data:`~kvgate_agent.admission.bucket.WARMUP_START_FRACTION` of its burst, not full, when the
Redis is new or restarted empty (no marker key of the policy: nobody's spending is known).
Keys expire once they would have refilled (plus a minute), so idle tenants cost the server nothing.

Connection: ``redis://HOST:PORT/DB`` or ``rediss://`` (TLS, with a CA file), password from a file
(a mounted Secret), every command bounded by ``timeout`` seconds: a slow or partitioned store
fails the sync rather than holding anything up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvgate_agent.admission import AsyncAdmission, Reason
from kvgate_agent.admission.bucket import WARMUP_START_FRACTION
from kvgate_agent.admission.lease import (
    LEASE_SECONDS,
    RETRY_SECONDS,
    Grant,
    LeaseBook,
    SliceOp,
    StoreState,
)
from kvgate_agent.sidecar.store.settings import StoreSettings as StoreSettings  # re-exported
from kvgate_agent.tasks import cancel_and_wait, every

log = logging.getLogger("kvgate.store")

#: The background loop's period, seconds.
TICK_S = 0.2
#: Name of the admission hold under FailClosed while the store is unreachable.
HOLD_KEY = "store"

#: KEYS[1] the policy's peer set, KEYS[2] its marker (a key that says this Redis has held the
#: policy's buckets before, kept a day past the last sync), KEYS[3..] the buckets; ARGV: member,
#: peer TTL (s), leaving (0/1), warm-up fraction, then per bucket: capacity, rate (units/s),
#: want, give back, debt. A bucket key the server does not hold starts full when the marker is
#: there (a new tenant, as a new local bucket does) and at the warm-up fraction when it is not
#: (a Redis new or restarted empty: every tenant's spending is unknown).
#: Returns {peers, granted, level, granted, level, ...} as strings (Lua numbers would be
#: truncated to integers on the way out).
LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local ttl = tonumber(ARGV[2])
if ARGV[3] == '1' then
  redis.call('ZREM', KEYS[1], ARGV[1])
else
  redis.call('ZADD', KEYS[1], now, ARGV[1])
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - ttl)
redis.call('EXPIRE', KEYS[1], math.ceil(ttl * 2))
local out = {tostring(redis.call('ZCARD', KEYS[1]))}
local warm = tonumber(ARGV[4])
if redis.call('EXISTS', KEYS[2]) == 1 then warm = 1 end
if #KEYS > 2 then redis.call('SET', KEYS[2], '1', 'EX', 86400) end
for i = 3, #KEYS do
  local j = 5 + (i - 3) * 5
  local cap, rate = tonumber(ARGV[j]), tonumber(ARGV[j + 1])
  local want, back, debt = tonumber(ARGV[j + 2]), tonumber(ARGV[j + 3]), tonumber(ARGV[j + 4])
  local h = redis.call('HMGET', KEYS[i], 'l', 't')
  local level, last = tonumber(h[1]), tonumber(h[2])
  if level == nil or last == nil then level, last = cap * warm, now end
  if now > last then level = math.min(cap, level + (now - last) * rate) end
  level = math.max(-cap, math.min(cap, level + back) - debt)
  local grant = 0
  if want > 0 and level > 0 then grant = math.min(want, level) end
  level = level - grant
  redis.call('HSET', KEYS[i], 'l', tostring(level), 't', tostring(now))
  redis.call('EXPIRE', KEYS[i], math.ceil((cap - level) / rate) + 60)
  out[#out + 1] = tostring(grant)
  out[#out + 1] = tostring(level)
end
return out
"""


def connect(settings: StoreSettings) -> aioredis.Redis:
    """The redis-py asyncio client for ``settings`` (connects lazily).

    Raises:
        OSError: the password file cannot be read.
        ValueError: the URL is not ``redis://`` or ``rediss://``.
    """
    if not settings.url.startswith(("redis://", "rediss://")):
        raise ValueError(f"store URL must be redis:// or rediss://, got {settings.url!r}")
    kwargs: dict[str, Any] = {
        "socket_timeout": settings.timeout,
        "socket_connect_timeout": settings.timeout,
        "health_check_interval": 0,
        "retry_on_timeout": False,
    }
    if settings.password_file:
        with open(settings.password_file, encoding="utf-8") as f:
            kwargs["password"] = f.read().rstrip("\r\n")
    if settings.url.startswith("rediss://") and settings.ca_file:
        kwargs["ssl_ca_certs"] = settings.ca_file
    client: aioredis.Redis = aioredis.Redis.from_url(settings.url, **kwargs)
    return client


def key_prefix(policy: str) -> str:
    """Key prefix of one policy's buckets, its name as the Redis Cluster hash tag."""
    return "kvgate:{" + policy.replace("}", "_") + "}:"


class StoreLink:
    """The background link between one sidecar's leases and the store (the store's counterpart
    of :class:`~kvgate_agent.sidecar.node_link.agent_link.AgentLink`).

    Args:
        settings: the store.
        admission: the admission whose shared limits are leased (:meth:`AsyncAdmission.lease_book`).
        policy: returns the governing policy's ``namespace/name`` (the keys' hash tag).
        clock: monotonic seconds (the book's; the store's own clock decides refills).
    """

    def __init__(
        self,
        settings: StoreSettings,
        admission: AsyncAdmission,
        policy: Callable[[], str],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.admission = admission
        self._policy = policy
        self.clock = clock
        #: The leases of the shared limits admission now holds as slices.
        self.book: LeaseBook = admission.lease_book(clock())
        self.client: aioredis.Redis | None = None
        self._script: Any = None
        self._task: asyncio.Task[None] | None = None
        self.syncs_ok = 0
        self.syncs_failed = 0
        self._held = False  # the FailClosed hold is in place

    async def start(self) -> None:
        """Connect (lazily: an unreachable store only fails syncs) and start the loop."""
        self.client = connect(self.settings)
        self._script = self.client.register_script(LUA)
        self._task = asyncio.create_task(
            every(self.step, TICK_S, log, "shared store loop"), name="kvgate-store"
        )

    async def stop(self) -> None:
        """Stop the loop, hand every slice back and charge every debt (one last sync, bounded
        by the timeout), leave the peer set, close the connection."""
        task, self._task = self._task, None
        await cancel_and_wait(task)
        if self.client is None:
            return
        if self.book.up:
            with contextlib.suppress(Exception):
                await self._call(self.book.hand_back_all(), leaving=True)
        await self.client.aclose()
        self.client = None

    async def step(self) -> None:
        """One turn of the loop: the sync due now (if any), then hold or lift admission as the
        fault state says (also when no sync was due: a limit no longer shared lifts a hold)."""
        ops = self.book.tick(self.clock())
        if ops is not None:
            await self.sync(ops)
        self._apply_state()

    async def sync(self, ops: list[SliceOp]) -> None:
        """Send ``ops`` as one script call and give the book the answer (or the failure); then
        hold or lift admission as the fault state says. Cancelled (at :meth:`stop`), hand-backs
        return to their slices without counting as a failure."""
        try:
            peers, grants = await self._call(ops)
        except asyncio.CancelledError:
            self.book.cancelled(ops)
            raise
        except Exception as exc:  # any store failure is a failed sync
            self.syncs_failed += 1
            before = self.book.up
            self.book.failed(ops, self.clock())
            if before and not self.book.up:
                log.warning("store %s unreachable (%s): %s", self._host(), exc, self.book.state)
        else:
            self.syncs_ok += 1
            if self.book.state is not StoreState.SHARED or self.syncs_ok == 1:
                log.info("store %s reachable: shared limits leased", self._host())
            self.book.done(ops, grants, peers, self.clock())
            if any(g.granted > 0 for g in grants):
                self.admission.slices_granted()  # waiters for a slice: look again
        self._apply_state()

    def _apply_state(self) -> None:
        if self.book.state is StoreState.CLOSED:
            message = "the store of the shared limits is unreachable (failureMode FailClosed)"
            if not self._held:
                # waiters would otherwise sit out their queue deadline behind the hold
                self.admission.reject_waiting(Reason.FAIL_CLOSED, 503, 1.0, message)
            self.admission.hold(
                Reason.FAIL_CLOSED,
                retry_after=max(1.0, RETRY_SECONDS),
                message=message,
                key=HOLD_KEY,
            )
            self._held = True
            return
        self._held = False
        self.admission.lift(HOLD_KEY)

    async def _call(self, ops: list[SliceOp], leaving: bool = False) -> tuple[int, list[Grant]]:
        assert self.client is not None and self._script is not None
        prefix = key_prefix(self._policy())
        keys = [prefix + "peers", prefix + "marker"] + [prefix + op.name for op in ops]
        args: list[str | float] = [
            self.settings.member,
            LEASE_SECONDS * 2,
            "1" if leaving else "0",
            WARMUP_START_FRACTION,
        ]
        for op in ops:
            b = op.bucket
            args += [b.capacity, b.rate, op.want, op.give_back, op.debt]
        raw = await asyncio.wait_for(
            self._script(keys=keys, args=args, client=self.client), self.settings.timeout * 2
        )
        vals = [float(v) for v in raw]
        grants = [Grant(vals[i], vals[i + 1]) for i in range(1, len(vals) - 1, 2)]
        return int(vals[0]), grants

    def _host(self) -> str:
        return self.settings.url.split("@")[-1]


class StoreCollector(Collector):
    """``kvgate_store_state{state}`` (1 for the state now), ``kvgate_store_peers``,
    ``kvgate_shared_lease_outstanding`` (this sidecar's part of the fleet's overshoot bound,
    units) and ``kvgate_shared_limits_local`` (shared limits enforced per pod for want of a
    store)."""

    def __init__(self, admission: AsyncAdmission, store: StoreLink | None) -> None:
        self.admission = admission
        self.store = store

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        local = (
            0
            if self.store is not None
            else sum(1 for t in self.admission.config.limits if t.shared)
        )
        yield GaugeMetricFamily(
            "kvgate_shared_limits_local",
            "Shared limits enforced per pod because no store is configured",
            value=local,
        )
        s = self.store
        if s is None:
            return
        g = GaugeMetricFamily(
            "kvgate_store_state", "Where shared limits stand (1 = now)", labels=["state"]
        )
        now = s.book.state
        for st in StoreState:
            g.add_metric([st.value], 1.0 if st is now else 0.0)
        yield g
        yield GaugeMetricFamily(
            "kvgate_store_peers", "Sidecars sharing the policy's budgets", value=s.book.peers
        )
        yield GaugeMetricFamily(
            "kvgate_shared_lease_outstanding",
            "Units held in leases or spent and not yet charged: this sidecar's part of the "
            "fleet's overshoot bound",
            value=s.book.outstanding(),
        )
        c = CounterMetricFamily(
            "kvgate_store_syncs", "Syncs with the store by result", labels=["result"]
        )
        c.add_metric(["ok"], s.syncs_ok)
        c.add_metric(["failed"], s.syncs_failed)
        yield c


def register_metrics(
    registry: CollectorRegistry,
    admission: AsyncAdmission,
    store: StoreLink | None,
    shares: Collector | None = None,
) -> None:
    """Add the store's metrics to the sidecar's ``registry`` (and the share exchange's, when
    there is one: :class:`~kvgate_agent.sidecar.store.exchange.ShareExchange`)."""
    registry.register(StoreCollector(admission, store))
    if shares is not None:
        registry.register(shares)
