"""kvgate's own server leg over real HTTP on loopback: what it does as an HTTP/1.1 server that
the other sidecar suites do not pin (pipelining, ``Expect: 100-continue``, lingering before
closing, HTTP/1.0, absolute-form targets, HEAD, request-body encodings and their bounds, header
limits, a client gone mid-stream, the idle keep-alive timeout)."""

from __future__ import annotations

import asyncio
import gzip
import json
import time
import zlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from kvgate_agent.contract.policy import parse_policy
from kvgate_agent.sidecar.app import Sidecar, SidecarSettings
from kvgate_agent.sidecar.edge import Answer as Finished
from kvgate_agent.sidecar.edge.client_body import READ_HIGH_WATER
from kvgate_agent.sidecar.edge.client_listener import ClientListener
from kvgate_agent.sidecar.edge.client_request import Request
from kvgate_agent.sidecar.edge.wire import Handler
from kvgate_agent.sidecar.server import SidecarServer
from kvgate_bench.kit.toolkit import poll_until_async, wait_until_async
from tests.conftest import SidecarFactory, gauges, policy_doc
from tests.upstream import CHAT, Upstream, serve_handler

REFUSED_INVALID = (
    'kvgate_admission_decisions_total{outcome="rejected",reason="invalid_request",tenant=""}'
)


# ---------------------------------------------------------------- a raw HTTP/1.1 client


@dataclass
class Answer:
    status: int
    version: bytes
    headers: dict[str, str]  # lower-case names (the last one of a repeated name)
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


