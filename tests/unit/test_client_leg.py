"""kvgate's own server leg, piece by piece, without sockets: request targets, llhttp's parse into
:class:`~kvgate_agent.sidecar.edge.client_request.Request`, the refusals while parsing, request
bodies (decoding, the decompression bound, flow control, ``Expect: 100-continue``), the bytes of an
answer (:func:`head_bytes`, :func:`response_bytes`, :class:`StreamOut`, an answer the handler
writes itself) and a connection's serving on a fake transport."""

from __future__ import annotations

import asyncio
import functools
import gzip
import re
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from multidict import CIMultiDict

from kvgate_agent.sidecar.edge.client_body import READ_HIGH_WATER, BodyStream, MalformedBody
from kvgate_agent.sidecar.edge.client_conn import ClientConnection, LegConfig
from kvgate_agent.sidecar.edge.client_parse import Refused, RequestParser, target
from kvgate_agent.sidecar.edge.client_request import (
    Answered,
    Request,
    StreamOut,
    head_bytes,
    response_bytes,
)
from kvgate_agent.sidecar.edge.wire import answer_now
from kvgate_agent.sidecar.reading import Answer

# ---------------------------------------------------------------- fakes


class FakeReceiver:
    """A connection as the parser and a request's writer see it: what they call, recorded."""

    def __init__(self) -> None:
        self.lost = False
        self.write_paused = False
        self.taken = asyncio.Event()  # what ``drain`` waits for while ``write_paused``
        self.drains = 0
        self.sent: list[bytes] = []
        self.requests: list[Request] = []
        self.completed = 0
        self.pauses = 0
        self.resumes = 0
        self.continues = 0

    def send(self, data: bytes) -> None:
        if not self.lost:
            self.sent.append(data)

    async def drain(self) -> None:
        self.drains += 1
        if self.lost:
            raise ConnectionResetError("gone")
        if self.write_paused:
            await self.taken.wait()

    def answer(self, req: Request, resp: Answer) -> bool:
        close = not req.keep_alive
        self.send(response_bytes(resp, req, close))
        return close

    def on_request(self, req: Request) -> None:
        self.requests.append(req)

    def on_complete(self) -> None:
        self.completed += 1

    def pause_body(self) -> None:
        self.pauses += 1

    def resume_body(self) -> None:
        self.resumes += 1

    def send_continue(self) -> None:
        self.continues += 1

    @property
    def wire(self) -> bytes:
        return b"".join(self.sent)


def parse(*pieces: bytes, max_field: int = 1024, decoded_limit: int = 10_000) -> FakeReceiver:
    """Feed ``pieces`` to a new parser; the receiver that got its requests."""
    r = FakeReceiver()
    p = RequestParser(r, max_field, decoded_limit)
    for piece in pieces:
        p.feed(piece)
    return r


def refused(*pieces: bytes, max_field: int = 1024) -> Refused:
    """The refusal feeding ``pieces`` raises."""
    with pytest.raises(Refused) as info:
        parse(*pieces, max_field=max_field)
    return info.value


def make_request(
    link: FakeReceiver | None = None,
    *,
    method: str = "GET",
    http10: bool = False,
    keep_alive: bool = True,
) -> Request:
    nothing = BodyStream("", 0, lambda: None, lambda: None)
    nothing.feed_eof()
    return Request(
        link or FakeReceiver(),
        method,
        "/x",
        "",
        CIMultiDict(),
        nothing,
        http10=http10,
        keep_alive=keep_alive,
        content_length=None,
        has_body=False,
    )


def body(encoding: str = "", limit: int = 10_000) -> tuple[BodyStream, FakeReceiver]:
    r = FakeReceiver()
    return BodyStream(encoding, limit, r.pause_body, r.resume_body, r.send_continue), r


async def read_all(b: BodyStream) -> bytes:
    out = b""
    async for chunk in b.iter_any():
        out += chunk
    return out


