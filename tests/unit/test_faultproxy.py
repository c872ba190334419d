"""The fault-injecting TCP proxy over real loopback sockets: an echo server behind it, each mode.

Absence (nothing forwarded) can only be shown by waiting: those waits are 0.2 s each, on reads
that would answer in microseconds if the proxy forwarded. A read that must answer waits up to
5 s instead (it returns as soon as the echo does), so a loaded machine does not fail it.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import pytest

from kvgate_bench.kit.faultproxy import FaultProxy, Mode, ThreadedFaultProxy

#: Seconds of silence that show nothing was forwarded.
SILENCE_S = 0.2
#: Seconds an echo that must come back may take.
ANSWER_S = 5.0


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(1024):
        writer.write(data)
        await writer.drain()
    writer.close()


@pytest.fixture
async def proxy() -> AsyncIterator[FaultProxy]:
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    p = await FaultProxy("127.0.0.1", server.sockets[0].getsockname()[1]).start()
    yield p
    await p.close()
    server.close()
    await server.wait_closed()


async def _connect(p: FaultProxy) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", p.port)


async def _echo_within(
    r: asyncio.StreamReader, w: asyncio.StreamWriter, data: bytes, seconds: float
) -> bool:
    w.write(data)
    await w.drain()
    try:
        return await asyncio.wait_for(r.readexactly(len(data)), seconds) == data
    except TimeoutError:
        return False


async def _echoes(r: asyncio.StreamReader, w: asyncio.StreamWriter, data: bytes) -> bool:
    """Whether ``data`` comes back (within :data:`ANSWER_S`)."""
    return await _echo_within(r, w, data, ANSWER_S)


async def _silent(r: asyncio.StreamReader, w: asyncio.StreamWriter, data: bytes) -> bool:
    """Whether nothing comes back for ``data`` within :data:`SILENCE_S`."""
    return not await _echo_within(r, w, data, SILENCE_S)


async def test_pass_forwards_both_ways(proxy: FaultProxy) -> None:
    r, w = await _connect(proxy)
    assert await _echoes(r, w, b"hello")
    assert proxy.counts.forwarded == 1
    assert (proxy.counts.bytes_up, proxy.counts.bytes_down) == (5, 5)
    w.close()


async def test_blackhole_holds_connections_open_and_silent_even_after_the_heal(
    proxy: FaultProxy,
) -> None:
    r_old, w_old = await _connect(proxy)
    assert await _echoes(r_old, w_old, b"before")
    await proxy.set_mode(Mode.BLACKHOLE)
    # The open connection: nothing comes back, and it is not closed either (no EOF, no reset).
    assert await _silent(r_old, w_old, b"during")
    assert not r_old.at_eof()
    # A new connection is accepted (connect succeeds) but nothing is forwarded.
    r_new, w_new = await _connect(proxy)
    assert await _silent(r_new, w_new, b"new")
    assert proxy.counts.held == 1 and not r_new.at_eof()
    # Healed: connections opened from now on flow; those caught in the blackhole stay dead.
    await proxy.set_mode(Mode.PASS)
    r3, w3 = await _connect(proxy)
    assert await _echoes(r3, w3, b"after")
    assert await _silent(r_old, w_old, b"still dead")
    assert await _silent(r_new, w_new, b"still dead")
    for w in (w_old, w_new, w3):
        w.close()


async def test_refuse_resets_open_connections_and_refuses_new_ones(proxy: FaultProxy) -> None:
    r, w = await _connect(proxy)
    assert await _echoes(r, w, b"x")
    await proxy.set_mode(Mode.REFUSE)
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(r.read(1), 5)
    with pytest.raises(ConnectionRefusedError):
        await _connect(proxy)
    assert proxy.counts.reset == 1
    await proxy.set_mode(Mode.PASS)  # the same port again
    r2, w2 = await _connect(proxy)
    assert await _echoes(r2, w2, b"back")
    w2.close()


async def test_a_dead_target_resets_the_client() -> None:
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    p = await FaultProxy("127.0.0.1", port).start()
    try:
        r, _ = await _connect(p)
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(r.read(1), 5)
    finally:
        await p.close()


def test_threaded_proxy_switches_modes_from_another_thread() -> None:
    with (
        socket.create_server(("127.0.0.1", 0)) as srv,
        ThreadedFaultProxy("127.0.0.1", srv.getsockname()[1]) as p,
    ):
        assert p.mode is Mode.PASS
        p.set_mode(Mode.REFUSE)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", p.port), timeout=5).close()
        p.set_mode(Mode.BLACKHOLE)
        with socket.create_connection(("127.0.0.1", p.port), timeout=5):
            pass
