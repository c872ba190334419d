"""Signals for routers over real HTTP: the main port's ``/metrics`` (the engine's exposition with
``kvgate_queue_depth`` and ``kvgate_kv_reserved_fraction`` appended) in front of the real llm-d
inference simulator and llama.cpp's llama-server, and the refusal headers: "this replica is
full" is a 429 with Retry-After and without ``x-envoy-ratelimited``, a fleet-wide budget's
refusal (a ``shared`` limit on a real Redis) carries ``x-envoy-ratelimited: true``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvgate_agent.sidecar.store.buckets import StoreSettings
from kvgate_bench.kit.processes import Proc
from kvgate_bench.kit.redisserver import RedisServer
from kvgate_bench.kit.toolkit import wait_until_async
from tests.conftest import SidecarFactory
from tests.upstream import CHAT, Upstream, serve_handler

TENANT = "acct"
DEPTH, FRACTION = "kvgate_queue_depth", "kvgate_kv_reserved_fraction"
#: One token per word in the simulator's echo mode: 30 tokens, 3 s at 100 ms a token.
ECHO_PROMPT = " ".join(["word"] * 30)


async def router_metrics(client: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The main port's ``/metrics`` read with prometheus_client's parser (which raises on
    invalid text): {sample name with labels: value}; a family appearing twice fails."""
    async with client.get(url + "/metrics") as r:
        assert r.status == 200
        text = await r.text()
    seen: set[str] = set()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        assert family.name not in seen, f"{family.name} twice"
        seen.add(family.name)
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def engine_sum(m: dict[str, float], name: str) -> float:
    return sum(v for k, v in m.items() if k == name or k.startswith(name + "{"))


async def chat(
    client: aiohttp.ClientSession, url: str, body: dict[str, Any], tenant: str = TENANT
) -> tuple[int, dict[str, str]]:
    async with client.post(
        url + "/v1/chat/completions", json=body, headers={"x-kvgate-tenant": tenant}
    ) as r:
        await r.read()
        return r.status, dict(r.headers)


# ------------------------------------------------------------------------- llm-d simulator


@pytest.mark.llmd
async def test_llmd_metrics_carry_the_engines_and_the_gauges_that_move(
    llmd_sim: Callable[..., Proc],
    sidecar_factory: SidecarFactory,
    client: aiohttp.ClientSession,
) -> None:
    # The engine runs one request at a time; kvgate admits two (the second waits in the
    # engine's queue) and queues up to two more: the queue depth counts both queues once.
    sim = llmd_sim("--mode", "echo", "--inter-token-latency", "100ms", "--max-num-seqs", "1")
    spec = {
        "capacity": {"kvCacheTokens": 4096},
        "concurrency": {"maxRequests": 2},
        "overload": {"actions": ["Queue", "Reject"]},
        "queue": {"maxLength": 2, "maxWaitSeconds": 60},
    }
    url, sc = await sidecar_factory(sim.url, spec)
    idle = await router_metrics(client, url)
    assert "vllm:num_requests_waiting" in {k.split("{")[0] for k in idle}  # the engine's own
    assert (idle[DEPTH], idle[FRACTION]) == (0, 0)

    body = {"model": "test-model", "messages": [{"role": "user", "content": ECHO_PROMPT}]}
    tasks = [asyncio.create_task(chat(client, url, {**body, "max_tokens": 40})) for _ in range(4)]
    await wait_until_async(lambda: sc.admission.stats().queue_length == 2, 10, "two queued")

    async def counted_once() -> bool:
        m = await router_metrics(client, url)
        return m[DEPTH] == 2 + engine_sum(m, "vllm:num_requests_waiting") == 3

    await wait_until_async(counted_once, 10, "kvgate's 2 queued + the engine's 1 waiting")
    busy = await router_metrics(client, url)
    stats = sc.admission.stats()
    assert busy[FRACTION] == pytest.approx(stats.kv_reserved_tokens / 4096) and busy[FRACTION] > 0

    # The queue is full: this replica refuses, for a proxy to retry on another one.
    status, headers = await chat(client, url, {**body, "max_tokens": 40})
    assert (status, headers["x-kvgate-reason"]) == (429, "queue_full")
    assert int(headers["Retry-After"]) >= 1 and "x-envoy-ratelimited" not in headers

    assert [s for s, _ in await asyncio.gather(*tasks)] == [200] * 4
    done = await router_metrics(client, url)
    assert (done[DEPTH], done[FRACTION]) == (0, 0)

    # The engine's /metrics gone: the gauges are still served, alone, with a comment why.
    sim.stop()
    async with client.get(url + "/metrics") as r:
        text = await r.text()
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
    assert text.startswith("# kvgate: the model server's /metrics failed")
    names = {f.name for f in text_string_to_metric_families(text)}
    assert names == {DEPTH, FRACTION}


