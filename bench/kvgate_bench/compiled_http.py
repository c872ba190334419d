"""The HTTP exchanges :mod:`kvgate_bench.compiled` compares on the compiled build and on the
sources: :data:`HTTP_CASES` through a sidecar whose own server leg, upstream leg and pipeline are
this process's ``kvgate_agent`` modules (on a compiled build, their compiled modules); each answer
as JSON-ready rows (:func:`http_trace`); the cases once also sent through aiohttp's server leg
went with that leg, retired. Split from :mod:`kvgate_bench.compiled` (the build and the decision
and body traces) by job.
"""

from __future__ import annotations

import asyncio

#: The requests :func:`http_trace` sends through a sidecar, one connection each unless paired:
#: (name, how the body is sent, body or None, extra header lines). ``pipelined``: the chat
#: request twice in one write; ``pathless``: ``GET http://host`` (the root, passed through);
#: ``malformed``: a header line llhttp refuses (400, closed).
HTTP_CASES: tuple[tuple[str, str, bytes | None, str], ...] = (
    ("chat", "length", None, ""),
    ("stream", "length", None, ""),
    ("chat-chunked", "chunked", None, ""),
    ("chat-gzip", "gzip", None, ""),
    ("chat-continue", "length", None, "Expect: 100-continue\r\n"),
    ("pipelined", "length", None, ""),
    ("bad-json", "length", b'{"model": "m", "messages": [', ""),
    ("not-a-generation", "length", b"", ""),
    ("passthrough-get", "get", None, ""),
    ("pathless", "absolute", None, ""),
    ("malformed", "malformed", None, ""),
)  # fmt: skip


def http_trace(itl_ms: float = 1.0) -> list[list[object]]:
    """Each of :data:`HTTP_CASES` through a sidecar of this process's ``kvgate_agent`` (the own
    server leg, the upstream pool, the pipeline: on a compiled build, their compiled modules;
    ``SidecarServer`` as the CLI serves it, the ``peers`` policy) in front of a loopback model
    server (``kvgate_bench.stages``' upstream: ``peers``' chat answer, or an SSE stream of 4
    token events ``itl_ms`` apart), as JSON-ready rows: ``[case, [[status line, header
    fields less Date, body], ...]]``, a chunked body de-chunked (the chunks' sizes follow the
    upstream's timing, not the sidecar's code)."""
    return asyncio.run(_http_trace(itl_ms))


async def _http_trace(itl_ms: float) -> list[list[object]]:
    import gzip

    import yaml

    from kvgate_agent.contract.policy import parse_policy
    from kvgate_agent.sidecar.app import Sidecar, SidecarSettings
    from kvgate_agent.sidecar.server import SidecarServer
    from kvgate_bench.peers.load import TENANT, chat_body
    from kvgate_bench.peers.servers import CHAT_PATH, POLICY_YAML
    from kvgate_bench.stages.ends import Upstream, sse_events

    loop = asyncio.get_running_loop()
    events = sse_events(4)
    up = await loop.create_server(lambda: Upstream(events, itl_ms / 1000), "127.0.0.1", 0)
    up_port = up.sockets[0].getsockname()[1]
    settings = SidecarSettings(
        upstream=f"http://127.0.0.1:{up_port}",
        policy=parse_policy(yaml.safe_load(POLICY_YAML)),
        engine_usage_seconds=0.0,
    )
    server = SidecarServer(Sidecar(settings))
    await server.start(("127.0.0.1", 0), None)
    port = server.port
    rows: list[list[object]] = []
    try:
        for name, framing, given, extra in HTTP_CASES:
            body = chat_body(1024, stream=name == "stream") if given is None else given
            head = f"Host: 127.0.0.1:{port}\r\nx-kvgate-tenant: {TENANT}\r\n{extra}"
            if framing == "get":
                data = f"GET /v1/models HTTP/1.1\r\n{head}\r\n".encode()
            elif framing == "absolute":  # an absolute-form target without a path: the root
                data = f"GET http://127.0.0.1:{port} HTTP/1.1\r\n{head}\r\n".encode()
            elif framing == "malformed":
                data = f"POST {CHAT_PATH} HTTP/1.1\r\n{head}Bad Header\r\n\r\n".encode()
            else:
                path = "/v1/embeddings-not" if name == "not-a-generation" else CHAT_PATH
                head += "Content-Type: application/json\r\n"
                if framing == "gzip":
                    body = gzip.compress(body)
                    head += "Content-Encoding: gzip\r\n"
                if framing == "chunked":
                    half = len(body) // 2
                    payload = b"".join(
                        b"%x\r\n%b\r\n" % (len(p), p) for p in (body[:half], body[half:])
                    )
                    payload += b"0\r\n\r\n"
                    head += "Transfer-Encoding: chunked\r\n"
                else:
                    payload = body
                    head += f"Content-Length: {len(body)}\r\n"
                data = f"POST {path} HTTP/1.1\r\n{head}\r\n".encode() + payload
            count = 2 if name == "pipelined" else 1
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(data * count)
            answers = [await _read_answer(reader) for _ in range(count)]
            writer.close()
            rows.append([name, answers])
    finally:
        await server.cleanup()
        up.close()
    return rows


async def _read_answer(reader: asyncio.StreamReader) -> list[object]:
    """One HTTP/1.1 answer: [status line, header fields less ``Date`` (sorted, names in lower
    case), body as text (de-chunked)]; a ``100 Continue`` before it is skipped but noted."""
    interim = []
    while True:
        head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).decode("latin-1")
        status, *lines = head.removesuffix("\r\n\r\n").split("\r\n")
        if not status.startswith("HTTP/1.1 1"):
            break
        interim.append(status)
    fields = sorted(
        (k.lower(), v.strip())
        for k, _, v in (line.partition(":") for line in lines)
        if k.lower() != "date"
    )
    got = dict(fields)
    if "content-length" in got:
        body = await reader.readexactly(int(got["content-length"]))
    elif got.get("transfer-encoding") == "chunked":
        body = b""
        while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
            body += await reader.readexactly(size)
            await reader.readexactly(2)
        await reader.readexactly(2)
    else:
        body = await reader.read()
    return [*interim, status, [list(f) for f in fields], body.decode("utf-8", "replace")]
