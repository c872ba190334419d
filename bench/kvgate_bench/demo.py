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
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TextIO

import aiohttp
from aiohttp import web

from kvgate_agent.contract.policy import LimitScope, RateLimitPolicy, load_policy
from kvgate_agent.sidecar.app import Sidecar, SidecarSettings
from kvgate_bench.loadgen import (
    LoadRun,
    RequestResult,
    RequestSpec,
    TenantSummary,
    run_load,
    summarize,
)
from kvgate_bench.sim.server import SimConfig, start_sim

REPO = Path(__file__).resolve().parents[2]
DEFAULT_POLICY = REPO / "examples" / "ratelimitpolicy.yaml"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
TENANTS = ("chat", "long-prompt", "long-output")
Mode = Literal["direct", "kvgate"]
#: Seconds of load per run, and the schedule seed, by default.
DEFAULT_DURATION = 8.0
DEFAULT_SEED = 7


@dataclass(frozen=True, slots=True)
class TenantProfile:
    """Traffic of one tenant: Poisson arrivals at ``rate`` requests/s, ``burst_rate`` during
    burst windows; prompt and max_tokens drawn uniformly from the inclusive ranges (tokens)."""

    name: str
    rate: float
    burst_rate: float
    prompt_tokens: tuple[int, int]
    max_tokens: tuple[int, int]