def split(raw: bytes) -> tuple[bytes, dict[str, str], bytes]:
    """(status line, {lower-case name: value}, body) of an answer's bytes; names must not
    repeat."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    status, *lines = head.decode().split("\r\n")
    headers: dict[str, str] = {}
    for line in lines:
        name, _, value = line.partition(": ")
        assert name.lower() not in headers, f"{name} twice in {head!r}"
        headers[name.lower()] = value
    return status.encode(), headers, rest


# ---------------------------------------------------------------- request targets


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (b"/v1/chat/completions", ("/v1/chat/completions", "")),
        (b"/a?b=c&d", ("/a", "b=c&d")),
        (b"/%2e/x?q=%20", ("/%2e/x", "q=%20")),  # as sent: never decoded
        (b"http://host:8080/v1/models?x=1", ("/v1/models", "x=1")),
        (b"http://evil.example/v1/chat/completions", ("/v1/chat/completions", "")),
        (b"http://x", ("/", "")),  # absolute-form without a path: the root
        (b"http://x?q=1", ("/", "q=1")),
        (b"*", ("*", "")),
    ],
)
def test_target_gives_path_and_query_as_sent(url: bytes, expected: tuple[str, str]) -> None:
    assert target(url) == expected


# ---------------------------------------------------------------- the parser


def test_parser_builds_a_request_with_utf8_headers() -> None:
    r = parse(
        b"POST /v1/chat/completions?x=1 HTTP/1.1\r\nHost: a\r\nX-Name: caf\xc3\xa9\r\n"
        b"x-dup: 1\r\nX-Dup: 2\r\nContent-Length: 2\r\n\r\n{}"
    )
    (req,) = r.requests
    assert (req.method, req.path, req.query_string) == ("POST", "/v1/chat/completions", "x=1")
    assert req.path_qs == "/v1/chat/completions?x=1"
    assert str(req.rel_url) == "/v1/chat/completions?x=1"
    assert req.headers["x-name"] == "café"  # UTF-8, case-insensitive names
    assert req.headers.getall("X-DUP") == ["1", "2"]  # in order, both kept
    assert req.keep_alive and not req.http10
    assert req.content_length == 2 and req.body_exists
    assert req.content.is_eof() and req.content.read_nowait() == b"{}"
    assert r.completed == 1


@pytest.mark.parametrize(
    ("version", "connection", "keep_alive"),
    [
        (b"1.1", b"", True),
        (b"1.1", b"Connection: close\r\n", False),
        (b"1.0", b"", False),
        (b"1.0", b"Connection: keep-alive\r\n", True),
    ],
)
def test_keep_alive_follows_the_version_and_connection_header(
    version: bytes, connection: bytes, keep_alive: bool
) -> None:
    head = b"GET /healthz HTTP/" + version + b"\r\nHost: h\r\n" + connection + b"\r\n"
    (req,) = parse(head).requests
    assert req.keep_alive is keep_alive
    assert req.http10 is (version == b"1.0")


def test_no_body_and_a_chunked_body_are_told_apart() -> None:
    (plain,) = parse(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n").requests
    assert plain.content_length is None and not plain.body_exists and plain.content.is_eof()
    (empty,) = parse(b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 0\r\n\r\n").requests
    assert empty.content_length == 0 and not empty.body_exists
    r = parse(b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n", b"3\r\nabc\r\n")
    (chunked,) = r.requests
    assert chunked.content_length is None and chunked.body_exists
    assert not chunked.content.is_eof() and r.completed == 0
    assert chunked.content.read_nowait() == b"abc"


def test_two_pipelined_requests_in_one_feed() -> None:
    r = parse(
        b"POST /a HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\n\r\nabc"
        b"GET /b?c HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n"
    )
    first, second = r.requests
    assert (first.method, first.path, first.content.read_nowait()) == ("POST", "/a", b"abc")
    assert (second.method, second.path, second.query_string) == ("GET", "/b", "c")
    assert first.keep_alive and not second.keep_alive
    assert r.completed == 2


def test_a_request_split_anywhere_parses_the_same() -> None:
    raw = b"POST /a?q HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n\r\nhello"
    for cut in range(1, len(raw)):
        (req,) = parse(raw[:cut], raw[cut:]).requests
        assert (req.path, req.query_string, req.headers["Host"]) == ("/a", "q", "h")
        assert req.content.read_nowait() == b"hello"


def test_a_target_over_max_field_is_414() -> None:
    assert (
        refused(b"GET /" + b"a" * 200 + b" HTTP/1.1\r\nHost: h\r\n\r\n", max_field=100).status
        == 414
    )
    # Even when it comes in pieces that are each short.
    pieces = [b"GET /"] + [b"a" * 40] * 4
    assert refused(*pieces, max_field=100).status == 414


def test_a_header_field_over_max_field_is_431() -> None:
    raw = b"GET / HTTP/1.1\r\nHost: h\r\nX-Big: " + b"a" * 200 + b"\r\n\r\n"
    assert refused(raw, max_field=100).status == 431


def test_a_header_field_growing_past_max_field_is_refused_as_it_comes() -> None:
    r = FakeReceiver()
    p = RequestParser(r, 100, 10_000)
    p.feed(b"GET / HTTP/1.1\r\nHost: h\r\nX-Big: ")
    with pytest.raises(Refused) as info:
        for _ in range(10):  # 10 x 64 bytes, no end of line: over 100 bytes by the 2nd piece
            p.feed(b"a" * 64)
    assert info.value.status == 431


@pytest.mark.parametrize("encoding", [b"br", b"zstd", b"compress", b"gzip, br"])
def test_an_unknown_content_encoding_is_415(encoding: bytes) -> None:
    raw = (
        b"POST / HTTP/1.1\r\nHost: h\r\nContent-Encoding: "
        + encoding
        + b"\r\nContent-Length: 1\r\n\r\nx"
    )
    assert refused(raw).status == 415


@pytest.mark.parametrize("encoding", [b"gzip", b"x-gzip", b"deflate", b"identity", b"GZIP"])
def test_a_known_content_encoding_is_accepted(encoding: bytes) -> None:
    raw = (
        b"POST / HTTP/1.1\r\nHost: h\r\nContent-Encoding: "
        + encoding
        + b"\r\nContent-Length: 0\r\n\r\n"
    )
    assert len(parse(raw).requests) == 1


def test_content_length_with_transfer_encoding_is_400() -> None:
    raw = (
        b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"3\r\nabc\r\n0\r\n\r\n"
    )
    assert refused(raw).status == 400


def test_a_broken_header_line_is_400() -> None:
    assert refused(b"GET / HTTP/1.1\r\nHost: h\r\nBad Header\r\n\r\n").status == 400


async def test_a_bad_chunk_size_after_the_headers_fails_the_body_read() -> None:
    r = FakeReceiver()
    p = RequestParser(r, 1024, 10_000)
    p.feed(b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
    (req,) = r.requests
    with pytest.raises(Refused) as info:
        p.feed(b"zz\r\n")
    assert info.value.status == 400
    assert p.reading is None and not p.partial
    assert await req.content.readany() == b"abc"  # what came before stays readable
    with pytest.raises(MalformedBody) as bad:
        await req.content.readany()
    assert bad.value.status == 400


# ---------------------------------------------------------------- request bodies


@functools.cache
def gzip_bomb() -> bytes:
    """50 MB of zeros, gzip-compressed (about 50 KB)."""
    c = zlib.compressobj(1, zlib.DEFLATED, 31)
    zeros = bytes(1 << 20)
    return b"".join(c.compress(zeros) for _ in range(50)) + c.flush()


@pytest.mark.parametrize(
    ("encoding", "compress"),
    [
        ("gzip", gzip.compress),
        ("x-gzip", gzip.compress),
        ("deflate", zlib.compress),  # RFC 9110 §8.4.1.2: the zlib format
    ],
)
async def test_an_encoded_body_is_read_decoded(
    encoding: str, compress: Callable[[bytes], bytes]
) -> None:
    plain = b'{"model": "m", "messages": []}' * 100
    encoded = compress(plain)
    b, _ = body(encoding)
    for i in range(0, len(encoded), 7):  # in small pieces, as the wire may give them
        b.feed_data(encoded[i : i + 7])
    b.feed_eof()
    assert await read_all(b) == plain
    assert b.decoded == len(plain) and b.total_bytes == len(encoded)


async def test_a_raw_deflate_body_is_decoded_as_aiohttps_leg_does() -> None:
    c = zlib.compressobj(wbits=-15)
    raw = c.compress(b'{"a": 1}') + c.flush()
    b, _ = body("deflate")
    b.feed_data(raw)
    b.feed_eof()
    assert await read_all(b) == b'{"a": 1}'


async def test_a_gzip_bomb_keeps_at_most_one_byte_over_the_limit() -> None:
    bomb = gzip_bomb()
    b, _ = body("gzip", limit=1001)
    for i in range(0, len(bomb), 16384):
        b.feed_data(bomb[i : i + 16384])
    b.feed_eof()
    assert b.total_bytes == len(bomb)
    assert b.decoded == 1002  # the limit + 1: the handler's size check refuses it
    assert len(await read_all(b)) == 1002


async def test_an_invalid_gzip_body_fails_the_read() -> None:
    b, _ = body("gzip")
    b.feed_data(b"this is not gzip at all")
    b.feed_eof()
    with pytest.raises(MalformedBody) as bad:
        await b.readany()
    assert bad.value.status == 400


async def test_a_body_that_is_not_gzip_is_not_called_cut() -> None:
    """The first fault found is the one the client reads: a body that is not gzip at all says
    so, the end of the request not overwriting it with 'the stream is cut' (found by a
    new-user review: `curl -H 'Content-Encoding: gzip' -d notgzip` was told its stream was
    cut)."""
    b, _ = body("gzip")
    b.feed_data(b"this is not gzip at all")
    b.feed_eof()
    with pytest.raises(MalformedBody, match="not valid gzip or deflate"):
        await b.readany()
    cut, _ = body("gzip")
    cut.feed_data(gzip.compress(b'{"a": 1}')[:-9])  # whole up to its trailer
    cut.feed_eof()
    with pytest.raises(MalformedBody, match="stream is cut"):
        await read_all(cut)


async def test_read_nowait_raises_what_stopped_the_body() -> None:
    b, _ = body("gzip")
    b.feed_data(b"this is not gzip at all")
    b.feed_eof()
    assert b.is_eof()
    with pytest.raises(MalformedBody):
        b.read_nowait()


async def test_reading_pauses_above_the_high_water_mark_and_resumes_when_read() -> None:
    b, r = body()
    b.feed_data(b"x" * READ_HIGH_WATER)
    assert r.pauses == 0
    b.feed_data(b"x")
    assert (r.pauses, r.resumes) == (1, 0)
    b.feed_data(b"x")  # paused once, however much more comes
    assert r.pauses == 1
    assert len(await b.readany()) == READ_HIGH_WATER + 2
    assert (r.pauses, r.resumes) == (1, 1)
    b.feed_data(b"y")
    b.feed_eof()
    assert await read_all(b) == b"y"
    assert (r.pauses, r.resumes) == (1, 1)


async def test_discard_drops_the_body_and_resumes_reading() -> None:
    b, r = body()
    b.feed_data(b"x" * (READ_HIGH_WATER + 1))
    assert r.pauses == 1
    b.discard()
    assert r.resumes == 1
    b.feed_data(b"more")  # counted, never kept
    b.feed_eof()
    assert b.total_bytes == READ_HIGH_WATER + 5
    assert await b.readany() == b""
    assert r.pauses == 1


async def test_expect_100_continue_is_asked_once_on_the_first_wait() -> None:
    b, r = body()
    reader = asyncio.ensure_future(b.readany())
    await asyncio.sleep(0)
    assert r.continues == 1  # the handler waits for the body: ask for it
    b.feed_data(b"ab")
    assert await asyncio.wait_for(reader, 1) == b"ab"
    later = asyncio.ensure_future(b.readany())
    await asyncio.sleep(0)
    b.feed_data(b"c")
    b.feed_eof()
    assert await asyncio.wait_for(later, 1) == b"c"
    assert await b.readany() == b""
    assert r.continues == 1


async def test_no_100_continue_when_the_body_is_already_there() -> None:
    b, r = body()
    b.feed_data(b"ab")
    b.feed_eof()
    assert await read_all(b) == b"ab"
    assert r.continues == 0


@pytest.mark.parametrize(("minor", "asked"), [(1, 1), (0, 0)])
async def test_the_parser_asks_for_100_continue_on_http11_only(minor: int, asked: int) -> None:
    head = (
        b"POST / HTTP/1.%d\r\nHost: h\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n" % minor
    )
    r = parse(head)
    (req,) = r.requests
    reader = asyncio.ensure_future(req.content.readany())
    await asyncio.sleep(0)
    assert r.continues == asked
    reader.cancel()


async def test_a_lost_client_fails_the_body_read() -> None:
    b, _ = body()
    reader = asyncio.ensure_future(b.readany())
    await asyncio.sleep(0)
    b.set_exception(ConnectionResetError("gone"))
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(reader, 1)


# ---------------------------------------------------------------- answers: head and whole


def test_head_bytes_with_a_length() -> None:
    raw = head_bytes(
        200,
        {"Content-Type": "application/json", "X-A": "é"},
        length=12,
        chunked=False,
        close=False,
        http10=False,
    )
    assert raw.endswith(b"\r\n\r\n")
    status, headers, rest = split(raw)
    assert status == b"HTTP/1.1 200 OK" and rest == b""
    assert headers["content-length"] == "12"
    assert headers["content-type"] == "application/json"
    assert headers["x-a"] == "é" and "X-A: \xc3\xa9".encode("latin-1") in raw
    assert "date" in headers and "connection" not in headers and "transfer-encoding" not in headers


def test_head_bytes_chunked_close_and_http10_keep_alive() -> None:
    _, h, _ = split(head_bytes(200, {}, length=None, chunked=True, close=True, http10=False))
    assert h["transfer-encoding"] == "chunked" and h["connection"] == "close"
    assert "content-length" not in h
    _, h, _ = split(head_bytes(200, {}, length=0, chunked=False, close=False, http10=True))
    assert h["connection"] == "keep-alive" and h["content-length"] == "0"
    _, h, _ = split(head_bytes(200, {}, length=0, chunked=False, close=True, http10=True))
    assert h["connection"] == "close"


def test_head_bytes_never_repeats_the_framing_headers_given() -> None:
    given = {
        "Content-Length": "999",
        "transfer-encoding": "gzip, chunked",
        "Connection": "keep-alive",
        "Date": "yesterday",
        "X-Kept": "1",
    }
    status, h, _ = split(head_bytes(429, given, length=5, chunked=False, close=True, http10=False))
    assert status == b"HTTP/1.1 429 Too Many Requests"
    assert h["content-length"] == "5" and "transfer-encoding" not in h
    assert h["connection"] == "close" and h["date"] != "yesterday" and h["x-kept"] == "1"


def test_response_bytes_has_its_length_and_body() -> None:
    resp = Answer(
        body=b'{"ok": true}',
        content_type="application/json",
        headers={"Content-Length": "1", "X-Y": "z"},
    )
    status, h, rest = split(response_bytes(resp, make_request(), close=False))
    assert status == b"HTTP/1.1 200 OK"
    assert rest == b'{"ok": true}' and h["content-length"] == str(len(rest))
    assert h["content-type"].startswith("application/json") and h["x-y"] == "z"
    assert "connection" not in h


def test_response_bytes_closing_and_to_http10() -> None:
    resp = Answer(text="hi")
    _, h, rest = split(response_bytes(resp, make_request(), close=True))
    assert h["connection"] == "close" and rest == b"hi"
    _, h, _ = split(response_bytes(resp, make_request(http10=True), close=False))
    assert h["connection"] == "keep-alive"


def test_response_bytes_to_head_has_the_length_but_no_body() -> None:
    resp = Answer(text="hello")
    status, h, rest = split(response_bytes(resp, make_request(method="HEAD"), close=False))
    assert status == b"HTTP/1.1 200 OK"
    assert h["content-length"] == "5" and rest == b""


@pytest.mark.parametrize("status", [204, 304])
def test_response_bytes_without_a_body_status(status: int) -> None:
    resp = Answer(status=status, body=b"dropped", headers={"Content-Length": "7"})
    raw = response_bytes(resp, make_request(), close=False)
    _, h, rest = split(raw)
    assert rest == b"" and raw.endswith(b"\r\n\r\n")
    assert "content-length" not in h and "transfer-encoding" not in h


def test_response_bytes_gives_a_body_a_content_type() -> None:
    resp = Answer(body=b"\x00\x01")
    resp.headers.popall("Content-Type", None)
    _, h, _ = split(response_bytes(resp, make_request(), close=False))
    assert "content-type" in h


# ---------------------------------------------------------------- answers: streamed


async def test_stream_out_frames_chunks_and_ends_with_the_terminator() -> None:
    link = FakeReceiver()
    req = make_request(link)
    out = req.new_stream(200, {"Content-Type": "text/event-stream"}, None)
    assert isinstance(out, StreamOut)
    await out.prepare(req)
    await out.prepare(req)  # once only
    _, h, rest = split(link.wire)
    assert h["transfer-encoding"] == "chunked" and "content-length" not in h and rest == b""
    head = link.wire
    await out.write(b"data: 1\n\n")
    await out.write(b"")  # nothing: no empty chunk (it would end the body)
    await out.write(b"x" * 300)
    await out.write_eof()
    await out.write_eof()  # once only
    assert link.wire[len(head) :] == (
        b"9\r\ndata: 1\n\n\r\n" + b"12c\r\n" + b"x" * 300 + b"\r\n" + b"0\r\n\r\n"
    )
    assert out.ended and not out.close


async def test_stream_out_write_eof_with_data_prepares_and_ends() -> None:
    link = FakeReceiver()
    out = make_request(link).new_stream(200, {}, None)
    await out.write_eof(b"abc")
    assert link.wire.endswith(b"\r\n\r\n3\r\nabc\r\n0\r\n\r\n")


async def test_stream_out_with_a_length_is_not_chunked() -> None:
    link = FakeReceiver()
    req = make_request(link)
    out = req.new_stream(200, {"Content-Length": "1", "Transfer-Encoding": "chunked"}, 6)
    await out.prepare(req)
    await out.write(b"abc")
    await out.write_eof(b"def")
    _, h, rest = split(link.wire)
    assert h["content-length"] == "6" and "transfer-encoding" not in h
    assert rest == b"abcdef"


async def test_stream_out_to_http10_is_not_chunked_and_closes() -> None:
    link = FakeReceiver()
    req = make_request(link, http10=True, keep_alive=True)
    out = req.new_stream(200, {}, None)
    await out.prepare(req)
    await out.write(b"abc")
    await out.write_eof()
    _, h, rest = split(link.wire)
    assert "transfer-encoding" not in h and "content-length" not in h
    assert h["connection"] == "close" and out.close
    assert rest == b"abc"  # the end of the body is the end of the connection


async def test_stream_out_to_http10_with_a_length_keeps_alive() -> None:
    link = FakeReceiver()
    req = make_request(link, http10=True, keep_alive=True)
    out = req.new_stream(200, {}, 2)
    await out.write_eof(b"ok")
    _, h, rest = split(link.wire)
    assert h["connection"] == "keep-alive" and h["content-length"] == "2" and rest == b"ok"
    assert not out.close


async def test_stream_out_to_head_sends_no_body() -> None:
    link = FakeReceiver()
    req = make_request(link, method="HEAD")
    out = req.new_stream(200, {}, None)
    await out.prepare(req)
    await out.write(b"abc")
    await out.write_eof()
    _, h, rest = split(link.wire)
    assert rest == b"" and "transfer-encoding" not in h


async def test_stream_out_waits_for_a_slow_client_only() -> None:
    link = FakeReceiver()
    out = make_request(link).new_stream(200, {}, None)
    await out.prepare(None)
    await out.write(b"a")
    assert link.drains == 0  # the client takes it: no wait
    link.write_paused = True
    writing = asyncio.ensure_future(out.write(b"b"))
    await asyncio.sleep(0)
    assert not writing.done() and link.drains == 1 and link.wire.endswith(b"1\r\nb\r\n")
    link.write_paused = False
    link.taken.set()
    await asyncio.wait_for(writing, 1)


async def test_stream_out_to_a_lost_client_raises() -> None:
    link = FakeReceiver()
    req = make_request(link)
    out = req.new_stream(200, {}, None)
    await out.prepare(req)
    link.lost = True
    with pytest.raises(ConnectionResetError):
        await out.write(b"x")
    gone = make_request(link).new_stream(200, {}, None)
    with pytest.raises(ConnectionResetError):
        await gone.prepare(None)


async def test_respond_writes_the_answer_whole_and_refuses_more() -> None:
    link = FakeReceiver()
    req = make_request(link)
    resp = Answer(text="hi", headers={"x-a": "1"})
    out = req.respond(resp)
    assert isinstance(out, Answered) and out.prepared and out.ended and not out.close
    assert link.wire == response_bytes(resp, req, close=False)
    await out.prepare(req)
    await out.write_eof()
    with pytest.raises(RuntimeError):
        await out.write(b"more")
    assert link.wire == response_bytes(resp, req, close=False)  # nothing more was sent
    link.lost = True
    with pytest.raises(ConnectionResetError):
        make_request(link).respond(resp)


# ---------------------------------------------------------------- a connection on a fake transport


class FakeTransport:
    """What a :class:`ClientConnection` uses of its transport, recorded."""

    def __init__(self) -> None:
        self.out = b""
        self.closing = False
        self.reading = True

    def write(self, data: bytes) -> None:
        assert not self.closing
        self.out += data

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


Route = Callable[[Any], Awaitable[Any]]


def connection(handler: Route) -> tuple[ClientConnection, FakeTransport, list[str]]:
    """A connection whose every request goes to ``handler``, on a fake transport; the list of
    what its counters counted."""
    counted: list[str] = []
    config = LegConfig(
        route=lambda _req: handler,
        header_timeout=30.0,
        keepalive_timeout=30.0,
        max_field=1024,
        decoded_limit=10_000,
        on_timeout=lambda: counted.append("timeout"),
        on_malformed=lambda: counted.append("malformed"),
        draining=lambda: False,
        connections=set(),
    )
    conn = ClientConnection(config)
    t = FakeTransport()
    conn.connection_made(t)  # type: ignore[arg-type]
    return conn, t, counted


async def settle() -> None:
    """Let the connection's handler tasks run (a few loop turns; no sleeping)."""
    for _ in range(20):
        await asyncio.sleep(0)


