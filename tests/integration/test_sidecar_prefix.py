"""The sidecar's prefix-aware reservations over real HTTP on loopback, in front of kvgate-sim with
its prefix cache on and ``usage.prompt_tokens_details.cached_tokens`` reported (vLLM's
``--enable-prompt-tokens-details``).

A conversation: two warm-up requests share a system prompt (the second is reported cached, which
opens the sidecar's gate; neither names blocks, admitted before), turn 1 (streamed; its cached
tokens come in the usage chunk the sidecar asked for and strips) names its blocks, and turn 2
resends turn 1 with the answer and a new question: its reservation, read from
``kvgate_kv_reserved_tokens`` while it streams, is its whole prompt less the expected cached
prefix (``kvgate_prefix_cached_tokens_total{source="expected"}``), and every reservation is
back to 0 afterwards. An engine that does not report cached tokens keeps whole-prompt
reservations."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from kvgate_agent.admission.limits import round_up
from kvgate_bench.kit.toolkit import wait_until_async
from tests.conftest import SidecarFactory, gauges

MODEL = "kvgate-sim-model"
B = 16
MAX_TOKENS = 64
OUTPUT = 40  # tokens kvgate-sim generates (x-sim-output-tokens)
#: 40 ms a token: turn 2 streams for 1.6 s, read in flight after its first event.
DECODE_MS = 40.0
SPEC: dict[str, Any] = {
    "capacity": {"kvCacheTokens": 200_000, "reservation": "MaxTokens"},
    "model": {"blockSize": B},
}
SYSTEM = "You are a meticulous assistant who answers questions about European history. " * 24
EXPECTED = 'kvgate_prefix_cached_tokens_total{source="expected"}'
REPORTED = 'kvgate_prefix_cached_tokens_total{source="reported"}'
RESERVED = "kvgate_kv_reserved_tokens"
Sim = Callable[..., Awaitable[str]]


def conversation(*turns: str) -> list[dict[str, str]]:
    roles = ["user", "assistant"]
    msgs = [{"role": "system", "content": SYSTEM}]
    return msgs + [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]


async def send(
    client: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[dict[str, Any] | None, str]:
    """POST a chat request; (the usage it answered with or None, the decision header)."""
    headers = {"x-sim-output-tokens": str(OUTPUT)}
    async with client.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        decision = r.headers["x-kvgate-decision"]
        if not body.get("stream"):
            return (await r.json())["usage"], decision
        text = (await r.read()).decode()
    usage = None
    for block in text.split("\n\n"):
        if block.startswith("data: {") and '"usage"' in block:
            usage = json.loads(block.removeprefix("data: ")).get("usage") or usage
    return usage, decision


async def test_turn_two_reserves_less_than_its_whole_prompt_and_nothing_leaks(
    sim: Sim, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    engine = await sim(prefix_caching=True, prompt_tokens_details=True, decode_ms=DECODE_MS)
    url, sc = await sidecar_factory(engine, SPEC)
    g = await gauges(client, url)
    assert g[EXPECTED] == 0 and g[REPORTED] == 0  # exported from the start

    # Warm-up: the second shares the first's system prompt and is reported cached.
    warm = {"model": MODEL, "max_tokens": MAX_TOKENS, "messages": conversation("Who was Clovis?")}
    first, _ = await send(client, url, warm)
    assert first is not None and first["prompt_tokens_details"]["cached_tokens"] == 0
    assert not sc.forwarder.prefixes.reported
    again, _ = await send(client, url, warm)
    assert again is not None
    cached_again = again["prompt_tokens_details"]["cached_tokens"]
    assert cached_again > 0
    assert sc.forwarder.prefixes.reported  # the gate is open from now on
    g = await gauges(client, url)
    assert g[REPORTED] == cached_again and g[EXPECTED] == 0  # neither named blocks

    # Turn 1, streamed without usage asked: the sidecar adds the usage chunk, reads the cached
    # tokens from it and strips it.
    q1 = "Tell me about the Merovingian dynasty."
    turn1 = {"model": MODEL, "max_tokens": MAX_TOKENS, "messages": conversation(q1), "stream": True}
    usage1, _ = await send(client, url, turn1)
    assert usage1 is None  # stripped for the client
    g1 = await gauges(client, url)
    assert g1[REPORTED] > g[REPORTED]  # the shared system prompt, read from the stripped chunk
    assert g1[EXPECTED] == 0  # nothing of turn 1 was admitted before

    # Turn 2 resends turn 1, the answer and a new question.
    answer = "The Merovingians ruled the Franks from the 5th to the 8th century. " * 3
    turn2 = {
        "model": MODEL,
        "max_tokens": MAX_TOKENS,
        "messages": conversation(q1, answer, "And the Carolingians?"),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    prompt = sc.counter.count(turn2).tokens  # the sidecar's own count, as it admits
    whole = round_up(prompt + MAX_TOKENS, B)
    headers = {"x-sim-output-tokens": str(OUTPUT)}
    async with client.post(url + "/v1/chat/completions", json=turn2, headers=headers) as r:
        assert r.status == 200
        assert (await r.content.readany()).startswith(b"data: ")  # admitted and streaming
        live = await gauges(client, url)
        rest = (await r.read()).decode()
    expected = live[EXPECTED] - g1[EXPECTED]
    assert 0 < expected < prompt and expected % B == 0
    reserved = live[RESERVED]
    assert reserved == round_up(prompt - int(expected) + MAX_TOKENS, B)
    assert reserved < whole, (reserved, whole)
    assert '"cached_tokens"' in rest
    await wait_until_async(lambda: sc.admission.stats().in_flight == 0, 5.0, "turn 2 settled")
    end = await gauges(client, url)
    assert end[RESERVED] == 0  # no leak
    assert end[REPORTED] > live[REPORTED]  # turn 2's cached tokens, reported
    print(
        f"turn 2: prompt {prompt} tokens (sidecar's count), expected cached {expected:.0f}, "
        f"reserved {reserved:.0f} of a whole-prompt {whole}, "
        f"reported cached {end[REPORTED] - live[REPORTED]:.0f}"
    )


async def test_an_engine_that_reports_no_cached_tokens_keeps_whole_prompt_reservations(
    sim: Sim, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    engine = await sim(prefix_caching=True, prompt_tokens_details=False)
    url, sc = await sidecar_factory(engine, SPEC)
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "messages": conversation("Who was Pepin?")}
    for _ in range(3):
        usage, decision = await send(client, url, body)
        assert usage is not None and "prompt_tokens_details" not in usage
        assert decision == "admitted"
    assert not sc.forwarder.prefixes.reported
    g = await gauges(client, url)
    assert g[EXPECTED] == 0 and g[REPORTED] == 0 and g[RESERVED] == 0
