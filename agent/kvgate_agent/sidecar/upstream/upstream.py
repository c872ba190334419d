"""The admitted requests' leg to the model server: a pool of kept-alive HTTP/1.1 connections on
raw asyncio protocols, responses parsed by llhttp (``httptools``).

aiohttp's client builds a ``ClientRequest``, a payload, a connection key, auto headers, tracing
hooks and a ``ClientResponse`` for every request: under a profile of the sidecar at c=32 that
machinery was about a quarter of its CPU (``docs/benchmarks.md``, "The sidecar's fast path").
An admitted request is simpler: one POST whose body is already in memory, whose answer is read
once. :class:`UpstreamPool` writes the request head and body in one ``writelines``, and hands
the answer's body on as the bytes arrive (what is buffered is coalesced into one read).
Each connection is an :class:`~kvgate_agent.sidecar.upstream.upstream_conn.UpstreamConnection` (its
errors, :class:`UpstreamConnectError` and :class:`UpstreamBroken`, and the timeouts are
described there; the errors live in :mod:`kvgate_agent.sidecar.upstream.errors`).

Pool: idle connections are reused last-in first-out; one the model server closed is dropped as
soon as the loss is seen (never handed to a request), and one idle for ``keepalive_s`` seconds
(:data:`KEEPALIVE_S`) is closed when the pool is next used.

Invariant: a request is sent at most twice, and twice only when it went out on a reused
connection that the model server closed, without a single byte of answer, within
:data:`RESEND_WINDOW_S` of the write: the server closed a kept-alive connection as the request
crossed it, so it had no time to work on it (the stale keep-alive case: Go's ``net/http`` names it
``errServerClosedIdle``; RFC 9112 §9.3.1 lets a client resend on a connection closed while idle).
The second send is on a fresh connection. llama.cpp's server answers a stream with
``Keep-Alive: timeout=5, max=100`` and closes the connection 0.1 ms after the stream's end, so
the next request written on it (one let out of the queue by that very end) met the close: that
was a 502. A later close (the server may have started on the request: a crash, a proxy's cut),
a byte of answer, a timeout or a fresh connection is never resent: a generation is not free.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

from multidict import CIMultiDict

from kvgate_agent.sidecar.upstream.errors import UpstreamBroken, UpstreamConnectError
from kvgate_agent.sidecar.upstream.upstream_conn import UpstreamConnection

__all__ = [
    "KEEPALIVE_S",
    "RESEND_WINDOW_S",
    "UpstreamBroken",
    "UpstreamConnectError",
    "UpstreamPool",
    "UpstreamResponse",
]

#: Seconds an idle connection is kept: under uvicorn's default ``--timeout-keep-alive`` of 5 s
#: (vLLM, SGLang and TGI's Python servers), so that the pool does not write a request on a
#: connection the model server is closing at that moment (a POST is never retried);
#: https://www.uvicorn.org/settings/#timeouts
KEEPALIVE_S = 4.0

#: Seconds after the write within which a reused connection's close, with no byte of answer,
#: is the server closing it as idle (resent once): the close crosses the request on the wire and
#: is seen within an event-loop turn (a fraction of a millisecond after llama-server's stream
#: ends; tens of milliseconds on a busy machine), while a server that read the request and then
#: failed takes longer than this to have done work worth not repeating.
RESEND_WINDOW_S = 0.25


class UpstreamResponse:
    """The model server's answer to one request: status and headers, then the body as it
    comes. :meth:`release` (read to its end) or :meth:`close` (drop the connection, so the
    model server sees the peer go away) must be called once."""

    __slots__ = ("_conn", "_done", "_pool", "_read_timeout", "headers", "status")

    def __init__(
        self, pool: UpstreamPool, conn: UpstreamConnection, read_timeout: float | None
    ) -> None:
        self._pool = pool
        self._conn = conn
        self._read_timeout = read_timeout
        self._done = False
        self.status = conn.status
        #: The answer's headers as they came (names and values as ``latin-1`` text).
        self.headers: CIMultiDict[str] = CIMultiDict(conn.headers)

    @property
    def content_type(self) -> str:
        """The media type of ``Content-Type`` in lower case, no parameters (aiohttp's
        ``content_type``: ``application/octet-stream`` when absent)."""
        raw = self.headers.get("Content-Type")
        if raw is None:
            return "application/octet-stream"
        return raw.split(";", 1)[0].strip().lower()

    @property
    def content_length(self) -> int | None:
        """``Content-Length`` in bytes, if given and valid."""
        raw = self.headers.get("Content-Length")
        return int(raw) if raw is not None and raw.isdigit() else None

    async def read_any(self) -> bytes:
        """The body bytes that have arrived since the last call (waiting for some), b"" at the
        end of the body. Raises :class:`UpstreamBroken`, ``TimeoutError``."""
        conn = self._conn
        while True:
            data = conn.take()
            if data:
                return data
            if conn.error is not None:
                raise conn.error
            if conn.complete:
                return b""
            await conn.wait(self._read_timeout)

    async def read_all(self, cap: int) -> bytes | None:
        """The whole body, or None once it grows past ``cap`` bytes (the rest left unread)."""
        parts: list[bytes] = []
        size = 0
        while chunk := await self.read_any():
            size += len(chunk)
            if size > cap:
                return None
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def release(self) -> None:
        """The body was read to its end: the connection goes back to the pool (if the model
        server keeps it alive), else it is closed."""
        if self._done:
            return
        self._done = True
        conn = self._conn
        if conn.complete and conn.error is None and conn.keep_alive and not conn.lost:
            self._pool._put(conn)
        else:
            self._pool._drop(conn)

    def close(self) -> None:
        """Drop the connection now (the answer may be unfinished)."""
        if not self._done:
            self._done = True
            self._pool._drop(self._conn)


class UpstreamPool:
    """Kept-alive connections to the model server at ``base_url`` (``http://`` or
    ``https://``, host and port; a path in it is ignored, as the forwarder always sends the
    request's own).

    ``connect_timeout``: seconds to open a connection; ``read_timeout``: seconds without a byte
    of the answer (None: no limit); ``keepalive_s``: seconds a connection may stay idle in the
    pool; ``max_idle``: idle connections kept at most; ``on_resend``: called for each request
    sent a second time (the module's invariant).
    """

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout: float,
        read_timeout: float | None,
        keepalive_s: float = KEEPALIVE_S,
        max_idle: int = 512,
        on_resend: Callable[[], object] | None = None,
    ) -> None:
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"expected an http:// or https:// base URL, got {base_url!r}")
        self._host = u.hostname
        self._port = u.port or (443 if u.scheme == "https" else 80)
        self._ssl = ssl.create_default_context() if u.scheme == "https" else None
        self._host_header = f"Host: {u.netloc}\r\n".encode("latin-1")
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.keepalive_s = keepalive_s
        self.max_idle = max_idle
        self._idle: list[UpstreamConnection] = []  # oldest first
        self._busy: set[UpstreamConnection] = set()
        self._closed = False
        #: Requests sent a second time because a reused connection was closed before any byte
        #: of answer (see the module's invariant).
        self.stale_retries = 0
        self._on_resend = on_resend

    @property
    def idle(self) -> int:
        """Idle connections kept now."""
        return len(self._idle)

    @property
    def busy(self) -> int:
        """Connections carrying a request now (answer not yet released or closed)."""
        return len(self._busy)

    async def request(
        self, method: str, target: str, headers: Iterable[tuple[str, str]], body: bytes
    ) -> UpstreamResponse:
        """Send ``method target`` with ``headers`` (no ``Host`` or ``Content-Length``: they are
        added) and ``body``; return once the answer's headers are in. Sent once more, on a fresh
        connection, only when a reused one was closed at once with no byte of answer (see the
        module's invariant; :attr:`stale_retries` counts those, and ``on_resend`` is called).

        Raises:
            UpstreamConnectError: no connection could be opened.
            UpstreamBroken: the model server closed the connection before the headers were
                complete (on a fresh connection, or after a byte of answer), or sent what is
                not HTTP.
            TimeoutError: no byte of answer within ``read_timeout`` seconds.
        """
        head = [f"{method} {target} HTTP/1.1\r\n".encode("latin-1"), self._host_header]
        # The server leg decodes header bytes as UTF-8 with surrogateescape: the same
        # encoding gives back the bytes the client sent.
        head.extend(f"{k}: {v}\r\n".encode("utf-8", "surrogateescape") for k, v in headers)
        head.append(b"Content-Length: %d\r\n\r\n" % len(body))
        data = [b"".join(head), body] if body else [b"".join(head)]
        conn, reused = await self._acquire(fresh=False)
        written = time.monotonic()
        try:
            await self._send(conn, data)
        except UpstreamBroken:
            self._drop(conn)
            if not reused or conn.received or time.monotonic() - written > RESEND_WINDOW_S:
                raise
            self.stale_retries += 1  # the server closed a kept-alive connection as it came
            if self._on_resend is not None:
                self._on_resend()
            conn, _ = await self._acquire(fresh=True)
            try:
                await self._send(conn, data)
            except BaseException:
                self._drop(conn)
                raise
        except BaseException:
            self._drop(conn)
            raise
        return UpstreamResponse(self, conn, self.read_timeout)

    async def _send(self, conn: UpstreamConnection, data: list[bytes]) -> None:
        """Write ``data`` on ``conn`` and wait for the answer's headers."""
        transport = conn.transport
        assert transport is not None
        transport.writelines(data)
        await conn.drain(self.read_timeout)
        while not conn.headers_done:
            if conn.error is not None:
                raise conn.error
            await conn.wait(self.read_timeout)

    async def _acquire(self, *, fresh: bool) -> tuple[UpstreamConnection, bool]:
        """A connection and whether it was reused from the idle list (``fresh``: always a new
        one)."""
        if self._closed:
            raise UpstreamConnectError("the upstream pool is closed")
        idle = self._idle
        now = time.monotonic()
        while idle and not fresh:
            conn = idle.pop()
            transport = conn.transport
            if (
                conn.lost
                or transport is None
                or transport.is_closing()
                or now - conn.idle_since > self.keepalive_s
            ):
                self._close(conn)
                continue
            conn.reset()
            self._busy.add(conn)
            return conn, True
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: UpstreamConnection(loop), self._host, self._port, ssl=self._ssl
                )
        except (OSError, TimeoutError) as exc:
            raise UpstreamConnectError(
                f"cannot connect to the model server at {self._host}:{self._port}: {exc!r}"
            ) from exc
        self._busy.add(conn)
        return conn, False

    def _put(self, conn: UpstreamConnection) -> None:
        self._busy.discard(conn)
        if self._closed or len(self._idle) >= self.max_idle:
            self._close(conn)
            return
        conn.idle_since = now = time.monotonic()
        idle = self._idle
        while idle and now - idle[0].idle_since > self.keepalive_s:
            self._close(idle.pop(0))
        idle.append(conn)

    def _drop(self, conn: UpstreamConnection) -> None:
        self._busy.discard(conn)
        self._close(conn)

    @staticmethod
    def _close(conn: UpstreamConnection) -> None:
        if conn.transport is not None and not conn.lost:
            conn.transport.close()

    def close(self) -> None:
        """Close every connection (idle or busy) and refuse new requests."""
        self._closed = True
        for conn in [*self._idle, *self._busy]:
            self._close(conn)
        self._idle.clear()
        self._busy.clear()
