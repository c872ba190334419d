"""The exchange of service counters between sidecars through a real ``redis-server`` (issue 34,
item 3): three sidecars in front of kvgate-sim servers, a regular tenant on one and a premium
one (weight 4) on the two others; the pool's sums in the store's hash, the regular tenant over
its pool-wide share where it is alone; the store hanging (SIGSTOP) and restarted empty under
load: no 5xx, no request waits on the store, local shares while it is away, pool-wide shares
back within 30 s."""

from __future__ import annotations

import asyncio
import collections
import signal
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from kvgate_agent.sidecar.app import Sidecar
from kvgate_agent.sidecar.store import ShareExchange, StoreSettings
from kvgate_agent.sidecar.store.exchange import parse_totals, shares_key
from kvgate_bench.kit.redisserver import RedisServer
from kvgate_bench.kit.toolkit import wait_until_async
from tests.conftest import SidecarFactory, gauges
from tests.upstream import CHAT

SPEC: dict[str, Any] = {
    "tenants": {
        "classes": [
            {"name": "premium", "match": {"tenants": ["gold"]}, "weight": 4},
            {"name": "regular", "match": {"tenants": ["plain"]}, "weight": 1},
        ]
    }
}
RATE = 25.0  # requests per second per sidecar


class Load:
    """Requests at :data:`RATE` per sidecar until stopped: statuses, the slowest answer."""

    def __init__(self, client: aiohttp.ClientSession, targets: list[tuple[str, str]]) -> None:
        self.client = client
        self.targets = targets
        self.statuses: collections.Counter[int] = collections.Counter()
        self.slowest = 0.0
        self._stop = False
        self._tasks = [asyncio.create_task(self._one(u, t)) for u, t in targets]

    async def _one(self, url: str, tenant: str) -> None:
        t0, n = time.monotonic(), 0
        while not self._stop:
            s = time.monotonic()
            async with self.client.post(
                url + "/v1/chat/completions",
                json={**CHAT, "model": "kvgate-sim-model", "max_tokens": 4},
                headers={"x-kvgate-tenant": tenant},
            ) as r:
                await r.read()
                self.statuses[r.status] += 1
            self.slowest = max(self.slowest, time.monotonic() - s)
            n += 1
            delay = t0 + n / RATE - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)

    async def stop(self) -> None:
        self._stop = True
        await asyncio.gather(*self._tasks)


def exchange(sc: Sidecar) -> ShareExchange:
    assert sc.shares is not None
    return sc.shares


def plain_over_share(sc: Sidecar) -> bool:
    ex = exchange(sc)
    now = ex.clock()
    return ex.pool.over_share("plain", now) and not ex.pool.over_share("gold", now)


async def test_pool_shares_through_the_store_survive_it_hanging_and_restarting(
    sidecar_factory: SidecarFactory,
    sim: Callable[..., Any],
    redis_server: Callable[..., RedisServer],
    client: aiohttp.ClientSession,
) -> None:
    server = redis_server()
    sidecars: list[tuple[str, Sidecar]] = []
    for i in range(3):
        settings = StoreSettings(url=server.url, member=f"pod-{i}", timeout=0.3, share_sync=0.2)
        sidecars.append(await sidecar_factory(await sim(), SPEC, store=settings))
    (u0, sc0), (u1, _), (u2, _) = sidecars
    load = Load(client, [(u0, "plain"), (u1, "gold"), (u2, "gold")])
    try:
        # gold is served twice plain's raw service at weight 4 against 1: plain is over its
        # pool-wide share on the replica where it is alone
        await wait_until_async(lambda: plain_over_share(sc0), 15, "plain over its share")
        redis = aioredis.Redis.from_url(server.url)
        totals = parse_totals(await redis.hgetall(shares_key(sc0.policy.name())))
        await redis.aclose()
        assert set(totals) == {"plain", "gold"}, totals
        assert totals["gold"][1] > totals["plain"][1] > 0  # raw: two replicas against one
        assert totals["gold"][0] < totals["plain"][0]  # weighted: a quarter each
        g = await gauges(client, u0)
        assert g["kvgate_share_exchange_fresh"] == 1
        assert g["kvgate_share_exchange_over_share_tenants"] <= 1  # plain (or none just now)
        assert g['kvgate_share_exchange_syncs_total{result="ok"}'] > 0

        assert server.proc is not None
        server.proc.send_signal(signal.SIGSTOP)  # the store hangs: commands time out
        hung = time.monotonic()
        ex0 = exchange(sc0)
        await wait_until_async(lambda: not ex0.pool.fresh(ex0.clock()), 15, "stale")
        assert not plain_over_share(sc0)  # local counters only
        assert (await gauges(client, u0))["kvgate_share_exchange_fresh"] == 0
        assert exchange(sc0).syncs_failed > 0
        server.proc.send_signal(signal.SIGCONT)
        back = time.monotonic()
        assert back - hung < 15
        await wait_until_async(lambda: plain_over_share(sc0), 30, "shares back after a hang")

        server.kill()  # restarted empty: the sums start again
        server.start()
        restarted = time.monotonic()
        await wait_until_async(lambda: plain_over_share(sc0), 30, "shares back after a restart")
        assert time.monotonic() - restarted <= 30
    finally:
        await load.stop()
    assert set(load.statuses) <= {200, 429}, load.statuses  # never a 5xx for the store
    assert load.statuses[200] > 0
    assert load.slowest < 2.0, load.slowest  # no request waited on the hung store


async def test_a_store_unreachable_from_the_start_is_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A mistyped store URL: the first failed sync logs a warning (the exchange was never up,
    and before this nothing was logged at all), later failures do not repeat it; the syncs
    count as failed and the pod decides on its own counters."""
    from kvgate_agent.admission import AdmissionConfig, AdmissionController, AsyncAdmission

    now = [0.0]
    admission = AsyncAdmission(AdmissionController(AdmissionConfig()))
    ex = ShareExchange(
        StoreSettings(url="redis://127.0.0.1:1/0", timeout=0.2), admission,
        lambda: "ns/policy", 0.5, clock=lambda: now[0],
    )  # fmt: skip
    ex.client = aioredis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)
    try:
        with caplog.at_level("WARNING", logger="kvgate.store.shares"):
            for _ in range(3):
                now[0] += 1.0
                assert await ex.step() is False
        warned = [r for r in caplog.records if "store unreachable" in r.getMessage()]
        assert len(warned) == 1 and ex.syncs_failed == 3 and ex.syncs_ok == 0
    finally:
        await ex.client.aclose()