#: The demo's tenants. Sizes are those of a Llama-3.1-8B deployment (maxModelLen 8192).
PROFILES: tuple[TenantProfile, ...] = (
    TenantProfile("chat", rate=2.5, burst_rate=8.0, prompt_tokens=(30, 150),
                  max_tokens=(32, 96)),
    TenantProfile("long-prompt", rate=0.15, burst_rate=0.5, prompt_tokens=(2000, 5000),
                  max_tokens=(128, 256)),
    TenantProfile("long-output", rate=0.3, burst_rate=10.0, prompt_tokens=(50, 300),
                  max_tokens=(1024, 2048)),
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """Knobs of one demo run.

    Attributes:
        duration: seconds during which requests are sent (per run).
        seed: seed of the arrival schedule (the same schedule is sent in both runs).
        burst_period: seconds between the starts of two burst windows.
        burst_length: seconds each burst window lasts.
        drain_timeout: seconds to wait for outstanding requests after the last one is sent;
            requests still running are then cut off and counted as failed.
        kv_capacity_tokens: the simulator's KV pool, tokens (the policy reads it from the
            simulator's ``vllm:cache_config_info``).
        decode_ms: the simulator's engine iteration time, ms.
        prefill_us_per_token: the simulator's prefill cost, microseconds per token.
        max_model_len: the simulator's context limit, tokens.
        policy_path: the RateLimitPolicy the sidecar enforces.
        profiles: the tenants' traffic.
    """

    duration: float = DEFAULT_DURATION
    seed: int = DEFAULT_SEED
    burst_period: float = 4.0
    burst_length: float = 1.5
    drain_timeout: float = 20.0
    kv_capacity_tokens: int = 16384
    decode_ms: float = 4.0
    prefill_us_per_token: float = 20.0
    max_model_len: int = 8192
    policy_path: Path = DEFAULT_POLICY
    profiles: tuple[TenantProfile, ...] = PROFILES

    def sim_config(self) -> SimConfig:
        """The simulator configuration of each run."""
        return SimConfig(
            model=MODEL,
            kv_capacity_tokens=self.kv_capacity_tokens,
            max_model_len=self.max_model_len,
            decode_ms=self.decode_ms,
            prefill_us_per_token=self.prefill_us_per_token,
        )


def _in_burst(t: float, cfg: DemoConfig) -> bool:
    return (t % cfg.burst_period) < cfg.burst_length


def build_schedule(cfg: DemoConfig) -> list[RequestSpec]:
    """The bursty open-loop arrival schedule: per tenant, a Poisson process whose rate is
    ``burst_rate`` inside burst windows and ``rate`` outside (generated by thinning), over
    ``cfg.duration`` seconds. Deterministic for a given ``cfg.seed``; sorted by send time."""
    out: list[RequestSpec] = []
    for prof in cfg.profiles:
        rng = random.Random(f"{cfg.seed}/{prof.name}")
        peak = max(prof.rate, prof.burst_rate)
        if peak <= 0:
            continue
        t = 0.0
        while True:
            t += rng.expovariate(peak)
            if t >= cfg.duration:
                break
            rate = prof.burst_rate if _in_burst(t, cfg) else prof.rate
            if rng.random() * peak >= rate:
                continue
            out.append(
                RequestSpec(
                    at=t,
                    tenant=prof.name,
                    prompt_tokens=rng.randint(*prof.prompt_tokens),
                    max_tokens=rng.randint(*prof.max_tokens),
                )
            )
    out.sort(key=lambda r: r.at)
    return out


@dataclass(slots=True)
class RunResult:
    """One run of the schedule.

    Attributes:
        mode: ``direct`` or ``kvgate``.
        results: one per scheduled request, in schedule order.
        preemptions: the simulator's preemptions by tenant header.
        wall: seconds from the first request to the last response.
        sim_stats: the simulator's ``/sim/stats`` at the end.
    """

    mode: Mode
    results: list[RequestResult]
    preemptions: dict[str, int]
    wall: float
    sim_stats: dict[str, object] = field(default_factory=dict)

    def summaries(self) -> dict[str, TenantSummary]:
        """Per-tenant summaries (see :func:`kvgate_bench.loadgen.summarize`), total under "*"."""
        return summarize(self.results, TENANTS)

    @property
    def preemptions_total(self) -> int:
        """All preemptions in this run."""
        return sum(self.preemptions.values())


@dataclass(slots=True)
class DemoReport:
    """Both runs of one demo."""

    config: DemoConfig
    policy: RateLimitPolicy
    schedule: list[RequestSpec]
    direct: RunResult
    kvgate: RunResult

    def offered_per_minute(self, tenant: str) -> float:
        """Cost units per minute the schedule offers for ``tenant``, priced with the policy's
        cost weights at the requested max_tokens (what admission charges up front)."""
        cost = self.policy.spec.cost
        total = sum(
            cost.of(r.prompt_tokens, r.max_tokens) for r in self.schedule if r.tenant == tenant
        )
        return total * 60.0 / self.config.duration

    def tenant_budget_per_minute(self) -> float | None:
        """The smallest per-tenant ``tokensPerMinute`` of the policy, if any."""
        rates = [
            rl.tokens_per_minute
            for rl in self.policy.spec.rate_limits
            if rl.per is LimitScope.TENANT and rl.tokens_per_minute is not None
        ]
        return min(rates) if rates else None


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


async def _start_sidecar(upstream: str, policy: RateLimitPolicy) -> tuple[web.AppRunner, str]:
    sidecar = Sidecar(SidecarSettings(upstream=upstream, policy=policy))
    runner = web.AppRunner(sidecar.build_app(), handler_cancellation=True, access_log=None)
    await runner.setup()  # on startup the sidecar reads the sim's KV capacity
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    if sidecar.admission.stats().kv_capacity_tokens is None:
        raise RuntimeError("the sidecar enforces no KV capacity: policy or engine metrics wrong")
    return runner, f"http://127.0.0.1:{port}"


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
    sidecar_runner: web.AppRunner | None = None
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


# ---------------------------------------------------------------------- report (pure)


def _secs(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s"


COLUMNS = (
    "tenant",
    "run",
    "requests",
    "completed",
    "preemptions",
    "TTFT p50",
    "TTFT p99",
    "tokens",
    "429s",
    "degraded",
    "queued",
    "failed",
)


def report_rows(report: DemoReport) -> list[list[str]]:
    """The table's rows (strings), two per tenant (without / with kvgate) plus the totals."""
    rows = []
    d_sum, k_sum = report.direct.summaries(), report.kvgate.summaries()
    for tenant in (*TENANTS, "*"):
        for label, run, sums in (
            ("without", report.direct, d_sum),
            ("kvgate", report.kvgate, k_sum),
        ):
            s = sums[tenant]
            pre = run.preemptions_total if tenant == "*" else run.preemptions.get(tenant, 0)
            rows.append(
                [
                    "all" if tenant == "*" else tenant,
                    label,
                    str(s.requests),
                    str(s.completed),
                    str(pre),
                    _secs(s.ttft_p50),
                    _secs(s.ttft_p99),
                    str(s.completion_tokens),
                    str(s.rejected_429),
                    str(s.degraded),
                    str(s.queued),
                    str(s.failed + s.rejected_other),
                ]
            )
    return rows


def format_table(rows: Sequence[Sequence[str]], header: Sequence[str] = COLUMNS) -> str:
    """A plain-text table: first two columns left-aligned, the rest right-aligned; a blank line
    between tenants."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        pairs = enumerate(zip(cells, widths, strict=True))
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in pairs).rstrip()

    out = [line(header), "  ".join("-" * w for w in widths)]
    prev = None
    for r in rows:
        if prev is not None and r[0] != prev:
            out.append("")
        out.append(line(r))
        prev = r[0]
    return "\n".join(out)


def _ratio(before: float, after: float) -> str:
    if after <= 0:
        return "all"
    return f"{before / after:.0f}x"


def takeaway(report: DemoReport) -> list[str]:
    """Two or three plain-English sentences computed from the numbers (nothing hard-coded)."""
    d, k = report.direct, report.kvgate
    ds, ks = d.summaries(), k.summaries()
    lines = []
    pd, pk = d.preemptions_total, k.preemptions_total
    if pd > pk:
        cut = "none" if pk == 0 else f"{pk} ({_ratio(pd, pk)} fewer)"
        lines.append(
            f"Without kvgate the engine preempted {pd} times as its KV pool overflowed; "
            f"with kvgate reserving each request's KV at admission: {cut}."
        )
    elif pd == pk == 0:
        lines.append(
            "The load never overflowed the KV pool (no preemptions either way): "
            "raise --duration or the load to see kvgate's effect."
        )
    else:
        lines.append(f"Preemptions went from {pd} without kvgate to {pk} with it.")
    c_d, c_k = ds["chat"], ks["chat"]
    if c_d.ttft_p99 is not None and c_k.ttft_p99 is not None:
        if c_k.ttft_p99 < c_d.ttft_p99:
            lines.append(
                f"The chat tenant's p99 time to first token fell from {_secs(c_d.ttft_p99)} "
                f"to {_secs(c_k.ttft_p99)} (p50 {_secs(c_d.ttft_p50)} -> "
                f"{_secs(c_k.ttft_p50)}): the heavy tenants can no longer crowd it out."
            )
        else:
            lines.append(
                f"The chat tenant's p99 time to first token went from {_secs(c_d.ttft_p99)} "
                f"to {_secs(c_k.ttft_p99)}: admission did not protect it in this run."
            )
    lo = ks["long-output"]
    if lo.requests:
        rejected = lo.rejected_429 + lo.rejected_other
        offered = report.offered_per_minute("long-output")
        budget = report.tenant_budget_per_minute()
        load = (
            f"offering {offered / 1000:.0f}k tokens/min against a {budget / 1000:.0f}k budget"
            if budget is not None
            else f"offering {offered / 1000:.0f}k tokens/min"
        )
        tok_d, tok_k = ds["*"].completion_tokens, ks["*"].completion_tokens
        price = (
            f"the price: {100 * (tok_d - tok_k) / tok_d:.0f}% fewer tokens delivered in total"
            if tok_d > tok_k
            else f"{tok_k} tokens delivered in total vs {tok_d} without"
        )
        no_retry_after = sum(
            1
            for r in k.results
            if r.tenant == "long-output" and r.status == 429 and r.retry_after is None
        )
        how = (
            "with Retry-After" if no_retry_after == 0 else f"({no_retry_after} without Retry-After)"
        )
        lines.append(
            f"long-output ({load}): {lo.degraded} of {lo.requests} requests degraded "
            f"(max_tokens clamped), {lo.queued} queued, {rejected} rejected {how}; {price}."
        )
    return lines


def format_report(report: DemoReport) -> str:
    """The whole printed report: set-up, the table, wall times and the takeaway."""
    cfg = report.config
    d, k = report.direct, report.kvgate
    head = (
        f"kvgate demo: {len(report.schedule)} requests from {len(TENANTS)} tenants over "
        f"{cfg.duration:g} s (bursts of {cfg.burst_length:g} s every {cfg.burst_period:g} s, "
        f"seed {cfg.seed}),\n"
        f"sent to kvgate-sim ({MODEL}, KV pool {cfg.kv_capacity_tokens} tokens, "
        f"{cfg.decode_ms:g} ms per decode step), without and with the kvgate sidecar "
        f"({cfg.policy_path.name})."
    )
    tps_d = d.summaries()["*"].completion_tokens / max(d.wall, 1e-9)
    tps_k = k.summaries()["*"].completion_tokens / max(k.wall, 1e-9)
    tail = (
        f"Run time: {d.wall:.1f} s without kvgate, {k.wall:.1f} s with; "
        f"tokens delivered per second: {tps_d:.0f} without, {tps_k:.0f} with."
    )
    return "\n\n".join([head, format_table(report_rows(report)), tail, "\n".join(takeaway(report))])


def build_parser() -> argparse.ArgumentParser:
    """The demo's argument parser."""
    p = argparse.ArgumentParser(
        prog="python -m kvgate_bench.demo",
        description="kvgate on a built-in default: a bursty three-tenant load sent to a "
        "vLLM-compatible simulator with a small KV pool, without and with the kvgate sidecar.",
    )
    p.add_argument(
        "--duration", type=float, default=DEFAULT_DURATION,
        help="seconds of load per run (default %(default)s)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="schedule seed")
    p.add_argument("--quiet", action="store_true", help="no progress display on stderr")
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