def statuses(raw: bytes) -> list[bytes]:
    """The status codes of the answers in ``raw`` (bodies here never hold a status line)."""
    return re.findall(rb"HTTP/1\.1 (\d{3}) ", raw)


async def test_pipelined_requests_are_answered_in_order() -> None:
    released = asyncio.Event()

    async def handler(req: Any) -> Answer:
        if req.path == "/slow":
            await released.wait()
        return Answer(text=req.path)

    conn, t, _ = connection(handler)
    conn.data_received(
        b"GET /slow HTTP/1.1\r\nHost: h\r\n\r\nGET /a HTTP/1.1\r\nHost: h\r\n\r\n"
        b"GET /b HTTP/1.1\r\nHost: h\r\n\r\n"
    )
    await settle()
    assert t.out == b""  # the first one holds the others' answers back
    released.set()
    await settle()
    bodies = [part.partition(b"\r\n\r\n")[2] for part in t.out.split(b"HTTP/1.1 ")[1:]]
    assert bodies == [b"/slow", b"/a", b"/b"]
    assert not t.closing and conn.idle
    conn.connection_lost(None)


async def test_malformed_request_gets_an_openai_400_and_the_connection_closes() -> None:
    async def handler(req: Any) -> Answer:
        return Answer(text="ok")

    conn, t, counted = connection(handler)
    conn.data_received(
        b"GET /a HTTP/1.1\r\nHost: h\r\n\r\nGET / HTTP/1.1\r\nHost: h\r\nBad Header\r\n\r\n"
    )
    await settle()
    assert statuses(t.out) == [b"200", b"400"]  # what came before it answered first
    assert b'"code":"malformed_http"' in t.out.replace(b" ", b"")
    assert t.closing and counted == ["malformed"]
    conn.connection_lost(None)


