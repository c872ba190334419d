"""The added-latency benchmark's upstream: a minimal aiohttp server on uvloop answering at once
with a fixed small OpenAI chat response, whole or streamed (:func:`serve_upstream`, run as
``python -m kvgate_bench.bench_latency --serve-upstream``), so that the model server's own time
is small and stable.
"""

from __future__ import annotations

import json

TENANT = "bench"


MODEL = "meta-llama/Llama-3.1-8B-Instruct"


_CHAT_ID = "chatcmpl-bench"


CONTENT = "Hello from the upstream."


def json_bytes(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


UPSTREAM_JSON = json_bytes(
    {
        "id": _CHAT_ID,
        "object": "chat.completion",
        "created": 1700000000,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": CONTENT},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 42, "completion_tokens": 6, "total_tokens": 48},
    }
)


def _chunk(delta: dict[str, str], finish: str | None) -> bytes:
    head = {"id": _CHAT_ID, "object": "chat.completion.chunk", "created": 1700000000}
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return b"data: " + json_bytes({**head, "model": MODEL, "choices": [choice]}) + b"\n\n"


#: The stream, as separate writes: role, content, finish, [usage], [DONE].
UPSTREAM_SSE = (
    _chunk({"role": "assistant", "content": ""}, None),
    _chunk({"content": CONTENT}, None),
    _chunk({}, "stop"),
)


UPSTREAM_SSE_USAGE = (
    b"data: "
    + json_bytes(
        {
            "id": _CHAT_ID,
            "object": "chat.completion.chunk",
            "created": 1700000000,
            "model": MODEL,
            "choices": [],
            "usage": {"prompt_tokens": 42, "completion_tokens": 6, "total_tokens": 48},
        }
    )
    + b"\n\n"
)


def serve_upstream(port: int) -> None:
    """Run the fixed-response upstream on 127.0.0.1:``port`` until killed (uvloop)."""
    from aiohttp import web

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if b'"stream":true' not in body:
            return web.Response(body=UPSTREAM_JSON, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for piece in UPSTREAM_SSE:
            await resp.write(piece)
        if b'"include_usage":true' in body:
            await resp.write(UPSTREAM_SSE_USAGE)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/bench/chat", chat)  # reached through the sidecar's pass-through
    app.router.add_get("/health", health)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)
    else:
        web.run_app(
            app,
            host="127.0.0.1",
            port=port,
            access_log=None,
            print=None,
            loop=uvloop.new_event_loop(),
        )
