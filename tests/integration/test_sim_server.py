"""kvgate-sim over real HTTP on loopback (in-process server, small decode latency)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from kvgate_bench.kit.toolkit import wait_until_async
from kvgate_bench.sim.config import SimConfig
from kvgate_bench.sim.loop import MAX_LAG_S
from kvgate_bench.sim.sequences import StepResult
from kvgate_bench.sim.server import SIM_KEY, start_sim

MODEL = "kvgate-sim-model"
Factory = Callable[..., Awaitable[str]]


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def chat_body(words: str = "hello world foo", **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": words}], **kw}


async def sse_events(resp: aiohttp.ClientResponse) -> list[Any]:
    """Parse a whole SSE body into JSON objects, with "[DONE]" kept as a string."""
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    text = await resp.text()
    assert text.endswith("\n\n")
    events: list[Any] = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: ")
        data = block.removeprefix("data: ")
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def stats(http: aiohttp.ClientSession, base: str) -> dict[str, Any]:
    async with http.get(f"{base}/sim/stats") as resp:
        data: dict[str, Any] = await resp.json()
        return data


async def wait_for(pred: Callable[[], Awaitable[bool]], within_s: float = 5.0) -> None:
    """Poll ``pred`` every 10 ms; fail unless it holds within ``within_s`` seconds (5 s: slack
    for a loaded CI machine; the simulator reacts within a step, milliseconds)."""
    await wait_until_async(pred, within_s, "the condition")


async def test_chat_completion_non_streaming(sim: Factory, http: aiohttp.ClientSession) -> None:
    base = await sim()
    body = chat_body(max_tokens=50, max_completion_tokens=5)  # max_completion_tokens wins
    async with http.post(f"{base}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        data = await resp.json()
    assert data["object"] == "chat.completion" and data["model"] == MODEL
    assert data["id"].startswith("chatcmpl-")
    (choice,) = data["choices"]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == " the quick brown fox jumps"
    assert choice["finish_reason"] == "length"
    # 3 words + 4 per message + 2
    assert data["usage"] == {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14}


async def test_completion_non_streaming(sim: Factory, http: aiohttp.ClientSession) -> None:
    base = await sim(extra_models=("fallback-model",))
    for prompt, n_prompt in (("a b  c d", 4), (["a b", "c"], 3), ([1, 2, 3, 4, 5], 5)):
        body = {"model": "fallback-model", "prompt": prompt, "max_tokens": 3}
        async with http.post(f"{base}/v1/completions", json=body) as resp:
            assert resp.status == 200
            data = await resp.json()
        assert data["object"] == "text_completion" and data["model"] == "fallback-model"
        assert data["choices"][0]["text"] == " the quick brown"
        assert data["choices"][0]["finish_reason"] == "length"
        assert data["usage"] == {
            "prompt_tokens": n_prompt,
            "completion_tokens": 3,
            "total_tokens": n_prompt + 3,
        }


async def test_max_tokens_defaults_to_remaining_context(
    sim: Factory, http: aiohttp.ClientSession
) -> None:
    base = await sim(max_model_len=16, max_num_batched_tokens=16)
    body = {"model": MODEL, "prompt": "one two three four five six"}
    async with http.post(f"{base}/v1/completions", json=body) as resp:
        data = await resp.json()
    assert data["usage"]["completion_tokens"] == 10


async def test_chat_streaming_without_usage(sim: Factory, http: aiohttp.ClientSession) -> None:
    base = await sim()
    body = chat_body(max_tokens=4, stream=True)
    async with http.post(f"{base}/v1/chat/completions", json=body) as resp:
        events = await sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = chunks[1:]
    assert [c["choices"][0]["delta"]["content"] for c in content] == [
        " the",
        " quick",
        " brown",
        " fox",
    ]
    assert [c["choices"][0]["finish_reason"] for c in content] == [None, None, None, "length"]
    assert all("usage" not in c for c in chunks)


async def test_completion_streaming_include_usage(
    sim: Factory, http: aiohttp.ClientSession
) -> None:
    base = await sim()
    body = {
        "model": MODEL,
        "prompt": "a b c",
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with http.post(f"{base}/v1/completions", json=body) as resp:
        events = await sse_events(resp)
    assert events[-1] == "[DONE]"
    *tokens, usage = events[:-1]
    assert [c["choices"][0]["text"] for c in tokens] == [" the", " quick", " brown"]
    assert tokens[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in tokens)
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


async def test_chat_streaming_include_usage(sim: Factory, http: aiohttp.ClientSession) -> None:
    base = await sim()
    body = chat_body(max_tokens=2, stream=True, stream_options={"include_usage": True})
    async with http.post(f"{base}/v1/chat/completions", json=body) as resp:
        events = await sse_events(resp)
    with_usage = [e for e in events[:-1] if "usage" in e]
    assert len(with_usage) == 1 and with_usage[0] is events[-2]
    assert with_usage[0]["choices"] == []
    assert with_usage[0]["usage"]["completion_tokens"] == 2


async def test_errors_are_openai_shaped(sim: Factory, http: aiohttp.ClientSession) -> None:
    base = await sim(max_model_len=64, max_num_batched_tokens=64)
    cases: list[tuple[str, Any, int, str | None]] = [
        ("/v1/chat/completions", {**chat_body(), "model": "nope"}, 404, "NotFoundError"),
        ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "NotFoundError"),
        ("/v1/chat/completions", b"{not json", 400, "BadRequestError"),
        ("/v1/completions", b"[1, 2]", 400, "BadRequestError"),
        ("/v1/chat/completions", chat_body(max_tokens=100), 400, "BadRequestError"),
        ("/v1/chat/completions", chat_body(max_completion_tokens=0, max_tokens=5), 400, None),
        ("/v1/completions", {"model": MODEL, "prompt": "x " * 64}, 400, "BadRequestError"),
        ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "BadRequestError"),
        ("/v1/chat/completions", chat_body(stream_options={"include_usage": True}), 400, None),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, None),
    ]
    for path, body, status, err_type in cases:
        kw: dict[str, Any] = {"data": body} if isinstance(body, bytes) else {"json": body}
        async with http.post(base + path, **kw) as resp:
            assert resp.status == status, (path, body)
            err = (await resp.json())["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["code"] == status and err["message"]
        if err_type:
            assert err["type"] == err_type
    assert (await stats(http, base))["running"] == 0


async def test_models_health_and_metrics(sim: Factory, http: aiohttp.ClientSession) -> None:
    base = await sim(kv_capacity_tokens=4096, block_size=32, extra_models=("alt",))
    async with http.get(f"{base}/health") as resp:
        assert resp.status == 200
    async with http.get(f"{base}/v1/models") as resp:
        models = await resp.json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL, "alt"]
    assert all(m["object"] == "model" for m in models["data"])
    headers = {"x-kvgate-tenant": "team-a"}
    body = {"prompt": "hi", "max_tokens": 2}
    async with http.post(f"{base}/v1/completions", json=body, headers=headers) as resp:
        assert resp.status == 200
    async with http.get(f"{base}/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    label = f'{{model_name="{MODEL}"}}'
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
    ):
        assert re.search(rf"^{re.escape(name + label)} 0\.0$", text, re.M), name
    assert re.search(r'^vllm:cache_config_info\{.*block_size="32".*\} 1\.0$', text, re.M)
    assert re.search(r'^vllm:cache_config_info\{.*num_gpu_blocks="128".*\} 1\.0$', text, re.M)
    assert 'kvgate_sim_requests_total{tenant="team-a"} 1.0' in text


async def test_metrics_registries_are_per_app(sim: Factory, http: aiohttp.ClientSession) -> None:
    a, b = await sim(), await sim()
    async with http.post(f"{a}/v1/completions", json={"prompt": "x", "max_tokens": 1}) as resp:
        assert resp.status == 200
    async with http.get(f"{b}/metrics") as resp:
        assert "kvgate_sim_requests_total{" not in await resp.text()


async def test_disconnect_mid_stream_cancels_request(
    sim: Factory, http: aiohttp.ClientSession
) -> None:
    base = await sim()
    body = chat_body(max_tokens=5000, stream=True)
    resp = await http.post(f"{base}/v1/chat/completions", json=body)
    for _ in range(3):  # role chunk + 2 tokens
        assert (await resp.content.readuntil(b"\n\n")).startswith(b"data: ")
    s = await stats(http, base)
    assert s["running"] == 1 and s["used_blocks"] > 0 and s["active_requests"] == 1
    resp.close()  # drops the connection

    async def cancelled() -> bool:
        s = await stats(http, base)
        return bool(s["cancelled_total"] == 1 and s["running"] == 0 and s["used_blocks"] == 0)

    await wait_for(cancelled)
    assert (await stats(http, base))["active_requests"] == 0


async def test_disconnect_while_waiting_cancels_request(
    sim: Factory, http: aiohttp.ClientSession
) -> None:
    base = await sim(max_num_seqs=1)
    blocker = await http.post(
        f"{base}/v1/completions",
        json={"prompt": "x", "max_tokens": 5000, "stream": True},
    )
    await blocker.content.readuntil(b"\n\n")
    waiter = asyncio.create_task(
        http.post(f"{base}/v1/completions", json={"prompt": "y", "max_tokens": 10})
    )

    async def queued() -> bool:
        return bool((await stats(http, base))["waiting"] == 1)

    await wait_for(queued)
    waiter.cancel()  # the non-streaming client gives up before its first token

    async def cancelled() -> bool:
        s = await stats(http, base)
        return bool(s["cancelled_total"] == 1 and s["waiting"] == 0 and s["running"] == 1)

    await wait_for(cancelled)
    blocker.close()

    async def idle() -> bool:
        s = await stats(http, base)
        return bool(s["cancelled_total"] == 2 and s["running"] == 0 and s["used_blocks"] == 0)

    await wait_for(idle)


async def test_overload_causes_preemptions_attributed_to_tenants(
    sim: Factory, http: aiohttp.ClientSession
) -> None:
    # 64 blocks of 16 tokens; 8 requests each peaking at ~14 blocks.
    base = await sim(kv_capacity_tokens=1024, max_model_len=1024)

    async def one(i: int) -> dict[str, Any]:
        headers = {"x-kvgate-tenant": f"t{i % 2}"}
        body = chat_body("lorem " * 10, max_tokens=200)
        async with http.post(f"{base}/v1/chat/completions", json=body, headers=headers) as resp:
            assert resp.status == 200
            data: dict[str, Any] = await resp.json()
            return data

    results = await asyncio.gather(*(one(i) for i in range(8)))
    assert all(r["usage"]["completion_tokens"] == 200 for r in results)
    assert all(len(r["choices"][0]["message"]["content"].split()) == 200 for r in results)
    s = await stats(http, base)
    assert s["preemptions"] > 0 and s["used_blocks"] == 0 and s["finished_total"] == 8
    async with http.get(f"{base}/metrics") as resp:
        text = await resp.text()
    m = re.search(r"^vllm:num_preemptions_total\{.*\} (\S+)$", text, re.M)
    assert m and float(m.group(1)) == s["preemptions"]
    by_tenant = re.findall(r'^kvgate_sim_preemptions_by_tenant_total\{tenant="(t\d)"\} (\S+)$',
                           text, re.M)  # fmt: skip
    assert by_tenant and sum(float(v) for _, v in by_tenant) == s["preemptions"]


async def test_cli_starts_and_exits_cleanly_on_sigterm() -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvgate_bench.sim.cli", "--port", "0", "--decode-ms", "1",
        stdout=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(10):
            line = (await proc.stdout.readline()).decode()
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
        assert m, line
        async with aiohttp.ClientSession() as http, http.get(f"{m.group(1)}/health") as resp:
            assert resp.status == 200
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(5):
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_shutdown_aborts_in_flight_streams_promptly(http: aiohttp.ClientSession) -> None:
    runner, port = await start_sim(SimConfig(decode_ms=1.0))
    base = f"http://127.0.0.1:{port}"
    body = {"prompt": "x", "max_tokens": 5000, "stream": True}
    async with http.post(f"{base}/v1/completions", json=body) as resp:
        await resp.content.readuntil(b"\n\n")
        async with asyncio.timeout(1.0):
            await runner.cleanup()
            rest = await resp.content.read()
    assert b"[DONE]" not in rest


async def test_engine_failure_aborts_requests_and_fails_health(
    http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    runner, port = await start_sim(SimConfig(decode_ms=1.0))
    base = f"http://127.0.0.1:{port}"
    engine = runner.app[SIM_KEY].loop.engine

    def boom() -> StepResult:
        raise RuntimeError("boom")

    engine.step = boom  # type: ignore[method-assign]
    try:
        async with http.post(f"{base}/v1/completions", json={"prompt": "x"}) as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["type"] == "ServiceUnavailableError"
        async with http.get(f"{base}/health") as resp:
            assert resp.status == 503
        assert "engine loop died" in caplog.text
    finally:
        await runner.cleanup()


async def test_preemptions_are_reported_per_response_id(
    sim: Factory, http: aiohttp.ClientSession
) -> None:
    base = await sim(kv_capacity_tokens=1024, max_model_len=1024)  # as the test above

    async def one() -> str:
        body = chat_body("lorem " * 10, max_tokens=200)
        async with http.post(f"{base}/v1/chat/completions", json=body) as resp:
            data: dict[str, Any] = await resp.json()
            return str(data["id"])

    ids = set(await asyncio.gather(*(one() for _ in range(8))))
    async with http.get(f"{base}/sim/preemptions") as resp:
        pre = await resp.json()
    s = await stats(http, base)
    assert pre["total"] == s["preemptions"] > 0
    assert set(pre["requests"]) <= ids and sum(pre["requests"].values()) == pre["total"]


async def test_time_scale_stretches_steps_and_steps_keep_to_their_deadlines(
    sim: Factory, http: aiohttp.ClientSession
) -> None:
    # 2000 decode steps of 0.5 ms: 1 s modelled. Paced to deadlines the loop's own time per
    # step (stepping, delivering the token, the sleep's overshoot) does not add up; slept after
    # the work (kvgate-sim before pacing) it took about 3x as long on a 2-core machine.
    loop = asyncio.get_running_loop()
    for scale in (1.0, 2.0):
        base = await sim(decode_ms=0.5, time_scale=scale)
        body = chat_body(max_tokens=2000, stream=True)
        t0 = loop.time()
        async with http.post(f"{base}/v1/chat/completions", json=body) as resp:
            await resp.read()
        elapsed = loop.time() - t0
        s = await stats(http, base)
        assert s["steps"] == 2000 and s["time_scale"] == scale
        # The bound is the point (paced, not ~3 s per modelled second). What a busy machine
        # adds to the paced timeline is written off in late_s (lag past MAX_LAG_S); on top of
        # that, up to MAX_LAG_S of lag not yet written off at the last step, and 0.5 s for the
        # request around the steps: generous, still well under the unpaced ~3 s (scale 1).
        bound = 1.1 * scale + s["late_s"] + MAX_LAG_S + 0.5
        assert 1.0 * scale <= elapsed < bound, (elapsed, s)
    with pytest.raises(ValueError, match="time_scale"):
        SimConfig(time_scale=0)