async def test_an_upgrade_request_is_served_plainly_and_the_connection_closes() -> None:
    async def handler(req: Any) -> Answer:
        return Answer(text=req.path)

    conn, t, counted = connection(handler)
    conn.data_received(
        b"GET /ws HTTP/1.1\r\nHost: h\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
        b"GET /never HTTP/1.1\r\nHost: h\r\n\r\n"  # after an upgrade: not HTTP, never parsed
    )
    await settle()
    status, h, rest = split(t.out)
    assert status == b"HTTP/1.1 200 OK" and rest == b"/ws"
    assert h["connection"] == "close" and t.closing and counted == []
    conn.connection_lost(None)


async def test_client_gone_cancels_the_handler() -> None:
    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def handler(req: Any) -> Answer:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        raise AssertionError("never reached")

    conn, t, _ = connection(handler)
    conn.data_received(b"GET /a HTTP/1.1\r\nHost: h\r\n\r\n")
    await asyncio.wait_for(started.wait(), 1)
    conn.connection_lost(None)
    await asyncio.wait_for(cancelled.wait(), 1)
    await settle()
    assert conn.task is None and t.out == b""


async def test_an_answer_before_an_unfinished_body_closes_after_lingering() -> None:
    async def handler(req: Any) -> Answer:
        return Answer(status=415, text="no")  # the body never read

    conn, t, _ = connection(handler)
    conn.data_received(b"POST /a HTTP/1.1\r\nHost: h\r\nContent-Length: 10\r\n\r\nabc")
    await settle()
    _, h, _ = split(t.out)
    assert statuses(t.out) == [b"415"] and h["connection"] == "close"
    assert not t.closing  # the rest of the body is read (and dropped) first
    conn.data_received(b"defghij")
    assert t.closing
    conn.connection_lost(None)