@pytest.mark.llmd
async def test_llmd_a_full_replica_refuses_before_any_byte_without_x_envoy_ratelimited(
    llmd_sim: Callable[..., Proc],
    sidecar_process: Callable[..., Proc],
    client: aiohttp.ClientSession,
) -> None:
    """The real sidecar CLI: concurrency and KV refusals are 429s with Retry-After, a whole
    answer (no stream started), never ``x-envoy-ratelimited``."""
    sim = llmd_sim("--mode", "echo", "--inter-token-latency", "100ms")
    for spec, reason in (
        ({"concurrency": {"maxRequests": 1}}, "concurrency"),
        ({"capacity": {"kvCacheTokens": 96}}, "kv_capacity"),
    ):
        proc = sidecar_process(sim.url, {**spec, "overload": {"actions": ["Reject"]}})
        body = {
            "model": "test-model",
            "messages": [{"role": "user", "content": ECHO_PROMPT}],
            "max_tokens": 40,
            "stream": True,
        }
        held = await client.post(
            proc.url + "/v1/chat/completions", json=body, headers={"x-kvgate-tenant": TENANT}
        )
        try:
            assert held.status == 200
            async with client.post(
                proc.url + "/v1/chat/completions", json=body, headers={"x-kvgate-tenant": TENANT}
            ) as r:
                assert (r.status, r.headers["x-kvgate-reason"]) == (429, reason)
                assert r.content_type == "application/json"  # an answer, not a stream begun
                assert (await r.json())["error"]["code"] == "rate_limit_exceeded"
                assert int(r.headers["Retry-After"]) >= 1
                assert "x-envoy-ratelimited" not in r.headers
        finally:
            held.close()


# ------------------------------------------------------------------------- llama-server


@pytest.mark.llama
async def test_llama_metrics_carry_the_engines_and_the_gauges_that_move(
    llama_server: Callable[..., Proc],
    sidecar_factory: SidecarFactory,
    client: aiohttp.ClientSession,
) -> None:
    engine = llama_server(2, 1024)
    spec = {
        "capacity": {"fromEngineMetrics": True},
        "concurrency": {"maxRequests": 1},
        "overload": {"actions": ["Queue", "Reject"]},
        "queue": {"maxWaitSeconds": 60},
    }
    url, sc = await sidecar_factory(engine.url, spec)
    await wait_until_async(lambda: sc.capacity_known, 10, "the KV capacity from /props")
    idle = await router_metrics(client, url)
    assert "llamacpp:requests_processing" in idle  # the engine's own
    assert (idle[DEPTH], idle[FRACTION]) == (0, 0)

    # llama.cpp's own API: 200 tokens whatever the model says (several seconds on CPU).
    long = {"prompt": "Once upon a time", "n_predict": 200, "ignore_eos": True, "stream": True}
    held = await client.post(url + "/completion", json=long, headers={"x-kvgate-tenant": TENANT})
    try:
        assert held.status == 200
        await held.content.readline()  # the first event: it runs
        short = {"prompt": "Hi", "n_predict": 2}
        waiter = asyncio.create_task(
            client.post(url + "/completion", json=short, headers={"x-kvgate-tenant": TENANT})
        )
        await wait_until_async(lambda: sc.admission.stats().queue_length == 1, 10, "queued")
        busy = await router_metrics(client, url)
        assert busy[DEPTH] >= 1 and 0 < busy[FRACTION] <= 1
        capacity = sc.admission.stats().kv_capacity_tokens
        assert capacity is not None
        assert busy[FRACTION] == pytest.approx(sc.admission.stats().kv_reserved_tokens / capacity)
    finally:
        held.close()
    resp = await waiter
    assert resp.status == 200
    resp.release()
    await wait_until_async(lambda: sc.admission.idle, 20, "everything released")
    done = await router_metrics(client, url)
    assert (done[DEPTH], done[FRACTION]) == (0, 0)


