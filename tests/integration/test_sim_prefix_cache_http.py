"""kvgate-sim's prefix cache over real HTTP on loopback: a repeated prompt's usage reports the
cached tokens (``usage.prompt_tokens_details.cached_tokens``, streamed usage too), a
conversation resent with one more turn reuses its earlier blocks, and the cache turned off
reuses nothing."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from kvgate_bench.sim.cli import build_parser, config_from_args
from kvgate_bench.sim.prompt_keys import chat_prompt_tokens, completion_prompt_tokens
from kvgate_bench.sim.server import count_chat_prompt_tokens, count_completion_prompt_tokens

MODEL = "kvgate-sim-model"
Factory = Callable[..., Awaitable[str]]
#: 40 words: with chat framing, 46 prompt tokens, two full blocks of 16 and a partial one.
WORDS = " ".join(f"w{i}" for i in range(40))


async def usage_of(http: aiohttp.ClientSession, base: str, body: dict[str, Any]) -> Any:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    async with http.post(base + path, json=body) as resp:
        assert resp.status == 200
        if not body.get("stream"):
            return (await resp.json())["usage"]
        events = [
            json.loads(block.removeprefix("data: "))
            for block in (await resp.text()).split("\n\n")
            if block.startswith("data: {")
        ]
        return events[-1]["usage"]


async def test_a_repeated_prompt_reports_its_cached_tokens(sim: Factory) -> None:
    base = await sim(prompt_tokens_details=True, prefix_caching=True)
    messages = [{"role": "user", "content": WORDS}]
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 2}
    async with aiohttp.ClientSession() as http:
        first = await usage_of(http, base, body)
        assert first["prompt_tokens"] == 46
        assert first["prompt_tokens_details"] == {"cached_tokens": 0}
        again = await usage_of(http, base, body)
        assert again["prompt_tokens_details"] == {"cached_tokens": 32}  # two full blocks
        streamed = await usage_of(
            http, base, {**body, "stream": True, "stream_options": {"include_usage": True}}
        )
        assert streamed["prompt_tokens_details"] == {"cached_tokens": 32}
        # The conversation resent with the answer and one more message: its earlier blocks.
        turn2 = {
            **body,
            "messages": [
                *messages,
                {"role": "assistant", "content": "the quick"},
                {"role": "user", "content": WORDS},
            ],
        }
        second = await usage_of(http, base, turn2)
        assert second["prompt_tokens"] == 46 + 6 + 44
        assert second["prompt_tokens_details"] == {"cached_tokens": 32}
        other = await usage_of(http, base, {"model": MODEL, "prompt": WORDS, "max_tokens": 1})
        assert other["prompt_tokens_details"] == {"cached_tokens": 0}
        async with http.get(f"{base}/sim/stats") as resp:
            assert (await resp.json())["cached_blocks"] >= 2


async def test_the_cache_off_reuses_nothing(sim: Factory) -> None:
    base = await sim(prompt_tokens_details=True)  # the cache is off by default
    body = {"model": MODEL, "prompt": WORDS, "max_tokens": 1}
    async with aiohttp.ClientSession() as http:
        for _ in range(2):
            usage = await usage_of(http, base, body)
            assert usage["prompt_tokens_details"] == {"cached_tokens": 0}


def test_the_flags_and_the_token_stand_ins() -> None:
    flags = ["--enable-prefix-caching", "--enable-prompt-tokens-details"]
    on = config_from_args(build_parser().parse_args(flags))
    assert on.prefix_caching and on.prompt_tokens_details
    off = config_from_args(build_parser().parse_args([]))
    assert not off.prefix_caching and not off.prompt_tokens_details
    messages: list[Any] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a b c"}]},
    ]
    assert len(chat_prompt_tokens(messages)) == count_chat_prompt_tokens(messages)
    for prompt in ("a b  c", ["a b", "c"], [1, 2, 3]):
        assert len(completion_prompt_tokens(prompt)) == count_completion_prompt_tokens(prompt)
