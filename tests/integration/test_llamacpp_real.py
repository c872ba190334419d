"""The sidecar in front of a real LLM engine: llama.cpp's llama-server (built by
scripts/build-llama) serving Gemma 3 270M on CPU, driven with the official ``openai`` client.

One llama-server for the module: ``--parallel 2 -c 1024 --no-kv-unified``, so each of its two
slots holds 512 tokens, a request's prompt + output must fit in one slot, and its KV pool is
1024 tokens. The model decodes about 50 tokens/s here: outputs stay a few tokens long.

Facts about llama-server these tests rely on (read from its source, ``tools/server``, and
observed):

- ``/props`` reports the slot's context (``default_generation_settings.n_ctx``) and
  ``total_slots``; ``/slots`` each slot's ``n_ctx`` and ``is_processing``;
  ``llamacpp:tokens_predicted_total`` counts the tokens generated (a cancelled request's too).
- A prompt of ``n_ctx`` tokens or more is refused with 400 ``exceed_context_size_error`` after
  the request waited for a slot; one that fits with too large a ``max_tokens`` is cut at the
  slot's end (``finish_reason`` ``length``).
- When the HTTP client of a stream goes away, the slot stops generating at the next token.
- Requests above the slots wait in its queue (``llamacpp:requests_deferred``).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import openai
import pytest

from kvgate_bench.kit.llamaserver import LLAMA_MODEL
from kvgate_bench.kit.processes import Proc
from kvgate_bench.kit.toolkit import parse_samples, sample_sum, wait_until_async
from tests.conftest import SidecarFactory, gauges

pytestmark = pytest.mark.llama

SLOTS, CTX = 2, 1024
SLOT_TOKENS = CTX // SLOTS
TENANT = "acct"
#: About 670 prompt tokens for Gemma's tokenizer (one per word): over a 512-token slot.
LONG_PROMPT = "hello " * 670


@pytest.fixture(scope="module")
def engine(llama_server: Callable[..., Proc]) -> Proc:
    """The module's llama-server."""
    return llama_server(SLOTS, CTX)


def oai(base: str, retries: int = 0, tenant: str = TENANT) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=base + "/v1",
        api_key="x",
        max_retries=retries,
        timeout=60.0,
        default_headers={"x-kvgate-tenant": tenant},
    )


async def engine_json(client: aiohttp.ClientSession, url: str, path: str) -> Any:
    async with client.get(url + path) as r:
        assert r.status == 200, (path, r.status)
        return await r.json()


async def engine_metric(client: aiohttp.ClientSession, url: str, name: str) -> float:
    async with client.get(url + "/metrics") as r:
        return sample_sum(parse_samples(await r.text()), name)


@pytest.fixture
async def sidecar(
    engine: Proc, sidecar_factory: SidecarFactory
) -> AsyncIterator[Callable[..., Any]]:
    """``url, sc = await sidecar(spec)``: an in-process sidecar in front of the engine."""

    async def make(spec: dict[str, Any], **settings: Any) -> Any:
        return await sidecar_factory(engine.url, spec, **settings)

    yield make


LEARN: dict[str, Any] = {"capacity": {"fromEngineMetrics": True}}
USAGE: Any = {"include_usage": True}


async def test_kv_capacity_and_slot_limit_are_learned_from_props_and_slots(
    engine: Proc, sidecar: Callable[..., Any], client: aiohttp.ClientSession
) -> None:
    url, sc = await sidecar(LEARN)
    props = await engine_json(client, engine.url, "/props")
    assert (props["total_slots"], props["default_generation_settings"]["n_ctx"]) == (
        SLOTS,
        SLOT_TOKENS,
    )
    assert sc.admission.stats().kv_capacity_tokens == SLOTS * SLOT_TOKENS == CTX
    assert sc.engine.max_model_len == SLOT_TOKENS  # the per-request limit: one slot
    assert sc.engine.engine_name == "llamacpp" and sc.engine.capacity_problem is None
    g = await gauges(client, url)
    assert g["kvgate_kv_capacity_tokens"] == CTX
    assert g["kvgate_engine_capacity_unknown"] == 0
    async with client.get(url + "/readyz") as r:
        assert (r.status, await r.text()) == (200, "ok")


