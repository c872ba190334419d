"""The sidecar's connections: bounds on slow clients (slow-loris), the time a connection may
take to send a request's headers, enforced per connection, and an OpenAI-style answer to a
request aiohttp's HTTP parser refuses.

aiohttp's server has no header timeout of its own (the ``slow_request_timeout`` of its early
versions, https://github.com/aio-libs/aiohttp/issues/1198, is gone): a client that trickles
header bytes, or opens a connection and sends nothing, holds a socket and a parser for as long
as the keep-alive timeout (3630 s by default in aiohttp 3.14). :class:`GuardedAppRunner` serves an
application through :class:`HeaderDeadlineHandler`, which closes a connection whose request
headers are not complete within ``header_timeout`` seconds, counted, as hyper's
``header_read_timeout`` does (https://github.com/hyperium/hyper/pull/2675), from the moment the
connection opens (first request) or from the first byte of a later request on a kept-alive
connection. An idle kept-alive connection (no byte of a next request) is left to aiohttp's
keep-alive timeout (:data:`KEEPALIVE_TIMEOUT_S` here). The time to send the body is bounded by
the handler reading it (see ``SidecarSettings.body_timeout_seconds``).

A request the parser refuses before any handler runs (a malformed request line or header,
``Content-Length`` together with ``Transfer-Encoding``: request smuggling, RFC 9112 §6.3) gets
its 4xx with an OpenAI error body (``code: malformed_http``) instead of aiohttp's plain text, and
the connection is closed; it never reaches the model server. On the port serving clients that
answer, and the 408 of a header deadline, carry ``x-kvgate-decision: rejected`` and
``x-kvgate-reason: invalid_request`` as kvgate's other refusals do, and a malformed request
counts as one (``on_malformed``).

A client that shuts its sending side once its request is out (a half-close, ``shutdown(SHUT_WR)``)
gets its answer, as on kvgate's own leg: aiohttp's server closes the connection at a FIN
(``RequestHandler.eof_received`` lets asyncio close the transport, and the handler is cancelled),
so :class:`HeaderDeadlineHandler` keeps it open while a complete request is still to be answered,
and asks whether the client is still there the way
:meth:`~kvgate_agent.sidecar.edge.client_transport.ClientTransport.watch_half_closed` does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from aiohttp import HttpVersion11, web
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from kvgate_agent.sidecar.edge.client_listener import KEEPALIVE_TIMEOUT_S
from kvgate_agent.sidecar.edge.client_transport import STILL_THERE, PeerWatch
from kvgate_agent.sidecar.reading import responses

__all__ = ["KEEPALIVE_TIMEOUT_S", "GuardedAppRunner", "HeaderDeadlineHandler", "track_requests"]


#: What a connection that ran out of time gets before it is closed (RFC 9110 §15.5.9): 408 with
#: an OpenAI error body, on the admin port.
_TIMEOUT_RESPONSE = responses.header_deadline_answer(client=False)
#: The same on the port serving clients, with kvgate's refusal headers.
_CLIENT_TIMEOUT_RESPONSE = responses.header_deadline_answer(client=True)


class HeaderDeadlineHandler(RequestHandler):
    """aiohttp's per-connection protocol with a deadline on reading request headers.

    The deadline (``header_timeout`` seconds) is armed when the connection opens and, on a
    kept-alive connection, when the first byte of the next request arrives; it is disarmed when
    a request's headers are complete and its handler starts (:meth:`request_started`, called by
    :func:`track_requests`). The first bytes of a pipelined next request that came with or
    during the one being handled (counted in :meth:`data_received`) arm it when that one ends
    (:meth:`request_finished`), as no further byte may come to arm it. When it fires, the
    connection is closed, after a 408 with an OpenAI error body if part of a request had come
    (a connection that sent nothing is closed silently, as Go's ``ReadHeaderTimeout`` does: an
    unasked 408 could be read as the answer to a request sent just then), and ``on_timeout``
    (a metric's ``inc``) is called. ``on_malformed`` is called for each request the parser
    refuses (a 4xx, :meth:`handle_error`); None on a port not serving clients (the admin
    port): its answers then carry no ``x-kvgate-*`` header. A FIN with a complete request still
    to answer is a half-close: see :meth:`eof_received`.
    """

    __slots__ = (
        "_half_closed",
        "_header_timeout",
        "_header_timer",
        "_in_request",
        "_last",
        "_on_malformed",
        "_on_timeout",
        "_partial",
        "_peer",
        "_pending",
        "_tail",
    )

    def __init__(
        self,
        manager: web.Server,
        *,
        header_timeout: float,
        on_timeout: Callable[[], None],
        on_malformed: Callable[[], None] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(manager, **kwargs)
        self._header_timeout = header_timeout
        self._on_timeout = on_timeout
        self._on_malformed = on_malformed
        self._header_timer: asyncio.TimerHandle | None = None
        self._in_request = False
        self._partial = False  # bytes of the awaited request have come
        self._tail = False  # the parser holds part of a request not yet complete (pipelined)
        self._last: tuple[Any, StreamReader] | None = None  # the last request parsed, its body
        self._half_closed = False  # the client shut its sending side: close after the answers
        self._peer: PeerWatch | None = None  # a half-closed client's socket, watched for a reset
        #: Requests parsed whose answers are not yet written (pipelined ones included).
        self._pending = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if not data:  # aiohttp feeds b"" to resume a parser it paused (a full queue)
            queued = len(self._messages)
            super().data_received(data)
            if len(self._messages) > queued:  # held requests came out: their bytes unknown
                self._last, self._tail = self._messages[-1], False
                self._pending += len(self._messages) - queued
            return
        if not self._in_request:
            if self._header_timer is None:
                self._arm()  # the first byte of a next request on a kept-alive connection
            self._partial = True
        last = self._last
        open_body = last is not None and not last[1].is_eof()
        before = last[1].total_bytes if last is not None and open_body else 0
        queued = len(self._messages)
        super().data_received(data)
        body = 0  # bytes of data that ended a body begun in an earlier read
        if last is not None and open_body:
            body = -1 if _uncountable(last[0]) else last[1].total_bytes - before
        new = list(self._messages)[queued:]
        if new:
            self._last = new[-1]
            self._pending += len(new)
        self._tail = _leftover(data, body, new)

    def _leftover_seen(self) -> bool:
        """Part of a next request is held by the parser and no complete one is queued."""
        return self._tail and not self._messages

    # asyncio.Protocol's eof_received returns whether to keep the transport; aiohttp's says None.
    def eof_received(self) -> bool:  # type: ignore[override]
        """The client shut its sending side. With complete requests still to answer (parsed,
        their answers not yet written: :attr:`_pending`), the last one's body all in and no
        byte of the one being handled's answer sent, a half-close: the connection stays open
        to answer them, then closes (:meth:`finish_response`). A client gone whole sends the
        same FIN: an HTTP/1.1 one is asked with an interim ``100 Continue``, which a closed
        socket answers with a reset, and the socket is watched for it
        (:class:`~kvgate_agent.sidecar.edge.client_transport.PeerWatch`: the connection is
        aborted, its handler cancelled). Otherwise (nothing complete to answer, a body cut
        short, an answer begun: the client leaving) False: closed now, as aiohttp does."""
        transport, last, current = self.transport, self._last, self._current_request
        if self._half_closed:  # said again (uvloop re-reads the EOF when reading resumes)
            return transport is not None
        if transport is None or self._pending <= 0 or last is None:
            return False
        if not last[1].is_eof():
            return False
        if current is not None and current.writer.output_size > 0:
            return False
        self._half_closed = True
        if getattr(last[0], "version", HttpVersion11) >= HttpVersion11:
            transport.write(STILL_THERE)  # no 1xx to an HTTP/1.0 client (RFC 9110 §15.2)
        self._peer = PeerWatch(self._loop, transport)
        return True

    async def finish_response(
        self, request: BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        """aiohttp's, then one answer fewer to write; a half-closed client's connection closes
        once its last answer is written."""
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self._pending -= 1
            if self._half_closed and self._pending <= 0:
                self.close()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        if self._peer is not None:
            self._peer.cancel()
            self._peer = None
        super().connection_lost(exc)

    def request_started(self) -> None:
        """A request's headers are complete and its handler runs: no header deadline now."""
        self._in_request = True
        self._partial = False
        self._disarm()

    def request_finished(self, body_read: bool) -> None:
        """The handler returned: the next byte on this connection starts a new deadline. When
        the handler left part of the body unread (``body_read`` False: a refusal, a body that
        came too slowly), aiohttp goes on reading it before the next request ("lingering"):
        that gets the same deadline, then the connection is closed."""
        self._in_request = False
        if not body_read:
            self._arm(headers=False)
        elif self._leftover_seen() and self._header_timer is None:
            # A pipelined next request's first bytes came with or during this one: its
            # header deadline starts now (no further byte may come to start it).
            self._partial = True
            self._arm()

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp's answer when its parser refuses a request (4xx): an OpenAI error body
        (:func:`responses.malformed_http`), ``on_malformed`` called, and the connection
        closed. Other statuses (a handler's crash, 500) keep aiohttp's answer."""
        if not 400 <= status < 500:
            return super().handle_error(request, status, exc, message)
        self.logger.debug("malformed HTTP request from %s: %s", request.remote, exc)
        if request.writer.output_size > 0:
            raise ConnectionError("a response was already sent: the connection is broken")
        text = message or HTTPStatus(status).phrase
        client = self._on_malformed is not None
        resp = responses.malformed_http(status, text, client=client)
        if self._on_malformed is not None:
            self._on_malformed()
        resp.force_close()
        return resp

    def _arm(self, *, headers: bool = True) -> None:
        if self._header_timeout > 0:
            self._header_timer = self._loop.call_later(self._header_timeout, self._expired, headers)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expired(self, headers: bool) -> None:
        """The deadline passed: ``headers`` True while waiting for request headers (408 and
        ``on_timeout``), False while lingering over an unread body (its answer was sent)."""
        self._header_timer = None
        if self._in_request:
            return
        transport = self.transport
        if headers:
            self._on_timeout()
            if self._partial and transport is not None and not transport.is_closing():
                client = self._on_malformed is not None
                transport.write(_CLIENT_TIMEOUT_RESPONSE if client else _TIMEOUT_RESPONSE)
        self.force_close()


def _leftover(data: bytes, body: int, messages: list[Any]) -> bool:
    """``data`` (one read) holds bytes past its last complete request: the start of a next
    request whose headers are not complete. ``body``: bytes of ``data`` that ended the body of
    a request parsed earlier (0: none; -1: unknown); ``messages``: the requests completed by
    ``data``, in order. Counted only when every length is known (no chunked or compressed
    body, which the parser's counts do not give on the wire): an unknown is False, so the
    header deadline is never armed on an idle connection by mistake."""
    if body < 0:
        return False
    pos = body
    for msg, payload in messages:
        if _uncountable(msg):
            return False
        end = data.find(b"\r\n\r\n", pos)  # a header block holds no empty line
        if end < 0:
            return False  # the block began in an earlier read: its length is unknown here
        pos = end + 4 + payload.total_bytes
    return pos < len(data)


def _uncountable(msg: Any) -> bool:
    """The body's bytes on the wire are not what the parser fed (chunked, compressed), or
    ``msg`` is the parser's error, not a request."""
    return getattr(msg, "chunked", True) or getattr(msg, "compression", None) is not None


class _GuardedServer(web.Server):
    """aiohttp's connection factory, building :class:`HeaderDeadlineHandler` connections."""

    def __init__(
        self,
        inner: web.Server,
        header_timeout: float,
        on_timeout: Callable[[], None],
        on_malformed: Callable[[], None] | None,
    ) -> None:
        super().__init__(
            inner.request_handler,
            request_factory=inner.request_factory,
            handler_cancellation=inner.handler_cancellation,
            # The handler settings the application and runner chose (access log, limits...).
            **inner._kwargs,
        )
        self.header_timeout = header_timeout
        self.on_timeout = on_timeout
        self.on_malformed = on_malformed

    def __call__(self) -> RequestHandler:
        return HeaderDeadlineHandler(
            self,
            header_timeout=self.header_timeout,
            on_timeout=self.on_timeout,
            on_malformed=self.on_malformed,
            loop=self._loop,
            **self._kwargs,
        )


class GuardedAppRunner(web.AppRunner):
    """``web.AppRunner`` whose connections must send their request headers within
    ``header_timeout`` seconds (0: no limit); ``on_timeout`` is called for each connection
    closed for it, ``on_malformed`` for each request aiohttp's parser refuses (None: a port
    not serving clients, whose answers carry no ``x-kvgate-*`` header). The application must
    use :func:`track_requests` as a middleware."""

    __slots__ = ("_header_timeout", "_on_malformed", "_on_timeout")

    def __init__(
        self,
        app: web.Application,
        *,
        header_timeout: float,
        on_timeout: Callable[[], None] = lambda: None,
        on_malformed: Callable[[], None] | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("keepalive_timeout", KEEPALIVE_TIMEOUT_S)
        super().__init__(app, **kwargs)
        self._header_timeout = header_timeout
        self._on_timeout = on_timeout
        self._on_malformed = on_malformed

    async def _make_server(self) -> web.Server:
        inner = await super()._make_server()
        return _GuardedServer(inner, self._header_timeout, self._on_timeout, self._on_malformed)


@web.middleware
async def track_requests(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Tell a :class:`HeaderDeadlineHandler` connection when a request's handler starts and
    ends (a no-op on other connections)."""
    proto = request.protocol
    if not isinstance(proto, HeaderDeadlineHandler):
        return await handler(request)
    proto.request_started()
    try:
        return await handler(request)
    finally:
        proto.request_finished(request.content.is_eof())
