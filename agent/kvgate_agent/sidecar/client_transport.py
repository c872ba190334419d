"""The socket side of one client connection of kvgate's own server leg: writes, waiting while
the client is slow to take them (the transport's high-water mark), and reading paused while
what was read waits unread (a request body, pipelined requests). The HTTP side is
:class:`~kvgate_agent.sidecar.client_conn.ClientConnection`'s, built on this.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import cast

__all__ = ["ClientTransport"]


class ClientTransport(asyncio.Protocol):
    """Writes and reading pauses of one connection (see the module docstring).

    ``transport``: set when the connection is made; ``lost``: the connection is gone (set by
    the subclass's ``connection_lost`` through :meth:`transport_lost`)."""

    __slots__ = ("_drain", "_loop", "_read_paused", "_write_paused", "lost", "transport")

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self._read_paused = 0  # reasons reading is paused (a body unread, a pipeline full)
        self._write_paused = False
        self._drain: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not subclasses of asyncio.Transport, but behave as one.
        self.transport = cast(asyncio.Transport, transport)

    def transport_lost(self) -> None:
        """The connection is gone: a writer waiting for the client gets
        ``ConnectionResetError``."""
        self.lost = True
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(ConnectionResetError("the client closed the connection"))

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
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
        if not self._write_paused:
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
