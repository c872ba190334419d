"""``python -m kvgate_bench.soak``: the sidecar's resident memory over many requests with mixed
outcomes and many tenants; prints the curve.

The sidecar is the real CLI (``python -m kvgate_agent sidecar``, a child process) in front of a
fast model-server stand-in served by this process, which also sends the requests over
``--concurrency`` keep-alive connections. Request ``i`` comes from tenant ``t{i % tenants}`` and
its outcome cycles through :data:`MIX`: answered (plain, streamed, streamed with usage), refused
(429: the ``hot`` tenant over its per-tenant budget; 400: malformed JSON), cut by the client (a
stream reset with SO_LINGER 0 after its first event) and failed upstream (a 500; a connection
reset: 502). Every ``sample_every`` requests, the sidecar's ``VmRSS`` (``/proc/<pid>/status``)
is read. Reported: the curve, the statuses, the growth over the last third of the run, and the
sidecar's gauges at the end (in flight, queued, reserved: all 0 when nothing leaked).

Usage: ``python -m kvgate_bench.soak [--requests 100000] [--tenants 10000]``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import socket
import struct
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yaml
from aiohttp import web

from kvgate_bench.kit.processes import start_sidecar
from kvgate_bench.kit.toolkit import free_port, memory_kib, parse_samples, series

#: The outcome of request ``i`` is ``MIX[i % len(MIX)]``.
MIX = (
    *["ok"] * 9,
    *["stream"] * 3,
    "stream_usage",
    "malformed",
    "hot",
    "hot",
    "status_500",
    "reset",
    "abort",
    "abort",
)
POLICY = {
    "apiVersion": "kvgate.io/v1alpha1",
    "kind": "RateLimitPolicy",
    "metadata": {"name": "soak"},
    "spec": {
        "model": {"maxModelLen": 8192},
        "capacity": {"kvCacheTokens": 10_000_000},
        "concurrency": {"maxRequests": 1024},
        "overload": {"actions": ["Reject"]},  # over a budget: 429 at once, never queued
        "rateLimits": [
            {"name": "per-tenant", "per": "Tenant", "requestsPerMinute": 60, "burstRequests": 10}
        ],
    },
}
_EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"tok "}}]}\n\n'
_USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":4}}\n\n'
_ANSWER = json.dumps(
    {
        "id": "x",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "a b c d"}}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13},
    }
).encode()


@dataclass
class SoakResult:
    """One run: ``curve`` as (requests done, sidecar VmRSS bytes); ``statuses`` by outcome of
    :data:`MIX` and HTTP status (``"abort"`` counts the cut streams); ``gauges``: the sidecar's
    ``/kvgate/metrics`` at the end; ``seconds``: the run's wall time."""

    curve: list[tuple[int, int]] = field(default_factory=list)
    statuses: collections.Counter[tuple[str, int]] = field(default_factory=collections.Counter)
    gauges: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def last_third_growth(self) -> float:
        """VmRSS growth over the last third of the run, as a fraction of its value there."""
        done = self.curve[-1][0]
        at = next(rss for n, rss in self.curve if n >= done * 2 / 3)
        return (self.curve[-1][1] - at) / at

    @property
    def unexpected(self) -> dict[tuple[str, int], int]:
        """Outcomes whose status is not the one their kind must get."""
        want = {"ok": 200, "stream": 200, "stream_usage": 200, "malformed": 400}
        want |= {"status_500": 500, "reset": 502, "abort": 200}
        return {
            k: v
            for k, v in self.statuses.items()
            if (k[0] == "hot" and k[1] not in (200, 429)) or (k[0] != "hot" and want[k[0]] != k[1])
        }


# ---------------------------------------------------------------------- the model server


async def _answer(request: web.Request) -> web.StreamResponse:
    """The stand-in model server: the outcome named by ``x-soak`` (see :data:`MIX`)."""
    if request.method != "POST":
        return web.Response(status=404 if request.path == "/metrics" else 200)
    kind = request.headers.get("x-soak", "ok")
    body = await request.read()
    if kind == "status_500":
        return web.json_response({"error": {"message": "soak"}}, status=500)
    if kind == "reset":
        assert request.transport is not None
        request.transport.abort()
        return web.Response()  # never sent: the connection is gone
    if b'"stream": true' not in body and b'"stream":true' not in body:
        return web.Response(body=_ANSWER, content_type="application/json")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    try:
        for _ in range(100 if kind == "abort" else 4):  # "abort": 5 s, cut by its client
            await resp.write(_EVENT)
            if kind == "abort":
                await asyncio.sleep(0.05)
        if b"include_usage" in body:
            await resp.write(_USAGE)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionResetError:  # the sidecar dropped it: its client went away
        pass
    return resp


@asynccontextmanager
async def _model_server() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", _answer)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=0.2)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port, backlog=4096).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def _sidecar(upstream: str, workdir: Path) -> AsyncIterator[tuple[str, int]]:
    """The real sidecar CLI in front of ``upstream``: yields (base URL, pid)."""
    policy = workdir / "policy.yaml"
    policy.write_text(yaml.safe_dump(POLICY))
    proc = await asyncio.to_thread(
        start_sidecar,
        workdir / "sidecar.log",
        "--log-level",
        "ERROR",
        upstream=upstream,
        policy=policy,
        status=None,
    )
    try:
        yield proc.url, proc.pid
    finally:
        await asyncio.to_thread(proc.stop, 30)