async def test_chat_and_completions_streamed_or_not_with_usage_counted(
    engine: Proc, sidecar: Callable[..., Any], client: aiohttp.ClientSession
) -> None:
    url, _ = await sidecar(LEARN)
    api = oai(url)
    msgs: Any = [{"role": "user", "content": "Say hi."}]
    prompt_sum = completion_sum = 0
    chat = await api.chat.completions.create(model=LLAMA_MODEL, messages=msgs, max_tokens=6)
    assert chat.choices[0].message.content is not None and chat.usage is not None
    comp = await api.completions.create(model=LLAMA_MODEL, prompt="Once upon a", max_tokens=6)
    assert comp.choices[0].text and comp.usage is not None
    for u in (chat.usage, comp.usage):
        assert 0 < u.completion_tokens <= 6 and u.prompt_tokens > 0
        prompt_sum += u.prompt_tokens
        completion_sum += u.completion_tokens
    # Streams: the client asks for the usage chunk (the sidecar asks for it anyway, to count, and
    # hides it from a client that did not).
    text = []
    usage: Any = None
    stream = await api.chat.completions.create(
        model=LLAMA_MODEL, messages=msgs, max_tokens=6, stream=True, stream_options=USAGE
    )
    async for c in stream:
        text += [c.choices[0].delta.content or ""] if c.choices else []
        usage = c.usage or usage
    assert "".join(text) and usage is not None
    prompt_sum += usage.prompt_tokens
    completion_sum += usage.completion_tokens
    usage = None
    cstream = await api.completions.create(
        model=LLAMA_MODEL, prompt="Once upon a", max_tokens=6, stream=True, stream_options=USAGE
    )
    async for cc in cstream:
        usage = cc.usage or usage
    assert usage is not None
    prompt_sum += usage.prompt_tokens
    completion_sum += usage.completion_tokens
    g = await gauges(client, url)
    assert g[f'kvgate_tokens_total{{kind="completion",tenant="{TENANT}"}}'] == completion_sum
    assert g[f'kvgate_tokens_total{{kind="prompt",tenant="{TENANT}"}}'] == prompt_sum
    assert g["kvgate_in_flight_requests"] == 0 and g["kvgate_kv_reserved_tokens"] == 0
    assert completion_sum > 4  # four answers, each of at least one token


async def test_a_prompt_over_the_slot_is_refused_with_400_before_the_engine(
    engine: Proc, sidecar: Callable[..., Any], client: aiohttp.ClientSession
) -> None:
    url, _ = await sidecar(LEARN)
    async with client.post(engine.url + "/tokenize", json={"content": LONG_PROMPT}) as r:
        assert len((await r.json())["tokens"]) > SLOT_TOKENS  # truly over, by the engine's count
    before = await engine_metric(client, engine.url, "llamacpp:prompt_tokens_total")
    for kind in ("chat", "completions"):
        with pytest.raises(openai.BadRequestError) as err:
            if kind == "chat":
                msgs: Any = [{"role": "user", "content": LONG_PROMPT}]
                await oai(url).chat.completions.create(
                    model=LLAMA_MODEL, messages=msgs, max_tokens=4
                )
            else:
                await oai(url).completions.create(
                    model=LLAMA_MODEL, prompt=LONG_PROMPT, max_tokens=4
                )
        assert err.value.status_code == 400 and f"{SLOT_TOKENS} tokens" in err.value.message
        assert err.value.response.headers["x-kvgate-decision"] == "rejected"
    slots = await engine_json(client, engine.url, "/slots")
    assert not any(s["is_processing"] for s in slots)
    assert await engine_metric(client, engine.url, "llamacpp:prompt_tokens_total") == before


