"""The client side of ``kvgate_bench.peers``: wrk's load and the streaming and memory clients.

* Load: wrk (https://github.com/wg/wrk), ``wrk -t1 -c C -d S --latency -s post.lua``, pinned to
  the load generator's CPU with ``taskset``, a Lua script POSTing one chat body; :func:`parse_wrk`
  reads its ``--latency`` report (its own units: ``85.00us``, ``1.23ms``, ``2.00s``, ``1.00m``)
  into microseconds. wrk measures each request from its send to its response (no
  coordinated-omission correction: wrk2's ``-R`` would add it; at fixed concurrency the closed
  loop is what is asked).
* :func:`measure_streams`: ``streams`` concurrent clients, each sending streaming chat requests
  back to back over one keep-alive connection and counting the SSE ``data:`` events it
  receives (``[DONE]`` excluded): the chunks delivered. After a warm-up that opens every
  stream, the server's CPU (``/proc/<pid>/stat`` utime + stime of the process and its children)
  is read at the start and the end of a window; CPU per chunk = CPU delta / chunks counted in
  the window. Resident memory (``/proc/<pid>/status`` VmRSS) is read in the middle of it.
* :func:`measure_idle`: opens ``n`` keep-alive connections, sends one small chat request on
  each, reads its answer and keeps the connection open and idle; RSS delta / n is the memory
  one idle keep-alive connection costs the server.

The HTTP/1.1 client is minimal (Content-Length or chunked responses), enough for the sidecar,
nginx and the llm-d simulator.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvgate_bench.kit.toolkit import memory_kib

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
TENANT = "bench"

_UNITS_US = {"us": 1.0, "ms": 1e3, "s": 1e6, "m": 60e6, "h": 3600e6}
_TIME = re.compile(r"^\s*([0-9.]+)\s*(us|ms|s|m|h)\s*$")
_PCT = re.compile(r"^\s*(50|75|90|99)(?:\.0+)?%\s+(\S+)\s*$", re.MULTILINE)
_RPS = re.compile(r"^Requests/sec:\s+([0-9.]+)", re.MULTILINE)
_TOTAL = re.compile(r"^\s*(\d+) requests in ", re.MULTILINE)
_NON2XX = re.compile(r"^\s*Non-2xx or 3xx responses:\s+(\d+)", re.MULTILINE)
_SOCKERR = re.compile(
    r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", re.MULTILINE
)


class WrkError(ValueError):
    """wrk's output lacks what the report needs (it failed, or its format changed)."""


@dataclass(frozen=True, slots=True)
class WrkResult:
    """One wrk run: latency percentiles (microseconds), throughput (requests/s) and errors."""

    p50_us: float
    p99_us: float
    rps: float
    requests: int
    non2xx: int
    socket_errors: int

    @property
    def errors(self) -> int:
        """Non-2xx responses plus socket errors (connect, read, write, timeout)."""
        return self.non2xx + self.socket_errors


def parse_time_us(text: str) -> float:
    """``"85.00us"`` → 85.0, ``"1.23ms"`` → 1230.0, ``"2.00s"`` → 2e6 (wrk's units).

    Raises:
        WrkError: not one of wrk's time formats.
    """
    m = _TIME.match(text)
    if m is None:
        raise WrkError(f"not a wrk time: {text!r}")
    return float(m.group(1)) * _UNITS_US[m.group(2)]


def parse_wrk(output: str) -> WrkResult:
    """Parse ``wrk --latency`` output (its default report, no Lua ``done`` hook).

    Raises:
        WrkError: no latency distribution or no ``Requests/sec`` line in ``output``.
    """
    pcts = {int(k): parse_time_us(v) for k, v in _PCT.findall(output)}
    rps, total = _RPS.search(output), _TOTAL.search(output)
    if 50 not in pcts or 99 not in pcts or rps is None or total is None:
        raise WrkError("wrk output without a latency distribution or Requests/sec:\n" + output)
    non2xx = _NON2XX.search(output)
    sock = _SOCKERR.search(output)
    return WrkResult(
        p50_us=pcts[50],
        p99_us=pcts[99],
        rps=float(rps.group(1)),
        requests=int(total.group(1)),
        non2xx=int(non2xx.group(1)) if non2xx else 0,
        socket_errors=sum(int(g) for g in sock.groups()) if sock else 0,
    )


def chat_body(size_bytes: int, *, stream: bool = False, max_tokens: int = 16) -> bytes:
    """A chat completion body of about ``size_bytes`` (within a few bytes): a system and a user
    message, the user's text padded with words to the size."""
    head: dict[str, object] = {"model": MODEL, "max_tokens": max_tokens}
    if stream:
        head["stream"] = True

    def build(pad: int) -> bytes:
        words = ("lorem ipsum dolor sit amet " * (pad // 27 + 1))[:pad]
        body = {
            **head,
            "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Summarise this text: " + words},
            ],
        }
        return json.dumps(body, separators=(",", ":")).encode()

    base = len(build(0))
    return build(max(0, size_bytes - base))


