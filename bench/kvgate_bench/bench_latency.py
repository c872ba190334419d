"""``python -m kvgate_bench.bench_latency``: the latency the kvgate sidecar adds to a request.

Three processes on loopback:

* an upstream that answers at once with a fixed small OpenAI response (a minimal aiohttp server
  on uvloop, started as ``python -m kvgate_bench.bench_latency --serve-upstream``), so the
  model server's own time is small and stable;
* the sidecar, the real CLI (``python -m kvgate_agent sidecar``), enforcing a realistic policy:
  one per-tenant limit with generous budgets, a concurrency cap and a KV capacity;
* the client, this process: one persistent keep-alive connection per path over a raw socket
  (the same code and the same bytes for both paths, so the client's own overhead cancels),
  sequential requests, warm-up first, then direct and via-sidecar requests interleaved in
  blocks so that drift (CPU frequency, noisy neighbours) hits both alike.

Reported: p50/p99 of direct and via-sidecar round trips, the added latency as the difference of
the percentiles (a percentile of paired differences would mix unrelated tails), and ratios; for
streaming requests the same for the time to the first content byte (TTFT) and the whole stream.
Targets: added p50 ≤ 0.35 ms, added p99 ≤ 1 ms (non-streaming).

Units: milliseconds in the output; nanoseconds internally.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvgate_agent.contract.api import API_VERSION
from kvgate_bench.kit.processes import Proc, sidecar_argv, start, stop_all
from kvgate_bench.kit.toolkit import free_port, percentile

TARGET_ADDED_P50_MS = 0.35
TARGET_ADDED_P99_MS = 1.0
TENANT = "bench"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"

# ---------------------------------------------------------------------- the upstream

_CHAT_ID = "chatcmpl-bench"
_CONTENT = "Hello from the upstream."


def _json(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


UPSTREAM_JSON = _json(
    {
        "id": _CHAT_ID,
        "object": "chat.completion",
        "created": 1700000000,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": _CONTENT},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 42, "completion_tokens": 6, "total_tokens": 48},
    }
)


def _chunk(delta: dict[str, str], finish: str | None) -> bytes:
    head = {"id": _CHAT_ID, "object": "chat.completion.chunk", "created": 1700000000}
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return b"data: " + _json({**head, "model": MODEL, "choices": [choice]}) + b"\n\n"


#: The stream, as separate writes: role, content, finish, [usage], [DONE].
UPSTREAM_SSE = (
    _chunk({"role": "assistant", "content": ""}, None),
    _chunk({"content": _CONTENT}, None),
    _chunk({}, "stop"),
)
UPSTREAM_SSE_USAGE = (
    b"data: "
    + _json(
        {
            "id": _CHAT_ID,
            "object": "chat.completion.chunk",
            "created": 1700000000,
            "model": MODEL,
            "choices": [],
            "usage": {"prompt_tokens": 42, "completion_tokens": 6, "total_tokens": 48},
        }
    )
    + b"\n\n"
)


def serve_upstream(port: int) -> None:
    """Run the fixed-response upstream on 127.0.0.1:``port`` until killed (uvloop)."""
    from aiohttp import web

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if b'"stream":true' not in body:
            return web.Response(body=UPSTREAM_JSON, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for piece in UPSTREAM_SSE:
            await resp.write(piece)
        if b'"include_usage":true' in body:
            await resp.write(UPSTREAM_SSE_USAGE)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/bench/chat", chat)  # reached through the sidecar's pass-through
    app.router.add_get("/health", health)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)
    else:
        web.run_app(
            app,
            host="127.0.0.1",
            port=port,
            access_log=None,
            print=None,
            loop=uvloop.new_event_loop(),
        )


# ---------------------------------------------------------------------- the client


class RawHTTP:
    """A minimal HTTP/1.1 keep-alive client over one socket, for timing.

    It sends pre-built request bytes and reads one response: ``Content-Length`` or chunked
    bodies, nothing else (enough for aiohttp servers). :meth:`roundtrip` returns nanoseconds to
    the first occurrence of ``marker`` in the body (or to the end) and to the end.
    """

    def __init__(self, host: str, port: int) -> None:
        self.sock = socket.create_connection((host, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray(1 << 16)
        self.view = memoryview(self.buf)

    def close(self) -> None:
        """Close the connection."""
        self.sock.close()

    def roundtrip(self, request: bytes, marker: bytes | None = None) -> tuple[int, int, int]:
        """Send ``request`` and read the whole response.

        Returns:
            (status, ns to the first ``marker`` byte in the body or to the end, ns to the end).
        """
        clock = time.perf_counter_ns
        sock, view = self.sock, self.view
        t0 = clock()
        sock.sendall(request)
        n = 0
        first = 0
        header_end: int | None = None  # offset of the blank line ending the headers
        total: int | None = None  # bytes of the whole response, when Content-Length gives it
        chunked = False
        while True:
            got = sock.recv_into(view[n:])
            if got == 0:
                raise ConnectionError("server closed the connection")
            n += got
            data = self.buf[:n]
            if header_end is None:
                found = data.find(b"\r\n\r\n")
                if found < 0:
                    continue
                header_end = found
                head = bytes(data[:header_end]).lower()
                chunked = b"transfer-encoding: chunked" in head
                if not chunked:
                    i = head.find(b"content-length:")
                    if i < 0:
                        raise ValueError("response without Content-Length or chunked encoding")
                    end = head.find(b"\r\n", i)
                    length = int(head[i + 15 : end if end >= 0 else len(head)])
                    total = header_end + 4 + length
            if marker is not None and not first and data.find(marker, header_end) >= 0:
                first = clock()
            if (total is not None and n >= total) or (chunked and data.endswith(b"\r\n0\r\n\r\n")):
                end_ns = clock()
                break
            if n == len(self.buf):
                raise ValueError("response larger than the client buffer")
        status = int(bytes(self.buf[9:12]))
        return status, (first or end_ns) - t0, end_ns - t0


def build_request(port: int, stream: bool, path: str = "/v1/chat/completions") -> bytes:
    """The request bytes sent on every path: a small chat completion (~200 B body)."""
    body: dict[str, object] = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Say hello in one short sentence, please."},
        ],
        "max_tokens": 16,
    }
    if stream:
        body["stream"] = True
    raw = _json(body)
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nx-kvgate-tenant: {TENANT}\r\n"
        f"Content-Length: {len(raw)}\r\n\r\n"
    ).encode() + raw


# ---------------------------------------------------------------------- processes


POLICY_YAML = (
    f"apiVersion: {API_VERSION}\n"
    + """\