async def _open(
    own: aiohttp.ClientSession, url: str, max_tokens: int
) -> tuple[aiohttp.ClientResponse, dict[str, float]]:
    """A completion streamed through the sidecar, its first event read (it runs in its slot):
    (the response, still open; the sidecar's gauges then)."""
    body = {
        "model": LLAMA_MODEL,
        "prompt": "Count from one to a thousand: one, two,",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    resp = await own.post(url + "/v1/completions", json=body, headers={"x-kvgate-tenant": TENANT})
    assert resp.status == 200, await resp.read()
    assert resp.headers["x-kvgate-decision"] == "admitted"
    async for line in resp.content:
        if line.startswith(b"data: "):
            break
    return resp, await gauges(own, url)


async def _released(own: aiohttp.ClientSession, url: str) -> bool:
    """The sidecar holds no request and no KV reservation."""
    g = await gauges(own, url)
    return g["kvgate_in_flight_requests"] == 0 and g["kvgate_kv_reserved_tokens"] == 0


async def test_a_request_reserves_no_more_than_its_slot_holds(
    engine: Proc, sidecar: Callable[..., Any], client: aiohttp.ClientSession
) -> None:
    # llama.cpp cuts an answer at its slot's end (finish_reason "length"): a max_tokens past it
    # reserves the slot's tokens, not the whole pool, and the other slot takes a second request.
    url, _ = await sidecar({**LEARN, "overload": {"actions": ["Reject"]}})
    async with aiohttp.ClientSession() as own:
        # Below the pool (1024) but twice the slot (512): it reserved ~97 % of the pool, so the
        # second request was refused (429, "the KV cache is fully reserved") with a slot free.
        first, g = await _open(own, url, CTX - 64)
        assert 0 < g["kvgate_kv_reserved_tokens"] <= SLOT_TOKENS, g
        second, g = await _open(own, url, SLOT_TOKENS // 2)
        assert g["kvgate_in_flight_requests"] == 2 and g["kvgate_kv_reserved_tokens"] <= CTX
        first.close()
        second.close()
        await wait_until_async(lambda: _released(own, url), 10.0, "both requests released")
        # Above the whole pool: it was a 400 exceeds_capacity ("lower max_tokens to at most
        # ~1000", where one request holds at most 512); the engine cuts it at the slot's end.
        third, g = await _open(own, url, 2 * CTX)
        assert 0 < g["kvgate_kv_reserved_tokens"] <= SLOT_TOKENS, g
        third.close()


async def test_tenant_limit_with_retry_after_honoured_by_the_client(
    sidecar: Callable[..., Any], client: aiohttp.ClientSession
) -> None:
    # One request per tenant every 15 s (a burst of one): far slower than a request here, even
    # on a busy machine (the third call must find the bucket still empty to be told to wait).
    spec = {
        **LEARN,
        "rateLimits": [{"name": "rpm", "requestsPerMinute": 4, "burstRequests": 1}],
        "overload": {"actions": ["Reject"]},
    }
    url, _ = await sidecar(spec)
    msgs: Any = [{"role": "user", "content": "Hi"}]
    await oai(url).chat.completions.create(model=LLAMA_MODEL, messages=msgs, max_tokens=2)
    with pytest.raises(openai.RateLimitError) as err:  # no retries: the 429 itself
        await oai(url).chat.completions.create(model=LLAMA_MODEL, messages=msgs, max_tokens=2)
    assert 1 <= int(err.value.response.headers["Retry-After"]) <= 15
    started = time.monotonic()
    raw = await oai(url, retries=3).chat.completions.with_raw_response.create(
        model=LLAMA_MODEL, messages=msgs, max_tokens=2
    )
    assert raw.http_response.status_code == 200 and raw.retries_taken >= 1
    assert time.monotonic() - started >= 1.0  # it waited as told, not at once
    other = await oai(url, tenant="other").chat.completions.create(
        model=LLAMA_MODEL, messages=msgs, max_tokens=2
    )
    assert other.choices  # the limit is per tenant
    g = await gauges(client, url)
    rejected = 'kvgate_admission_decisions_total{outcome="rejected",reason="rate_limit_requests",'
    assert g[rejected + f'tenant="{TENANT}"}}'] >= 2
    assert g.get(rejected + 'tenant="other"}', 0) == 0


async def test_a_client_disconnect_mid_stream_stops_the_generation(
    engine: Proc, sidecar: Callable[..., Any], client: aiohttp.ClientSession
) -> None:
    url, _ = await sidecar(LEARN)
    max_tokens = 300  # ~6 s at 50 tokens/s if nothing stopped it
    body = {
        "model": LLAMA_MODEL,
        "prompt": "Count from one to a thousand: one, two,",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    predicted = "llamacpp:tokens_predicted_total"
    before = await engine_metric(client, engine.url, predicted)
    async with aiohttp.ClientSession() as own:
        resp = await own.post(url + "/v1/completions", json=body)
        assert resp.status == 200
        seen = 0
        async for line in resp.content:
            seen += line.startswith(b"data: ")
            if seen >= 3:
                break
        resp.close()  # the client goes away mid-stream
    stopped = time.monotonic()

    async def idle() -> list[Any] | None:
        slots: list[Any] = await engine_json(client, engine.url, "/slots")
        return None if any(s["is_processing"] for s in slots) else slots

    await wait_until_async(idle, 10.0, "the engine's slots idle after the disconnect")
    took = time.monotonic() - stopped
    decoded = await engine_metric(client, engine.url, predicted) - before
    assert decoded < max_tokens, f"the engine generated all {decoded} tokens"
    assert took < 5.0
    g = await gauges(client, url)
    assert g["kvgate_in_flight_requests"] == 0 and g["kvgate_kv_reserved_tokens"] == 0
    assert g["kvgate_client_disconnects_total"] == 1
    print(f"disconnect: slot idle {took:.2f}s later, {decoded}/{max_tokens} tokens decoded")


async def test_concurrency_above_the_slots_is_queued_not_failed(
    engine: Proc, sidecar: Callable[..., Any], client: aiohttp.ClientSession
) -> None:
    # Queued for as long as it takes: on a busy machine three waves of streams on two slots can
    # outlast the default 30 s queue wait, and this test is about where they wait.
    url, _ = await sidecar({**LEARN, "queue": {"maxWaitSeconds": 600}})
    api = oai(url)
    n = 3 * SLOTS
    deferred_seen = 0.0

    async def watch() -> None:
        nonlocal deferred_seen
        while True:
            m = await engine_metric(client, engine.url, "llamacpp:requests_deferred")
            deferred_seen = max(deferred_seen, m)
            await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch())
    try:
        got = await asyncio.gather(
            *(
                api.completions.create(model=LLAMA_MODEL, prompt=f"{i} is a number", max_tokens=8)
                for i in range(n)
            )
        )
    finally:
        watcher.cancel()
    assert len(got) == n and all(c.choices and c.usage for c in got)
    g = await gauges(client, url)
    decided = 'kvgate_admission_decisions_total{{outcome="{}",reason="ok",tenant="' + TENANT + '"}}'
    # The engine's two slots are the ceiling: two admitted at once, the rest from kvgate's queue.
    assert g[decided.format("admitted")] == SLOTS
    assert g[decided.format("queued")] == n - SLOTS
    assert g["kvgate_in_flight_requests"] == 0 and deferred_seen == 0
    print(f"concurrency {n} over {SLOTS} slots: all served; engine deferred up to {deferred_seen}")


async def _stream(
    client: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int
) -> tuple[int, dict[str, str], bytes, float]:
    """One streamed completion through the sidecar: (status, headers, body, ``time.monotonic()``
    at the send)."""
    body = {"model": LLAMA_MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    sent = time.monotonic()
    async with client.post(
        url + "/v1/completions", json=body, headers={"x-kvgate-tenant": TENANT}
    ) as r:
        return r.status, dict(r.headers), await r.read(), sent


async def test_a_request_let_out_of_the_queue_is_not_sent_on_the_connection_llama_closed(
    sidecar: Callable[..., Any], client: aiohttp.ClientSession
) -> None:
    # llama-server answers a stream with "Keep-Alive: timeout=5, max=100", then closes the
    # connection: the request released from the queue by that stream's end took it (502).
    # (A long queue wait stated: the default bound, 0.5 s with no TTFT SLO, is not the subject.)
    url, sc = await sidecar({"concurrency": {"maxRequests": 1}, "queue": {"maxWaitSeconds": 60}})
    for i in range(5):
        got = await asyncio.gather(*(_stream(client, url, f"{i}{j} is", 4) for j in range(2)))
        assert [g[0] for g in got] == [200, 200], [g[2][:300] for g in got]
        assert all(g[2].rstrip().endswith(b"data: [DONE]") for g in got)
        assert sorted(g[1]["x-kvgate-decision"] for g in got) == ["admitted", "queued"]
    g = await gauges(client, url)
    assert sum(v for k, v in g.items() if k.startswith("kvgate_upstream_errors_total")) == 0
    assert g["kvgate_in_flight_requests"] == 0 and g["kvgate_kv_reserved_tokens"] == 0
    assert g["kvgate_upstream_resends_total"] == sc.model_server.pool.stale_retries
    print(f"stale keep-alive connections met and resent: {sc.model_server.pool.stale_retries}")


async def test_no_more_requests_reach_llama_than_it_has_slots_the_rest_wait_in_order(
    llama_server: Callable[..., Proc],
    sidecar_factory: SidecarFactory,
    client: aiohttp.ClientSession,
) -> None:
    slots = 4
    engine = llama_server(slots, 4096)  # the new user's server: 4 slots of 1024 tokens
    # The policy less its TTFT SLO (1 s), with a long queue wait: on a busy machine the
    # queued four would be shed by the SLO or the queue's deadline, and this test is about where
    # they wait (the adaptive limit of the TPOT SLO stays, under the slots).
    spec = {**LEARN, "slo": {"tpotSeconds": 0.2}, "queue": {"maxWaitSeconds": 600}}
    url, sc = await sidecar_factory(engine.url, spec)
    assert (
        sc.admission.stats().engine_concurrency == slots
        and sc.admission.stats().concurrency_limit == slots
    )
    seen = {"llamacpp:requests_processing": 0.0, "llamacpp:requests_deferred": 0.0}

    async def watch() -> None:
        while True:
            async with client.get(engine.url + "/metrics") as r:
                samples = parse_samples(await r.text())
            for name in seen:
                seen[name] = max(seen[name], sample_sum(samples, name))
            await asyncio.sleep(0.02)

    c = sc.admission.core

    async def send(i: int) -> tuple[int, dict[str, str], bytes, float]:
        # A known arrival order: each sent once the sidecar holds the ones before it.
        await wait_until_async(
            lambda: c.stats().in_flight + c.stats().queue_length >= i, 30.0, f"request {i}"
        )
        return await _stream(client, url, f"Story {i}: once", 16)

    watcher = asyncio.create_task(watch())
    try:
        got = await asyncio.gather(*(send(i) for i in range(2 * slots)))
    finally:
        watcher.cancel()
    assert [g[0] for g in got] == [200] * (2 * slots), [g[2][:300] for g in got]
    decisions = [g[1]["x-kvgate-decision"] for g in got]
    assert decisions == ["admitted"] * slots + ["queued"] * slots, decisions
    # Each queued request was let in after the one that arrived before it (its send time plus
    # its queue wait; 50 ms of slack for the rounding and the hop from client to sidecar, so
    # requests let in by one release, within a millisecond, are not told apart).
    t0 = got[0][3]
    admitted_at = [
        round(got[i][3] - t0 + int(got[i][1]["x-kvgate-queue-wait-ms"]) / 1000, 3)
        for i in range(slots, 2 * slots)
    ]
    assert all(b >= a - 0.05 for a, b in itertools.pairwise(admitted_at)), admitted_at
    assert seen["llamacpp:requests_processing"] <= slots
    assert seen["llamacpp:requests_deferred"] == 0, seen
    g = await gauges(client, url)
    assert g["kvgate_in_flight_requests"] == 0 and g["kvgate_kv_reserved_tokens"] == 0
    print(f"{2 * slots} streams over {slots} slots: engine saw {seen}; admitted at {admitted_at}")
