"""A non-streamed answer reaches its client before admission's release (issue 37): over real
loopback HTTP on the own server leg, the client's socket already holds the whole answer when the
release runs; the release still comes exactly once, nothing left reserved, when the write to the
client fails."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

import aiohttp
import pytest

from kvgate_agent.admission import AsyncAdmission, Ticket
from kvgate_agent.sidecar.app import Sidecar
from kvgate_agent.sidecar.edge.client_conn import ClientConnection
from kvgate_agent.sidecar.edge.client_request import Request
from kvgate_agent.sidecar.reading import Answer
from kvgate_bench.kit.toolkit import wait_until_async
from tests.conftest import SidecarFactory, gauges
from tests.upstream import CHAT, Upstream

SPEC: dict[str, Any] = {"capacity": {"kvCacheTokens": 100000}, "model": {"blockSize": 1}}


class Releases:
    """Forwarder's admission, its ``release`` counted (and ``before`` run before each one)."""

    def __init__(self, real: AsyncAdmission, before: Any = None) -> None:
        self.real = real
        self.before = before
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def release(self, ticket: Ticket, **kwargs: Any) -> None:
        self.calls += 1
        if self.before is not None:
            self.before()
        self.real.release(ticket, **kwargs)


def whole_answer(raw: bytes) -> bool:
    """``raw`` holds a whole answer (its head and its ``Content-Length`` bytes of body)."""
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return False


def peek_whole(sock: socket.socket, seconds: float) -> bool:
    """Whether ``sock`` (non-blocking) holds a whole answer unread, within ``seconds`` (the
    kernel hands loopback bytes over at once; the wait only bounds a failing run)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            if whole_answer(sock.recv(1 << 20, socket.MSG_PEEK)):
                return True
        except BlockingIOError:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)


def chat_request(port: int) -> bytes:
    raw = json.dumps({**CHAT, "max_tokens": 9}).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%b" % (port, len(raw), raw)
    )


async def read_answer(sock: socket.socket) -> bytes:
    loop = asyncio.get_running_loop()
    got = b""
    while not whole_answer(got):
        part = await asyncio.wait_for(loop.sock_recv(sock, 1 << 20), 10)
        if not part:
            break
        got += part
    return got


def all_released(sc: Sidecar) -> bool:
    s = sc.admission.core.stats()
    return s.in_flight == 0 and s.kv_reserved_tokens == 0 and s.queue_length == 0


async def test_the_client_has_the_whole_answer_before_the_release(
    upstream: Upstream,
    sidecar_factory: SidecarFactory,
    client: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url, sc = await sidecar_factory(upstream.url, SPEC)
    port = int(url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setblocking(False)
    seen: list[bool] = []
    rec = Releases(sc.admission, lambda: seen.append(peek_whole(sock, 2.0)))
    monkeypatch.setattr(sc.forwarder, "admission", rec)
    try:
        for _ in range(2):  # and again on the same kept-alive connection
            await asyncio.get_running_loop().sock_sendall(sock, chat_request(port))
            got = await read_answer(sock)
            assert got.startswith(b"HTTP/1.1 200 ") and b"x-kvgate-decision: admitted" in got
            assert json.loads(got.partition(b"\r\n\r\n")[2])["usage"]["completion_tokens"] == 3
    finally:
        sock.close()
    assert seen == [True, True] and rec.calls == 2
    assert all_released(sc)
    # The same tokens settled as when the answer came after the release.
    g = await gauges(client, url)
    assert g['kvgate_tokens_total{kind="completion",tenant="anonymous"}'] == 6
    assert g['kvgate_tokens_total{kind="prompt",tenant="anonymous"}'] == 14  # the server's count


@pytest.mark.parametrize("error", [ConnectionResetError, RuntimeError])
async def test_a_failed_client_write_still_releases_once(
    upstream: Upstream,
    sidecar_factory: SidecarFactory,
    monkeypatch: pytest.MonkeyPatch,
    error: type[Exception],
) -> None:
    url, sc = await sidecar_factory(upstream.url, SPEC)
    rec = Releases(sc.admission)
    monkeypatch.setattr(sc.forwarder, "admission", rec)
    failed: list[bytes] = []
    answer = ClientConnection.answer

    def failing(self: ClientConnection, req: Request, resp: Answer) -> bool:
        if not failed:  # the admitted answer's write, written from the handler
            failed.append(resp.body)
            raise error("the write to the client failed")
        return answer(self, req, resp)

    monkeypatch.setattr(ClientConnection, "answer", failing)
    port = int(url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_sendall(sock, chat_request(port))
        got = await read_answer(sock)
    finally:
        sock.close()
    assert failed and b'"usage"' in failed[0]  # it was the upstream's answer that failed
    await wait_until_async(lambda: all_released(sc), 10, "everything released")
    assert rec.calls == 1
    if error is RuntimeError:  # a handler failure: 500, nothing else was written before it
        assert got.startswith(b"HTTP/1.1 500 ")
    else:  # the client counted gone; what the handler hands back is written (here it is there)
        assert got.startswith(b"HTTP/1.1 200 ")