# ------------------------------------------------------------------------- a shared limit


async def test_a_spent_fleet_wide_budget_refuses_with_x_envoy_ratelimited(
    redis_server: Callable[..., RedisServer],
    sim: Callable[..., Any],
    sidecar_factory: SidecarFactory,
    client: aiohttp.ClientSession,
) -> None:
    """A tenant over its ``shared`` limit (one budget for every replica, in Redis: a burst of 8,
    starting at its warm-up quarter in a new Redis, then one request every 20 s) gets 429 with
    ``x-envoy-ratelimited: true`` once the whole budget is spent: another replica would refuse
    it alike. Before that, a refusal by this pod's slice alone (the store still holding units,
    or not asked yet) does not carry it."""
    server = redis_server()
    limit = {"name": "r", "per": "Tenant", "shared": True, "requestsPerMinute": 3}
    spec = {"rateLimits": [{**limit, "burstRequests": 8}], "overload": {"actions": ["Reject"]}}
    store = StoreSettings(url=server.url, member="pod-0")
    url, _ = await sidecar_factory(await sim(), spec, store=store)
    body = {**CHAT, "model": "kvgate-sim-model", "max_tokens": 1}
    answers: list[tuple[int, dict[str, str]]] = []
    for _ in range(60):
        answers.append(await chat(client, url, body))
        status, headers = answers[-1]
        if "x-envoy-ratelimited" in headers:
            break
        await asyncio.sleep(0.1)
    admitted = [s for s, _ in answers if s == 200]
    assert 1 <= len(admitted) <= 3, [s for s, _ in answers]  # the warm-up level, maybe +1
    assert all(s in (200, 429) for s, _ in answers)
    assert (status, headers.get("x-envoy-ratelimited")) == (429, "true"), answers[-1]
    assert headers["x-kvgate-reason"] == "rate_limit_requests"
    assert int(headers["Retry-After"]) >= 1 and headers["x-kvgate-thresholds"] == "store=shared"


async def test_a_retry_that_already_waited_its_ttft_budget_is_refused_at_once(
    sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    """Behind a retrying proxy a retry carries the client request's start
    (``X-Request-Start: t=<epoch seconds>``, docs/routers.md): one that already spent most of
    its 3 s TTFT budget elsewhere is refused within the little left (before any byte, retriable
    elsewhere), while the same request stamped now waits its turn (the 3 s) and is served."""
    hold = asyncio.Event()
    up = Upstream(hold=hold)
    async with serve_handler(up.handle) as up_url:
        spec = {
            "capacity": {"kvCacheTokens": 4096},
            "concurrency": {"maxRequests": 1},
            "slo": {"ttftSeconds": 3},
            "overload": {"actions": ["Queue", "Reject"]},
        }
        url, sc = await sidecar_factory(up_url, spec)
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        first = asyncio.create_task(chat(client, url, body))
        await wait_until_async(lambda: up.active == 1, 10, "the first request upstream")

        async def stamped(age_s: float) -> tuple[int, dict[str, str]]:
            headers = {"x-kvgate-tenant": TENANT, "X-Request-Start": f"t={time.time() - age_s:.3f}"}
            async with client.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
                await r.read()
                return r.status, dict(r.headers)

        started = time.monotonic()
        status, headers = await stamped(2.9)
        # Refused within what was left of its budget: at once for its SLO when the wait ahead is
        # known, else when the little left of its budget ran out in the queue.
        assert time.monotonic() - started < 1.0
        assert (status, headers["x-kvgate-reason"]) in ((429, "slo"), (429, "queue_timeout"))
        assert int(headers["Retry-After"]) >= 1 and "x-envoy-ratelimited" not in headers
        assert up.active == 1 and len(up.bodies) == 1  # it never reached the model server
        fresh = asyncio.create_task(stamped(0.0))
        await wait_until_async(lambda: sc.admission.stats().queue_length == 1, 10, "queued")
        await asyncio.sleep(1.0)  # longer than the stamped one was given: still queued
        assert sc.admission.stats().queue_length == 1 and not fresh.done()
        hold.set()
        assert (await first)[0] == 200
        assert (await fresh)[0] == 200
        assert sc.admission.stats().kv_reserved_tokens == 0
