"""``--tokenizer engine``: prompt counts from the engine's own ``/tokenize`` over real HTTP on
loopback, against the llm-d simulator (vLLM's dialect), a llama.cpp-shaped stand-in that records
what it was asked (and can be slow or fail), and the real ``llama-server`` when
``KVGATE_LLAMA_SERVER`` and ``KVGATE_LLAMA_MODEL`` name it (skipped otherwise)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvgate_agent.admission import Reason
from kvgate_agent.sidecar.engine.engine_tokens import EngineTokenizer
from kvgate_agent.sidecar.reading.tokens import PromptCounter
from kvgate_bench import tokenizer_error
from kvgate_bench.kit.processes import Proc
from kvgate_bench.kit.toolkit import free_port, wait_until_async
from tests.conftest import SidecarFactory, gauges
from tests.upstream import Upstream, serve_handler

CHAT: dict[str, Any] = {
    "model": "test-model",
    "messages": [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "What is the capital of France? Answer in one word."},
    ],
}
CMPL: dict[str, Any] = {"model": "test-model", "prompt": "def add(a, b):\n    return a + b\n"}


@dataclass
class LlamaLike:
    """llama.cpp's ``/tokenize`` and ``/apply-template`` in shape: one token per word (plus one
    for ``add_special``); a vLLM-shaped ``/tokenize`` body gets ``{"tokens": []}`` as from
    llama-server. Records ``(path, body)`` of every call."""

    url: str = ""
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    delay: float = 0.0
    status: int = 200
    generation: Upstream | None = None  # serves every other path when set

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if self.generation is not None and request.path not in ("/tokenize", "/apply-template"):
            return await self.generation.handle(request)
        body = await request.json()
        self.calls.append((request.path, body))
        await asyncio.sleep(self.delay)
        if self.status != 200:
            return web.json_response({"error": "boom"}, status=self.status)
        if request.path == "/apply-template":
            turns = [f"<{m['role']}> {m['content']}" for m in body["messages"]]
            return web.json_response({"prompt": " ".join(turns) + " <model>"})
        content = body.get("content")
        if content is None:
            return web.json_response({"tokens": []})
        n = len(content.split()) + (1 if body.get("add_special") else 0)
        return web.json_response({"tokens": list(range(n))})


@pytest.fixture
async def llama_like() -> AsyncIterator[LlamaLike]:
    up = LlamaLike()
    async with serve_handler(up.handle, handler_cancellation=True, shutdown_timeout=0.2) as up.url:
        yield up


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def tokenizer(
    url: str, session: aiohttp.ClientSession, **kw: Any
) -> tuple[EngineTokenizer, PromptCounter]:
    counter = PromptCounter()
    et = EngineTokenizer(url, counter, session=lambda: session, **kw)
    return et, counter


async def usage_prompt_tokens(
    session: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]
) -> int:
    """``usage.prompt_tokens`` the engine reports for ``body`` generated with one token."""
    async with session.post(url + path, json={**body, "max_tokens": 1}) as r:
        assert r.status == 200, await r.text()
        usage = (await r.json())["usage"]
    tokens = usage["prompt_tokens"]
    assert isinstance(tokens, int)
    return tokens


# ------------------------------------------------------------------ vLLM's dialect: llm-d sim


async def test_vllm_dialect_counts_what_the_engine_charges(
    llmd_sim: Callable[..., Proc], session: aiohttp.ClientSession
) -> None:
    sim = llmd_sim()
    et, counter = tokenizer(sim.url, session)
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", CMPL)):
        got = await et.count(body, counter.count(body))
        assert got.exact
        assert got.tokens == await usage_prompt_tokens(session, sim.url, path, body)
    assert et.dialect == "vllm"
    assert et.answered == {"cache": 0, "engine": 2, "estimate": 0, "unsupported": 0}
    again = await et.count(CHAT, counter.count(CHAT))  # a repeated prompt: no request
    assert again.exact and et.answered["cache"] == 1


async def test_the_sidecar_reserves_the_engines_count(
    llmd_sim: Callable[..., Proc], sidecar_factory: SidecarFactory, session: aiohttp.ClientSession
) -> None:
    """Through the sidecar (``--tokenizer engine``): the reservation is the engine's prompt count
    + max_tokens, not the estimate's."""
    sim = llmd_sim("--time-to-first-token", "400ms")
    url, sc = await sidecar_factory(
        sim.url,
        {"capacity": {"kvCacheTokens": 100000}, "model": {"blockSize": 1}},
        engine_tokenizer=True,
    )
    assert sc.engine_tokens is not None
    real = await usage_prompt_tokens(session, sim.url, "/v1/chat/completions", CHAT)
    assert real != sc.counter.count(CHAT).tokens  # the test tells the two apart
    task = asyncio.create_task(
        session.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 9})
    )
    await wait_until_async(lambda: sc.admission.stats().in_flight == 1, 10, "the request in flight")
    assert sc.admission.stats().kv_reserved_tokens == real + 9
    r = await task
    assert r.status == 200
    r.release()
    assert sc.engine_tokens.answered["engine"] == 1
    g = await gauges(session, url)
    assert g['kvgate_engine_prompt_counts_total{source="engine"}'] == 1
    assert g['kvgate_engine_prompt_counts_total{source="estimate"}'] == 0