async def test_an_unread_whole_body_over_the_high_water_mark_does_not_stall_the_connection() -> (
    None
):
    async def handler(req: Any) -> Answer:
        return Answer(status=415, text="no")  # the body never read

    conn, t, _ = connection(handler)
    big = b"x" * (READ_HIGH_WATER + 1)
    conn.data_received(
        b"POST /a HTTP/1.1\r\nHost: h\r\nContent-Length: %d\r\n\r\n%s" % (len(big), big)
    )
    await settle()
    _, h, _ = split(t.out)
    assert statuses(t.out) == [b"415"]
    assert "connection" not in h and not t.closing  # kept alive ...
    assert t.reading  # ... so it must read the next request
    conn.connection_lost(None)


def test_a_cut_gzip_stream_fails_the_read_instead_of_reading_as_whole() -> None:
    whole = gzip.compress(b'{"model": "m", "messages": []}' * 50)
    body = BodyStream("gzip", 1 << 20, lambda: None, lambda: None)
    body.feed_data(whole[: len(whole) // 2])
    body.feed_eof()
    with pytest.raises(MalformedBody, match="cut"):
        body.read_nowait()
    ok = BodyStream("gzip", 1 << 20, lambda: None, lambda: None)
    ok.feed_data(whole)
    ok.feed_eof()
    assert ok.read_nowait() == b'{"model": "m", "messages": []}' * 50


# ---------------------------------------------------------------- a new user's findings


def test_an_http11_request_without_host_is_400() -> None:
    assert refused(b"GET /healthz HTTP/1.1\r\n\r\n").status == 400
    (req,) = parse(b"GET /healthz HTTP/1.0\r\n\r\n").requests  # HTTP/1.0 needs none
    assert req.path == "/healthz"


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (b"/v1/chat/completions#f", ("/v1/chat/completions", "")),
        (b"/a?b=1#f", ("/a", "b=1")),
        (b"*", ("*", "")),
        (b"host:443", ("host:443", "")),
    ],
)
def test_a_target_loses_its_fragment_and_a_non_path_stays_as_sent(
    url: bytes, expected: tuple[str, str]
) -> None:
    assert target(url) == expected


