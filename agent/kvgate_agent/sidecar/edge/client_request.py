"""A client's request as kvgate's own server leg hands it to the pipeline (:class:`Request`), and
the answers it writes straight to the connection: a finished ``Answer`` serialised whole
(:func:`response_bytes`; by the connection once the handler returns it, or by the handler
itself, :meth:`Request.respond`, which answers with the :class:`Answered` it gets back), or a
stream (:class:`StreamOut`) whose chunks are framed and written as they come, one transport
write per chunk and no per-chunk object.

The connection itself (parsing, deadlines, keep-alive, order of pipelined answers) is
:class:`~kvgate_agent.sidecar.edge.client_conn.ClientConnection`'s; what a request and its writer
need of it is :class:`Link`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from email.utils import formatdate
from functools import cached_property
from http import HTTPStatus
from typing import Any, Protocol

from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from kvgate_agent.sidecar.edge.client_body import BodyStream
from kvgate_agent.sidecar.reading import Answer

__all__ = ["Answered", "Link", "Request", "StreamOut", "response_bytes"]


class Link(Protocol):
    """What a request's writer needs of its connection."""

    @property
    def lost(self) -> bool:
        """The client's connection is gone."""
        ...

    @property
    def write_paused(self) -> bool:
        """The client is slow to take what was written: await :meth:`drain`."""
        ...

    def send(self, data: bytes) -> None:
        """Write ``data`` to the client (dropped once the connection is lost)."""
        ...

    async def drain(self) -> None:
        """Until the client has taken what was written (above the transport's high-water
        mark); raises ``ConnectionResetError`` when it goes away meanwhile."""
        ...

    def answer(self, req: Request, resp: Answer) -> bool:
        """Write ``resp`` (finished) in answer to ``req`` (:func:`response_bytes`, one write);
        whether the connection closes after it (then its head says so)."""
        ...


_REASONS = {int(s): s.phrase.encode() for s in HTTPStatus}
#: Header fields the writer sets itself (lower case): never copied from the answer given.
_FRAMING = frozenset({"content-length", "transfer-encoding", "connection", "date"})
_date_second = -1
_date_header = b""


def _date() -> bytes:
    """``Date: ...\\r\\n`` (RFC 9110 §6.6.1), formatted once per second."""
    global _date_second, _date_header
    now = int(time.time())
    if now != _date_second:
        _date_second = now
        _date_header = b"Date: " + formatdate(now, usegmt=True).encode() + b"\r\n"
    return _date_header


