"""Degrading to a smaller model's pool (``overload.degrade.fallback``) over real HTTP: two real
llm-d simulators, the primary (``big``) and the smaller pool (``small``), each behind its own
sidecar. A full primary sends requests there with the model rewritten; both full gives the
primary's own 429; a degraded request is never sent on (two pools naming each other do not
loop); nothing stays reserved on either side."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiohttp

from kvgate_bench.kit.processes import Proc
from kvgate_bench.kit.toolkit import free_port, wait_until_async
from tests.conftest import SidecarFactory, gauges

SLOW = ("--time-to-first-token", "1500ms", "--inter-token-latency", "1ms")
#: The primary's slot is held longer than a request to the pool takes.
SLOWER = ("--time-to-first-token", "4000ms", "--inter-token-latency", "1ms")


def chat(model: str, max_tokens: int = 4) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": max_tokens,
    }


def degrade_to(model: str, url: str) -> dict[str, Any]:
    return {
        "concurrency": {"maxRequests": 1},
        "overload": {
            "actions": ["Degrade", "Reject"],
            "degrade": {"fallback": {"model": model, "upstream": url}},
        },
    }


async def _hold(client: aiohttp.ClientSession, url: str, model: str) -> asyncio.Task[int]:
    """A slow request that holds ``url``'s only slot (about 1.5 s), as a task."""

    async def go() -> int:
        async with client.post(url + "/v1/chat/completions", json=chat(model)) as r:
            await r.read()
            return r.status

    return asyncio.create_task(go())


async def test_a_full_primary_degrades_to_the_pool_and_both_full_gives_its_own_429(
    llmd_sim: Callable[..., Proc],
    sidecar_factory: SidecarFactory,
    client: aiohttp.ClientSession,
) -> None:
    big = llmd_sim("--model", "big", *SLOWER)
    small = llmd_sim("--model", "small", *SLOW)
    # The pool refuses when full (with its default Queue it would hold the request instead).
    full_refuses = {"concurrency": {"maxRequests": 1}, "overload": {"actions": ["Reject"]}}
    pool_url, pool = await sidecar_factory(small.url, full_refuses)
    url, primary = await sidecar_factory(big.url, degrade_to("small", pool_url))

    held = await _hold(client, url, "big")
    await wait_until_async(lambda: primary.admission.stats().in_flight == 1, 10, "the primary full")
    async with client.post(url + "/v1/chat/completions", json=chat("big")) as r:
        body = await r.json()
        assert r.status == 200, body
        assert r.headers["x-kvgate-degraded"] == "model=small"
        assert r.headers["x-kvgate-reason"] == "fallback_pool"
        assert body["model"] == "small"  # the pool's engine served it
    # Both full: the pool's slot held by a degraded request, then one more.
    held_pool = await _hold(client, url, "big")
    await wait_until_async(lambda: pool.admission.stats().in_flight == 1, 10, "the pool full")
    async with client.post(url + "/v1/chat/completions", json=chat("big")) as r:
        refused = await r.json()
        assert r.status == 429, refused
        assert r.headers["x-kvgate-reason"] == "concurrency"  # the primary's own refusal
        assert int(r.headers["Retry-After"]) >= 1
        assert refused["error"]["type"] == "rate_limit_exceeded" or refused["error"]["code"]
    assert await held == 200 and await held_pool == 200
    g, gp = await gauges(client, url), await gauges(client, pool_url)
    assert g["kvgate_in_flight_requests"] == 0 and gp["kvgate_in_flight_requests"] == 0
    assert g["kvgate_kv_reserved_tokens"] == 0 and gp["kvgate_kv_reserved_tokens"] == 0
    decided = {k: v for k, v in g.items() if k.startswith("kvgate_admission_decisions_total")}
    assert (
        decided[
            'kvgate_admission_decisions_total{outcome="degraded",reason="fallback_pool",tenant="anonymous"}'
        ]
        == 2
    )
    assert (
        decided[
            'kvgate_admission_decisions_total{outcome="rejected",reason="concurrency",tenant="anonymous"}'
        ]
        == 1
    )


async def test_a_degraded_request_is_never_sent_on_and_an_unreachable_pool_refuses_as_before(
    llmd_sim: Callable[..., Proc],
    sidecar_factory: SidecarFactory,
    client: aiohttp.ClientSession,
) -> None:
    a_sim = llmd_sim("--model", "a", *SLOWER)
    b_sim = llmd_sim("--model", "b", *SLOWER)
    # B's own fallback names a port nothing listens on (B's pool unreachable); A's is B.
    b_url, b = await sidecar_factory(b_sim.url, degrade_to("a", f"http://127.0.0.1:{free_port()}"))
    a_url, a = await sidecar_factory(a_sim.url, degrade_to("b", b_url))
    held_a = await _hold(client, a_url, "a")
    await wait_until_async(lambda: a.admission.stats().in_flight == 1, 10, "A full")
    held_b = await _hold(client, a_url, "a")  # degraded to B: B full
    await wait_until_async(lambda: b.admission.stats().in_flight == 1, 10, "B full")
    # A -> B (degraded, full) must not go on to B's fallback: B answers its 429, A its own.
    async with client.post(a_url + "/v1/chat/completions", json=chat("a")) as r:
        assert r.status == 429 and r.headers["x-kvgate-reason"] == "concurrency"
    gb = await gauges(client, b_url)
    assert (
        gb[
            'kvgate_admission_decisions_total{outcome="rejected",reason="concurrency",tenant="anonymous"}'
        ]
        == 1
    )
    # B's own client, B full: B's fallback (nothing listens there) is unreachable: B's 429.
    async with client.post(b_url + "/v1/chat/completions", json=chat("b")) as r:
        assert r.status == 429 and "Retry-After" in r.headers
    assert await held_a == 200 and await held_b == 200
    for u in (a_url, b_url):
        g = await gauges(client, u)
        assert g["kvgate_in_flight_requests"] == 0 and g["kvgate_kv_reserved_tokens"] == 0
