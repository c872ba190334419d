"""A fault-injecting TCP proxy (asyncio), put between a client and a server to cut the network
between them for real.

:class:`FaultProxy` listens on a loopback port and forwards every connection, byte for byte, to
``target`` (TLS passes through untouched: the client still verifies the server's certificate).
Its :class:`Mode` can be switched at any time:

- ``pass``: new connections are forwarded; live ones flow.
- ``refuse``: the API server unreachable. The listening socket is closed, so a new connection
  gets ``ECONNREFUSED`` from the kernel, and every open connection is reset (RST, via
  ``SO_LINGER`` 0) both ways.
- ``blackhole``: the network silently dead, as after a partition or a lost NAT entry. New
  connections are accepted and held open with nothing forwarded (not even the TLS handshake);
  open connections stop forwarding both ways without being closed. A connection caught in a
  blackhole stays dead after the network heals (the lost-NAT-entry case: the peer never hears
  of it again), so the client must notice it on its own, by its timeouts; only connections
  opened after the heal flow.

Note: the proxy's own kernel still ACKs what the client sends and answers its TCP keep-alive
probes, so a blackhole here is seen only by the client's application-level timeouts (read
timeouts, watch timeouts), never by TCP keep-alive. That is the harder case: a real partition
is also caught by keep-alive.

:class:`ThreadedFaultProxy` runs one in a background thread for synchronous tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeVar

log = logging.getLogger("kvgate.faultproxy")

T = TypeVar("T")

#: Bytes read at once from either side.
CHUNK = 65536


class Mode(StrEnum):
    """What the proxy does with connections (see the module docstring)."""

    PASS = "pass"
    REFUSE = "refuse"
    BLACKHOLE = "blackhole"


@dataclass
class Counts:
    """What the proxy saw: connections accepted (forwarded), held in a blackhole, and reset;
    bytes forwarded each way."""

    forwarded: int = 0
    held: int = 0
    reset: int = 0
    bytes_up: int = 0
    bytes_down: int = 0


@dataclass(eq=False)
class _Conn:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    dead: bool = False
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with an RST (``SO_LINGER`` on, 0 seconds), not a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class FaultProxy:
    """A TCP proxy from ``listen_host:port`` to ``target_host:target_port`` (see the module
    docstring). Start it with :meth:`start` (on the loop that will run it), switch with
    :meth:`set_mode`, stop with :meth:`close`.

    Args:
        target_host, target_port: the server.
        listen_host: the address to listen on.
        port: the port to listen on; 0 picks a free one (kept across ``refuse``).
    """

    def __init__(
        self, target_host: str, target_port: int, listen_host: str = "127.0.0.1", port: int = 0
    ) -> None:
        self.target = (target_host, target_port)
        self.listen_host = listen_host
        self.port = port
        self.mode = Mode.PASS
        self.counts = Counts()
        self._server: asyncio.Server | None = None
        self._conns: set[_Conn] = set()
        self._closed = asyncio.Event()

    async def start(self) -> FaultProxy:
        """Listen (mode ``pass``)."""
        await self._listen()
        return self

    async def _listen(self) -> None:
        if self._server is not None:
            return
        self._server = await asyncio.start_server(
            self._accept, self.listen_host, self.port, reuse_address=True
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def _unlisten(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def set_mode(self, mode: Mode) -> None:
        """Switch to ``mode`` (see :class:`Mode`)."""
        mode = Mode(mode)
        log.info("fault proxy to %s:%d: %s -> %s", *self.target, self.mode, mode)
        self.mode = mode
        if mode is Mode.REFUSE:
            await self._unlisten()
            for conn in list(self._conns):
                self._drop(conn, reset=True)
            return
        await self._listen()
        if mode is Mode.BLACKHOLE:
            for conn in self._conns:
                conn.dead = True

    async def close(self) -> None:
        """Stop listening and close every connection."""
        self._closed.set()
        await self._unlisten()
        for conn in list(self._conns):
            self._drop(conn, reset=False)
            for t in conn.tasks:
                t.cancel()

    def _drop(self, conn: _Conn, *, reset: bool) -> None:
        for w in (conn.client, conn.upstream):
            if w is None:
                continue
            if reset:
                _reset(w)
            else:
                w.transport.abort()
        if reset:
            self.counts.reset += 1
        self._conns.discard(conn)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Conn(writer)
        if self.mode is not Mode.PASS:  # (refuse: a connection accepted as the listener closed)
            if self.mode is Mode.REFUSE:
                _reset(writer)
                self.counts.reset += 1
                return
            conn.dead = True
            self.counts.held += 1
            self._conns.add(conn)
            await self._closed.wait()  # held open, silent, until the proxy closes
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            _reset(writer)
            self.counts.reset += 1
            return
        conn.upstream = up_writer
        self.counts.forwarded += 1
        self._conns.add(conn)
        conn.tasks = [
            asyncio.create_task(self._pump(conn, reader, up_writer, up=True)),
            asyncio.create_task(self._pump(conn, up_reader, writer, up=False)),
        ]
        await asyncio.gather(*conn.tasks, return_exceptions=True)
        if conn in self._conns:  # both ways at EOF: done
            self._drop(conn, reset=False)

    async def _pump(
        self, conn: _Conn, src: asyncio.StreamReader, dst: asyncio.StreamWriter, *, up: bool
    ) -> None:
        """Copy ``src`` to ``dst`` until EOF; once the connection is dead, forward nothing more
        (and stop reading, so the sender's window fills as on a dead path)."""
        try:
            while not conn.dead:
                data = await src.read(CHUNK)
                if conn.dead:
                    break
                if not data:
                    if dst.can_write_eof():
                        dst.write_eof()
                    return
                dst.write(data)
                if up:
                    self.counts.bytes_up += len(data)
                else:
                    self.counts.bytes_down += len(data)
                await dst.drain()
        except (ConnectionError, OSError):
            if not conn.dead:
                self._drop(conn, reset=True)
            return
        await self._closed.wait()  # dead: silent until the proxy closes


class ThreadedFaultProxy:
    """A :class:`FaultProxy` on its own event loop in a daemon thread, for synchronous tests:
    ``with ThreadedFaultProxy(host, port) as p: ...; p.set_mode(Mode.BLACKHOLE)``."""

    def __init__(self, target_host: str, target_port: int, listen_host: str = "127.0.0.1"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="kvgate-faultproxy", daemon=True
        )
        self._thread.start()
        self.proxy = self._call(FaultProxy(target_host, target_port, listen_host).start())

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    @property
    def port(self) -> int:
        """The port the proxy listens on."""
        return self.proxy.port

    @property
    def mode(self) -> Mode:
        return self.proxy.mode

    @property
    def counts(self) -> Counts:
        return self.proxy.counts

    def set_mode(self, mode: Mode) -> None:
        """Switch modes (returns once the switch is done)."""
        self._call(self.proxy.set_mode(mode))

    def close(self) -> None:
        """Close the proxy and stop its thread."""
        if self.loop.is_closed():
            return
        self._call(self.proxy.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()

    def __enter__(self) -> ThreadedFaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