# ------------------------------------------------------------------ llama.cpp's dialect


async def test_llamacpp_dialect_renders_chats_then_tokenizes(
    llama_like: LlamaLike, session: aiohttp.ClientSession
) -> None:
    et, counter = tokenizer(llama_like.url, session)
    got = await et.count(CHAT, counter.count(CHAT))
    # "<system> You answer briefly. <user> What ... word. <model>" + the BOS of add_special
    assert got.exact and got.tokens == 2 + 3 + 10 + 1 + 1
    assert et.dialect == "llamacpp"
    assert [p for p, _ in llama_like.calls] == ["/tokenize", "/apply-template", "/tokenize"]
    assert llama_like.calls[1][1] == {"messages": CHAT["messages"]}
    assert llama_like.calls[2][1]["add_special"] is True
    llama_like.calls.clear()
    cmpl = await et.count(CMPL, counter.count(CMPL))
    assert cmpl.exact and cmpl.tokens == 7 + 1  # 7 words + BOS
    assert llama_like.calls == [("/tokenize", {"content": CMPL["prompt"], "add_special": True})]


async def test_the_sidecar_process_asks_the_engine_with_tokenizer_engine(
    llama_like: LlamaLike, sidecar_process: Callable[..., Proc], session: aiohttp.ClientSession
) -> None:
    """``kvgate-agent sidecar --tokenizer engine``: the prompt is counted by the engine's
    ``/apply-template`` + ``/tokenize`` before the request is forwarded."""
    llama_like.generation = Upstream()
    proc = sidecar_process(
        llama_like.url, {}, "--tokenizer", "engine", "--engine-tokenize-timeout", "5"
    )
    body = {**CHAT, "max_tokens": 3}
    async with session.post(proc.url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
    assert [p for p, _ in llama_like.calls] == ["/tokenize", "/apply-template", "/tokenize"]
    assert llama_like.generation.bodies == [body]


async def test_a_request_admission_refuses_anyway_is_not_counted_by_the_engine(
    llama_like: LlamaLike, sidecar_factory: SidecarFactory, session: aiohttp.ClientSession
) -> None:
    """A tenant over its request-count rate limit (Reject only), a FailClosed hold: refused
    whatever the prompt's exact count, so no ``/tokenize`` is asked for them."""
    llama_like.generation = Upstream()
    url, sc = await sidecar_factory(
        llama_like.url,
        {
            "rateLimits": [{"name": "t", "requestsPerMinute": 0.01, "burstRequests": 1}],
            "overload": {"actions": ["Reject"]},
        },
        engine_tokenizer=True,
        engine_tokenize_timeout=5.0,
    )

    async def post(prompt: str, tenant: str) -> int:
        body = {**CMPL, "prompt": prompt, "max_tokens": 3}
        headers = {"x-kvgate-tenant": tenant}
        async with session.post(url + "/v1/completions", json=body, headers=headers) as r:
            return r.status

    assert await post("one two three", "a") == 200
    asked = len(llama_like.calls)  # the dialect probe, then the count
    assert asked == 2
    assert await post("four five six", "a") == 429  # tenant a is out of requests
    sc.admission.hold(Reason.FAIL_CLOSED, retry_after=5, message="stale thresholds")
    assert await post("seven eight", "b") == 503
    assert len(llama_like.calls) == asked  # neither was counted
    sc.admission.lift(Reason.FAIL_CLOSED)
    assert await post("seven eight", "b") == 200  # tenant b, no hold: counted, admitted
    assert llama_like.calls[asked:] == [
        ("/tokenize", {"content": "seven eight", "add_special": True})
    ]
    assert sc.admission.stats().in_flight == 0


async def test_a_slow_engine_costs_one_timeout_and_fills_the_cache_later(
    llama_like: LlamaLike, session: aiohttp.ClientSession
) -> None:
    llama_like.delay = 0.5
    et, counter = tokenizer(llama_like.url, session, timeout=0.05)
    estimate = counter.count(CMPL)
    got = await et.count(CMPL, estimate)
    assert got is estimate and not got.exact
    await wait_until_async(lambda: not et._pending, 10, "the engine's late answer")
    cached = await et.count(CMPL, counter.count(CMPL))
    assert cached.exact and cached.tokens == 8 and et.answered["cache"] == 1


async def test_a_failing_engine_is_left_alone_for_a_doubling_backoff(
    llama_like: LlamaLike, session: aiohttp.ClientSession
) -> None:
    """A 5xx pauses the engine's counts for the backoff, twice as long after the next failure;
    an answer resets it. A 4xx (the prompt's fault) pauses nothing."""
    now = [100.0]
    et, counter = tokenizer(llama_like.url, session, backoff=5.0, clock=lambda: now[0])

    async def exact(body: dict[str, Any]) -> bool:
        return (await et.count(body, counter.count(body))).exact

    llama_like.status = 400
    assert not await exact(CHAT)
    assert not await exact({"model": "m", "prompt": "another"})
    assert len(llama_like.calls) == 2  # each asked: no pause after a 400
    llama_like.status = 500
    llama_like.calls.clear()
    assert not await exact(CMPL)
    assert not await exact({"model": "m", "prompt": "during the pause"})
    assert len(llama_like.calls) == 1
    now[0] += 5.0
    assert not await exact(CMPL)  # the second failure: 10 s
    now[0] += 9.0
    assert not await exact(CMPL) and len(llama_like.calls) == 2
    llama_like.status = 200
    now[0] += 1.0
    assert await exact(CMPL)
    llama_like.status = 500
    assert not await exact(CHAT)  # after an answer, the pause starts again at 5 s
    now[0] += 5.0
    llama_like.status = 200
    assert await exact(CHAT)


async def test_an_engine_that_is_down_gives_the_estimate(session: aiohttp.ClientSession) -> None:
    et, counter = tokenizer(f"http://127.0.0.1:{free_port()}", session)
    estimate = counter.count(CHAT)
    assert await et.count(CHAT, estimate) is estimate


async def test_the_cache_is_bounded_least_recently_used_first(
    llama_like: LlamaLike, session: aiohttp.ClientSession
) -> None:
    et, counter = tokenizer(llama_like.url, session, cache_size=2)
    bodies = [{"model": "m", "prompt": f"prompt number {i}"} for i in range(3)]
    for b in (bodies[0], bodies[1], bodies[0], bodies[2]):  # 1 is least recently used
        await et.count(b, counter.count(b))
    assert et.answered == {"cache": 1, "engine": 3, "estimate": 0, "unsupported": 0}
    llama_like.calls.clear()
    await et.count(bodies[0], counter.count(bodies[0]))
    await et.count(bodies[1], counter.count(bodies[1]))  # evicted: asked again
    assert [c[1].get("content") for c in llama_like.calls] == ["prompt number 1"]


async def test_prompts_the_engine_cannot_count_keep_the_estimate(
    llama_like: LlamaLike, session: aiohttp.ClientSession
) -> None:
    et, counter = tokenizer(llama_like.url, session)
    image = {
        "model": "m",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is in this picture?"},
                    {"type": "image_url", "image_url": {"url": "x"}},
                ],
            }
        ],
    }
    for body in (image, {"model": "m", "prompt": ["a", "b"]}, {"model": "m", "prompt": [1, 2]}):
        estimate = counter.count(body)
        assert await et.count(body, estimate) is estimate
    assert llama_like.calls == []
    assert et.answered["unsupported"] == 2  # the token ids were exact: not the engine's to count


