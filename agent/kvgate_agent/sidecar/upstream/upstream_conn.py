"""One kept-alive HTTP/1.1 connection to the model server, on a raw asyncio protocol, its
answers parsed by llhttp (``httptools``): the state of the answer being read (status, headers,
body bytes buffered, end, loss), waiting for it to change, and the body handed on as the bytes
arrive (what is buffered is coalesced into one read; reading pauses above
:data:`READ_HIGH_WATER` bytes buffered).
:class:`~kvgate_agent.sidecar.upstream.upstream.UpstreamPool`
owns the connections and sends on them.

Errors (the upstream room's own, :mod:`kvgate_agent.sidecar.upstream.errors`):

* :class:`UpstreamConnectError`: the connection could not be opened (refused, unreachable, or
  not within ``connect_timeout`` seconds): the model server never saw the request.
* :class:`UpstreamBroken`: the model server closed the connection before the answer was
  complete, or sent what is not HTTP.
* ``TimeoutError``: no byte of the answer for ``read_timeout`` seconds (aiohttp's
  ``sock_read``), or the request body not accepted by the socket in that time.
"""

from __future__ import annotations

import asyncio
from typing import cast

import httptools

from kvgate_agent.sidecar.upstream.errors import UpstreamBroken

#: Buffered answer bytes above which a connection stops reading until they are consumed (flow
#: control against a model server faster than the client).
READ_HIGH_WATER = 1024 * 1024


class UpstreamConnection(asyncio.Protocol):
    """One connection to the model server and the answer being read on it (created by the
    pool's ``loop.create_connection``).

    What the pool and its responses read: ``transport``, ``lost`` (the connection is gone),
    ``idle_since`` (``time.monotonic()`` when it went idle), ``received`` (a byte of the current
    answer arrived), ``status``, ``headers``, ``headers_done``, ``complete``, ``keep_alive`` and
    ``error``; :meth:`reset` before a reuse, :meth:`wait`, :meth:`drain` and :meth:`take`."""

    __slots__ = (
        "_buffered",
        "_chunks",
        "_deadline",
        "_drain",
        "_informational",
        "_loop",
        "_parser",
        "_paused",
        "_read_paused",
        "_timer",
        "_until_close",
        "_waiter",
        "complete",
        "error",
        "headers",
        "headers_done",
        "idle_since",
        "keep_alive",
        "lost",
        "received",
        "status",
        "transport",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.idle_since = 0.0
        self.received = False  # a byte of the current answer has arrived
        self._paused = False  # the socket's write buffer is full
        self._drain: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None  # the read deadline's, see wait()
        self._deadline = 0.0  # loop.time() by which the awaited change must come
        # One parser for the connection's life: llhttp starts on the next answer by itself
        # once one is complete (a connection whose answer failed is never reused).
        self._parser = httptools.HttpResponseParser(self)
        self.reset()

    def reset(self) -> None:
        """Ready for the next answer on this connection (a reused one, before its request)."""
        #: The answer's headers as parsed so far (names and values as ``latin-1`` text).
        self.headers: list[tuple[str, str]] = []
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._read_paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._until_close = False  # the body ends when the connection does (no length given)
        self._informational = False  # a 1xx answer is being parsed
        self.status = 0
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.received = False
        self.error: BaseException | None = None

    # ---------------------------------------------------------------- asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not subclasses of asyncio.Transport, but behave as one.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamBroken(f"malformed HTTP from the model server: {exc}"))
            return
        if self._buffered > READ_HIGH_WATER and not self._read_paused and self.transport:
            self._read_paused = True
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        return False  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(UpstreamBroken("the model server closed the connection"))
        if self.complete or self.error is not None:
            self._wake()
            return
        if self.headers_done and self._until_close:
            self.complete = True  # a body delimited by the connection's end (RFC 9112 §6.3)
        else:
            self.error = UpstreamBroken("the model server closed the connection mid-answer")
        self._wake()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    # ---------------------------------------------------------------- llhttp callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:  # informational (100 Continue, 103): the answer follows
            self.headers = []
            self._informational = True
            return
        self.status = status
        self.headers_done = True
        self.keep_alive = self._parser.should_keep_alive()
        self._until_close = not any(
            k.lower() in ("content-length", "transfer-encoding") for k, _ in self.headers
        )
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        self._wake()

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        self.complete = True
        self._wake()

    # ---------------------------------------------------------------- waiting

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        self.error = exc
        self.keep_alive = False
        if self.transport is not None:
            self.transport.close()
        self._wake()

    async def wait(self, idle_s: float | None) -> None:
        """Until the connection's state changes (headers, body bytes, end, loss); raises
        ``TimeoutError`` after ``idle_s`` seconds without a change (None: no limit).

        One timer per connection, moved lazily: a wait only pushes the deadline on, and the
        timer, when it fires early, re-arms itself for the deadline (a stream waits once per
        event; a timer made and cancelled for each would cost more than the wait)."""
        self._waiter = w = self._loop.create_future()
        if idle_s is not None:
            self._deadline = self._loop.time() + idle_s
            if self._timer is None:
                self._timer = self._loop.call_at(self._deadline, self._check_deadline)
        try:
            await w
        finally:
            self._waiter = None

    def _check_deadline(self) -> None:
        self._timer = None
        w = self._waiter
        if w is None or w.done():
            return  # nobody waits: the next wait arms the timer again
        if self._loop.time() < self._deadline:
            self._timer = self._loop.call_at(self._deadline, self._check_deadline)
        else:
            w.set_exception(TimeoutError())

    async def drain(self, idle_s: float | None) -> None:
        """Until the socket accepts more bytes (the request body was large); raises
        ``TimeoutError`` after ``idle_s`` seconds (None: no limit)."""
        if not self._paused:
            return
        self._drain = d = self._loop.create_future()
        try:
            async with asyncio.timeout(idle_s):
                await d
        finally:
            self._drain = None

    def take(self) -> bytes:
        """The answer's body bytes buffered now (b"" when none), coalesced."""
        chunks = self._chunks
        if not chunks:
            return b""
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._chunks = []
        self._buffered = 0
        if self._read_paused and self.transport is not None:
            self._read_paused = False
            self.transport.resume_reading()
        return data
