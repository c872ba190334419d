"""A recording stand-in for a model server, for sidecar tests over loopback."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kvgate_bench.kit.toolkit import free_port

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}


def chunk(text: str) -> bytes:
    return (
        b"data: "
        + json.dumps({"choices": [{"index": 0, "delta": {"content": text}}]}).encode()
        + b"\n\n"
    )


USAGE_CHUNK = b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3}}\n\n'


@dataclass
class Upstream:
    """An in-process model server stand-in that records every request and when its client
    connection went away."""

    url: str = ""
    bodies: list[dict[str, Any]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    closed_at: list[float] = field(default_factory=list)
    headers_delay: float = 0.0
    hold: asyncio.Event | None = None  # when given: no answer (not even headers) until it is set
    first_token_delay: float = 0.0
    token_delay: float = 0.0
    tokens: int = 3
    byte_by_byte: bool = False
    fail: str = ""  # "before_response": drop the connection; "mid_stream": drop after 2 events
    #: When given: a stream freezes after 2 events (the connection open, nothing sent) until
    #: it is set, as a hung engine whose /health still answers.
    freeze: asyncio.Event | None = None
    headers_seen: list[dict[str, str]] = field(default_factory=list)
    #: The headers of every other request (pass-through, the probes), as received.
    other_headers: list[dict[str, str]] = field(default_factory=list)
    active: int = 0
    events_sent: int = 0  # stream events written (not byte_by_byte), over all requests

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.paths.append(request.path)
        if request.path not in ("/v1/chat/completions", "/v1/completions"):
            self.other_headers.append(dict(request.headers))
            return web.json_response(
                {
                    "path": request.path,
                    "method": request.method,
                    "body": (await request.read()).decode(errors="replace"),
                }
            )
        self.headers_seen.append(dict(request.headers))
        body = await request.json()
        self.bodies.append(body)
        self.active += 1
        try:
            await asyncio.sleep(self.headers_delay)
            if self.hold is not None:
                await self.hold.wait()
            if self.fail == "before_response" and request.transport is not None:
                request.transport.abort()
                raise ConnectionResetError("simulated engine crash")
            if not body.get("stream"):
                return web.json_response(
                    {
                        "id": "x",
                        "object": "chat.completion",
                        "choices": [
                            {"index": 0, "message": {"role": "assistant", "content": "a b c"}}
                        ],
                        "usage": {
                            "prompt_tokens": 7,
                            "completion_tokens": self.tokens,
                            "total_tokens": 7 + self.tokens,
                        },
                    }
                )
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await asyncio.sleep(self.first_token_delay)
            payload = b"".join(chunk(f"t{i} ") for i in range(self.tokens))
            if (body.get("stream_options") or {}).get("include_usage"):
                payload += USAGE_CHUNK.replace(
                    b'"completion_tokens":3', b'"completion_tokens":%d' % self.tokens
                )
            payload += b"data: [DONE]\n\n"
            if self.byte_by_byte:
                for i in range(len(payload)):
                    await resp.write(payload[i : i + 1])
            else:
                for i, part in enumerate(p for p in re.split(b"(?<=\n\n)", payload) if p):
                    if self.freeze is not None and i == 2:
                        await self.freeze.wait()
                    if self.fail == "mid_stream" and i == 2 and request.transport is not None:
                        request.transport.abort()
                        raise ConnectionResetError("simulated engine crash mid-stream")
                    await resp.write(part)
                    self.events_sent += 1
                    await asyncio.sleep(self.token_delay)
            await resp.write_eof()
            return resp
        finally:
            self.active -= 1
            self.closed_at.append(time.monotonic())


@dataclass
class Faulty:
    """A model server stand-in whose behaviour each request picks with its ``x-test-fault``
    header (forwarded by the sidecar): see :meth:`_answer`. Counts the POSTs that reached it
    and how each ended (``finished``, or ``cancelled`` when its client connection went away);
    other methods (the sidecar's probes) get an empty 200 (404 for ``/metrics``)."""

    url: str = ""
    reached: int = 0
    active: int = 0
    cancelled: int = 0
    finished: int = 0
    faults: list[str] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.method != "POST":  # the sidecar's probes (/health, /v1/models, /metrics)
            return web.Response(status=404 if request.path == "/metrics" else 200)
        fault = request.headers.get("x-test-fault", "ok")
        await request.read()
        self.reached += 1
        self.active += 1
        self.faults.append(fault)
        try:
            resp = await self._answer(request, fault)
            self.finished += 1
            return resp
        except (asyncio.CancelledError, ConnectionResetError):  # its client went away
            self.cancelled += 1
            raise
        finally:
            self.active -= 1

    async def _answer(self, request: web.Request, fault: str) -> web.StreamResponse:
        """``ok``: 3 events and ``[DONE]`` (streams; any body gets it); ``short``/``long``/
        ``longer``: 40 events 50 ms apart / 1000 / 3000 events 10 ms apart (at least 2 s / 10 s
        / 30 s); ``hang_before_headers``,
        ``hang_before_first_token``: silence; ``status_500`` (OpenAI body),
        ``status_503_html``; ``reset_in_body``: 10 of 1000 promised bytes, then a TCP reset;
        ``reset_mid_stream``: a reset after 2 events; ``garbage``: bytes that are not SSE or
        not JSON, then a clean end without ``[DONE]``; ``endless_event``: one event that never
        ends (128 MiB without a newline)."""
        if fault == "hang_before_headers":
            await asyncio.sleep(3600)
        if fault == "status_500":
            return web.json_response({"error": {"message": "engine died"}}, status=500)
        if fault == "status_503_html":
            return web.Response(status=503, text="<html>bad gateway</html>")
        if fault == "reset_in_body":  # headers promise 1000 bytes, 10 come, then a reset
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            resp.content_length = 1000
            await resp.prepare(request)
            await resp.write(b'{"id": "x"')
            await asyncio.sleep(0.05)
            assert request.transport is not None
            request.transport.abort()
            return resp
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if fault == "hang_before_first_token":
            await asyncio.sleep(3600)
        if fault == "garbage":
            await resp.write(b"\x00\xff\xfe not sse at all\r\n\r\ndata: {not json\n\n")
            await resp.write(b"data: [1, 2]\n\nevent: x\ndata: \xc3\x28\n\n")
            await resp.write_eof()
            return resp
        if fault == "endless_event":  # one event that never ends: 64 KiB pieces, no newline
            await resp.write(b"data: ")
            for _ in range(2_000):  # 128 MiB
                await resp.write(b"x" * 65536)
            return resp
        tokens, delay = {"longer": (3000, 0.01), "long": (1000, 0.01), "short": (40, 0.05)}.get(
            fault, (3, 0.0)
        )
        for i in range(tokens):
            await resp.write(chunk(f"t{i} "))
            if fault == "reset_mid_stream" and i == 1:
                assert request.transport is not None
                request.transport.abort()
                return resp
            await asyncio.sleep(delay)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@asynccontextmanager
async def serve_handler(
    handler: Handler, *, backlog: int = 128, **runner: Any
) -> AsyncIterator[str]:
    """Serve ``handler`` for every method and path on a free loopback port; yields the base
    URL (``http://127.0.0.1:PORT``). ``runner`` goes to ``web.AppRunner``."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    app_runner = web.AppRunner(app, **runner)
    await app_runner.setup()
    port = free_port()
    await web.TCPSite(app_runner, "127.0.0.1", port, backlog=backlog).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await app_runner.cleanup()


@asynccontextmanager
async def serve_faulty() -> AsyncIterator[Faulty]:
    """A :class:`Faulty` model server on a free loopback port."""
    up = Faulty()
    async with serve_handler(
        up.handle, backlog=2048, handler_cancellation=True, shutdown_timeout=0.2
    ) as up.url:
        yield up
