"""Every generation API of the supported engines goes through admission, over real HTTP on
loopback, against a recording upstream that answers each API in its own format; unknown mutating
requests never reach the model server.

Engines and their APIs: vLLM (OpenAI ``/v1/chat/completions``, ``/v1/completions``,
``/v1/responses``; Anthropic ``/v1/messages``), TGI (``/generate``, ``/generate_stream``),
SGLang (``/generate``), llama.cpp (``/completion``, ``/completions``, ``/infill``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvgate_bench.toolkit import free_port
from tests.conftest import SidecarFactory, gauges

# ---------------------------------------------------------------- a recording multi-API upstream


def _sse(events: list[Any], done: bool) -> bytes:
    out = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    return out + (b"data: [DONE]\n\n" if done else b"")


def _named_sse(events: list[tuple[str, Any]]) -> bytes:
    return b"".join(
        b"event: " + name.encode() + b"\ndata: " + json.dumps(e).encode() + b"\n\n"
        for name, e in events
    )


TOKENS = 4  # output tokens every API answers with
PROMPT = 9  # prompt tokens every API reports


def answer(path: str, body: dict[str, Any]) -> tuple[bytes, str]:
    """(payload, content type) of a well-behaved engine for ``path``."""
    stream = bool(body.get("stream")) or path == "/generate_stream"
    if path in ("/v1/chat/completions", "/v1/completions"):
        if not stream:
            usage = {"prompt_tokens": PROMPT, "completion_tokens": TOKENS}
            return json.dumps({"choices": [{"text": "a"}], "usage": usage}).encode(), "json"
        ev: list[Any] = [{"choices": [{"index": 0, "text": "t"}]} for _ in range(TOKENS)]
        if (body.get("stream_options") or {}).get("include_usage"):
            ev.append(
                {"choices": [], "usage": {"prompt_tokens": PROMPT, "completion_tokens": TOKENS}}
            )
        return _sse(ev, True), "sse"
    if path == "/v1/responses":
        usage = {"input_tokens": PROMPT, "output_tokens": TOKENS}
        if not stream:
            return json.dumps({"object": "response", "usage": usage}).encode(), "json"
        named: list[tuple[str, Any]] = [("response.created", {"type": "response.created"})]
        named += [
            ("response.output_text.delta", {"type": "response.output_text.delta", "delta": "t"})
        ] * TOKENS
        named.append(
            ("response.completed", {"type": "response.completed", "response": {"usage": usage}})
        )
        return _named_sse(named), "sse"
    if path == "/v1/messages":
        if not stream:
            usage = {"input_tokens": PROMPT, "output_tokens": TOKENS}
            return json.dumps({"type": "message", "usage": usage}).encode(), "json"
        start = {"type": "message_start", "message": {"usage": {"input_tokens": PROMPT}}}
        named = [("message_start", start)]
        named += [
            ("content_block_delta", {"type": "content_block_delta", "delta": {"text": "t"}})
        ] * TOKENS
        named.append(("message_delta", {"type": "message_delta", "usage": {"output_tokens": 4}}))
        named.append(("message_stop", {"type": "message_stop"}))
        return _named_sse(named), "sse"
    if path in ("/generate", "/generate_stream") and "inputs" in body:  # TGI
        if not stream:
            det = {"generated_tokens": TOKENS, "finish_reason": "length"}
            return json.dumps({"generated_text": "abcd", "details": det}).encode(), "json"
        ev = [{"token": {"id": i, "text": "t"}, "generated_text": None} for i in range(TOKENS)]
        ev[-1] = {**ev[-1], "generated_text": "tttt", "details": {"generated_tokens": TOKENS}}
        return _sse(ev, False), "sse"
    if path == "/generate":  # SGLang
        meta = {"prompt_tokens": PROMPT, "completion_tokens": TOKENS}
        if not stream:
            return json.dumps({"text": "abcd", "meta_info": meta}).encode(), "json"
        ev = [
            {"text": "t" * (i + 1), "meta_info": {**meta, "completion_tokens": i + 1}}
            for i in range(TOKENS)
        ]
        return _sse(ev, True), "sse"
    # llama.cpp native
    final = {"content": "", "stop": True, "tokens_predicted": TOKENS, "tokens_evaluated": PROMPT}
    if not stream:
        return json.dumps({**final, "content": "abcd"}).encode(), "json"
    ev = [{"content": "t", "stop": False} for _ in range(TOKENS)] + [final]
    return _sse(ev, False), "sse"


@dataclass
class MultiUpstream:
    """Records every request that reaches it; holds each generation request ``hold`` seconds."""

    url: str = ""
    seen: list[tuple[str, str, bytes]] = field(default_factory=list)
    hold: float = 0.0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.seen.append((request.method, request.path, raw))
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = {}
        if not isinstance(body, dict) or request.method != "POST":
            return web.json_response({"path": request.path})
        if request.path in ("/tokenize", "/detokenize", "/v1/messages/count_tokens"):
            return web.json_response({"tokens": [1, 2]})
        await asyncio.sleep(self.hold)
        payload, kind = answer(request.path, body)
        if kind == "json":
            return web.Response(body=payload, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for part in payload.split(b"\n\n"):
            if part:
                await resp.write(part + b"\n\n")
        await resp.write_eof()
        return resp

    @property
    def generation_calls(self) -> list[tuple[str, str, bytes]]:
        return [s for s in self.seen if s[1] not in ("/v1/models", "/health", "/metrics")]


@pytest.fixture
async def multi() -> AsyncIterator[MultiUpstream]:
    up = MultiUpstream()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", up.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    up.url = f"http://127.0.0.1:{port}"
    yield up
    await runner.cleanup()


# ---------------------------------------------------------------- one request per API

#: (path, body, the field naming its output limit): one valid request per generation API.
APIS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"model": "m", "prompt": "hi"}),
    ("/v1/responses", {"model": "m", "input": "hi"}),
    (
        "/v1/responses",
        {
            "model": "m",
            "instructions": "be brief",
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
        },
    ),
    (
        "/v1/messages",
        {
            "model": "m",
            "max_tokens": 32,
            "system": "be brief",
            "messages": [{"role": "user", "content": "hi"}],
        },
    ),
    ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 32}}),
    ("/generate_stream", {"inputs": "hi", "parameters": {"max_new_tokens": 32}}),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 32}}),
    ("/completion", {"prompt": "hi", "n_predict": 32}),
    ("/completions", {"prompt": "hi", "n_predict": -1}),
    ("/infill", {"input_prefix": "def f(", "input_suffix": "):", "n_predict": 32}),
]
API_IDS = [f"{p}-{i}" for i, (p, _) in enumerate(APIS)]


#: One request per minute and tenant, refused (never degraded or queued) above it.
LIMITED: dict[str, Any] = {
    "rateLimits": [{"name": "per-tenant", "requestsPerMinute": 1, "burstRequests": 1}],
    "overload": {"actions": ["Reject"]},
}


async def _exhaust(sc_url: str, client: aiohttp.ClientSession) -> None:
    """Spend the anonymous tenant's one request of the minute on chat."""
    async with client.post(
        sc_url + "/v1/chat/completions", json={**APIS[0][1], "max_tokens": 4}
    ) as r:
        assert r.status == 200, await r.text()
    async with client.post(
        sc_url + "/v1/chat/completions", json={**APIS[0][1], "max_tokens": 4}
    ) as r:
        assert r.status == 429


