"""``python -m kvgate_bench.peers``: the kvgate sidecar side by side with nginx and LiteLLM.

One run, one machine, pinned CPUs: the load generator (wrk, one thread) and this process's
stream client on ``--client-cpu`` (default 0), every server on ``--server-cpu`` (default 1),
with ``taskset``. The arms (``servers.py``): ``direct`` (nginx ``return 200``), ``nginx`` as
a keep-alive proxy in front of it, the ``litellm`` proxy (one worker, no database), the
``kvgate`` sidecar of this checkout with a realistic policy and ``kvgate pass-through`` (the
same sidecar on an allowlisted path: the proxy hop without admission); the ``kvgate aiohttp
leg`` arm went with that leg (retired, issue 35). The sidecars run with the mypyc-compiled
modules the agent image ships (``--pure``: this checkout's Python sources).

1. Load (``load.py``): chat POST bodies of 1 KB, 16 KB and 200 KB at 1, 32 and 256
   connections, each cell ``--seconds`` per arm, the arms in rotated order cell by cell so that
   drift hits them alike; p50/p99 from ``wrk --latency``, requests/s, errors.
2. Streaming (``load.py``): 256 concurrent streams from the llm-d simulator at 10 ms and
   at 0 ms inter-token latency, through the sidecar and through nginx; server CPU per chunk.
3. Memory: the sidecar's RSS per 1,000 idle keep-alive connections, and with 256 streams open.

It prints the tables, the ratios and the own server leg's targets (issue 25: each a ratio within
the run), and replaces its section of
``docs/benchmarks.md`` (``--no-write`` leaves the file alone). It refuses, exit status 1,
before it measures anything and again before it writes, when text it did not write sits between
the section's markers (:mod:`kvgate_bench.kit.doc_block`: move that text outside them, or
``--force``). It installs what the peers need on first use (``tools.py``: nginx and wrk
from Debian, LiteLLM from PyPI into its own venv).
``--quick``: two body sizes × two concurrencies, short windows (about 2 minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import importlib.metadata
import os
import signal
import sys
import tempfile
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import TypeVar

from kvgate_bench import compiled
from kvgate_bench.kit.doc_block import BlockError
from kvgate_bench.kit.toolkit import free_port, machine
from kvgate_bench.peers.load import (
    IdleResult,
    StreamResult,
    StreamRow,
    chat_body,
    lua_script,
    measure_idle,
    measure_streams,
    run_wrk,
    wrk_command,
)
from kvgate_bench.peers.report import (
    ARMS,
    DIRECT,
    KVGATE,
    LITELLM,
    NGINX,
    PASSTHROUGH,
    Cell,
    Report,
    render,
    replace_section,
    size_label,
)
from kvgate_bench.peers.servers import (
    CHAT_PATH,
    PASSTHROUGH_PATH,
    Fleet,
    Server,
    commit,
    fleet,
    nginx_direct_conf,
    nginx_proxy_conf,
    version,
    wait_answer,
)
from kvgate_bench.peers.tools import Tools, ensure_tools

REPO = Path(__file__).resolve().parents[3]
DOCS = REPO / "docs" / "benchmarks.md"
_T = TypeVar("_T")
TITLE = "## kvgate next to nginx and LiteLLM (`python -m kvgate_bench.peers`)"


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """What one run measures: body sizes (bytes), concurrencies, seconds per cell, streams."""

    bodies: tuple[int, ...]
    connections: tuple[int, ...]
    seconds: float
    streams: int
    itls_ms: tuple[float, ...]
    stream_warmup: float
    stream_seconds: float
    stream_tokens: int
    idle_connections: int


FULL = Plan((1024, 16384, 204800), (1, 32, 256), 10.0, 256, (10.0, 0.0), 3.0, 10.0, 200, 1000)
QUICK = Plan((1024, 204800), (1, 32), 3.0, 256, (10.0, 0.0), 2.0, 4.0, 100, 1000)


# ------------------------------------------------------------------------------------- the run


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m kvgate_bench.peers", description=__doc__)
    p.add_argument("--quick", action="store_true", help="fewer cells, short windows (~2 min)")
    p.add_argument("--seconds", type=float, help="seconds per load cell (default 10; quick 3)")
    p.add_argument("--client-cpu", type=int, default=0, help="CPU of wrk and the stream client")
    p.add_argument("--server-cpu", type=int, default=1, help="CPU of every server")
    p.add_argument("--no-litellm", action="store_true", help="leave the LiteLLM arm out")
    p.add_argument("--no-stream", action="store_true", help="skip streaming and memory")
    p.add_argument("--no-write", action="store_true", help="do not touch docs/benchmarks.md")
    p.add_argument(
        "--pure",
        action="store_true",
        help="run the sidecars on this checkout's Python sources (default: with the mypyc-"
        "compiled modules the agent image ships, built or found in the cache)",
    )
    p.add_argument("--docs", type=Path, default=DOCS, help="the Markdown file to update")
    p.add_argument(
        "--force",
        action="store_true",
        help="overwrite text between the section's markers that the last run did not write "
        "(default: refuse, exit 1)",
    )
    p.add_argument("--workdir", type=Path, help="keep configs and server logs here")
    return p.parse_args(argv)


def header(tools: Tools, plan: Plan, args: argparse.Namespace) -> list[tuple[str, str]]:
    """The report's first rows: when, on what, with which versions, pinned how."""
    lite = "not run"
    if tools.litellm:
        py = str(Path(tools.litellm).with_name("python"))
        lite = version([py, "-c", "import importlib.metadata as m; print(m.version('litellm'))"])
    dist = importlib.metadata.version
    rows = [("date", datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"))]
    rows += machine()
    one, five, _ = os.getloadavg()
    rows.append(("load average", f"{one:.1f} (1 min), {five:.1f} (5 min) at the end of the run"))
    rows += [
        ("pinning", f"wrk (1 thread) and the stream client on CPU {args.client_cpu}; every "
                    f"server on CPU {args.server_cpu} (taskset); nginx 1 worker, LiteLLM 1 worker"),
        ("kvgate", f"{commit(REPO)}, aiohttp {dist('aiohttp')}, uvloop {dist('uvloop')}, "
                   + ("Python sources (--pure)" if args.pure else
                      "the mypyc-compiled modules of scripts/mypyc-modules.txt, as the agent "
                      "image ships them")),
        ("peers", f"{version([tools.nginx, '-v']).removeprefix('nginx version: ')}, "
                  f"LiteLLM {lite}, {version([tools.wrk, '-v']).split(' [')[0]}, "
                  f"{Path(tools.llmd_sim).name}"),
        ("load", f"{plan.seconds:g} s per cell and arm, arms rotated cell by cell, each run "
                 f"started once the servers idle (under 0.1 core, at most {SETTLE_TIMEOUT_S:g} s)"
                 + (" (--quick)" if args.quick else "")),
    ]  # fmt: skip
    return rows


def arm_urls(direct: int, proxy: int, litellm: int | None, kvgate: int) -> dict[str, str]:
    """The URL each arm's load is sent to (``litellm`` None: not run)."""
    urls = {
        DIRECT: f"http://127.0.0.1:{direct}{CHAT_PATH}",
        NGINX: f"http://127.0.0.1:{proxy}{CHAT_PATH}",
        KVGATE: f"http://127.0.0.1:{kvgate}{CHAT_PATH}",
        PASSTHROUGH: f"http://127.0.0.1:{kvgate}{PASSTHROUGH_PATH}",
    }
    if litellm is not None:
        urls[LITELLM] = f"http://127.0.0.1:{litellm}{CHAT_PATH}"
    return {a: urls[a] for a in ARMS if a in urls}


#: Seconds a cell waits for the servers to idle before its load starts: LiteLLM works through
#: the backlog of a 256-connection cell for tens of seconds after wrk stops, and the arm after
#: it in the rotation (on the same CPU) measured that backlog's CPU at 10 s.
SETTLE_TIMEOUT_S = 90.0


def settle(
    servers: Sequence[Server], *, idle: float = 0.1, timeout: float = SETTLE_TIMEOUT_S
) -> bool:
    """Wait until ``servers`` together use under ``idle`` of a core over 0.25 s (the last
    cell's backlog drained), at most ``timeout`` seconds; False when they never settled."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = sum(s.cpu_seconds() for s in servers)
        time.sleep(0.25)
        if sum(s.cpu_seconds() for s in servers) - before < idle * 0.25:
            return True
    return False


def run_grid(
    wrk: str, urls: dict[str, str], plan: Plan, workdir: Path, cpu: int,
    servers: Sequence[Server] = (),
) -> list[Cell]:  # fmt: skip
    """Every (body, connections) cell through every arm, arms rotated per cell."""
    cells: list[Cell] = []
    arms = list(urls)
    i = 0
    for size in plan.bodies:
        body = workdir / f"body-{size}.json"
        body.write_bytes(chat_body(size))
        script = workdir / f"post-{size}.lua"
        script.write_text(lua_script(body))
        for conns in plan.connections:
            order = arms[i % len(arms) :] + arms[: i % len(arms)]
            i += 1
            for arm in order:
                cmd = wrk_command(wrk, urls[arm], script, connections=conns,
                                  seconds=plan.seconds, cpu=cpu)  # fmt: skip
                if not settle(servers):
                    print(f"  (servers not idle after {SETTLE_TIMEOUT_S:g} s)", file=sys.stderr)
                raw = workdir / f"wrk-{arm.replace(' ', '-')}-{size}-c{conns}.txt"
                result = run_wrk(cmd, timeout=plan.seconds + 60, save=raw)
                cells.append(Cell(arm, size, conns, result))
                print(
                    f"  {size_label(size):>6} c={conns:<3} {arm:<20} p50 "
                    f"{result.p50_us:9.0f} us  p99 {result.p99_us:9.0f} us  "
                    f"{result.rps:9.0f} rps  errors {result.errors}",
                    file=sys.stderr,
                )
    return cells


def _run_async(coro: Coroutine[object, object, _T]) -> _T:
    """Run ``coro`` on a fresh uvloop event loop (the sidecar's own loop: a lighter client)."""
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def stream_phase(
    f: Fleet, tools: Tools, plan: Plan, sims: dict[float, tuple[int, int]], proxy: Server
) -> tuple[list[StreamRow], IdleResult | None, list[str]]:
    """Streaming through the sidecar and nginx at each ITL, and the idle-connection memory.

    ``sims`` maps an ITL (ms) to (simulator port, nginx's port proxying to it); ``proxy`` is
    the nginx proxy (its worker's CPU is counted with its master's).
    """
    rows: list[StreamRow] = []
    idle = None
    notes: list[str] = []
    for itl, (sim_port, via_nginx) in sims.items():
        sim = f.llmd_sim(tools.llmd_sim, itl, port=sim_port)
        sidecar: Server = f.sidecar(f"kvgate-stream-itl{itl:g}", sim.port)
        wait_answer(f"http://127.0.0.1:{sidecar.port}{CHAT_PATH}", sidecar.proc, timeout=30)
        if idle is None:
            idle, failed = _run_async(
                measure_idle(sidecar.port, sidecar.proc.pid, connections=plan.idle_connections)
            )
            if failed:
                notes.append(f"Idle connections: {failed} of {plan.idle_connections} failed.")
        arms = ((KVGATE, sidecar), (NGINX, proxy))
        for arm, server in arms:
            port = via_nginx if arm == NGINX else server.port
            result: StreamResult = _run_async(
                measure_streams(
                    port, server.cpu_seconds, server.pids[-1], streams=plan.streams,
                    warmup=plan.stream_warmup, seconds=plan.stream_seconds,
                    max_tokens=plan.stream_tokens, upstream_cpu=sim.cpu_seconds,
                )
            )  # fmt: skip
            rows.append(StreamRow(arm, itl, result))
            print(
                f"  stream {arm:<7} ITL {itl:g} ms: {result.chunks_per_second:8.0f} chunks/s, "
                f"{result.cores:.2f} cores, {result.us_per_chunk or 0:.1f} us/chunk, "
                f"errors {result.errors}",
                file=sys.stderr,
            )
        f.stop(sidecar)
        f.stop(sim)
    return rows, idle, notes


def run(args: argparse.Namespace) -> Report:
    """Install what is missing, start the arms, measure, and return the report."""
    plan = QUICK if args.quick else FULL
    if args.seconds:
        plan = dataclasses.replace(plan, seconds=args.seconds)
    os.sched_setaffinity(0, {args.client_cpu})
    t0 = time.monotonic()
    tools = ensure_tools(REPO, litellm=not args.no_litellm)
    for what, secs in tools.install_seconds.items():
        print(f"installed {what} in {secs:.0f} s", file=sys.stderr)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvgate-peers-"))
    workdir.mkdir(parents=True, exist_ok=True)
    agent_path = None
    if not args.pure:
        t = time.monotonic()
        agent_path = compiled.overlay(compiled.build(), workdir / "agent")
        print(f"compiled build ready in {time.monotonic() - t:.0f} s", file=sys.stderr)
    with fleet(workdir, args.server_cpu) as f:
        f.agent_path = agent_path
        d_port, p_port = free_port(), free_port()
        sims = {itl: (free_port(), free_port()) for itl in plan.itls_ms}
        routes = {p_port: d_port, **{via: sim for sim, via in sims.values()}}
        f.nginx(tools.nginx, "direct", nginx_direct_conf(workdir, d_port), d_port)
        proxy = f.nginx(tools.nginx, "proxy", nginx_proxy_conf(workdir, routes), p_port)
        lite = f.litellm(tools.litellm, d_port) if tools.litellm else None
        kvgate = f.sidecar("kvgate", d_port)
        urls = arm_urls(d_port, p_port, lite.port if lite else None, kvgate.port)
        for url in urls.values():
            wait_answer(url, kvgate.proc, timeout=30)
        print(f"arms up in {time.monotonic() - t0:.0f} s; load:", file=sys.stderr)
        cells = run_grid(tools.wrk, urls, plan, workdir, args.client_cpu, list(f.servers))
        if lite is not None:
            f.stop(lite)
        f.stop(kvgate)
        streams: list[StreamRow] = []
        idle = None
        notes: list[str] = []
        if not args.no_stream:
            streams, idle, notes = stream_phase(f, tools, plan, sims, proxy)
    errs = sum(c.result.errors for c in cells)
    if errs:
        notes.append(f"**{errs} requests failed** (non-2xx or socket errors): see `errors`.")
    notes.append(
        "Targets: the bounds are issue 25's; '-' where this run has no such cell (`--quick` runs "
        "no 16 KB body at c=256). Stream `errors`: answers other than 200 or socket errors "
        "(each costs its client 0.1 s, so a row with errors counts fewer chunks)."
    )
    notes.append(
        "Added = the arm's percentile minus direct's in the same cell. Streaming: server CPU "
        "(/proc/<pid>/stat utime+stime, nginx's worker included) over the window / SSE chunks "
        "counted by the client; the simulator's CPU is its own column. Memory: VmRSS."
    )
    notes.append(f"Run time: {time.monotonic() - t0:.0f} s.")
    return Report(header(tools, plan, args), cells, streams, idle, notes)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print the report, update the docs section."""
    args = parse_args(argv)

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds through the fleet, which stops every server

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started in background
    if not args.no_write and (refusal := docs_refusal(args.docs, None, force=args.force)):
        print(f"{refusal}\nnothing measured", file=sys.stderr)
        return 1
    report = run(args)
    print(render(report, markdown=False))
    if not args.no_write:
        if refusal := docs_refusal(args.docs, render(report, markdown=True), force=args.force):
            print(f"{refusal}\nthe report is printed above; {args.docs} is unchanged",
                  file=sys.stderr)  # fmt: skip
            return 1
        print(f"wrote the section of {args.docs}", file=sys.stderr)
    return 0


def docs_refusal(docs: Path, body: str | None, *, force: bool) -> str | None:
    """Write the section (``body``: its Markdown) into ``docs``, or with ``body`` ``None`` only
    check that it could be written; ``None`` when it was (or could be), else why not (the
    message of :class:`~kvgate_bench.kit.doc_block.BlockError`, naming the file).

    Raises:
        OSError: reading or writing ``docs``.
    """
    doc = docs.read_text(encoding="utf-8") if docs.exists() else ""
    try:
        new = replace_section(doc, body or "", title=TITLE, name=str(docs), force=force)
    except BlockError as e:
        return str(e)
    if body is not None:
        docs.write_text(new, encoding="utf-8")
    return None
