"""A recording stand-in for a model server, for sidecar tests over loopback."""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

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
    first_token_delay: float = 0.0
    token_delay: float = 0.0
    tokens: int = 3
    byte_by_byte: bool = False
    fail: str = ""  # "before_response": drop the connection; "mid_stream": drop after 2 events
    headers_seen: list[dict[str, str]] = field(default_factory=list)
    active: int = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.paths.append(request.path)
        if request.path not in ("/v1/chat/completions", "/v1/completions"):
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
                    if self.fail == "mid_stream" and i == 2 and request.transport is not None:
                        request.transport.abort()
                        raise ConnectionResetError("simulated engine crash mid-stream")
                    await resp.write(part)
                    await asyncio.sleep(self.token_delay)
            await resp.write_eof()
            return resp
        finally:
            self.active -= 1
            self.closed_at.append(time.monotonic())