@pytest.mark.parametrize(("path", "body"), APIS, ids=API_IDS)
async def test_every_generation_api_is_refused_for_a_tenant_over_its_limit(
    multi: MultiUpstream,
    sidecar_factory: SidecarFactory,
    client: aiohttp.ClientSession,
    path: str,
    body: dict[str, Any],
) -> None:
    url, _ = await sidecar_factory(multi.url, LIMITED)
    await _exhaust(url, client)
    before = len(multi.generation_calls)
    async with client.post(url + path, json=body) as r:
        assert r.status == 429, await r.text()
        assert r.headers["x-kvgate-decision"] == "rejected"
        err = await r.json()
    assert err["error"]["type"] == "rate_limit_error"
    assert len(multi.generation_calls) == before  # never reached the model server


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("path", "body"), APIS, ids=API_IDS)
async def test_every_generation_api_is_admitted_and_settled_from_its_own_usage(
    multi: MultiUpstream,
    sidecar_factory: SidecarFactory,
    client: aiohttp.ClientSession,
    path: str,
    body: dict[str, Any],
    stream: bool,
) -> None:
    url, sc = await sidecar_factory(multi.url, {"capacity": {"kvCacheTokens": 100000}})
    sent = {**body, "stream": True} if stream else body
    if stream and path == "/generate_stream":
        sent = body
    async with client.post(url + path, json=sent) as r:
        assert r.status == 200, await r.text()
        assert r.headers["x-kvgate-decision"] == "admitted"
        await r.read()
    g = await gauges(client, url)
    assert g['kvgate_tokens_total{kind="completion",tenant="anonymous"}'] == TOKENS
    assert g["kvgate_in_flight_requests"] == 0
    assert sc.controller.kv_reserved_tokens == 0


# ---------------------------------------------------------------- sequences: n, best_of, batches


async def test_best_of_is_reserved_for_every_sequence(
    multi: MultiUpstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    url, sc = await sidecar_factory(
        multi.url, {"capacity": {"kvCacheTokens": 100000}, "model": {"blockSize": 1}}
    )
    multi.hold = 0.5
    body = {"model": "m", "prompt": "hi", "max_tokens": 10, "n": 2, "best_of": 5}
    task = asyncio.create_task(client.post(url + "/v1/completions", json=body))
    for _ in range(200):
        if multi.generation_calls:
            break
        await asyncio.sleep(0.02)
    prompt = sc.counter.count({"prompt": "hi"}).tokens
    assert sc.controller.kv_reserved_tokens == prompt + 5 * 10  # max(n, best_of) sequences
    (await task).release()


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"model": "m", "prompt": "hi", "best_of": 1000000}, "best_of"),
        ("/v1/completions", {"model": "m", "prompt": "hi", "n": 1000000}, "n"),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 129},
            "n",
        ),
        ("/generate", {"inputs": "hi", "parameters": {"best_of": 1000000}}, "parameters.best_of"),
        ("/generate", {"text": "hi", "sampling_params": {"n": 1000000}}, "sampling_params.n"),
    ],
)
async def test_absurd_sequence_counts_are_refused_before_the_model_server(
    multi: MultiUpstream,
    sidecar_factory: SidecarFactory,
    client: aiohttp.ClientSession,
    path: str,
    body: dict[str, Any],
    param: str,
) -> None:
    url, _ = await sidecar_factory(multi.url, {})
    async with client.post(url + path, json=body) as r:
        assert r.status == 400, await r.text()
        err = await r.json()
    assert err["error"]["param"] == param
    assert multi.generation_calls == []