def test_an_absolute_target_that_is_not_a_url_is_400() -> None:
    with pytest.raises(Refused) as exc:
        target(b"http://host:port/a")
    assert exc.value.status == 400


async def test_an_upgrade_requests_body_is_read_past_where_llhttp_stops() -> None:
    """``curl --http2`` on http:// sends ``Upgrade: h2c``: llhttp stops after the headers; the
    body still reaches the handler (the upgrade is ignored) and the connection then closes."""
    head = (
        b"POST /p HTTP/1.1\r\nHost: h\r\nConnection: Upgrade, HTTP2-Settings\r\n"
        b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\nContent-Length: 11\r\n\r\n"
    )

    async def handler(req: Any) -> Answer:
        body = b"".join([chunk async for chunk in req.content.iter_any()])
        return Answer(body=body)

    for pieces in ([head + b"hello world"], [head + b"hello", b" world"], [head, b"hello world"]):
        conn, t, _ = connection(handler)
        for piece in pieces:
            conn.data_received(piece)
            await settle()
        assert t.out.endswith(b"\r\n\r\nhello world"), (pieces, t.out)
        assert t.closing
        conn.connection_lost(None)


def test_a_multi_member_gzip_body_is_read_whole() -> None:
    data = gzip.compress(b"hello ") + gzip.compress(b"world")
    body = BodyStream("gzip", 1 << 20, lambda: None, lambda: None)
    body.feed_data(data)
    body.feed_eof()
    assert body.read_nowait() == b"hello world"


