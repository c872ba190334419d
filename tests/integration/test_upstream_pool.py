"""The admitted requests' upstream leg (:mod:`kvgate_agent.sidecar.upstream.upstream`) against raw
loopback servers that send exactly the bytes each case needs: keep-alive reuse, the three ways a
body ends, a model server that breaks the answer, read deadlines and connect failures."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from kvgate_agent.sidecar.upstream.upstream import (
    RESEND_WINDOW_S,
    UpstreamBroken,
    UpstreamConnectError,
    UpstreamPool,
)
from kvgate_bench.kit.toolkit import free_port

#: What one connection of the test server does: read requests from the reader, write answers.
Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request's head and body (``Content-Length`` framed)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head, await reader.readexactly(length)


@asynccontextmanager
async def server(serve: Serve) -> AsyncIterator[tuple[str, list[int]]]:
    """A loopback server running ``serve`` per connection; yields its URL and a one-element
    list counting the connections opened."""
    opened = [0]

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        opened[0] += 1
        try:
            await serve(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    port = free_port()
    srv = await asyncio.start_server(on_conn, "127.0.0.1", port)
    try:
        yield f"http://127.0.0.1:{port}", opened
    finally:
        srv.close()


def pool(url: str, read_timeout: float | None = 5.0) -> UpstreamPool:
    return UpstreamPool(url, connect_timeout=2.0, read_timeout=read_timeout)


async def test_a_kept_alive_connection_is_reused_and_the_request_is_sent_as_given() -> None:
    seen: list[tuple[bytes, bytes]] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            seen.append(await read_request(reader))
            writer.write(OK)

    async with server(serve) as (url, opened):
        p = pool(url)
        for i in range(3):
            target = "/v1/chat/completions?x=1"
            resp = await p.request("POST", target, [("X-A", "b")], b"body%d" % i)
            assert (resp.status, resp.content_type, resp.content_length) == (
                200,
                "application/json",
                2,
            )
            assert await resp.read_all(1024) == b"{}"
            resp.release()
            assert (p.idle, p.busy) == (1, 0)
        assert opened[0] == 1
        head, body = seen[2]
        assert head.startswith(b"POST /v1/chat/completions?x=1 HTTP/1.1\r\n")
        assert f"Host: {url.removeprefix('http://')}\r\n".encode() in head
        assert b"X-A: b\r\n" in head and b"Content-Length: 5\r\n" in head
        assert body == b"body2"
        p.close()
        assert p.idle == 0


async def test_chunked_and_until_close_bodies_are_read_whole() -> None:
    answers = [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil the end",
    ]

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answers.pop(0))
        await writer.drain()
        if not answers:  # the second answer has no length: it ends with the connection
            writer.close()
            return
        await read_request(reader)  # the first connection stays open: keep-alive

    async with server(serve) as (url, opened):
        p = pool(url)
        r1 = await p.request("POST", "/", [], b"")
        assert await r1.read_all(1024) == b"abcde"
        r1.release()
        assert p.idle == 1
        p.close()  # the next request opens a new connection
        p = pool(url)
        r2 = await p.request("POST", "/", [], b"x")
        assert await r2.read_all(1024) == b"until the end"
        r2.release()
        assert p.idle == 0  # a body delimited by the close: not reusable
        assert opened[0] == 2


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort",  # closed mid-body
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",  # not HTTP
    ],
)
async def test_a_broken_answer_raises_and_the_connection_is_not_reused(answer: bytes) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer)
        await writer.drain()

    async with server(serve) as (url, _):
        p = pool(url)
        resp = await p.request("POST", "/", [], b"{}")
        with pytest.raises(UpstreamBroken):
            await resp.read_all(1024)
        resp.release()
        assert (p.idle, p.busy) == (0, 0)


async def test_the_read_deadline_counts_from_the_last_byte() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(6):  # 0.6 s in all, an event every 0.1 s: under a 0.3 s deadline
            await asyncio.sleep(0.1)
            writer.write(b"2\r\nok\r\n")
        await asyncio.sleep(5)  # then silence

    async with server(serve) as (url, _):
        p = pool(url, read_timeout=0.3)
        resp = await p.request("POST", "/", [], b"{}")
        got = b""
        with pytest.raises(TimeoutError):
            while chunk := await resp.read_any():
                got += chunk
        assert got == b"ok" * 6
        resp.close()
        assert (p.idle, p.busy) == (0, 0)


async def test_no_answer_times_out_and_a_refused_connection_is_a_connect_error() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(5)

    async with server(serve) as (url, _):
        p = pool(url, read_timeout=0.2)
        with pytest.raises(TimeoutError):
            await p.request("POST", "/", [], b"{}")
        assert (p.idle, p.busy) == (0, 0)
    with pytest.raises(UpstreamConnectError):
        await pool(f"http://127.0.0.1:{free_port()}").request("POST", "/", [], b"{}")


async def test_an_idle_connection_the_server_closed_is_dropped() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(OK)
        await writer.drain()
        await asyncio.sleep(0.05)  # then close it while it is idle in the pool

    async with server(serve) as (url, opened):
        p = pool(url)
        for _ in range(2):
            resp = await p.request("POST", "/", [], b"{}")
            assert await resp.read_all(1024) == b"{}"
            resp.release()
            await asyncio.sleep(0.3)
        assert opened[0] == 2
        p.close()
        with pytest.raises(UpstreamConnectError):
            await p.request("POST", "/", [], b"{}")


async def test_an_informational_answer_is_skipped_and_header_bytes_pass_unchanged() -> None:
    seen: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, _ = await read_request(reader)
        seen.append(head)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" + OK)
        await read_request(reader)

    async with server(serve) as (url, _):
        p = pool(url)
        value = "caf\xc3\xa9".encode("latin-1").decode("utf-8", "surrogateescape")  # as aiohttp
        resp = await p.request("POST", "/", [("X-Name", value)], b"{}")
        assert resp.status == 200 and await resp.read_all(1024) == b"{}"
        resp.release()
        assert p.idle == 1
        assert "X-Name: café\r\n".encode() in seen[0]
        p.close()


async def test_a_connection_idle_past_keepalive_is_not_reused() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(OK)

    async with server(serve) as (url, opened):
        p = UpstreamPool(url, connect_timeout=2.0, read_timeout=5.0, keepalive_s=0.1)
        for _ in range(2):
            resp = await p.request("POST", "/", [], b"{}")
            assert await resp.read_all(1024) == b"{}"
            resp.release()
            await asyncio.sleep(0.2)
        assert opened[0] == 2  # the first was closed rather than reused
        p.close()


async def test_a_request_on_a_kept_alive_connection_the_server_closed_goes_on_a_fresh_one() -> None:
    # The server reads the next request on a kept-alive connection and closes it unanswered:
    # what a server closing an idle connection does as the request crosses it.
    served: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _, body = await read_request(reader)
        served.append(body)
        writer.write(OK)
        await writer.drain()
        await read_request(reader)  # read, never answered: the connection closes

    async with server(serve) as (url, opened):
        p = pool(url)
        for i in range(3):
            resp = await p.request("POST", "/", [], b"req%d" % i)
            assert resp.status == 200 and await resp.read_all(1024) == b"{}"
            resp.release()
        # The 2nd and 3rd each went out on the previous (closed) connection, then a fresh one.
        assert served == [b"req0", b"req1", b"req2"]
        assert opened[0] == 3 and p.stale_retries == 2
        assert p.busy == 0
        p.close()


async def test_a_server_that_closes_after_each_streamed_answer_loses_no_request() -> None:
    # llama.cpp's llama-server: a chunked stream with "Keep-Alive: timeout=5, max=100", then the
    # connection closed at once.
    stream = (
        b"HTTP/1.1 200 OK\r\nKeep-Alive: timeout=5, max=100\r\nContent-Type: text/event-stream\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
        b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"
    )

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(stream)
        await writer.drain()

    async with server(serve) as (url, opened):
        p = pool(url)
        for _ in range(5):  # each taken at once after the last release, as a queued request is
            resp = await p.request("POST", "/", [], b"{}")
            assert resp.status == 200 and await resp.read_all(1024) == b"data: [DONE]\n\n"
            resp.release()
        assert opened[0] == 5 and p.busy == 0
        p.close()


async def test_a_failure_after_a_byte_a_late_close_or_on_a_fresh_connection_is_never_resent() -> (
    None
):
    sent = [0]

    async def partial(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(OK)
        await read_request(reader)
        sent[0] += 1
        writer.write(b"HTTP/1.1 200")  # a byte of answer, then the close

    async with server(partial) as (url, opened):
        p = pool(url)
        resp = await p.request("POST", "/", [], b"{}")
        await resp.read_all(1024)
        resp.release()
        with pytest.raises(UpstreamBroken):
            await p.request("POST", "/", [], b"{}")
        assert (sent[0], opened[0], p.stale_retries, p.busy) == (1, 1, 0, 0)
        p.close()

    async def late_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(OK)
        await read_request(reader)
        sent[0] += 1
        await asyncio.sleep(RESEND_WINDOW_S * 2)  # it may have worked on it: then closes

    sent[0] = 0
    async with server(late_close) as (url, opened):
        p = pool(url)
        resp = await p.request("POST", "/", [], b"{}")
        await resp.read_all(1024)
        resp.release()
        with pytest.raises(UpstreamBroken):
            await p.request("POST", "/", [], b"{}")
        assert (sent[0], opened[0], p.stale_retries, p.busy) == (1, 1, 0, 0)
        p.close()

    async def unanswered(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)  # a fresh connection closed unanswered

    async with server(unanswered) as (url, opened):
        p = pool(url)
        with pytest.raises(UpstreamBroken):
            await p.request("POST", "/", [], b"{}")
        assert (opened[0], p.stale_retries, p.busy) == (1, 0, 0)
        p.close()