kind: RateLimitPolicy
metadata:
  name: bench-latency
spec:
  model: {numLayers: 32, numKVHeads: 8, headDim: 128, kvCacheDtype: bf16, blockSize: 16,
          maxModelLen: 8192}
  capacity: {kvCacheTokens: 262144}
  concurrency: {maxRequests: 64}
  tenants: {header: x-kvgate-tenant, defaultMaxTokens: 512, maxTokensCap: 2048}
  rateLimits:
    - {name: per-tenant, per: Tenant, requestsPerMinute: 10000000, tokensPerMinute: 10000000000}
  cost: {perRequest: 16, promptTokenWeight: 1, outputTokenWeight: 1}
  queue: {maxLength: 64, maxWaitSeconds: 10, order: FIFO}
  overload: {actions: [Queue, Reject]}
"""
)


@contextlib.contextmanager
def processes(workdir: Path, profile: Path | None = None) -> Iterator[tuple[int, int]]:
    """Start the upstream and the sidecar as child processes; yields (upstream, sidecar) ports
    and stops both (SIGTERM, then SIGKILL) on exit. With ``profile``, the sidecar runs under
    cProfile and writes its stats there when it exits."""
    up_port, sc_port = free_port(), free_port()
    policy = workdir / "policy.yaml"
    policy.write_text(POLICY_YAML)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs: list[Proc] = []
    try:
        procs.append(
            start(
                [sys.executable, "-m", "kvgate_bench.bench_latency", "--serve-upstream",
                 "--port", str(up_port)],
                workdir / "upstream.log", env=env, port=up_port, timeout=20.0,
            )
        )  # fmt: skip
        sidecar = sidecar_argv(
            "--log-level", "WARNING", "--passthrough-path", "/bench/chat",
            upstream=f"http://127.0.0.1:{up_port}", policy=policy, port=sc_port, profile=profile,
        )  # fmt: skip
        procs.append(start(sidecar, workdir / "sidecar.log", env=env, port=sc_port, timeout=20.0))
        yield up_port, sc_port
    finally:
        stop_all(p.popen for p in procs)


# ---------------------------------------------------------------------- measurement


@dataclass(frozen=True, slots=True)
class PathStats:
    """Latency percentiles of one path, milliseconds."""

    p50: float
    p99: float
    mean: float


def _stats(ns: Sequence[int]) -> PathStats:
    ms = [x / 1e6 for x in ns]
    return PathStats(
        percentile(ms, 50) or 0.0, percentile(ms, 99) or 0.0, sum(ms) / max(1, len(ms))
    )


@dataclass(frozen=True, slots=True)
class Comparison:
    """Direct vs via-sidecar for one measure (e.g. round trip, TTFT).

    ``passthrough`` is the same request through the sidecar on a path it forwards without
    admission (``/bench/chat``): the cost of the proxy itself, so ``sidecar − passthrough`` is
    what admission, body parsing and accounting add on top.
    """

    name: str
    direct: PathStats
    sidecar: PathStats
    passthrough: PathStats | None
    samples: int

    @property
    def added_p50(self) -> float:
        """p50(sidecar) − p50(direct), ms."""
        return self.sidecar.p50 - self.direct.p50

    @property
    def added_p99(self) -> float:
        """p99(sidecar) − p99(direct), ms."""
        return self.sidecar.p99 - self.direct.p99


ADMITTED_PATH = "/v1/chat/completions"
PASSTHROUGH_PATH = "/bench/chat"


def measure(
    up_port: int, sc_port: int, *, stream: bool, n: int, warmup: int, block: int
) -> list[Comparison]:
    """``warmup`` then ``n`` requests on each path (direct, via the sidecar's admitted path, via
    its pass-through), in rotating blocks of ``block`` requests.

    Returns one :class:`Comparison` for non-streaming requests (round trip), or two for
    streaming ones (time to the first content byte, and to the end of the stream).
    """
    paths = (
        ("direct", RawHTTP("127.0.0.1", up_port), build_request(up_port, stream)),
        ("sidecar", RawHTTP("127.0.0.1", sc_port), build_request(sc_port, stream)),
        (
            "passthrough",
            RawHTTP("127.0.0.1", sc_port),
            build_request(sc_port, stream, PASSTHROUGH_PATH),
        ),
    )
    marker = _CONTENT.encode() if stream else None
    first: dict[str, list[int]] = {name: [] for name, _, _ in paths}
    whole: dict[str, list[int]] = {name: [] for name, _, _ in paths}
    try:
        for phase, count in (("warmup", warmup), ("measure", n)):
            done = 0
            while done < count:
                k = min(block, count - done)
                shift = (done // block) % len(paths)  # rotate which path goes first
                for name, conn, req in paths[shift:] + paths[:shift]:
                    for _ in range(k):
                        status, t_first, t_end = conn.roundtrip(req, marker)
                        if status != 200:
                            raise RuntimeError(f"{name}: HTTP {status}")
                        if phase == "measure":
                            first[name].append(t_first)
                            whole[name].append(t_end)
                done += k
    finally:
        for _, conn, _ in paths:
            conn.close()

    def comp(name: str, data: dict[str, list[int]]) -> Comparison:
        return Comparison(
            name,
            _stats(data["direct"]),
            _stats(data["sidecar"]),
            _stats(data["passthrough"]),
            n,
        )

    if not stream:
        return [comp("round trip", whole)]
    return [comp("stream: TTFT", first), comp("stream: whole", whole)]


def format_table(rows: Sequence[Comparison]) -> str:
    """A markdown table of the comparisons (milliseconds)."""
    out = [
        "| request | direct p50 | via sidecar p50 | added p50 | direct p99 | via sidecar p99 "
        "| added p99 | p50 ratio | p99 ratio | pass-through p50 / p99 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in rows:
        pt = "-" if c.passthrough is None else f"{c.passthrough.p50:.3f} / {c.passthrough.p99:.3f}"
        out.append(
            f"| {c.name} | {c.direct.p50:.3f} | {c.sidecar.p50:.3f} | **{c.added_p50:.3f}** "
            f"| {c.direct.p99:.3f} | {c.sidecar.p99:.3f} | **{c.added_p99:.3f}** "
            f"| {c.sidecar.p50 / c.direct.p50:.2f}x | {c.sidecar.p99 / c.direct.p99:.2f}x "
            f"| {pt} |"
        )
    return "\n".join(out)


def breakdown(c: Comparison) -> str:
    """One sentence splitting the added p50 into the proxy hop and what admission adds."""
    if c.passthrough is None:
        return ""
    hop = c.passthrough.p50 - c.direct.p50
    adm = c.sidecar.p50 - c.passthrough.p50
    return (
        f"Of the added p50 ({c.added_p50:.3f} ms), the proxy hop itself (pass-through, no "
        f"admission) accounts for {hop:.3f} ms and admission + body parsing + accounting for "
        f"{adm:.3f} ms."
    )


def verdict(c: Comparison) -> str:
    """Whether the non-streaming round trip meets the targets, and by how much it misses."""
    parts = []
    for label, added, target in (
        ("p50", c.added_p50, TARGET_ADDED_P50_MS),
        ("p99", c.added_p99, TARGET_ADDED_P99_MS),
    ):
        if added <= target:
            parts.append(f"added {label} {added:.3f} ms ≤ {target:g} ms: met")
        else:
            parts.append(
                f"added {label} {added:.3f} ms > {target:g} ms: MISSED by {added - target:.3f} ms"
            )
    return "; ".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns 0 (1 with ``--check`` when a target is missed)."""
    p = argparse.ArgumentParser(prog="python -m kvgate_bench.bench_latency", description=__doc__)
    p.add_argument("-n", "--requests", type=int, default=2000, help="measured requests per path")
    p.add_argument("--warmup", type=int, default=2000, help="warm-up requests per path")
    p.add_argument("--block", type=int, default=100, help="requests per interleaved block")
    p.add_argument("--no-stream", action="store_true", help="skip the streaming variant")
    p.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    p.add_argument(
        "--profile-sidecar",
        type=Path,
        metavar="FILE",
        help="run the sidecar under cProfile and write its stats to FILE (inflates its latency)",
    )
    p.add_argument("--serve-upstream", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_upstream:
        serve_upstream(args.port)
        return 0

    rows: list[Comparison] = []
    with (
        tempfile.TemporaryDirectory(prefix="kvgate-bench-") as tmp,
        processes(Path(tmp), args.profile_sidecar) as (
            up,
            sc,
        ),
    ):
        kw = {"n": args.requests, "warmup": args.warmup, "block": args.block}
        rows += measure(up, sc, stream=False, **kw)
        if not args.no_stream:
            rows += measure(up, sc, stream=True, **kw)
    print(
        f"# kvgate sidecar added latency ({args.requests} requests per path after "
        f"{args.warmup} warm-up, blocks of {args.block}, {platform.python_implementation()} "
        f"{platform.python_version()}, {os.cpu_count()} CPUs)\n"
    )
    print(format_table(rows))
    print("\nmilliseconds; added = percentile via sidecar − same percentile direct.")
    print(breakdown(rows[0]))
    print("Targets (round trip): " + verdict(rows[0]) + ".")
    met = rows[0].added_p50 <= TARGET_ADDED_P50_MS and rows[0].added_p99 <= TARGET_ADDED_P99_MS
    return 1 if (args.check and not met) else 0


if __name__ == "__main__":
    sys.exit(main())