# ------------------------------------------------------------------ the real llama-server


@pytest.fixture(scope="module")
def llama_url(llama_server: Callable[..., Proc]) -> str:
    """The real llama.cpp ``llama-server`` (the shared ``llama_server`` fixture), one slot of
    4,096 tokens: its base URL."""
    return llama_server(1, 4096).url


LLAMA_PROMPTS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", CHAT),
    ("/v1/completions", CMPL),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Übersetze: 東京は日本の首都です。"}]},
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "Hello! How can I help?"},
                {"role": "user", "content": "Write SELECT * FROM t WHERE id = 42;"},
            ]
        },
    ),
    ("/v1/completions", {"prompt": "Once upon a time, in a land far away,"}),
]


async def test_real_llama_server_counts_match_its_usage(
    llama_url: str, session: aiohttp.ClientSession
) -> None:
    et, counter = tokenizer(llama_url, session, timeout=30.0)
    for path, body in LLAMA_PROMPTS:
        got = await et.count(body, counter.count(body))
        assert got.exact, body
        assert got.tokens == await usage_prompt_tokens(session, llama_url, path, body), body
    assert et.dialect == "llamacpp"


# ------------------------------------------------------------------ the benchmark, in short


def test_tokenizer_error_benchmark_smoke(
    llmd_sim: Callable[..., Proc], capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m kvgate_bench.tokenizer_error`` end to end on a few prompts (the simulator's
    word tokenizer: the figures mean nothing, the plumbing is what is checked)."""
    sim = llmd_sim("--max-model-len", "16384")
    argv = ["--url", sim.url, "--prompts", "24", "--served-model", "test-model", "--json"]
    assert tokenizer_error.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["dialect"] == "vllm" and out["checked"] == 10 and out["usage_mismatches"] == 0
    for which in ("initial", "calibrated"):
        s = out[which]
        assert 0 < s["n"] <= 24 and 0 <= s["p50"] <= s["p95"] <= s["max"]
    prompts = tokenizer_error.make_prompts(300)
    assert prompts == tokenizer_error.make_prompts(300)  # seeded: every run the same prompts
    assert {p.kind for p in prompts} == set(tokenizer_error.SNIPPETS)
    assert sum(p.path == "/v1/chat/completions" for p in prompts) == 150
