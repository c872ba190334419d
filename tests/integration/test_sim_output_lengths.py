"""kvgate-sim's true output lengths over real HTTP: the x-sim-output-tokens header, finish_reason
stop/length, the seeded draw, the realistic profile, and the header passing the sidecar."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from kvgate_bench.sim.lengths import OutputLengths
from tests.conftest import SidecarFactory

MODEL = "kvgate-sim-model"
HEADER = "x-sim-output-tokens"


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello world"}], **kw}


async def complete(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[str, str, dict[str, int]]:
    """POST a chat completion; returns (content, finish_reason, usage), streaming or not."""
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        if not body.get("stream"):
            data = await resp.json()
            (choice,) = data["choices"]
            return choice["message"]["content"], choice["finish_reason"], data["usage"]
        text = await resp.text()
    events = [b.removeprefix("data: ") for b in text.split("\n\n") if b]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert all(f is None for f in finishes[:-1])
    (usage,) = [c["usage"] for c in chunks if "usage" in c]
    return content, str(finishes[-1]), usage


@pytest.mark.parametrize("stream", [False, True])
async def test_header_sets_the_true_length(sim: Any, stream: bool) -> None:
    base = await sim()
    extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    async with aiohttp.ClientSession() as http:
        content, finish, usage = await complete(
            http, base, chat(max_tokens=50, **extra), {HEADER: "7"}
        )
        assert finish == "stop" and usage["completion_tokens"] == 7 == len(content.split())
        assert usage["total_tokens"] == usage["prompt_tokens"] + 7
        # A true length at or past max_tokens is cut there: finish_reason length.
        content, finish, usage = await complete(
            http, base, chat(max_tokens=5, **extra), {HEADER: "9"}
        )
        assert finish == "length" and usage["completion_tokens"] == 5 == len(content.split())


async def test_bad_header_is_a_400(sim: Any) -> None:
    base = await sim()
    async with aiohttp.ClientSession() as http:
        for bad in ("0", "x", "-1"):
            async with http.post(
                base + "/v1/chat/completions", json=chat(max_tokens=5), headers={HEADER: bad}
            ) as resp:
                assert resp.status == 400
                assert HEADER in (await resp.json())["error"]["message"]
        async with http.get(base + "/sim/stats") as resp:
            assert (await resp.json())["finished_total"] == 0


async def test_seeded_draw_without_header_on_the_h100_profile(sim: Any) -> None:
    base = await sim(profile="h100-llama3-8b", output_lengths="lognormal", output_seed=3)
    expected = OutputLengths("lognormal", seed=3)
    async with aiohttp.ClientSession() as http:
        for _ in range(3):  # sequential, so the draws are taken in this order
            true = expected.draw()
            assert true is not None
            _, finish, usage = await complete(http, base, chat(max_tokens=300), {})
            assert usage["completion_tokens"] == min(true, 300)
            assert finish == ("stop" if true < 300 else "length")
        async with http.get(base + "/sim/stats") as resp:
            stats = await resp.json()
    assert stats["num_gpu_blocks"] == 29205 and stats["profile"] == "h100-llama3-8b"


async def test_the_sidecar_forwards_the_header_untouched(
    sim: Any, sidecar_factory: SidecarFactory
) -> None:
    base = await sim()
    url, _ = await sidecar_factory(base, {})
    async with aiohttp.ClientSession() as http:
        for stream in (False, True):
            extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
            _, finish, usage = await complete(
                http, url, chat(max_tokens=50, **extra), {HEADER: "7"}
            )
            assert (finish, usage["completion_tokens"]) == ("stop", 7)
