"""``python -m kvgate_bench.demo``: kvgate's main job, shown on a built-in default.

It starts kvgate-sim (a vLLM-compatible simulator) in this process with a deliberately small KV
pool, then offers the same bursty three-tenant load twice, each time to a fresh simulator:

1. DIRECT to the simulator: the engine admits whatever its KV pool holds *now*; as sequences
   grow the pool runs out and the scheduler preempts (recomputes) running requests.
2. THROUGH the kvgate sidecar with ``examples/ratelimitpolicy.yaml``: requests reserve
   ``prompt + max_tokens`` of KV before they reach the engine, tenants are held to their token
   budgets, long outputs are clamped rather than refused, the rest waits in a bounded queue.

The tenants: ``chat`` (many short prompts, short answers), ``long-prompt`` (few requests with
prompts of thousands of tokens) and ``long-output`` (short prompts, large ``max_tokens``).

It prints, per tenant and run, requests, completions, preemptions (the simulator's per-tenant
counter), time to first token, tokens delivered, 429s, degradations and queued requests, and a
takeaway computed from those numbers. Takes about 40 s with the defaults. Time is compressed:
the simulator's 4 ms decode step is a few times faster than a real GPU's for a batch this size,
so a 2048-token answer takes 8 s instead of half a minute.

Units: times in seconds unless named ``_ms``; sizes in tokens.

The offered load is :mod:`~kvgate_bench.demo.http_schedule`'s, the report
:mod:`~kvgate_bench.demo.http_report`'s; this module runs the load and is the entry point.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

import aiohttp

from kvgate_agent.contract.policy import RateLimitPolicy, load_policy
from kvgate_agent.sidecar.app import Sidecar, SidecarSettings
from kvgate_agent.sidecar.server import SidecarServer
from kvgate_bench.demo.common import add_quiet_flag, add_schedule_flags
from kvgate_bench.demo.http_report import (
    COLUMNS,
    DemoReport,
    Mode,
    RunResult,
    format_report,
    report_rows,
    takeaway,
)
from kvgate_bench.demo.http_schedule import (
    DEFAULT_DURATION,
    DEFAULT_POLICY,
    DEFAULT_SEED,
    MODEL,
    TENANTS,
    DemoConfig,
    TenantProfile,
    build_schedule,
)
from kvgate_bench.demo.loadgen import LoadRun, RequestSpec, run_load
from kvgate_bench.sim.server import start_sim

#: The demo's public names, its schedule's and its report's included (one import for a caller).
__all__ = [
    "COLUMNS",
    "DEFAULT_POLICY",
    "TENANTS",
    "DemoConfig",
    "DemoReport",
    "Progress",
    "RunResult",
    "TenantProfile",
    "build_parser",
    "build_schedule",
    "format_report",
    "main",
    "report_rows",
    "run_demo",
    "run_once",
    "takeaway",
]


class Progress:
    """A single-line progress display on a terminal (stderr), redrawn a few times a second;
    silent when disabled or when the stream is not a terminal (phase lines only)."""

    def __init__(self, stream: TextIO | None) -> None:
        self.stream = stream
        self.tty = stream is not None and stream.isatty()
        self._task: asyncio.Task[None] | None = None
        self._width = 0

    def _draw(self, label: str, run: LoadRun) -> None:
        assert self.stream is not None
        line = (
            f"[{label}] {run.done}/{run.total} requests done, "
            f"{run.sent - run.done} in flight, {run.elapsed:5.1f} s"
        )
        pad = max(0, self._width - len(line))
        self._width = len(line)
        self.stream.write("\r" + line + " " * pad)
        self.stream.flush()

    async def _loop(self, label: str, run: LoadRun) -> None:
        while True:
            self._draw(label, run)
            await asyncio.sleep(0.25)

    def start(self, label: str, run: LoadRun) -> None:
        """Begin showing ``run``'s progress under ``label``."""
        if self.stream is None:
            return
        if not self.tty:
            self.stream.write(f"[{label}] sending {run.total} requests...\n")
            self.stream.flush()
            return
        self._task = asyncio.create_task(self._loop(label, run))

    async def stop(self, label: str, run: LoadRun) -> None:
        """Stop the display and leave a final line."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
            self._draw(label, run)
            assert self.stream is not None
            self.stream.write("\n")
            self.stream.flush()


async def _sim_stats(url: str) -> dict[str, object]:
    async with aiohttp.ClientSession() as s, s.get(url + "/sim/stats") as r:
        data: dict[str, object] = await r.json()
        return data


async def _start_sidecar(upstream: str, policy: RateLimitPolicy) -> tuple[SidecarServer, str]:
    sidecar = Sidecar(SidecarSettings(upstream=upstream, policy=policy))
    server = SidecarServer(sidecar)
    await server.start(("127.0.0.1", 0), None)  # on start the sidecar reads the sim's capacity
    if sidecar.admission.stats().kv_capacity_tokens is None:
        await server.cleanup()
        raise RuntimeError("the sidecar enforces no KV capacity: policy or engine metrics wrong")
    return server, f"http://127.0.0.1:{server.port}"


async def run_once(
    mode: Mode,
    cfg: DemoConfig,
    schedule: Sequence[RequestSpec],
    policy: RateLimitPolicy,
    progress: Progress,
) -> RunResult:
    """Offer ``schedule`` to a fresh simulator, directly or through a fresh sidecar."""
    sim_runner, sim_port = await start_sim(cfg.sim_config(), port=0)
    sim_url = f"http://127.0.0.1:{sim_port}"
    sidecar_runner: SidecarServer | None = None
    try:
        target = sim_url
        if mode == "kvgate":
            sidecar_runner, target = await _start_sidecar(sim_url, policy)
        run = LoadRun(len(schedule))
        label = "without kvgate" if mode == "direct" else "with kvgate"
        progress.start(label, run)
        try:
            results = await run_load(
                target, schedule, model=MODEL, drain_timeout=cfg.drain_timeout, progress=run
            )
        finally:
            await progress.stop(label, run)
        wall = run.elapsed
        stats = await _sim_stats(sim_url)
    finally:
        if sidecar_runner is not None:
            await sidecar_runner.cleanup()
        await sim_runner.cleanup()
    by_tenant = stats.get("preemptions_by_tenant")
    preemptions = (
        {str(k): int(v) for k, v in by_tenant.items()} if isinstance(by_tenant, dict) else {}
    )
    return RunResult(mode, results, preemptions, wall, stats)


async def run_demo(
    cfg: DemoConfig, progress: Progress | None = None, policy: RateLimitPolicy | None = None
) -> DemoReport:
    """Both runs on the same schedule: direct first, then through kvgate."""
    progress = progress or Progress(None)
    policy = policy or load_policy(cfg.policy_path)
    schedule = build_schedule(cfg)
    direct = await run_once("direct", cfg, schedule, policy, progress)
    kvgate = await run_once("kvgate", cfg, schedule, policy, progress)
    return DemoReport(cfg, policy, schedule, direct, kvgate)


def build_parser() -> argparse.ArgumentParser:
    """The demo's argument parser."""
    p = argparse.ArgumentParser(
        prog="python -m kvgate_bench.demo",
        description="kvgate on a built-in default: a bursty three-tenant load sent to a "
        "vLLM-compatible simulator with a small KV pool, without and with the kvgate sidecar.",
    )
    add_schedule_flags(
        p,
        duration=DEFAULT_DURATION,
        duration_help="seconds of load per run (default %(default)s)",
        seed=DEFAULT_SEED,
        seed_help="schedule seed",
    )
    add_quiet_flag(p)
    p.add_argument(
        "--policy", type=Path, default=DEFAULT_POLICY,
        help="RateLimitPolicy for the sidecar (default examples/ratelimitpolicy.yaml)",
    )  # fmt: skip
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    args = build_parser().parse_args(argv)
    if not (math.isfinite(args.duration) and args.duration > 0):
        print("--duration must be a positive number of seconds", file=sys.stderr)
        return 2
    cfg = DemoConfig(duration=args.duration, seed=args.seed, policy_path=args.policy)
    policy = load_policy(cfg.policy_path)
    progress = Progress(None if args.quiet else sys.stderr)
    started = time.perf_counter()
    coro = run_demo(cfg, progress, policy)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        report = asyncio.run(coro)
    else:
        report = uvloop.run(coro)
    print(format_report(report))
    if not args.quiet:
        print(f"(demo took {time.perf_counter() - started:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
