"""The two ends of ``python -m kvgate_bench.stages``, each its own process (so that neither
runs on the sidecar's event loop): ``python -m kvgate_bench.stages.ends upstream`` and
``... client``.

* **upstream**: a fast loopback model server on a raw asyncio protocol (uvloop when present):
  a chat POST gets :data:`kvgate_bench.peers.servers.RESPONSE_JSON` (the answer the
  ``peers`` benchmark's ``direct`` nginx gives); one with ``"stream": true`` gets a vLLM-like SSE
  stream, chunked, of ``--tokens`` token events ``--itl-ms`` apart, a usage event and
  ``[DONE]``; anything else 404. It prints its port, then serves until killed.
* Both run ``SCHED_BATCH`` (``--normal``: not): on a CPU shared with the sidecar, a process
  woken by the sidecar's write would otherwise preempt it inside that write.
* **client**: blocking sockets, one kept-alive connection per target, one request at a time
  (c=1): ``--warmup`` rounds then ``--requests`` rounds, each round a chat POST (``--body``
  bytes, the ``peers`` body) through the sidecar and the same straight to the upstream, and
  every ``--stream-every``-th round both streamed too. It prints one JSON object:
  ``records``, ``[kind, warm-up, t_send, t_first, t_done, status]`` per exchange
  (``perf_counter_ns``; ``t_first``: the first byte read, for a stream the first byte of its
  first event).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import sys
import time
from collections.abc import Sequence

from kvgate_bench.peers.load import MODEL, TENANT, chat_body
from kvgate_bench.peers.servers import CHAT_PATH, RESPONSE_JSON

_LENGTH = re.compile(rb"(?i)content-length:\s*(\d+)")
_CHAT = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b" % (
    len(RESPONSE_JSON),
    RESPONSE_JSON.encode(),
)
_NOT_FOUND = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"
_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)


def sse_events(tokens: int) -> list[bytes]:
    """The streamed answer's events (SSE, each ending in a blank line): a role delta, ``tokens``
    content deltas (the last with ``finish_reason``), the usage event, ``[DONE]``."""
    base = {"id": "chatcmpl-stages", "object": "chat.completion.chunk", "created": 1700000000,
            "model": MODEL}  # fmt: skip

    def event(obj: object) -> bytes:
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    def delta(d: dict[str, str], finish: str | None) -> bytes:
        choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
        return event({**base, "choices": [choice]})

    out = [delta({"role": "assistant", "content": ""}, None)]
    out += [delta({"content": " tok"}, "stop" if i == tokens - 1 else None) for i in range(tokens)]
    usage = {"prompt_tokens": 42, "completion_tokens": tokens, "total_tokens": 42 + tokens}
    out.append(event({**base, "choices": [], "usage": usage}))
    out.append(b"data: [DONE]\n\n")
    return out


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


class Upstream(asyncio.Protocol):
    """One connection of the upstream (see the module docstring)."""

    def __init__(self, events: list[bytes], itl_s: float) -> None:
        self._events = events
        self._itl = itl_s
        self._buf = b""
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = t = transport  # type: ignore[assignment]
        sock = t.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self._buf += data
        while (end := self._buf.find(b"\r\n\r\n")) >= 0:
            head = self._buf[:end]
            m = _LENGTH.search(head)
            size = int(m.group(1)) if m else 0
            if len(self._buf) < end + 4 + size:
                return
            body = self._buf[end + 4 : end + 4 + size]
            self._buf = self._buf[end + 4 + size :]
            self._answer(head, body)

    def _answer(self, head: bytes, body: bytes) -> None:
        t = self._transport
        assert t is not None
        if not head.startswith(b"POST "):
            t.write(_NOT_FOUND)
        elif re.search(rb'"stream"\s*:\s*true', body):
            self._stream(0, _SSE_HEAD)
        else:
            t.write(_CHAT)

    def _stream(self, i: int, prefix: bytes = b"") -> None:
        t = self._transport
        if t is None or t.is_closing():
            return
        events = self._events
        if self._itl <= 0:
            t.write(prefix + b"".join(_chunk(e) for e in events) + b"0\r\n\r\n")
            return
        last = i == len(events) - 1
        t.write(prefix + _chunk(events[i]) + (b"0\r\n\r\n" if last else b""))
        if not last:
            asyncio.get_running_loop().call_later(self._itl, self._stream, i + 1)


async def serve_upstream(tokens: int, itl_ms: float) -> None:
    """Serve on a free loopback port, print it, serve until cancelled."""
    loop = asyncio.get_running_loop()
    events = sse_events(tokens)
    server = await loop.create_server(lambda: Upstream(events, itl_ms / 1000), "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.Future()


# ----------------------------------------------------------------------------------- the client


def request_bytes(port: int, body: bytes) -> bytes:
    """A chat POST as ``wrk`` sends the ``peers`` load (Host, the JSON type, the tenant)."""
    return (
        f"POST {CHAT_PATH} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nx-kvgate-tenant: {TENANT}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def exchange(sock: socket.socket, data: bytes, stream: bool) -> tuple[int, int, int, int]:
    """Send ``data``, read the whole answer: (t_send, t_first, t_done, status)."""
    now = time.perf_counter_ns
    t_send = now()
    sock.sendall(data)
    buf = sock.recv(65536)
    t_first = 0 if stream else now()
    while b"\r\n\r\n" not in buf:
        buf += _recv(sock)
    head, _, body = buf.partition(b"\r\n\r\n")
    m = _LENGTH.search(head)
    while True:
        if not t_first and b"data:" in body:
            t_first = now()
        if m is not None and len(body) >= int(m.group(1)):
            break
        if m is None and (body.endswith(b"\r\n0\r\n\r\n") or body == b"0\r\n\r\n"):
            break
        body += _recv(sock)
    return t_send, t_first or now(), now(), int(head[9:12])


def _recv(sock: socket.socket) -> bytes:
    got = sock.recv(65536)
    if not got:
        raise ConnectionError("the server closed the connection")
    return got


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def run_client(
    sidecar: int, upstream: int, size: int, rounds: int, warmup: int, stream_every: int
) -> list[object]:
    """The exchanges (see the module docstring), in the order sent; the streamed pair only in
    every ``stream_every``-th round (a stream takes its events' gaps)."""
    kinds = []
    for name, port in (("chat", sidecar), ("chat-direct", upstream)):
        kinds.append((name, port, request_bytes(port, chat_body(size)), False))
    for name, port in (("stream", sidecar), ("stream-direct", upstream)):
        kinds.append((name, port, request_bytes(port, chat_body(size, stream=True)), True))
    socks = {port: _connect(port) for port in (sidecar, upstream)}
    out: list[object] = []
    for i in range(warmup + rounds):
        for name, port, data, stream in kinds:
            if stream and i % stream_every:
                continue
            out.append([name, i < warmup, *exchange(socks[port], data, stream)])
    for s in socks.values():
        s.close()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``upstream`` or ``client`` (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m kvgate_bench.stages.ends")
    sub = p.add_subparsers(dest="role", required=True)
    up = sub.add_parser("upstream")
    up.add_argument("--tokens", type=int, default=4)
    up.add_argument("--itl-ms", type=float, default=1.0)
    cl = sub.add_parser("client")
    cl.add_argument("--sidecar", type=int, required=True)
    cl.add_argument("--upstream", type=int, required=True)
    cl.add_argument("--body", type=int, default=1024)
    cl.add_argument("--requests", type=int, default=2000)
    cl.add_argument("--warmup", type=int, default=200)
    cl.add_argument("--stream-every", type=int, default=4)
    p.add_argument("--normal", action="store_true", help="keep SCHED_OTHER (default: BATCH)")
    args = p.parse_args(argv)
    if not args.normal and hasattr(os, "SCHED_BATCH"):
        # Woken by the sidecar's write, a SCHED_BATCH process does not preempt it on a shared
        # CPU (it runs once the sidecar waits), so the peer's work is not charged to the
        # sidecar's socket write.
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    if args.role == "upstream":
        try:
            import uvloop

            runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
        except ImportError:
            runner = asyncio.Runner()
        with runner:
            runner.run(serve_upstream(args.tokens, args.itl_ms))
        return 0
    records = run_client(args.sidecar, args.upstream, args.body, args.requests, args.warmup,
                         args.stream_every)  # fmt: skip
    json.dump({"records": records}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
