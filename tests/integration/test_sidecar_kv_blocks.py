"""KV arithmetic in vLLM's blocks, over real HTTP on loopback (issue 36, item 10): vLLM allocates
KV per sequence in whole blocks and ``vllm:kv_cache_usage_perc`` counts those blocks, not the
tokens in them (https://github.com/vllm-project/vllm/issues/57336: 66.7 % of blocks while
36.5 % of token slots hold KV). So a request's reservation rounds each of its ``n`` sequences up
to whole blocks (the prompt's full blocks counted once), and the engine's usage is read as the
token slots of its blocks in use, the reservations' own unit."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from aiohttp import web

from kvgate_bench.kit.toolkit import free_port, wait_until_async
from tests.conftest import SidecarFactory
from tests.upstream import Upstream

BLOCK = 16
#: A short prompt: its count (the estimate, chat overhead included) is under one block.
SHORT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def post(client: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with client.post(url + "/v1/chat/completions", json=body) as r:
        return r.status, await r.json(content_type=None)


async def test_each_of_n_sequences_reserves_whole_blocks(
    upstream: Upstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    spec = {
        "model": {"blockSize": BLOCK},
        "capacity": {"kvCacheTokens": 4096, "reservation": "MaxTokens"},
    }
    url, sc = await sidecar_factory(upstream.url, spec)
    upstream.hold = asyncio.Event()
    request = asyncio.ensure_future(post(client, url, {**SHORT, "n": 4, "max_tokens": 1}))
    await wait_until_async(lambda: upstream.active == 1, 10, "the request upstream")
    reserved = sc.admission.stats().kv_reserved_tokens
    upstream.hold.set()
    assert (await request)[0] == 200
    # Four sequences of a prompt under one block and one token: a block each, not one in all.
    assert reserved == 4 * BLOCK, reserved
    await wait_until_async(lambda: sc.admission.stats().in_flight == 0, 10, "released")
    assert sc.admission.stats().kv_reserved_tokens == 0


async def test_a_pool_too_small_for_n_sequences_in_blocks_is_refused_before_the_engine(
    upstream: Upstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    """Three blocks hold three one-token sequences of a short prompt, never four: vLLM would
    need a block per sequence (it preempts or refuses), so the fourth is not admitted."""
    spec = {
        "model": {"blockSize": BLOCK},
        "capacity": {"kvCacheTokens": 3 * BLOCK, "reservation": "MaxTokens"},
    }
    url, _ = await sidecar_factory(upstream.url, spec)
    status, body = await post(client, url, {**SHORT, "n": 4, "max_tokens": 1})
    assert status == 400, body  # can never fit: waiting would not help
    assert body["error"]["code"] == "exceeds_capacity", body
    assert upstream.bodies == []
    assert (await post(client, url, {**SHORT, "n": 3, "max_tokens": 1}))[0] == 200


async def test_the_engines_block_usage_is_read_in_the_reservations_unit(
    upstream: Upstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    """A vLLM stand-in with a 6-block pool reports 4 blocks in use (66.7 %) while the request in
    flight holds one token of KV in each of its four sequences' blocks: kvgate counts 64 token
    slots in use, its own reservation, not 4 tokens nor a phantom beside it, so two more blocks
    (a 31-token reservation) still fit, exactly."""
    port = free_port()
    usage = {"value": 0.0}

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(
            text=f'vllm:cache_config_info{{block_size="{BLOCK}",num_gpu_blocks="6"}} 1\n'
            "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n"
            f"vllm:kv_cache_usage_perc {usage['value']!r}\n"
        )

    async def rest(request: web.Request) -> web.StreamResponse:
        return await upstream.handle(request)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_route("*", "/{tail:.*}", rest)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        spec = {
            "model": {"blockSize": BLOCK},
            "capacity": {"fromEngineMetrics": True, "reservation": "MaxTokens"},
            "overload": {"actions": ["Reject"]},
        }
        url, sc = await sidecar_factory(f"http://127.0.0.1:{port}", spec, engine_usage_seconds=0.05)
        await wait_until_async(
            lambda: sc.admission.stats().kv_capacity_tokens == 6 * BLOCK, 10, "the pool read"
        )
        upstream.hold = asyncio.Event()
        first = asyncio.ensure_future(post(client, url, {**SHORT, "n": 4, "max_tokens": 1}))
        await wait_until_async(lambda: upstream.active == 1, 10, "the first request upstream")
        usage["value"] = 4 / 6  # the engine's four blocks, one per sequence
        await asyncio.sleep(0.3)  # several reads of the engine's usage
        core = sc.admission.core
        assert core.stats().kv_reserved_tokens == 4 * BLOCK
        second = asyncio.ensure_future(post(client, url, {**SHORT, "max_tokens": 2 * BLOCK - 15}))
        await wait_until_async(
            lambda: upstream.active == 2 or second.done(), 10, "the second request decided"
        )
        assert core.stats().kv_reserved_tokens == 6 * BLOCK  # 64 + 32: the whole pool
        upstream.hold.set()
        status, body = await second
        assert status == 200, body
        assert (await first)[0] == 200
    finally:
        await runner.cleanup()
