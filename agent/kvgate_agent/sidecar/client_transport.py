"""The socket side of one client connection of kvgate's own server leg: writes, waiting while
the client is slow to take them (the transport's high-water mark), and reading paused while
what was read waits unread (a request body, pipelined requests). The HTTP side is
:class:`~kvgate_agent.sidecar.client_conn.ClientConnection`'s, built on this.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import cast

__all__ = ["ClientTransport"]


class ClientTransport(asyncio.Protocol):
    """Writes and reading pauses of one connection (see the module docstring).

    ``transport``: set when the connection is made; ``lost``: the connection is gone (set by
    the subclass's ``connection_lost`` through :meth:`transport_lost`)."""

    __slots__ = ("_drain", "_loop", "_read_paused", "lost", "transport", "write_paused")

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.lost = False
        #: The client is slow to take what was written (above the transport's high-water
        #: mark): a writer awaits :meth:`drain` before writing more.
        self.write_paused = False
        self._read_paused = 0  # reasons reading is paused (a body unread, a pipeline full)
        self._drain: asyncio.Future[None] | None = None

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
            t.write(data)

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