def test_bytes_after_a_gzip_or_deflate_stream_are_refused() -> None:
    for encoding, data in (
        ("gzip", gzip.compress(b"hello") + b"garbage!"),
        ("deflate", zlib.compress(b"hello") + b"garbage!"),
    ):
        body = BodyStream(encoding, 1 << 20, lambda: None, lambda: None)
        body.feed_data(data)
        body.feed_eof()
        with pytest.raises(MalformedBody):
            body.read_nowait()


async def test_an_answer_the_handler_writes_goes_out_before_it_returns() -> None:
    """``answer_now`` from the handler (an admitted request's, before its release): the same
    bytes as the answer returned, sent while the handler still runs; pipelining and keep-alive
    as before."""
    seen: list[bytes] = []

    async def handler(req: Any) -> Any:
        out = answer_now(req, Answer(text=req.path, headers={"x-a": "1"}))
        seen.append(t.out)  # what the client has, before the handler goes on
        await asyncio.sleep(0)
        return out

    async def returned(req: Any) -> Answer:
        return Answer(text=req.path, headers={"x-a": "1"})

    requests = b"GET /a HTTP/1.1\r\nHost: h\r\n\r\nGET /b HTTP/1.1\r\nHost: h\r\n\r\n"
    conn, t, _ = connection(handler)
    conn.data_received(requests)
    await settle()
    plain, tp, _ = connection(returned)
    plain.data_received(requests)
    await settle()
    assert t.out == tp.out and statuses(t.out) == [b"200", b"200"]
    assert seen[0].endswith(b"\r\n\r\n/a") and seen[1] == t.out
    assert not t.closing and conn.idle
    conn.connection_lost(None)
    plain.connection_lost(None)


