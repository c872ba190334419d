"""``python -m kvgate_bench.fleet``: shared limits across a fleet of sidecars on a real Redis.

For 1, 3 and 10 sidecars (each an admission core with its
:class:`~kvgate_agent.sidecar.store.buckets.
StoreLink`, in one process, the lease loop talking to a real ``redis-server`` on loopback):

* accuracy: one tenant offered 3x its shared budget, spread evenly over the sidecars, for
  ``--seconds``; admitted vs the budget (the shared bucket's warm-up level + rate x time) and
  the documented overshoot bound (the leases outstanding);
* Redis commands per admitted request at steady state: the same fleet offered 80 % of a budget
  (``INFO commandstats`` after the first third of the run and at its end: the commands clients
  sent, i.e. round trips, not those the script runs inside its EVALSHA);
* the decision's cost (submit + release, p50 ns) with a shared limit vs the same limit local,
  timed alone in this process (no Redis on that path).

Needs ``redis-server`` (``scripts/install-redis``, or ``KVGATE_REDIS_SERVER``). Figures on a
shared machine are noisy: same-run ratios are the ones to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from kvgate_agent.admission import (
    AdmissionConfig,
    AdmissionController,
    AdmissionRequest,
    AsyncAdmission,
)
from kvgate_agent.admission.bucket import WARMUP_START_FRACTION
from kvgate_agent.admission.lease import MAX_LEASE_FRACTION
from kvgate_agent.contract.api import API_VERSION
from kvgate_agent.contract.policy import parse_policy
from kvgate_agent.sidecar.store.buckets import StoreLink, StoreSettings
from kvgate_bench.kit.redisserver import RedisServer, find_redis_server


def policy(per: str, rpm: float, burst: int, shared: bool = True) -> Any:
    """A policy with one request-rate limit, refusing at once what does not fit (no queue: a
    queued request would be admitted later, out of this benchmark's count)."""
    doc = {
        "apiVersion": API_VERSION,
        "kind": "RateLimitPolicy",
        "metadata": {"name": "fleet", "namespace": "bench"},
        "spec": {
            "rateLimits": [
                {
                    "name": "r",
                    "per": per,
                    "shared": shared,
                    "requestsPerMinute": rpm,
                    "burstRequests": burst,
                }
            ],
            "overload": {"actions": ["Reject"]},
        },
    }
    return parse_policy(doc).spec


#: Commands the store's script runs inside one EVALSHA (``INFO commandstats`` counts them too).
SCRIPT_INNER = {"time", "zadd", "zrem", "zremrangebyscore", "expire", "zcard", "hmget", "hset"}


async def commands(client: aioredis.Redis) -> int:
    """Commands clients have sent the server so far (one round trip each: EVALSHA, SCRIPT
    LOAD, HELLO, ...), from ``INFO commandstats`` less the commands run inside scripts and the
    benchmark's own INFO calls."""
    stats = await client.info("commandstats")
    return sum(
        int(v["calls"])
        for k, v in stats.items()
        if isinstance(v, dict) and k.removeprefix("cmdstat_") not in SCRIPT_INNER | {"info"}
    )


async def run_fleet(
    server: RedisServer, n: int, rpm: float, burst: int, offered: float, seconds: float
) -> dict[str, float]:
    """``n`` sidecars sharing one per-Tenant budget of ``rpm``/``burst``, offered ``offered``
    requests/second in all for ``seconds``; returns the admitted count, the commands the
    server ran and the leases outstanding at the end."""
    spec = policy("Tenant", rpm, burst)
    stores = []
    for i in range(n):
        ctl = AdmissionController(AdmissionConfig.from_policy(spec))
        store = StoreLink(
            StoreSettings(url=server.url, member=f"pod-{i}"),
            AsyncAdmission(ctl),
            lambda: f"bench/fleet-{n}-{int(rpm)}",
        )
        await store.start()
        stores.append(store)
    probe = aioredis.Redis.from_url(server.url)
    before = await commands(probe)
    admitted = 0
    req = AdmissionRequest("tenant-a", 0, 1)
    t0 = time.monotonic()
    sent = 0
    warm: tuple[int, int] | None = None  # (commands, admitted) once past the first third
    while (now := time.monotonic()) - t0 < seconds:
        if warm is None and now - t0 >= seconds / 3:
            warm = (await commands(probe), admitted)
        due = int((now - t0) * offered)
        while sent < due:
            ctl = stores[sent % n].admission.core
            d = ctl.submit(req)
            if d.ticket is not None:
                ctl.release(d.ticket, completion_tokens=1)
                admitted += 1
            sent += 1
        await asyncio.sleep(0.005)
    outstanding = sum(s.book.outstanding() for s in stores)
    after = await commands(probe)
    for s in stores:
        await s.stop()
    await probe.aclose()
    assert warm is not None
    return {
        "admitted": admitted,
        "sent": sent,
        "commands": after - before,
        "outstanding": outstanding,
        "steady_per_admitted": (after - warm[0]) / max(1, admitted - warm[1]),
    }


def decision_cost(iterations: int, rounds: int = 10) -> tuple[float, float]:
    """CPU ns per submit + release with the limit local, and with it shared (slices held):
    interleaved rounds, the median round of each (CPU time: a loaded machine's waits do not
    count)."""
    ops: list[tuple[AdmissionController, list[AdmissionRequest], list[float]]] = []
    for shared in (False, True):
        spec = policy("Tenant", 6e7, 10**9, shared)
        ctl = AdmissionController(AdmissionConfig.from_policy(spec))
        if shared:
            ctl.attach_store()
            for _, _, bmap in ctl.shared_maps():
                bmap.first_slice = 1e12  # a slice already held: the steady state
        reqs = [AdmissionRequest(f"t-{i}", 180, 256) for i in range(1000)]
        ops.append((ctl, reqs, []))
    k = max(1, iterations // rounds)
    gc.collect()
    gc.disable()
    try:
        for _ in range(rounds):
            for ctl, reqs, times in ops:
                submit, release = ctl.submit, ctl.release
                t0 = time.process_time_ns()
                for i in range(k):
                    d = submit(reqs[i % 1000])
                    assert d.ticket is not None
                    release(d.ticket, completion_tokens=200, prompt_tokens=180)
                times.append((time.process_time_ns() - t0) / k)
    finally:
        gc.enable()
    local, shared_t = (statistics.median(t) for _, _, t in ops)
    return local, shared_t


async def main_async(args: argparse.Namespace) -> int:
    binary = find_redis_server()
    if binary is None:
        print("redis-server not found: run scripts/install-redis or set KVGATE_REDIS_SERVER")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(binary, Path(tmp)).start()
        try:
            print(f"# kvgate fleet on a real Redis ({args.seconds:g} s per run)\n")
            print(
                "| sidecars | budget (req) | admitted | admitted / budget | bound (leases) "
                "| Redis cmds / admitted (80 % load) |"
            )
            print("|---|---|---|---|---|---|")
            for n in args.sidecars:
                rpm, burst = 3000.0, 600
                budget = burst * WARMUP_START_FRACTION + rpm / 60 * args.seconds
                acc = await run_fleet(server, n, rpm, burst, 3 * rpm / 60, args.seconds)
                big_rpm = 60.0 * 40 * n  # 40 req/s per sidecar at 80 %: 32 req/s each
                steady = await run_fleet(
                    server, n, big_rpm, int(big_rpm), 0.8 * big_rpm / 60, args.seconds
                )
                bound = n * 2 * MAX_LEASE_FRACTION * burst
                per = steady["steady_per_admitted"]
                print(
                    f"| {n} | {budget:.0f} | {acc['admitted']:.0f} | "
                    f"{acc['admitted'] / budget:.3f} | {bound:.0f} | {per:.4f} |"
                )
        finally:
            server.stop()
    local, shared = decision_cost(args.iterations)
    print(
        f"\ndecision (submit + release), CPU per call: local {local:.0f} ns, "
        f"shared {shared:.0f} ns (difference {shared - local:+.0f} ns)"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns 0 (2 without redis-server)."""
    p = argparse.ArgumentParser(prog="python -m kvgate_bench.fleet", description=__doc__)
    p.add_argument("--seconds", type=float, default=10.0, help="length of each run")
    p.add_argument("--sidecars", type=int, nargs="+", default=[1, 3, 10])
    p.add_argument("--iterations", type=int, default=100_000, help="decisions timed")
    return asyncio.run(main_async(p.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