def lua_script(body_file: Path) -> str:
    """wrk's Lua script: POST the bytes of ``body_file`` as JSON, tenant header set."""
    return (
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        f'wrk.headers["x-kvgate-tenant"] = "{TENANT}"\n'
        f'local f = assert(io.open("{body_file}", "rb"))\n'
        "wrk.body = f:read('*a')\n"
        "f:close()\n"
    )


def wrk_command(
    wrk: str, url: str, script: Path, *, connections: int, seconds: float, cpu: int
) -> list[str]:
    """``taskset -c CPU wrk -t1 -cN -dS --latency -s SCRIPT URL`` (one thread: one CPU; a
    30 s request timeout, so that the slowest arm's latencies at 256 connections are not cut)."""
    return [
        "taskset", "-c", str(cpu), wrk, "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s",
        "--timeout", "30s", "--latency", "-s", str(script), url,
    ]  # fmt: skip


def run_wrk(cmd: list[str], *, timeout: float, save: Path | None = None) -> WrkResult:
    """Run one wrk command and parse its report (its raw output written to ``save``).

    Raises:
        WrkError: wrk failed or printed no report (its output is in the message).
    """
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise WrkError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr}{done.stdout}")
    if save is not None:
        save.write_text(" ".join(cmd) + "\n" + done.stdout)
    return parse_wrk(done.stdout)


@dataclass(frozen=True, slots=True)
class StreamResult:
    """One streaming window: chunks counted by the clients, the server's CPU over it."""

    streams: int
    seconds: float
    chunks: int
    cpu_seconds: float
    rss_kib: int
    errors: int
    client_cpu_seconds: float = 0.0
    upstream_cpu_seconds: float = 0.0

    @property
    def chunks_per_second(self) -> float:
        """Chunks delivered per second of wall time."""
        return self.chunks / self.seconds if self.seconds else 0.0

    @property
    def cores(self) -> float:
        """Server CPU over the window, in cores (CPU seconds / wall seconds)."""
        return self.cpu_seconds / self.seconds if self.seconds else 0.0

    @property
    def client_cores(self) -> float:
        """The client's own CPU over the window, in cores: near 1, the client is the limit."""
        return self.client_cpu_seconds / self.seconds if self.seconds else 0.0

    @property
    def upstream_cores(self) -> float:
        """The upstream's (the simulator's) CPU over the window, in cores."""
        return self.upstream_cpu_seconds / self.seconds if self.seconds else 0.0

    @property
    def us_per_chunk(self) -> float | None:
        """Server CPU microseconds per chunk delivered; None without chunks."""
        return self.cpu_seconds / self.chunks * 1e6 if self.chunks else None


@dataclass(frozen=True, slots=True)
class IdleResult:
    """Resident memory before and with ``connections`` idle keep-alive connections (KiB)."""

    connections: int
    rss_before_kib: int
    rss_after_kib: int

    @property
    def kib_per_connection(self) -> float:
        """RSS delta per connection, KiB."""
        return (self.rss_after_kib - self.rss_before_kib) / max(1, self.connections)

    @property
    def kib_per_1000(self) -> float:
        """RSS delta per 1,000 connections, KiB."""
        return self.kib_per_connection * 1000


def request_bytes(port: int, body: bytes, path: str = "/v1/chat/completions") -> bytes:
    """A keep-alive POST of ``body`` (JSON) with the benchmark's tenant header."""
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"x-kvgate-tenant: {TENANT}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


class EventCounter:
    """Counts SSE ``data:`` events (not ``data: [DONE]``) across arbitrary splits of a stream.

    Each marker is counted where its last byte arrives: a tail one byte shorter than the marker
    is carried from one piece to the next, so no marker is counted twice or missed.
    """

    def __init__(self) -> None:
        self.count = 0
        self._data_tail = b""
        self._done_tail = b""

    def feed(self, data: bytes) -> None:
        """Count the markers that ``data`` completes."""
        a = self._data_tail + data
        b = self._done_tail + data
        self.count += a.count(b"data:") - b.count(b"[DONE]")
        self._data_tail, self._done_tail = a[-4:], b[-5:]


async def read_response(reader: asyncio.StreamReader, on_body: Callable[[bytes], None]) -> int:
    """Read one HTTP/1.1 response, passing its decoded body to ``on_body`` piece by piece.

    Returns:
        The status code.
    Raises:
        ConnectionError: the server closed the connection mid-response.
        ValueError: neither Content-Length nor chunked framing.
    """
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    lower = head.lower()
    if b"transfer-encoding: chunked" in lower:
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                return status
            on_body((await reader.readexactly(size + 2))[:-2])
    i = lower.find(b"content-length:")
    if i < 0:
        raise ValueError("response without Content-Length or chunked encoding")
    length = int(lower[i + 15 : lower.find(b"\r\n", i)])
    on_body(await reader.readexactly(length))
    return status