async def test_a_handler_failing_after_its_answer_leaves_it_whole() -> None:
    async def handler(req: Any) -> Any:
        answer_now(req, Answer(text="done"))
        raise RuntimeError("after the answer")

    conn, t, _ = connection(handler)
    conn.data_received(b"GET /a HTTP/1.1\r\nHost: h\r\n\r\n")
    await settle()
    assert statuses(t.out) == [b"200"] and t.out.endswith(b"done")  # no 500 after it
    assert t.closing
    conn.connection_lost(None)


def test_an_answer_is_kvgates_own_holder_of_status_headers_and_body() -> None:
    """``Answer`` (issue 35: no longer aiohttp's ``web.Response``): text gives a UTF-8 body and
    a text/plain type, headers are case-insensitive and mutable, ``force_close`` closes after."""
    a = Answer(text="héllo", headers={"x-a": "1"})
    assert (a.status, a.body, a.text) == (200, "héllo".encode(), "héllo")
    assert a.headers["Content-Type"] == "text/plain; charset=utf-8" and a.headers["X-A"] == "1"
    assert a.keep_alive is None
    a.force_close()
    assert a.keep_alive is False
    _, h, rest = split(response_bytes(a, make_request(), close=True))
    assert rest == "héllo".encode() and h["content-length"] == str(len(rest))
    assert Answer(404).body == b""
    with pytest.raises(ValueError, match="not both"):
        Answer(body=b"x", text="y")
    with pytest.raises(ValueError, match="twice"):
        Answer(body=b"{}", content_type="application/json", headers={"content-type": "x"})
