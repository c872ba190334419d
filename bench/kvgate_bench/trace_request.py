"""``python -m kvgate_bench.trace_request``: the kvgate_agent files and functions one streamed
chat completion enters on its way through an in-process sidecar (issue 35's measure of how far a
request travels).

One process holds a model-server stand-in (aiohttp: ``/v1/models``, ``/health``, a streamed chat
completion of :data:`TOKENS` events and a usage event), the sidecar (:class:`Sidecar` served by
:class:`SidecarServer` on loopback, as the CLI serves it, the policy :data:`POLICY`) and the
client (raw asyncio streams, keep-alive). After ``--warmup`` untraced requests (first-time paths:
imports, the probe's first reads, connection set-up), one request is sent with
:func:`sys.setprofile` on (this thread and :func:`threading.setprofile` for any other) from the
first byte written to the last byte read; every Python ``call`` whose code lies under
``kvgate_agent/`` counts. The engine's usage poll is off (``engine_usage_seconds=0``) and the
policy names its KV capacity, so no background read of the engine falls inside the request.
The tree traced is the interpreted one: a module compiled by mypyc (``scripts/build-mypyc``, as in
the image) makes no Python calls a profiler sees.

Reported: distinct files, distinct functions (``file:qualname``), calls, how often consecutive
calls change file, and the rooms entered (``sidecar/<room>``, ``sidecar`` for its top,
``admission`` and its sub-packages, ``contract``...), each with its files; ``--list`` prints
every function; ``--json FILE`` writes it all.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from aiohttp import web

import kvgate_agent
from kvgate_agent.contract.policy import parse_policy
from kvgate_agent.sidecar.app import Sidecar, SidecarSettings
from kvgate_agent.sidecar.server import SidecarServer

#: The agent's package directory: a call counts when its code's file lies under it.
AGENT = Path(kvgate_agent.__file__).resolve().parent
#: The policy the request is admitted under: a KV capacity, a per-tenant token rate, a
#: concurrency cap, the queue (what a typical policy enforces).
POLICY: dict[str, Any] = {
    "apiVersion": "kvgate.io/v1alpha1",
    "kind": "RateLimitPolicy",
    "metadata": {"name": "trace"},
    "spec": {
        "model": {"maxModelLen": 4096},
        "capacity": {"kvCacheTokens": 100_000},
        "concurrency": {"maxRequests": 8},
        "rateLimits": [{"name": "per-tenant", "tokensPerMinute": 1_000_000, "per": "Tenant"}],
        "overload": {"actions": ["Queue", "Reject"]},
    },
}
#: The streamed chat completion sent (the OpenAI SDK's shape).
BODY = json.dumps(
    {
        "model": "m",
        "stream": True,
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "Say hello in three words."}],
    }
).encode()
#: Content events the stand-in streams before its usage event and ``[DONE]``.
TOKENS = 3


@dataclass
class Trace:
    """What one traced request entered.

    Attributes:
        status: the answer's HTTP status.
        calls: ``file:qualname`` -> calls (a coroutine's resumption counts as a call).
        switches: how many consecutive calls were in different files.
    """

    status: int = 0
    calls: Counter[str] = field(default_factory=Counter)
    switches: int = 0

    @property
    def files(self) -> list[str]:
        """The distinct files entered, relative to ``kvgate_agent/``, sorted."""
        return sorted({name.split(":", 1)[0] for name in self.calls})

    def rooms(self) -> dict[str, list[str]]:
        """Room -> its files entered: a sub-package of a top-level package for a file in one
        (``sidecar/reading``, its ``apis/`` included; ``admission/fairqueue``), else the
        top-level package (``sidecar`` for its top, ``admission``, ``contract``...)."""
        out: dict[str, list[str]] = {}
        for f in self.files:
            parts = f.split("/")
            room = "/".join(parts[:2]) if len(parts) > 2 else parts[0]
            out.setdefault(room, []).append(f)
        return out

    def summary(self) -> dict[str, Any]:
        """The figures as JSON-ready data."""
        return {
            "status": self.status,
            "files": len(self.files),
            "functions": len(self.calls),
            "calls": sum(self.calls.values()),
            "file_switches": self.switches,
            "rooms": self.rooms(),
            "functions_by_call": dict(self.calls.most_common()),
        }


class _Profiler:
    """The profile function: counts ``call`` events of code under :data:`AGENT`."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.last_file: str | None = None
        self.names: dict[Any, str | None] = {}  # code object -> "file:qualname" or None

    def __call__(self, frame: FrameType, event: str, arg: object) -> None:
        if event != "call":
            return
        code = frame.f_code
        name = self.names.get(code, "")
        if name == "":
            name = self._name(code.co_filename, code.co_qualname)
            self.names[code] = name
        if name is None:
            return
        self.trace.calls[name] += 1
        file = name.split(":", 1)[0]
        if self.last_file is not None and file != self.last_file:
            self.trace.switches += 1
        self.last_file = file

    @staticmethod
    def _name(filename: str, qualname: str) -> str | None:
        try:
            rel = Path(filename).resolve().relative_to(AGENT)
        except ValueError:
            return None
        return f"{rel.as_posix()}:{qualname}"


async def _engine(request: web.Request) -> web.StreamResponse:
    """The model-server stand-in: a chat stream, its models, its health; 404 else."""
    if request.path == "/v1/models":
        return web.json_response({"data": [{"id": "m", "max_model_len": 4096}]})
    if request.path == "/health":
        return web.Response(text="ok")
    if request.path != "/v1/chat/completions":
        return web.Response(status=404)
    await request.read()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(TOKENS):
        delta = {"choices": [{"index": 0, "delta": {"content": f"t{i} "}}]}
        await resp.write(b"data: " + json.dumps(delta).encode() + b"\n\n")
    usage = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": TOKENS}}
    await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int:
    """Send :data:`BODY` on the kept-alive connection and read the chunked answer to its end;
    returns the status."""
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: kvgate\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(BODY)
    )
    writer.write(head + BODY)
    await writer.drain()
    status_line = await reader.readuntil(b"\r\n")
    headers = (await reader.readuntil(b"\r\n\r\n")).lower()
    if b"transfer-encoding: chunked" in headers:
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    else:
        length = next(
            int(line.split(b":")[1])
            for line in headers.split(b"\r\n")
            if line.startswith(b"content-length:")
        )
        await reader.readexactly(length)
    return int(status_line.split()[1])


