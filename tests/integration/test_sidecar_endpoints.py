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

from kvgate_bench.kit.toolkit import wait_until_async
from tests.conftest import SidecarFactory, gauges
from tests.upstream import serve_handler

#: The decisions counter's series for refusals before admission (a bad body, path or method).
REFUSED_INVALID = (
    'kvgate_admission_decisions_total{outcome="rejected",reason="invalid_request",tenant=""}'
)

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
    """Records every request that reaches it; holds each generation request ``hold`` seconds,
    then, with a ``gate``, until the gate is set."""

    url: str = ""
    seen: list[tuple[str, str, bytes]] = field(default_factory=list)
    hold: float = 0.0
    gate: asyncio.Event | None = None
    cut_after: int | None = None  # streams: drop the connection after this many events

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
        if self.gate is not None:
            await self.gate.wait()
        payload, kind = answer(request.path, body)
        if kind == "json":
            return web.Response(body=payload, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, part in enumerate(p for p in payload.split(b"\n\n") if p):
            if i == self.cut_after and request.transport is not None:
                request.transport.abort()
                raise ConnectionResetError("simulated engine crash mid-stream")
            await resp.write(part + b"\n\n")
        await resp.write_eof()
        return resp

    @property
    def generation_calls(self) -> list[tuple[str, str, bytes]]:
        """What reached it but the sidecar's own probes (sent in the background, at times of
        their own: llama.cpp's ``/props`` and ``/slots`` among them)."""
        probes = ("/v1/models", "/health", "/metrics", "/props", "/slots")
        return [s for s in self.seen if s[1] not in probes]


@pytest.fixture
async def multi() -> AsyncIterator[MultiUpstream]:
    up = MultiUpstream()
    async with serve_handler(up.handle, access_log=None) as up.url:
        yield up


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
    assert sc.admission.stats().kv_reserved_tokens == 0


# ---------------------------------------------------------------- sequences: n, best_of, batches


async def test_best_of_is_reserved_for_every_sequence(
    multi: MultiUpstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    url, sc = await sidecar_factory(
        multi.url, {"capacity": {"kvCacheTokens": 100000}, "model": {"blockSize": 1}}
    )
    multi.gate = asyncio.Event()  # in flight until the reservation was read, however slowly
    body = {"model": "m", "prompt": "hi", "max_tokens": 10, "n": 2, "best_of": 5}
    task = asyncio.create_task(client.post(url + "/v1/completions", json=body))
    try:
        await wait_until_async(
            lambda: any(c[:2] == ("POST", "/v1/completions") for c in multi.seen),
            10,
            "the upstream to get the request",  # not the sidecar's GET probes
        )
        prompt = sc.counter.count({"prompt": "hi"}).tokens
        assert (
            sc.admission.stats().kv_reserved_tokens == prompt + 5 * 10
        )  # max(n, best_of) sequences
    finally:
        multi.gate.set()
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


async def test_list_prompts_and_batches_reserve_every_sequence(
    multi: MultiUpstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    url, sc = await sidecar_factory(
        multi.url, {"capacity": {"kvCacheTokens": 100000}, "model": {"blockSize": 1}}
    )
    cases: list[tuple[str, dict[str, Any], int]] = [
        ("/v1/completions", {"model": "m", "prompt": ["a", "b", "c"], "max_tokens": 10, "n": 2}, 6),
        ("/v1/completions", {"model": "m", "prompt": [[1, 2], [3]], "max_tokens": 10}, 2),
        ("/generate", {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 10, "n": 3}}, 6),
        ("/generate", {"inputs": "a", "parameters": {"max_new_tokens": 10, "best_of": 2}}, 2),
        ("/completion", {"prompt": ["a", "b"], "n_predict": 10}, 2),
    ]
    for path, body, sequences in cases:
        multi.gate = asyncio.Event()  # in flight until the reservation was read, however slowly
        task = asyncio.create_task(client.post(url + path, json=body))
        try:
            await wait_until_async(
                lambda: sc.admission.stats().kv_reserved_tokens, 10, "a reservation"
            )
            reserved = sc.admission.stats().kv_reserved_tokens
        finally:
            multi.gate.set()
        (await task).release()
        assert (
            reserved - 10 * sequences
            == sc.counter.count(
                {"prompt": body.get("prompt") or body.get("text") or body.get("inputs")}
            ).tokens
        ), (path, body)
        await wait_until_async(
            lambda: sc.admission.stats().kv_reserved_tokens == 0, 10, "the release"
        )


async def test_unbounded_or_missing_limits_send_the_policy_default_in_each_apis_field(
    multi: MultiUpstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    url, _ = await sidecar_factory(multi.url, {"tenants": {"defaultMaxTokens": 77}})
    cases: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
        ("/v1/responses", {"model": "m", "input": "hi"}, ("max_output_tokens",)),
        ("/generate", {"inputs": "hi"}, ("parameters", "max_new_tokens")),
        ("/generate", {"text": "hi", "sampling_params": {}}, ("sampling_params", "max_new_tokens")),
        ("/completion", {"prompt": "hi", "n_predict": -1}, ("n_predict",)),
        ("/completions", {"prompt": "hi"}, ("max_tokens",)),
        # llama.cpp's OpenAI routes let n_predict override max_tokens: -1 is unbounded
        ("/v1/chat/completions", {**APIS[0][1], "max_tokens": 1, "n_predict": -1}, ("n_predict",)),
        ("/v1/completions", {"model": "m", "prompt": "hi", "n_predict": -1}, ("max_tokens",)),
    ]
    for path, body, where in cases:
        async with client.post(url + path, json=body) as r:
            assert r.status == 200, await r.text()
        sent: Any = json.loads(multi.generation_calls[-1][2])
        for key in where:
            sent = sent[key]
        assert sent == 77, (path, body)


async def test_degraded_limit_is_written_where_the_api_reads_it(
    multi: MultiUpstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    url, _ = await sidecar_factory(
        multi.url,
        {"tenants": {"maxTokensCap": 40, "defaultMaxTokens": 16}, "model": {"maxModelLen": 4096}},
    )
    body = {"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 500}, {"max_new_tokens": 8}]}
    async with client.post(url + "/generate", json=body) as r:
        assert r.status == 200
        assert r.headers["x-kvgate-degraded"] == "max_tokens=40"
    sent = json.loads(multi.generation_calls[-1][2])
    assert [p["max_new_tokens"] for p in sent["sampling_params"]] == [40, 8]
    async with client.post(url + "/v1/messages", json={**APIS[4][1], "max_tokens": 900}) as r:
        assert r.status == 200
    assert json.loads(multi.generation_calls[-1][2])["max_tokens"] == 40


async def test_apis_without_a_model_field_are_never_degraded_to_the_fallback_model(
    multi: MultiUpstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    url, _ = await sidecar_factory(
        multi.url,
        {
            "rateLimits": [{"name": "t", "requestsPerMinute": 1, "burstRequests": 1}],
            "overload": {"actions": ["Degrade", "Reject"], "degrade": {"fallbackModel": "small"}},
        },
    )
    async with client.post(url + "/generate", json={"inputs": "hi"}) as r:
        assert r.status == 200
    before = len(multi.generation_calls)
    async with client.post(url + "/generate", json={"inputs": "hi"}) as r:
        assert r.status == 429  # no model to rewrite: refused, not served by the big model
    async with client.post(url + "/v1/responses", json={"model": "m", "input": "x"}) as r:
        assert r.status == 200 and r.headers["x-kvgate-degraded"] == "model=small"
    assert json.loads(multi.generation_calls[-1][2])["model"] == "small"
    assert len(multi.generation_calls) == before + 1


# ---------------------------------------------------------------- routing: refuse what is unknown


async def raw_post(url: str, target: str, body: bytes = b"{}", method: str = "POST") -> bytes:
    """One HTTP/1.1 request (POST by default) with its request-target sent exactly as given;
    the whole response."""
    reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
    writer.write(
        method.encode() + b" " + target.encode() + b" HTTP/1.1\r\nHost: x\r\n"
        b"Connection: close\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body
    )
    await writer.drain()
    data = await reader.read()
    writer.close()
    return data


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/embeddings"),
        ("POST", "/invocations"),
        ("POST", "/"),
        ("POST", "/sleep"),
        ("POST", "/v1/load_lora_adapter"),
        ("PUT", "/v1/models"),
        ("DELETE", "/v1/responses/abc"),
        ("PATCH", "/anything"),
    ],
)
async def test_unknown_mutating_requests_are_refused_and_never_forwarded(
    multi: MultiUpstream,
    sidecar_factory: SidecarFactory,
    client: aiohttp.ClientSession,
    method: str,
    path: str,
) -> None:
    url, _ = await sidecar_factory(multi.url, {})
    async with client.request(method, url + path, json={"model": "m", "input": "x"}) as r:
        assert r.status == 404
        assert r.headers["x-kvgate-decision"] == "rejected"
        assert r.headers["x-kvgate-reason"] == "unknown_endpoint"
        err = await r.json()
    assert err["error"]["code"] == "unknown_endpoint" and set(err) == {"error"}
    assert multi.generation_calls == []
    g = await gauges(client, url)  # counted, so a path scanner shows in the rejection ratio
    assert g[REFUSED_INVALID] == 1


async def test_allowlist_and_safe_methods_pass_through(
    multi: MultiUpstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    url, _ = await sidecar_factory(multi.url, {}, passthrough_paths=("/v1/embeddings", "/admin/*"))
    for method, path in [
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("POST", "/v1/messages/count_tokens"),
        ("POST", "/v1/embeddings"),
        ("POST", "/admin/reset"),
        ("GET", "/v1/models"),
        ("GET", "/health"),
        ("GET", "/metrics"),
        ("HEAD", "/version"),
    ]:
        async with client.request(method, url + path, json={}) as r:
            assert r.status == 200, (method, path)
            assert r.headers["x-kvgate-decision"] == "passthrough"
    reached = {(m, p) for m, p, _ in multi.seen}
    assert {("POST", "/tokenize"), ("POST", "/v1/embeddings"), ("POST", "/admin/reset")} <= reached
    assert {("GET", "/health"), ("GET", "/metrics"), ("HEAD", "/version")} <= reached
    # A dot segment cannot smuggle a refused path past the allowlist.
    before = len(multi.seen)
    assert (await raw_post(url, "/tokenize/../sleep")).startswith(b"HTTP/1.1 404")
    # ... and an allowlisted path passes in its canonical form only
    assert (await raw_post(url, "/v1/x/../embeddings")).startswith(b"HTTP/1.1 400")
    assert (await raw_post(url, "/v1/%65mbeddings")).startswith(b"HTTP/1.1 400")
    assert len(multi.seen) == before


async def test_absolute_form_targets_are_routed_by_their_path_and_never_bypass_admission(
    multi: MultiUpstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    """An absolute-form request-target (RFC 9112 §3.2.2, ``GET http://host/path``) is served as
    its path: passed through to the sidecar's own upstream (never the named host), refused, or
    admitted exactly as the origin-form request would be."""
    url, sc = await sidecar_factory(multi.url, {"tenants": {"defaultMaxTokens": 33}})
    models = await raw_post(url, "http://evil.example/v1/models?x=1", b"", method="GET")
    assert models.startswith(b"HTTP/1.1 200"), models[:200]
    assert b'"path": "/v1/models"' in models
    assert (await raw_post(url, "http://x/tokenize")).startswith(b"HTTP/1.1 200")
    assert ("POST", "/tokenize") in {(m, p) for m, p, _ in multi.seen}
    assert (await raw_post(url, "http://x/sleep")).startswith(b"HTTP/1.1 404")
    root = await raw_post(url, "http://x?q=1", b"", method="GET")  # no path: the root
    assert root.startswith(b"HTTP/1.1 200") and b'"path": "/"' in root
    assert ("GET", "/") in {(m, p) for m, p, _ in multi.seen}
    assert b'"code":"unknown_endpoint"' in await raw_post(url, "http://x")
    chat = json.dumps(APIS[0][1]).encode()
    admitted = await raw_post(url, "http://x/v1/chat/completions", chat)
    assert admitted.startswith(b"HTTP/1.1 200") and b"x-kvgate-decision: admitted" in admitted
    sent = multi.generation_calls[-1]
    assert sent[1] == "/v1/chat/completions" and json.loads(sent[2])["max_tokens"] == 33
    assert (await raw_post(url, "http://x/v1/chat/completions", b"{")).startswith(b"HTTP/1.1 400")
    assert (await raw_post(url, "http://x/v1/x/../completions", chat)).startswith(b"HTTP/1.1 4")
    posts = [c[1] for c in multi.generation_calls if c[0] == "POST"]
    assert posts == ["/tokenize", "/v1/chat/completions"]
    assert sc.admission.stats().in_flight == 0 and sc.admission.stats().kv_reserved_tokens == 0


@pytest.mark.parametrize("method", ["GET", "HEAD", "PUT", "DELETE", "PATCH"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/generate"])
async def test_other_methods_on_a_generation_path_get_405_with_allow(
    multi: MultiUpstream,
    sidecar_factory: SidecarFactory,
    client: aiohttp.ClientSession,
    method: str,
    path: str,
) -> None:
    url, _ = await sidecar_factory(multi.url, {})
    async with client.request(method, url + path) as r:
        assert r.status == 405
        assert r.headers["Allow"] == "POST, OPTIONS"
        if method != "HEAD":
            assert (await r.json())["error"]["code"] == "method_not_allowed"
    assert multi.generation_calls == []
    assert (await gauges(client, url))[REFUSED_INVALID] == 1


@pytest.mark.parametrize(
    ("content_type", "status"),
    [
        ("text/plain", 415),
        ("application/x-www-form-urlencoded", 415),
        ("multipart/form-data; boundary=x", 415),
        ("application/json; charset=utf-8", 200),
        ("Application/JSON", 200),
        ("application/vnd.api+json", 200),
    ],
)
async def test_generation_bodies_must_be_declared_json(
    multi: MultiUpstream,
    sidecar_factory: SidecarFactory,
    client: aiohttp.ClientSession,
    content_type: str,
    status: int,
) -> None:
    url, _ = await sidecar_factory(multi.url, {})
    body = json.dumps(APIS[2][1]).encode()
    async with client.post(
        url + "/v1/responses", data=body, headers={"Content-Type": content_type}
    ) as r:
        assert r.status == status, await r.text()
        if status == 415:
            assert (await r.json())["error"]["code"] == "unsupported_media_type"
    assert len(multi.generation_calls) == (1 if status == 200 else 0)


async def test_background_responses_are_refused(
    multi: MultiUpstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    url, _ = await sidecar_factory(multi.url, {})
    body = {**APIS[2][1], "background": True}
    async with client.post(url + "/v1/responses", json=body) as r:
        assert r.status == 400
        assert (await r.json())["error"]["param"] == "background"
    assert multi.generation_calls == []


async def test_the_cli_flag_and_the_environment_extend_the_allowlist(
    multi: MultiUpstream,
    sidecar_process: Any,
    client: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVGATE_PASSTHROUGH_PATHS", "/v1/embeddings, /pooling")
    proc = sidecar_process(multi.url, {}, "--passthrough-path", "/v1/score*")
    for path, status in [
        ("/v1/embeddings", 200),
        ("/pooling", 200),
        ("/v1/score/x", 200),
        ("/v1/rerank", 404),
    ]:
        async with client.post(proc.url + path, json={}) as r:
            assert r.status == status, path
    assert [p for m, p, _ in multi.seen if m == "POST"] == [
        "/v1/embeddings",
        "/pooling",
        "/v1/score/x",
    ]


@pytest.mark.parametrize(
    ("path", "body"),
    [(p, b) for p, b in APIS if p not in ("/v1/chat/completions", "/v1/completions")],
    ids=[i for i, (p, _) in zip(API_IDS, APIS, strict=True) if "/v1/c" not in p],
)
async def test_a_stream_cut_mid_way_releases_and_charges_the_events_seen(
    multi: MultiUpstream,
    sidecar_factory: SidecarFactory,
    client: aiohttp.ClientSession,
    path: str,
    body: dict[str, Any],
) -> None:
    url, sc = await sidecar_factory(multi.url, {"capacity": {"kvCacheTokens": 100000}})
    multi.cut_after = 3
    async with client.post(url + path, json={**body, "stream": True}) as r:
        assert r.status == 200
        data = await r.read()
    assert b"upstream_error" in data  # the in-band error event ends the stream
    g = await gauges(client, url)
    assert g["kvgate_in_flight_requests"] == 0 and sc.admission.stats().kv_reserved_tokens == 0
    charged = g['kvgate_tokens_total{kind="completion",tenant="anonymous"}']
    assert 1 <= charged <= 3  # the output events that arrived, not the reservation