async def _stream_client(
    port: int, request: bytes, counter: EventCounter, stop: asyncio.Event, errors: list[str]
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
    try:
        while not stop.is_set():
            writer.write(request)
            status = await read_response(reader, counter.feed)
            if status != 200:
                errors.append(f"status {status}")
                await asyncio.sleep(0.1)
    except (OSError, asyncio.IncompleteReadError, ValueError) as e:
        errors.append(repr(e))
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def measure_streams(
    port: int,
    cpu: Callable[[], float],
    rss_pid: int,
    *,
    streams: int,
    warmup: float,
    seconds: float,
    max_tokens: int,
    upstream_cpu: Callable[[], float] = lambda: 0.0,
) -> StreamResult:
    """Run ``streams`` streaming clients against 127.0.0.1:``port`` (see the module)."""
    body = chat_body(1024, stream=True, max_tokens=max_tokens)
    body = body[:-1] + b',"ignore_eos":true}'  # every stream runs its max_tokens
    request = request_bytes(port, body)
    counters = [EventCounter() for _ in range(streams)]
    stop = asyncio.Event()
    errors: list[str] = []
    tasks = [asyncio.create_task(_stream_client(port, request, c, stop, errors)) for c in counters]
    await asyncio.sleep(warmup)
    t0, cpu0, n0 = time.monotonic(), cpu(), sum(c.count for c in counters)
    own0, up0 = time.process_time(), upstream_cpu()
    await asyncio.sleep(seconds / 2)
    rss = memory_kib(rss_pid, "VmRSS")
    await asyncio.sleep(seconds / 2)
    t1, cpu1, n1 = time.monotonic(), cpu(), sum(c.count for c in counters)
    own, up = time.process_time() - own0, upstream_cpu() - up0
    stop.set()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return StreamResult(streams, t1 - t0, n1 - n0, cpu1 - cpu0, rss, len(errors), own, up)


async def _idle_connection(
    port: int, request: bytes, held: list[asyncio.StreamWriter], errors: list[str]
) -> None:
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request)
        status = await read_response(reader, lambda _: None)
    except (OSError, asyncio.IncompleteReadError, ValueError) as e:
        errors.append(repr(e))
        return
    held.append(writer)
    if status != 200:
        errors.append(f"status {status}")


async def measure_idle(
    port: int, pid: int, *, connections: int, batch: int = 64, settle: float = 1.0
) -> tuple[IdleResult, int]:
    """Hold ``connections`` idle keep-alive connections to 127.0.0.1:``port`` (see the module);
    returns the result and the number of failed connections or non-200 answers."""
    request = request_bytes(port, chat_body(256, max_tokens=1))
    held: list[asyncio.StreamWriter] = []
    errors: list[str] = []
    for _ in range(20):  # warm the server's code paths and pools before the baseline
        await _idle_connection(port, request, held, errors)
    for w in held:
        w.close()
    held.clear()
    await asyncio.sleep(settle)
    before = memory_kib(pid, "VmRSS")
    for i in range(0, connections, batch):
        n = min(batch, connections - i)
        await asyncio.gather(*(_idle_connection(port, request, held, errors) for _ in range(n)))
    await asyncio.sleep(settle)
    after = memory_kib(pid, "VmRSS")
    for w in held:
        w.close()
    return IdleResult(len(held), before, after), len(errors)


# ------------------------------------------------------------------- the report's stream rows


@dataclass(frozen=True, slots=True)
class StreamRow:
    """One streaming window through ``arm`` at ``itl_ms`` inter-token latency."""

    arm: str
    itl_ms: float
    result: StreamResult


def stream_rows(streams: Sequence[StreamRow]) -> list[list[str]]:
    """The streaming table: chunks/s, server cores, CPU per chunk, RSS with the streams open."""
    rows = []
    for s in streams:
        r = s.result
        per = r.us_per_chunk
        rows.append([
            s.arm, f"{s.itl_ms:g} ms", str(r.streams), f"{r.chunks_per_second:,.0f}",
            f"{r.cores:.2f}", "-" if per is None else f"{per:.1f} us",
            f"{r.rss_kib / 1024:.1f} MiB", f"{r.upstream_cores:.2f}",
            f"{r.client_cores:.2f}", str(r.errors),
        ])  # fmt: skip
    return rows


STREAM_HEAD = [
    "through", "ITL", "streams", "chunks/s", "server cores", "CPU per chunk",
    "server RSS (streams open)", "simulator cores", "client cores", "errors",
]  # fmt: skip


def idle_line(idle: IdleResult | None) -> str:
    """One sentence on the idle keep-alive connections' memory."""
    if idle is None:
        return "Idle keep-alive connections: not measured."
    return (
        f"kvgate sidecar resident memory with {idle.connections:,} idle keep-alive connections "
        f"(one request each): {idle.rss_before_kib / 1024:.1f} -> "
        f"{idle.rss_after_kib / 1024:.1f} MiB, **{idle.kib_per_1000 / 1024:.2f} MiB per 1,000** "
        f"({idle.kib_per_connection:.1f} KiB per connection)."
    )