async def trace(warmup: int = 3) -> Trace:
    """Serve the stand-in and a sidecar in this event loop, send ``warmup`` requests, then
    trace one (see the module docstring)."""
    engine = web.Application()
    engine.router.add_route("*", "/{tail:.*}", _engine)
    engine_runner = web.AppRunner(engine, access_log=None)
    await engine_runner.setup()
    site = web.TCPSite(engine_runner, "127.0.0.1", 0)
    await site.start()
    port = engine_runner.addresses[0][1]
    settings = SidecarSettings(
        upstream=f"http://127.0.0.1:{port}",
        policy=parse_policy(POLICY),
        engine_usage_seconds=0.0,
    )
    server = SidecarServer(Sidecar(settings))
    await server.start(("127.0.0.1", 0), None)
    out = Trace()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        for _ in range(warmup):
            await _exchange(reader, writer)
        profiler = _Profiler(out)
        threading.setprofile(profiler)
        sys.setprofile(profiler)
        try:
            out.status = await _exchange(reader, writer)
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
        writer.close()
    finally:
        await server.cleanup()
        await engine_runner.cleanup()
    return out


def report(t: Trace, listing: bool) -> str:
    """The printed report: the figures, the rooms with their files, optionally every function."""
    s = t.summary()
    lines = [
        f"one streamed chat completion (status {t.status}) entered {s['files']} kvgate_agent "
        f"files, {s['functions']} functions, {s['calls']} calls, changing file "
        f"{s['file_switches']} times",
        "",
    ]
    for room, files in s["rooms"].items():
        names = ", ".join(f.rsplit("/", 1)[-1] for f in files)
        lines.append(f"  {room} ({len(files)}): {names}")
    if listing:
        lines.append("")
        lines += [f"  {n:6d}  {name}" for name, n in sorted(t.calls.items())]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """The entry point: trace, print, write ``--json``."""
    ap = argparse.ArgumentParser(prog="python -m kvgate_bench.trace_request", description=__doc__)
    ap.add_argument("--warmup", type=int, default=3, help="untraced requests first (default 3)")
    ap.add_argument("--list", action="store_true", help="print every function and its calls")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    t = asyncio.run(trace(args.warmup))
    print(report(t, args.list))
    if args.json is not None:
        args.json.write_text(json.dumps(t.summary(), indent=2) + "\n")
    return 0 if t.status == 200 else 1


if __name__ == "__main__":
    sys.exit(main())
