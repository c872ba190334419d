"""The socket side of one client connection of kvgate's own server leg: writes, waiting while
the client is slow to take them (the transport's high-water mark), reading paused while what
was read waits unread (a request body, pipelined requests), and the watch on a client that shut
its sending side (:meth:`ClientTransport.watch_half_closed`). The HTTP side is
:class:`~kvgate_agent.sidecar.edge.client_conn.ClientConnection`'s, built on this.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import cast

__all__ = ["STILL_THERE", "ClientTransport", "PeerWatch"]

#: What asks a half-closed client whether it is still there: an interim answer, which an
#: HTTP/1.1 client reads and skips before the final one, asked or not (RFC 9110 §15.2), and
#: which a socket closed whole answers with a reset (RFC 9293 §3.6.1).
STILL_THERE = b"HTTP/1.1 100 Continue\r\n\r\n"
#: Seconds between checks of a half-closed connection's socket for a reset: the first, then
#: doubling up to the last.
PEER_CHECKS_S = (0.02, 1.0)


class PeerWatch:
    """Checks the socket of a connection whose client shut its sending side for the reset a
    client gone whole answers a write with (``SO_ERROR``), after :data:`PEER_CHECKS_S` seconds,
    then doubling up to the last, until :meth:`cancel`; aborts ``transport`` when it comes (its
    protocol's ``connection_lost`` then releases what the connection's handler holds); used by
    :class:`ClientTransport`."""

    __slots__ = ("_handle", "_loop", "_transport")

    def __init__(self, loop: asyncio.AbstractEventLoop, transport: asyncio.BaseTransport) -> None:
        self._loop = loop
        self._transport: asyncio.BaseTransport | None = transport
        self._handle: asyncio.TimerHandle | None = loop.call_later(
            PEER_CHECKS_S[0], self._check, PEER_CHECKS_S[0]
        )

    def cancel(self) -> None:
        """Stop checking (the connection is gone, or closing)."""
        if self._handle is not None:
            self._handle.cancel()
        self._handle = self._transport = None

    def _check(self, seconds: float) -> None:
        self._handle = None
        t = self._transport
        if t is None or t.is_closing():
            return
        sock = t.get_extra_info("socket")
        try:
            reset = sock is not None and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0
        except OSError:
            reset = True
        if reset:
            cast(asyncio.Transport, t).abort()
            self._transport = None
        else:
            delay = min(PEER_CHECKS_S[1], 2 * seconds)
            self._handle = self._loop.call_later(delay, self._check, delay)


class ClientTransport(asyncio.Protocol):
    """Writes and reading pauses of one connection (see the module docstring).

    ``transport``: set when the connection is made; ``lost``: the connection is gone (set by
    the subclass's ``connection_lost`` through :meth:`transport_lost`)."""

    __slots__ = (
        "_drain",
        "_loop",
        "_peer_check",
        "_read_paused",
        "answer_started",
        "lost",
        "transport",
        "write_paused",
    )

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.lost = False
        #: The client is slow to take what was written (above the transport's high-water
        #: mark): a writer awaits :meth:`drain` before writing more.
        self.write_paused = False
        self._read_paused = 0  # reasons reading is paused (a body unread, a pipeline full)
        self._drain: asyncio.Future[None] | None = None
        #: A byte of the answer being written was sent (:meth:`send`; the owner clears it
        #: when it starts the next answer): no interim answer may be sent before it now.
        self.answer_started = False
        self._peer_check: PeerWatch | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not subclasses of asyncio.Transport, but behave as one.
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # Each answer (or chunk) is one write: send it now, not after a delayed ACK
            # (Nagle's algorithm, RFC 896), as aiohttp's server does.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def transport_lost(self) -> None:
        """The connection is gone: a writer waiting for the client gets
        ``ConnectionResetError``."""
        self.lost = True
        if self._peer_check is not None:
            self._peer_check.cancel()
            self._peer_check = None
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(ConnectionResetError("the client closed the connection"))

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    def send(self, data: bytes) -> None:
        """Write ``data`` to the client (dropped once the connection is lost or closing)."""
        t = self.transport
        if t is not None and not self.lost and not t.is_closing():
            self.answer_started = True
            t.write(data)

    def send_interim(self, data: bytes) -> None:
        """Write an interim (1xx) answer, which leaves :attr:`answer_started` as it is."""
        started = self.answer_started
        self.send(data)
        self.answer_started = started

    def watch_half_closed(self, *, ask: bool) -> None:
        """The client shut its sending side (a FIN) with a request still to answer: a client
        that half-closes waits for the answer, one that closed its whole socket sent the same
        FIN and is gone. ``ask`` (an HTTP/1.1 client, no byte of the answer sent yet): write an
        interim ``100 Continue``, which a closed socket answers with a reset; for an HTTP/1.0
        client the answer's own writes do that. The socket is then watched for that reset
        (:class:`PeerWatch`) and the connection aborted when it came, as if lost (the owner's
        ``connection_lost`` releases what its handler holds)."""
        if ask:
            self.send_interim(STILL_THERE)
        if not self.lost and self.transport is not None and self._peer_check is None:
            self._peer_check = PeerWatch(self._loop, self.transport)

    async def drain(self) -> None:
        """Until the client has taken what was written (see :meth:`pause_writing`); raises
        ``ConnectionResetError`` when it goes away meanwhile."""
        if not self.write_paused:
            return
        if self.lost:
            raise ConnectionResetError("the client closed the connection")
        self._drain = d = self._loop.create_future()
        try:
            await d
        finally:
            self._drain = None

    def close_transport(self) -> None:
        """Close the socket once what was written is sent."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def pause_body(self) -> None:
        """Something read waits unread: stop reading (counted: each pause is resumed once)."""
        self._read_paused += 1
        if self._read_paused == 1 and self.transport is not None and not self.lost:
            self.transport.pause_reading()

    def resume_body(self) -> None:
        """What was waiting was read: read again once no other pause holds."""
        if self._read_paused == 0:
            return
        self._read_paused -= 1
        if self._read_paused == 0 and self.transport is not None and not self.lost:
            with contextlib.suppress(RuntimeError):
                self.transport.resume_reading()
