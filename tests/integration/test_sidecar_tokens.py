"""Live token counts: as a streamed response passes the sidecar, the admission controller is told
how many output tokens the request has generated so far (``observe_tokens``), over real HTTP on
loopback, in front of kvgate-sim or a stand-in that streams several choices."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from itertools import pairwise

import aiohttp
import pytest
from aiohttp import web

from kvgate_agent.admission import Ticket
from kvgate_agent.sidecar.app import Sidecar
from kvgate_bench.kit.toolkit import free_port
from kvgate_bench.sim.config import SimConfig
from kvgate_bench.sim.server import start_sim
from tests.conftest import SidecarFactory
from tests.upstream import CHAT, Upstream


@dataclass(frozen=True)
class Observed:
    """One ``observe_tokens`` call: its ticket, its count, and the requests in flight then."""

    ticket: Ticket
    generated: int
    in_flight: int


def spy_on_observe_tokens(sc: Sidecar, monkeypatch: pytest.MonkeyPatch) -> list[Observed]:
    """Record every ``observe_tokens`` call the sidecar makes, then let the real one run."""
    calls: list[Observed] = []
    admission = sc.admission
    real = admission.observe_tokens

    def spy(ticket: Ticket, generated: int) -> None:
        calls.append(Observed(ticket, generated, admission.stats().in_flight))
        real(ticket, generated)

    monkeypatch.setattr(admission, "observe_tokens", spy)
    return calls


def final_usage(sse: str) -> dict[str, int]:
    """The ``usage`` object of the stream's usage event (the client asked for it)."""
    found = []
    for line in sse.splitlines():
        if line.startswith("data: {"):
            obj = json.loads(line[6:])
            if obj.get("usage"):
                found.append(obj["usage"])
    assert len(found) == 1, sse
    usage: dict[str, int] = found[0]
    return usage


def assert_growing_to(calls: list[Observed], total: int) -> None:
    counts = [c.generated for c in calls]
    assert counts, "observe_tokens was never called"
    assert all(a < b for a, b in pairwise(counts)), counts
    assert counts[-1] == total, counts
    assert len({id(c.ticket) for c in calls}) == 1  # one request, one ticket
    assert all(c.in_flight == 1 for c in calls)  # told while the request holds its ticket


async def test_streamed_tokens_reach_the_controller_as_they_pass(
    sidecar_factory: SidecarFactory,
    client: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runner, port = await start_sim(SimConfig(decode_ms=5))
    try:
        url, sc = await sidecar_factory(f"http://127.0.0.1:{port}", {})
        calls = spy_on_observe_tokens(sc, monkeypatch)
        body = {
            "model": "kvgate-sim-model",
            "stream": True,
            "max_tokens": 64,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "tell me a story"}],
        }
        # The simulator stops this request at 30 tokens (finish_reason stop), below max_tokens.
        async with client.post(
            url + "/v1/chat/completions", json=body, headers={"x-sim-output-tokens": "30"}
        ) as r:
            assert r.status == 200
            text = await r.text()
        assert final_usage(text)["completion_tokens"] == 30
        assert_growing_to(calls, 30)
        # Reported as the tokens passed, not once at the end (one event per 5 ms step).
        assert len(calls) >= 5, [c.generated for c in calls]
        assert sc.admission.stats().in_flight == 0
    finally:
        await runner.cleanup()


async def test_one_report_at_most_per_event_even_byte_by_byte(
    upstream: Upstream,
    sidecar_factory: SidecarFactory,
    client: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Events split into 1-byte writes: each token is reported once, when its event is whole."""
    upstream.byte_by_byte = True
    upstream.tokens = 5
    url, sc = await sidecar_factory(upstream.url, {})
    calls = spy_on_observe_tokens(sc, monkeypatch)
    async with client.post(
        url + "/v1/chat/completions", json={**CHAT, "stream": True, "max_tokens": 50}
    ) as r:
        assert r.status == 200
        await r.read()
    assert_growing_to(calls, 5)
    assert len(calls) <= 5


@pytest.fixture
async def two_choice_upstream() -> AsyncIterator[str]:
    """A model server stand-in that streams ``n: 2`` chat completions: 4 events, each with a
    token for both choices, then the usage event (8 completion tokens) and ``[DONE]``."""

    async def handle(request: web.Request) -> web.StreamResponse:
        if request.path != "/v1/chat/completions":
            return web.json_response({"error": "not here"}, status=404)
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(4):
            choices = [{"index": k, "delta": {"content": f"t{i} "}} for k in (0, 1)]
            await resp.write(b"data: " + json.dumps({"choices": choices}).encode() + b"\n\n")
        usage = {"prompt_tokens": 7, "completion_tokens": 8}
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def test_counts_cover_every_choice(
    two_choice_upstream: str,
    sidecar_factory: SidecarFactory,
    client: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url, sc = await sidecar_factory(two_choice_upstream, {})
    calls = spy_on_observe_tokens(sc, monkeypatch)
    async with client.post(
        url + "/v1/chat/completions", json={**CHAT, "stream": True, "max_tokens": 20, "n": 2}
    ) as r:
        assert r.status == 200
        await r.read()
    assert_growing_to(calls, 8)
    assert all(c.generated % 2 == 0 for c in calls)  # both choices of an event at once