def head_bytes(
    status: int,
    headers: Mapping[str, str],
    *,
    length: int | None,
    chunked: bool,
    close: bool,
    http10: bool,
) -> bytes:
    """The status line and headers of an answer: ``headers`` as given (but the framing ones,
    which this writes: ``Content-Length: length`` or ``Transfer-Encoding: chunked``), ``Date``,
    and ``Connection: close`` when the connection ends after it (``keep-alive`` for an
    HTTP/1.0 client that keeps it)."""
    reason = _REASONS.get(status, b"Unknown")
    skip = _FRAMING
    fields = "".join([f"{k}: {v}\r\n" for k, v in headers.items() if k.lower() not in skip])
    parts = [
        b"HTTP/1.1 %d %s\r\n" % (status, reason),
        _date(),
        fields.encode("utf-8", "surrogateescape"),
    ]
    if length is not None:
        parts.append(b"Content-Length: %d\r\n" % length)
    elif chunked:
        parts.append(b"Transfer-Encoding: chunked\r\n")
    if close:
        parts.append(b"Connection: close\r\n")
    elif http10:
        parts.append(b"Connection: keep-alive\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


def _no_body(status: int) -> bool:
    return status < 200 or status in (204, 304)


def response_bytes(resp: Answer, request: Request, close: bool) -> bytes:
    """``resp`` (finished: status, headers, body bytes) as it goes on the wire in answer to
    ``request`` (no body for HEAD, 1xx, 204 and 304; ``Content-Length`` otherwise)."""
    data = resp.body
    headers: Mapping[str, str] = resp.headers
    if data and "Content-Type" not in headers:
        headers = {**headers, "Content-Type": "application/octet-stream"}
    no_body = _no_body(resp.status)
    head = head_bytes(
        resp.status,
        headers,
        length=None if no_body else len(data),
        chunked=False,
        close=close,
        http10=request.http10,
    )
    if no_body or request.method == "HEAD":
        return head
    return head + data


class StreamOut:
    """A streamed answer written straight to the client's connection (see
    :class:`~kvgate_agent.sidecar.edge.wire.ResponseStream`): chunked unless its length is known
    (then as is; an HTTP/1.0 client gets the bytes and the connection's end).

    ``ended``: the body was ended (:meth:`write_eof`); an answer handed back unended leaves
    the connection to be closed, so the client never takes a cut body for a whole one."""

    __slots__ = (
        "_chunked",
        "_head_only",
        "_link",
        "_request",
        "close",
        "content_length",
        "ended",
        "headers",
        "prepared",
        "status",
    )

    def __init__(
        self,
        link: Link,
        request: Request,
        status: int,
        headers: Mapping[str, str],
        content_length: int | None,
    ) -> None:
        self._link = link
        self._request = request
        self.status = status
        self.headers: CIMultiDict[str] = CIMultiDict(headers)
        self.content_length = content_length
        self.prepared = False
        self.ended = False
        self.close = not request.keep_alive
        self._head_only = request.method == "HEAD" or _no_body(status)
        self._chunked = False

    def force_close(self) -> None:
        """Close the connection once this answer ends."""
        self.close = True

    async def prepare(self, request: Any = None) -> None:
        """Send the status line and headers; raises ``ConnectionResetError`` when the client is
        gone."""
        if self.prepared:
            return
        link = self._link
        if link.lost:
            raise ConnectionResetError("the client closed the connection")
        http10 = self._request.http10
        length = self.content_length
        self._chunked = length is None and not http10 and not self._head_only
        if length is None and http10 and not self._head_only:
            self.close = True  # an HTTP/1.0 body without a length ends with the connection
        link.send(
            head_bytes(
                self.status,
                self.headers,
                length=length,
                chunked=self._chunked,
                close=self.close,
                http10=http10,
            )
        )
        self.prepared = True

    async def write(self, data: bytes) -> None:
        """Send ``data`` (one transport write, framed as a chunk when chunked); waits while the
        client is slow to take it; raises ``ConnectionResetError`` when the client is gone."""
        link = self._link
        if link.lost:
            raise ConnectionResetError("the client closed the connection")
        if not data or self._head_only:
            return
        link.send(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)
        if link.write_paused:
            await link.drain()

    async def write_eof(self, data: bytes = b"") -> None:
        """Send ``data`` and end the body (the last chunk when chunked)."""
        if self.ended:
            return
        if not self.prepared:
            await self.prepare()
        if data:
            await self.write(data)
        if self._chunked and not self._link.lost:
            self._link.send(b"0\r\n\r\n")
        self.ended = True


class Answered:
    """A finished answer the handler already wrote whole (:meth:`Request.respond`), handed back
    as its answer (a :class:`~kvgate_agent.sidecar.edge.wire.ResponseStream`, ended): nothing
    more may be written. ``close``: the connection closes after it."""

    __slots__ = ("close", "ended", "headers", "prepared", "status")

    def __init__(self, status: int, headers: Mapping[str, str], close: bool) -> None:
        self.status = status
        self.headers = headers
        self.close = close
        self.prepared = True
        self.ended = True

    def force_close(self) -> None:
        """Close the connection after it (its head, already sent, may not say so)."""
        self.close = True

    async def prepare(self, request: Any = None) -> None:
        """Sent already: nothing to do."""

    async def write(self, data: bytes) -> None:
        """Refused: the answer was written whole."""
        raise RuntimeError("the answer was already written whole")

    async def write_eof(self, data: bytes = b"") -> None:
        """Ended already: nothing more to send (``data`` is refused)."""
        if data:
            raise RuntimeError("the answer was already written whole")


class Request:
    """A client's request as the own leg parsed it (see
    :class:`~kvgate_agent.sidecar.edge.wire.ClientRequest`).

    Args:
        link: its connection.
        method: the method, e.g. ``POST``.
        raw_path: the target's path as sent (an absolute-form target's path; "/" when empty).
        query: the target's query as sent, without ``?`` ("" when none).
        headers: its header fields, in order (names and values as UTF-8 text).
        body: its body (ended at once when it has none).
        http10: an HTTP/1.0 request.
        keep_alive: the connection may carry another request after this one.
        content_length: the declared ``Content-Length`` (bytes), or None.
        has_body: a length or chunked framing was declared.
    """

    __slots__ = (
        "__dict__",
        "_link",
        "body_exists",
        "content",
        "content_length",
        "headers",
        "http10",
        "keep_alive",
        "method",
        "path",
        "query_string",
    )

    def __init__(
        self,
        link: Link,
        method: str,
        raw_path: str,
        query: str,
        headers: CIMultiDict[str],
        body: BodyStream,
        *,
        http10: bool,
        keep_alive: bool,
        content_length: int | None,
        has_body: bool,
    ) -> None:
        self._link = link
        self.method = method
        self.path = raw_path
        self.query_string = query
        self.headers = CIMultiDictProxy(headers)
        self.content = body
        self.http10 = http10
        self.keep_alive = keep_alive
        self.content_length = content_length
        self.body_exists = has_body

    @property
    def path_qs(self) -> str:
        """The path and the query as sent."""
        return self.path + "?" + self.query_string if self.query_string else self.path

    @cached_property
    def rel_url(self) -> URL:
        """The target as sent (relative; an absolute-form target's path and query)."""
        return URL.build(path=self.path, query_string=self.query_string, encoded=True)

    def new_stream(
        self, status: int, headers: Mapping[str, str], content_length: int | None
    ) -> StreamOut:
        """The writer of this request's streamed answer (its head is sent by ``prepare``)."""
        return StreamOut(self._link, self, status, headers, content_length)

    def respond(self, resp: Answer) -> Answered:
        """Write ``resp`` (finished) now, as the connection would once the handler returned it
        (the same bytes, one write), so that what the handler does after it (an admitted
        request's release) is off the client's latency; the handler answers with what this
        returns. Raises ``ConnectionResetError`` when the client is gone."""
        link = self._link
        if link.lost:
            raise ConnectionResetError("the client closed the connection")
        return Answered(resp.status, resp.headers, link.answer(self, resp))