# ---------------------------------------------------------------------- the clients


def _body(kind: str) -> bytes:
    if kind == "malformed":
        return b'{"model": "m", "messages": [{"role": "user", "content": "hi"}'
    req: dict[str, object] = {
        "model": "m",
        "messages": [{"role": "user", "content": "say four words"}],
        "max_tokens": 16,
    }
    if kind in ("stream", "stream_usage", "abort"):
        req["stream"] = True
    if kind == "stream_usage":
        req["stream_options"] = {"include_usage": True}
    return json.dumps(req).encode()


async def _abort(port: int, tenant: str) -> int:
    """A stream cut by its client with a TCP reset after its first event; returns its
    status."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = _body("abort")
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"x-soak: abort\r\nx-kvgate-tenant: %s\r\nContent-Length: %d\r\n\r\n%s"
        % (tenant.encode(), len(body), body)
    )
    got = b""
    while b"data: " not in got and not (b"\r\n\r\n" in got and b" 200 " not in got[:13]):
        part = await reader.read(65536)
        if not part:
            break
        got += part
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
    return int(got.split(b" ", 2)[1]) if got.startswith(b"HTTP/1.1 ") else 0


async def _one(s: aiohttp.ClientSession, url: str, port: int, i: int, tenants: int) -> int:
    """Request ``i``; returns its status (0: no answer within 30 s)."""
    kind = MIX[i % len(MIX)]
    tenant = "hot" if kind == "hot" else f"t{i % tenants}"
    headers = {"x-soak": kind, "x-kvgate-tenant": tenant, "Content-Type": "application/json"}
    try:
        async with asyncio.timeout(30):
            if kind == "abort":
                return await _abort(port, tenant)
            async with s.post(url + "/v1/chat/completions", data=_body(kind), headers=headers) as r:
                await r.read()
                return r.status
    except TimeoutError:
        return 0


async def soak(
    requests: int, tenants: int = 10_000, concurrency: int = 64, samples: int = 30
) -> SoakResult:
    """Run ``requests`` requests through a fresh sidecar (see the module docstring), reading
    its VmRSS ``samples`` times along the way (and once before the first request)."""
    result = SoakResult()
    every = max(1, requests // samples)
    with tempfile.TemporaryDirectory(prefix="kvgate-soak-") as tmp:
        async with _model_server() as upstream, _sidecar(upstream, Path(tmp)) as (url, pid):
            port = int(url.rsplit(":", 1)[1])
            result.curve.append((0, memory_kib(pid, "VmRSS") * 1024))
            todo = iter(range(requests))
            done = 0
            t0 = time.monotonic()
            connector = aiohttp.TCPConnector(limit=concurrency)
            async with aiohttp.ClientSession(connector=connector) as s:

                async def worker() -> None:
                    nonlocal done
                    for i in todo:
                        status = await _one(s, url, port, i, tenants)
                        result.statuses[(MIX[i % len(MIX)], status)] += 1
                        done += 1
                        if done % every == 0:
                            result.curve.append((done, memory_kib(pid, "VmRSS") * 1024))

                await asyncio.gather(*(worker() for _ in range(concurrency)))
                result.seconds = time.monotonic() - t0
                if result.curve[-1][0] != done:
                    result.curve.append((done, memory_kib(pid, "VmRSS") * 1024))
                await asyncio.sleep(0.5)  # the last aborted streams' cancellation
                async with s.get(url + "/kvgate/metrics") as r:
                    result.gauges = series(parse_samples(await r.text()))
    return result


def report(r: SoakResult) -> str:
    """The curve and the figures as text (Markdown)."""
    lines = [
        f"# sidecar resident memory: {r.curve[-1][0]} requests in {r.seconds:.0f} s "
        f"({r.curve[-1][0] / r.seconds:.0f}/s)",
        "",
        "| requests | VmRSS MiB |",
        "|---:|---:|",
        *(f"| {n} | {rss / 2**20:.1f} |" for n, rss in r.curve),
        "",
        f"growth over the last third: {100 * r.last_third_growth:+.2f} %",
        "outcomes: " + ", ".join(f"{k} {s}: {n}" for (k, s), n in sorted(r.statuses.items())),
        f"unexpected statuses: {r.unexpected or 'none'}",
        "at the end: "
        + ", ".join(
            f"{name} {r.gauges.get(name, float('nan')):g}"
            for name in (
                "kvgate_in_flight_requests",
                "kvgate_queue_length",
                "kvgate_kv_reserved_tokens",
                "kvgate_tenants_tracked",
                "kvgate_client_disconnects_total",
            )
        ),
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvgate_bench.soak", description=__doc__)
    p.add_argument("--requests", type=int, default=100_000)
    p.add_argument("--tenants", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--samples", type=int, default=30, help="VmRSS readings along the run")
    args = p.parse_args(argv)
    r = asyncio.run(soak(args.requests, args.tenants, args.concurrency, args.samples))
    print(report(r))
    return 1 if r.unexpected else 0


if __name__ == "__main__":
    raise SystemExit(main())