async def read_answer(reader: asyncio.StreamReader, method: str = "GET") -> Answer:
    """One answer from ``reader``: its head, then its body as its framing says (none for a
    1xx, 204, 304 or an answer to HEAD; chunked; ``Content-Length``; else until the end)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    status_line, *lines = head[:-4].decode("latin-1").split("\r\n")
    version, code, *_ = status_line.split(" ")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    status = int(code)
    if status < 200 or status in (204, 304) or method == "HEAD":
        return Answer(status, version.encode(), headers, b"")
    if "chunked" in headers.get("transfer-encoding", ""):
        body = b""
        while True:
            size = int((await asyncio.wait_for(reader.readline(), 10)).split(b";")[0], 16)
            if size == 0:
                await asyncio.wait_for(reader.readline(), 10)  # the last CRLF (no trailers)
                break
            body += (await asyncio.wait_for(reader.readexactly(size + 2), 10))[:-2]
        return Answer(status, version.encode(), headers, body)
    if "content-length" in headers:
        body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), 10)
        return Answer(status, version.encode(), headers, body)
    return Answer(status, version.encode(), headers, await asyncio.wait_for(reader.read(), 10))


@asynccontextmanager
async def connect(url: str) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
    try:
        yield reader, writer
    finally:
        writer.close()


async def closed_cleanly(reader: asyncio.StreamReader) -> bool:
    """The server closed the connection with a FIN (no bytes more, no reset) within 10 s."""
    try:
        return await asyncio.wait_for(reader.read(), 10) == b""
    except ConnectionResetError:
        return False


def post(
    target: bytes,
    body: bytes,
    *,
    version: bytes = b"1.1",
    extra: bytes = b"",
    content_type: bytes = b"application/json",
) -> bytes:
    """A POST of ``body`` with a length, exactly these bytes (``extra``: more header lines)."""
    head = [
        b"POST " + target + b" HTTP/" + version,
        b"Host: x",
        b"Content-Type: " + content_type,
        b"Content-Length: %d" % len(body),
    ]
    return b"\r\n".join(head) + b"\r\n" + extra + b"\r\n" + body


CHAT_BODY = json.dumps({**CHAT, "max_tokens": 5}).encode()
GET_HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"


def assert_openai_error(answer: Answer, code: str) -> None:
    body = answer.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code, body


async def all_released(client: aiohttp.ClientSession, url: str) -> dict[str, float]:
    g = await poll_until_async(
        lambda: gauges(client, url),
        lambda g: g["kvgate_in_flight_requests"] == 0 and g["kvgate_kv_reserved_tokens"] == 0,
        10.0,
    )
    assert g["kvgate_in_flight_requests"] == 0 and g["kvgate_kv_reserved_tokens"] == 0
    return g


# ---------------------------------------------------------------- pipelining, 100-continue


async def test_pipelined_requests_are_answered_in_order_on_one_connection(
    upstream: Upstream, sidecar_factory: SidecarFactory
) -> None:
    upstream.headers_delay = 0.2  # the chat completion is the slowest: answered second anyway
    url, sc = await sidecar_factory(upstream.url, {})
    async with connect(url) as (reader, writer):
        writer.write(
            GET_HEALTHZ
            + post(b"/v1/chat/completions", CHAT_BODY)
            + b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        first = await read_answer(reader)
        second = await read_answer(reader)
        third = await read_answer(reader)
        assert (first.status, first.body) == (200, b"ok")
        assert second.status == 200 and second.headers["x-kvgate-decision"] == "admitted"
        assert second.json()["usage"]["completion_tokens"] == 3
        assert (third.status, third.body) == (200, b"ok")
        assert third.headers["connection"] == "close"
        assert await closed_cleanly(reader)
    assert upstream.bodies == [{**CHAT, "max_tokens": 5}]
    assert sc.admission.stats().in_flight == 0


async def test_expect_100_continue_gets_continue_then_the_answer(
    upstream: Upstream, sidecar_factory: SidecarFactory
) -> None:
    url, _ = await sidecar_factory(upstream.url, {})
    request = post(b"/v1/chat/completions", CHAT_BODY, extra=b"Expect: 100-continue\r\n")
    head, body = request[: -len(CHAT_BODY)], CHAT_BODY
    async with connect(url) as (reader, writer):
        writer.write(head)  # the body only once asked for it
        interim = await read_answer(reader)
        assert (interim.status, interim.version) == (100, b"HTTP/1.1")
        assert upstream.bodies == []
        writer.write(body)
        final = await read_answer(reader)
        assert final.status == 200 and final.headers["x-kvgate-decision"] == "admitted"
    assert upstream.bodies == [{**CHAT, "max_tokens": 5}]


async def test_a_refusal_before_the_body_is_sent_closes_without_a_reset(
    upstream: Upstream, sidecar_factory: SidecarFactory
) -> None:
    """Answered (415: not JSON) before its 4 MB body came: the answer says it closes, then
    what the client still sends is read and dropped, and the connection ends with a FIN, never
    a reset that could lose the client the answer."""
    url, _ = await sidecar_factory(upstream.url, {})
    big = b"x" * 4_000_000
    async with connect(url) as (reader, writer):
        writer.write(post(b"/v1/chat/completions", big, content_type=b"text/plain")[: -len(big)])
        answer = await read_answer(reader)
        assert answer.status == 415 and answer.headers["connection"] == "close"
        assert_openai_error(answer, "unsupported_media_type")
        writer.write(big)
        await asyncio.wait_for(writer.drain(), 10)
        assert await closed_cleanly(reader)
    assert upstream.bodies == []


async def test_an_unread_whole_body_does_not_stall_a_kept_alive_connection(
    upstream: Upstream, sidecar_factory: SidecarFactory
) -> None:
    upstream.hold = asyncio.Event()  # the first request is answered once the second is all in
    url, _ = await sidecar_factory(upstream.url, {})
    big = b"x" * (READ_HIGH_WATER + 1)  # over the mark only with its last byte: whole
    try:
        async with connect(url) as (reader, writer):
            writer.write(post(b"/v1/chat/completions", CHAT_BODY))
            await wait_until_async(lambda: upstream.bodies, 10, "the first request upstream")
            writer.write(post(b"/v1/chat/completions", big, content_type=b"text/plain"))
            await asyncio.wait_for(writer.drain(), 10)
            await asyncio.sleep(0.5)  # for the sidecar to take it all in (unobservable)
            upstream.hold.set()
            assert (await read_answer(reader)).status == 200
            refused = await read_answer(reader)
            assert refused.status == 415
            if refused.headers.get("connection") == "close":
                return  # closing is a fine answer too; staying open must serve the next one
            writer.write(GET_HEALTHZ)
            nxt = await asyncio.wait_for(read_answer(reader), 3)
            assert (nxt.status, nxt.body) == (200, b"ok")
    finally:
        upstream.hold.set()


# ---------------------------------------------------------------- request forms


async def test_http10_request_is_answered_and_closed(
    upstream: Upstream, sidecar_factory: SidecarFactory
) -> None:
    url, _ = await sidecar_factory(upstream.url, {})
    async with connect(url) as (reader, writer):
        writer.write(b"GET /healthz HTTP/1.0\r\n\r\n")
        answer = await read_answer(reader)
        assert (answer.status, answer.body) == (200, b"ok")
        assert answer.headers["content-length"] == "2"
        assert await closed_cleanly(reader)


async def test_http10_stream_is_sent_unchunked_and_ended_by_the_close(
    upstream: Upstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    url, _ = await sidecar_factory(upstream.url, {})
    body = json.dumps({**CHAT, "stream": True, "max_tokens": 5}).encode()
    async with connect(url) as (reader, writer):
        writer.write(post(b"/v1/chat/completions", body, version=b"1.0"))
        answer = await read_answer(reader)  # until the end of the connection
    assert answer.status == 200 and "transfer-encoding" not in answer.headers
    assert answer.headers["connection"] == "close"
    assert answer.body.startswith(b"data: ") and answer.body.endswith(b"data: [DONE]\n\n")
    await all_released(client, url)


async def test_http10_keep_alive_is_honoured(
    upstream: Upstream, sidecar_factory: SidecarFactory
) -> None:
    url, _ = await sidecar_factory(upstream.url, {})
    async with connect(url) as (reader, writer):
        writer.write(b"GET /healthz HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
        first = await read_answer(reader)
        assert first.status == 200 and first.headers["connection"] == "keep-alive"
        writer.write(b"GET /healthz HTTP/1.0\r\n\r\n")
        assert (await read_answer(reader)).body == b"ok"
        assert await closed_cleanly(reader)


async def test_absolute_form_target_is_admitted_as_its_path(
    upstream: Upstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    url, _ = await sidecar_factory(upstream.url, {})
    async with connect(url) as (reader, writer):
        writer.write(post(b"http://elsewhere.example/v1/chat/completions", CHAT_BODY))
        answer = await read_answer(reader)
    assert answer.status == 200 and answer.headers["x-kvgate-decision"] == "admitted"
    assert upstream.bodies == [{**CHAT, "max_tokens": 5}]
    assert "/v1/chat/completions" in upstream.paths
    await all_released(client, url)


async def test_head_healthz_has_a_length_but_no_body(
    upstream: Upstream, sidecar_factory: SidecarFactory
) -> None:
    url, _ = await sidecar_factory(upstream.url, {})
    async with connect(url) as (reader, writer):
        # Pipelined behind it: a body sent after HEAD's head would be read as the next answer.
        writer.write(b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n" + GET_HEALTHZ)
        head = await read_answer(reader, "HEAD")
        assert head.status == 200 and head.headers["content-length"] == "2"
        after = await read_answer(reader)
        assert (after.status, after.body) == (200, b"ok")


# ---------------------------------------------------------------- bodies and limits


def gzip_bomb() -> bytes:
    """50 MB of zeros, gzip-compressed (about 50 KB)."""
    c = zlib.compressobj(1, zlib.DEFLATED, 31)
    zeros = bytes(1 << 20)
    return b"".join(c.compress(zeros) for _ in range(50)) + c.flush()


async def test_gzip_bomb_gets_413_and_never_reaches_the_model(
    upstream: Upstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    url, _ = await sidecar_factory(upstream.url, {}, max_body_bytes=1_000_000)
    bomb = gzip_bomb()
    assert len(bomb) < 1_000_000  # under the limit as sent: only decoding finds it over
    async with connect(url) as (reader, writer):
        writer.write(post(b"/v1/chat/completions", bomb, extra=b"Content-Encoding: gzip\r\n"))
        answer = await read_answer(reader)
    assert answer.status == 413
    assert_openai_error(answer, "body_too_large")
    assert upstream.bodies == []
    await all_released(client, url)


async def test_gzip_body_under_the_limit_is_forwarded_decoded(
    upstream: Upstream, sidecar_factory: SidecarFactory
) -> None:
    url, _ = await sidecar_factory(upstream.url, {})
    async with connect(url) as (reader, writer):
        gz = gzip.compress(CHAT_BODY)
        writer.write(post(b"/v1/chat/completions", gz, extra=b"Content-Encoding: gzip\r\n"))
        assert (await read_answer(reader)).status == 200
    assert upstream.bodies == [{**CHAT, "max_tokens": 5}]


async def test_invalid_gzip_body_gets_400_and_never_reaches_the_model(
    upstream: Upstream, sidecar_factory: SidecarFactory
) -> None:
    url, _ = await sidecar_factory(upstream.url, {})
    # Chunked, so the handler waits for it: the decoder's failure is what it reads.
    chunked = b"8\r\nnot gzip\r\n0\r\n\r\n"
    async with connect(url) as (reader, writer):
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            b"\r\nContent-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        writer.write(chunked)
        answer = await read_answer(reader)
        assert answer.status == 400 and answer.headers["connection"] == "close"
        assert_openai_error(answer, "malformed_http")
        assert await closed_cleanly(reader)
    # With a length, all of it with the headers: 400 as well (the body reads as not JSON).
    async with connect(url) as (reader, writer):
        writer.write(
            post(b"/v1/chat/completions", b"not gzip", extra=b"Content-Encoding: gzip\r\n")
        )
        answer = await read_answer(reader)
        assert answer.status == 400 and answer.json()["error"]["type"] == "invalid_request_error"
    assert upstream.bodies == []


async def test_brotli_body_gets_415_with_an_openai_body(
    upstream: Upstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    url, _ = await sidecar_factory(upstream.url, {})
    async with connect(url) as (reader, writer):
        writer.write(
            post(b"/v1/chat/completions", b"\x0b\x02\x80{}\x03", extra=b"Content-Encoding: br\r\n")
        )
        answer = await read_answer(reader)
        assert answer.status == 415 and answer.headers["connection"] == "close"
        assert answer.headers["x-kvgate-reason"] == "invalid_request"
        assert_openai_error(answer, "malformed_http")
        assert await closed_cleanly(reader)
    assert upstream.bodies == []
    g = await gauges(client, url)
    assert g[REFUSED_INVALID] == 1  # counted as a refusal before admission


async def test_a_header_over_64_kib_gets_431(
    upstream: Upstream, sidecar_factory: SidecarFactory
) -> None:
    url, _ = await sidecar_factory(upstream.url, {})
    big = b"X-Big: " + b"a" * (64 * 1024 + 1) + b"\r\n"
    async with connect(url) as (reader, writer):
        writer.write(post(b"/v1/chat/completions", CHAT_BODY, extra=big))
        answer = await read_answer(reader)
        assert answer.status == 431
        assert_openai_error(answer, "malformed_http")
    assert upstream.bodies == []
    # Just under it is served (the 64 KiB the sidecar has always allowed); on the sidecar's own
    # endpoint, as the model server stand-in allows aiohttp's 8 KiB only.
    fits = b"X-Big: " + b"a" * (64 * 1024 - 16) + b"\r\n"
    async with connect(url) as (reader, writer):
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + fits + b"\r\n")
        assert (await read_answer(reader)).body == b"ok"


# ---------------------------------------------------------------- the client gone


async def test_client_gone_mid_stream_leaves_nothing_reserved(
    upstream: Upstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    upstream.tokens = 300
    upstream.token_delay = 0.05  # a 15 s stream
    url, sc = await sidecar_factory(upstream.url, {})
    body = json.dumps({**CHAT, "stream": True, "max_tokens": 1000}).encode()
    async with connect(url) as (reader, writer):
        writer.write(post(b"/v1/chat/completions", body))
        got = b""
        while b"data: " not in got:
            part = await asyncio.wait_for(reader.read(4096), 10)
            assert part, got
            got += part
        assert got.startswith(b"HTTP/1.1 200")
        assert sc.admission.stats().in_flight == 1
        closed = time.monotonic()
    await wait_until_async(lambda: upstream.closed_at, 10, "the upstream connection to close")
    assert upstream.closed_at[0] - closed < 5.0  # at once, not at the 15 s stream's end
    g = await all_released(client, url)
    assert g["kvgate_client_disconnects_total"] == 1
    assert upstream.events_sent < upstream.tokens


# ---------------------------------------------------------------- deadlines, at the listener


@asynccontextmanager
async def listener(**kw: Any) -> AsyncIterator[tuple[str, list[str]]]:
    """A :class:`ClientListener` on a free loopback port whose every request gets ``ok``; its
    URL and what its counters counted."""
    counted: list[str] = []

    async def ok(req: Request) -> Finished:
        return Finished(text="ok")

    def route(req: Request) -> Handler:
        return ok

    lst = ClientListener(
        route,
        header_timeout=kw.pop("header_timeout", 10.0),
        max_field=65536,
        decoded_limit=1_000_001,
        on_timeout=lambda: counted.append("timeout"),
        on_malformed=lambda: counted.append("malformed"),
        draining=lambda: False,
        **kw,
    )
    await lst.start("127.0.0.1", 0, 16)
    try:
        yield f"http://127.0.0.1:{lst.port}", counted
    finally:
        await lst.close()


async def test_an_idle_kept_alive_connection_closes_after_the_keepalive_timeout() -> None:
    async with listener(keepalive_timeout=0.3) as (url, counted), connect(url) as (r, w):
        for _ in range(2):  # kept alive between requests sent within the timeout
            w.write(GET_HEALTHZ)
            answer = await read_answer(r)
            assert answer.body == b"ok" and "connection" not in answer.headers
        idle_from = time.monotonic()
        assert await closed_cleanly(r)
        idle = time.monotonic() - idle_from
        assert 0.2 < idle < 5.0, idle
        assert counted == []  # an idle close is neither a timeout nor a refusal


async def test_slow_headers_get_408_at_the_header_deadline() -> None:
    async with listener(header_timeout=0.3) as (url, counted), connect(url) as (r, w):
        w.write(b"GET /healthz HTTP/1.1\r\nHost:")  # and no more
        started = time.monotonic()
        answer = await read_answer(r)
        assert answer.status == 408 and answer.headers["connection"] == "close"
        assert 0.2 < time.monotonic() - started < 5.0
        assert await closed_cleanly(r)
        assert counted == ["timeout"]


async def test_a_passthrough_request_in_flight_at_the_drain_is_answered() -> None:
    """SIGTERM's drain (``SidecarServer.drain``) waits for pass-through requests too, not only
    for admitted ones: a slow ``/tokenize`` under way when the drain starts is answered 200
    before the sidecar stops."""
    started = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        if request.path != "/tokenize":  # the sidecar's own probes of the model server
            return web.Response(status=404)
        started.set()
        await asyncio.sleep(0.5)
        return web.json_response({"tokens": [1, 2, 3]})

    async with serve_handler(slow) as up:
        sc = Sidecar(
            SidecarSettings(upstream=up, policy=parse_policy(policy_doc({})), drain_seconds=10)
        )
        server = SidecarServer(sc)
        await server.start(("127.0.0.1", 0), None)
        try:
            async with aiohttp.ClientSession() as client:
                url = f"http://127.0.0.1:{server.port}/tokenize"
                pending = asyncio.ensure_future(client.post(url, json={"prompt": "hi"}))
                await asyncio.wait_for(started.wait(), 10)
                drain = asyncio.ensure_future(server.drain(10, asyncio.Event()))
                r = await asyncio.wait_for(pending, 10)
                assert r.status == 200 and (await r.json()) == {"tokens": [1, 2, 3]}
                await asyncio.wait_for(drain, 15)
        finally:
            await server.cleanup()
