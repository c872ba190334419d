"""Prefix-aware reservations through the sidecar in front of the real llama.cpp ``llama-server``
(built by scripts/build-llama; Gemma 3 270M on CPU), which reports the prompt tokens its slot
reused as ``usage.prompt_tokens_details.cached_tokens`` and ``timings.cache_n``.

One llama-server for the module: one slot of 2048 tokens (``--parallel 1 -c 2048``), so a
conversation's turns land on the slot that holds the earlier turn. A warm-up prompt sent twice
is reported cached the second time (the gate opens); then a two-turn conversation: turn 2 resends
turn 1, its answer and a new user message. Turn 2's KV reservation, read from the sidecar's
``kvgate_kv_reserved_tokens`` while it streams, is smaller than its whole prompt would need; the
engine's report reaches ``kvgate_prefix_cached_tokens_total{source="reported"}``; nothing stays
reserved afterwards.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

from kvgate_agent.admission.limits import round_up
from kvgate_bench.kit.llamaserver import LLAMA_MODEL
from kvgate_bench.kit.processes import Proc
from kvgate_bench.kit.toolkit import wait_until_async
from tests.conftest import SidecarFactory, gauges

pytestmark = pytest.mark.llama

SLOTS, CTX, B = 1, 2048, 16
#: Output tokens per turn; EOS ignored so that turn 2 is still decoding while it is read.
MAX_TOKENS = 48
SPEC: dict[str, Any] = {
    "capacity": {"fromEngineMetrics": True, "reservation": "MaxTokens"},
    "model": {"blockSize": B},
}
SYSTEM = (
    "You are a patient tutor. Answer in two short sentences, plainly, without lists. "
    "The student is learning about rivers, mountains and the weather of Europe. "
) * 3
EXPECTED = 'kvgate_prefix_cached_tokens_total{source="expected"}'
REPORTED = 'kvgate_prefix_cached_tokens_total{source="reported"}'
RESERVED = "kvgate_kv_reserved_tokens"


@pytest.fixture(scope="module")
def engine(llama_server: Callable[..., Proc]) -> Proc:
    """The module's llama-server: one 2048-token slot."""
    return llama_server(SLOTS, CTX)


def body(messages: list[dict[str, str]], stream: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": LLAMA_MODEL,
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,  # llama.cpp's own: always MAX_TOKENS tokens
        "temperature": 0,
    }
    if stream:
        out |= {"stream": True, "stream_options": {"include_usage": True}}
    return out


def last_usage(text: str) -> dict[str, Any]:
    """The usage object of a chat stream's usage chunk."""
    for block in reversed(text.split("\n\n")):
        if block.startswith("data: {") and '"usage"' in block:
            usage = json.loads(block.removeprefix("data: "))["usage"]
            if usage:
                return dict(usage)
    raise AssertionError(f"no usage chunk in {text[-500:]!r}")


async def chat(client: aiohttp.ClientSession, url: str, payload: dict[str, Any]) -> Any:
    async with client.post(url + "/v1/chat/completions", json=payload) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def test_turn_two_is_reserved_without_its_cached_prefix(
    engine: Proc, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    url, sc = await sidecar_factory(engine.url, SPEC)
    system = {"role": "system", "content": SYSTEM}

    # Warm-up: a prompt sent twice; the second is reported cached and opens the gate.
    warm = body([system, {"role": "user", "content": "Name one river."}])
    first = await chat(client, url, warm)
    again = await chat(client, url, warm)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, (first, again)
    assert sc.forwarder.prefixes.reported
    g0 = await gauges(client, url)
    assert g0[EXPECTED] == 0  # both admitted before the engine had reported anything
    assert g0[REPORTED] >= again["usage"]["prompt_tokens_details"]["cached_tokens"]

    # Turn 1: names its blocks (nothing of it admitted before).
    turn1 = [system, {"role": "user", "content": "Which mountains separate France and Spain?"}]
    one = await chat(client, url, body(turn1))
    answer = one["choices"][0]["message"]["content"]
    g1 = await gauges(client, url)

    # Turn 2: turn 1, its answer and a new user message, streamed and read in flight.
    turn2 = [
        *turn1,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And which river flows through Lyon?"},
    ]
    payload = body(turn2, stream=True)
    estimate = sc.counter.count(payload).tokens  # the sidecar's count, as it admits it
    whole = round_up(estimate + MAX_TOKENS, B)
    async with client.post(url + "/v1/chat/completions", json=payload) as r:
        assert r.status == 200, await r.text()
        assert (await r.content.readany()).startswith(b"data: ")  # admitted, streaming
        live = await gauges(client, url)
        in_flight = sc.admission.stats().in_flight
        text = (await r.read()).decode()
    usage = last_usage(text)
    expected = live[EXPECTED] - g1[EXPECTED]
    reserved = live[RESERVED]
    assert in_flight == 1
    assert expected > 0 and expected % B == 0
    assert reserved == round_up(estimate - int(expected) + MAX_TOKENS, B)
    assert reserved < whole, (reserved, whole)
    reported = usage["prompt_tokens_details"]["cached_tokens"]
    assert reported > 0

    await wait_until_async(lambda: sc.admission.stats().in_flight == 0, 10.0, "turn 2 settled")
    end = await gauges(client, url)
    assert end[RESERVED] == 0  # no reservation leaks
    assert end[REPORTED] - live[REPORTED] == reported
    print(
        f"\nllama-server turn 2: prompt {usage['prompt_tokens']} tokens (sidecar's estimate "
        f"{estimate}), cached reported {reported}, expected cached {expected:.0f}; KV reserved "
        f"{reserved:.0f} tokens vs {whole} for the whole prompt (max_tokens {MAX_TOKENS}); "
        f"reserved after: {end[RESERVED]:.0f}"
    )
