"""``python -m kvgate_bench.demo.virtual``: what kvgate changes, on one realistic schedule.

Usage::

    python -m kvgate_bench.demo.virtual [--workload multi-tenant] [--load 2]
        [--duration 300] [--seed 1] [--jobs 2] [--profile h100-llama3-8b] [--quiet]

In virtual time (:mod:`kvgate_bench.effectiveness.model.driver`: the engine model and the admission
core in one process, nothing sleeps), on the ``h100-llama3-8b`` engine profile
(:mod:`kvgate_bench.sim.steptime`):

1. calibrate the ``none`` arm's goodput capacity ``C`` for the workload
   (:func:`kvgate_bench.effectiveness.calibration.calibrate`), so that load 1 is ``C / E[out]``
   requests per second;
2. generate ONE seeded schedule at ``--load`` x that rate
   (:func:`kvgate_bench.effectiveness.model.workloads.generate`);
3. run that same schedule through ``none`` (the engine alone), every ``concurrency-cap``
   setting of :func:`kvgate_bench.effectiveness.arms.registry.candidates` (``short=True``) and
   ``kvgate`` on its one default policy, each into a fresh engine; the tuned cap is the setting
   with the best goodput on this very schedule (a generous tuning: an operator tunes on past
   traffic, not on the traffic it will meet);
4. print the setup, a table per arm (goodput, throughput, SLO attainment, preemptions per
   1,000 requests, rejections, interactive TTFT and TPOT p99), a table per tenant for each arm
   (requests, SLO met, goodput, rejections, TTFT p99) and a takeaway whose every figure is
   computed from this run's numbers (ratios kvgate / none and kvgate / the tuned cap; where
   kvgate does worse than either on a figure, it says so).

The figures' definitions are :mod:`kvgate_bench.effectiveness.model.metrics`' (SLOs, goodput, span).
A progress display goes to stderr (one line rewritten in place on a terminal, a line per tenth
of a phase otherwise; ``--quiet``: none); stdout carries the report only. With the defaults it
takes about 45 s on 2 cores. The real-time counterpart over HTTP, through the sidecar and
kvgate-sim, is ``python -m kvgate_bench.demo``.

The report (setup text, tables, takeaway) is :mod:`kvgate_bench.demo.virtual_report`'s; this
module runs the arms and is the entry point (``scripts/demo``).

Units: times in seconds, lengths in tokens, goodput and throughput in output tokens/s.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import textwrap
import time
from collections.abc import Callable
from typing import Any, TextIO

from kvgate_bench.demo.common import add_quiet_flag, add_schedule_flags
from kvgate_bench.demo.virtual_report import (
    WIDTH,
    ArmRun,
    TenantFigures,
    arm_table,
    setup_text,
    sweep_lines,
    takeaway,
    tenant_table,
)
from kvgate_bench.effectiveness.arms.context import ArmContext
from kvgate_bench.effectiveness.arms.registry import candidates, make_arm
from kvgate_bench.effectiveness.calibration import Calibration, calibrate
from kvgate_bench.effectiveness.model.driver import simulate
from kvgate_bench.effectiveness.model.gate import REJECTED, RunResult
from kvgate_bench.effectiveness.model.metrics import met_slo, summarize, ttft_s
from kvgate_bench.effectiveness.model.schedule import Schedule
from kvgate_bench.effectiveness.model.workloads import WORKLOADS, generate, tenants_of
from kvgate_bench.effectiveness.report.progress import Progress
from kvgate_bench.kit.toolkit import percentile
from kvgate_bench.sim.steptime import PROFILES, StepTimeModel, profile

#: The demo's public names, its report's figures and takeaway included.
__all__ = [
    "DEMO_ARMS",
    "ArmRun",
    "TenantFigures",
    "calibrate_shown",
    "main",
    "parse_args",
    "run_arm",
    "run_arms",
    "takeaway",
    "tenant_figures",
]

#: The arms compared, in report order.
DEMO_ARMS: tuple[str, ...] = ("none", "concurrency-cap", "kvgate")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m kvgate_bench.demo.virtual",
        description="One schedule through no admission, a tuned concurrency cap and kvgate, "
        "in virtual time on a realistic engine model.",
    )
    p.add_argument("--workload", default="multi-tenant", choices=WORKLOADS)
    p.add_argument(
        "--load", type=float, default=2.0, help="x the none arm's goodput capacity (default 2)"
    )
    add_schedule_flags(
        p, duration=300.0, duration_help="schedule length, s (300)",
        seed=1, seed_help="schedule seed (default 1)",
    )  # fmt: skip
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="processes")
    p.add_argument("--profile", default="h100-llama3-8b", choices=sorted(PROFILES))
    add_quiet_flag(p)
    args = p.parse_args(argv)
    if args.load <= 0 or args.duration <= 0 or args.jobs < 1:
        p.error("--load and --duration must be > 0, --jobs >= 1")
    return args


def tenant_figures(run: RunResult, span_s: float) -> list[TenantFigures]:
    """Per-tenant figures of ``run`` over ``span_s`` seconds (the span of its summary)."""
    out = []
    for name, tenant in run.schedule.tenants.items():
        recs = [r for r in run.records if r.request.tenant == name]
        good = [r for r in recs if met_slo(r)]
        ttfts = [x for x in (ttft_s(r) for r in recs) if x is not None]
        out.append(
            TenantFigures(
                name,
                tenant.tier,
                tenant.demand,
                len(recs),
                len(good),
                sum(r.output_tokens for r in good) / span_s,
                sum(1 for r in recs if r.outcome == REJECTED),
                percentile(ttfts, 99),
            )
        )
    return out


#: One unit of work: (schedule, arm context, step-time model, arm, params).
Work = tuple[Schedule, ArmContext, StepTimeModel, str, dict[str, Any]]


def run_arm(work: Work) -> ArmRun:
    """Simulate the schedule through a fresh arm ``arm`` with ``params``; its figures."""
    sched, ctx, steptime, arm, params = work
    run = simulate(sched, make_arm(arm, ctx, params), steptime)
    summary = summarize(run)
    retry = sum(1 for r in run.records if r.outcome == REJECTED and r.retry_after_s is not None)
    return ArmRun(arm, dict(params), summary, tenant_figures(run, float(summary["span_s"])), retry)


def run_arms(
    works: list[Work], jobs: int, progress: Callable[[int, int], None] | None
) -> list[ArmRun]:
    """:func:`run_arm` each of ``works`` on ``jobs`` processes (1: here); results in order."""
    out: list[ArmRun | None] = [None] * len(works)
    if progress:
        progress(0, len(works))
    if jobs <= 1:
        for i, w in enumerate(works):
            out[i] = run_arm(w)
            if progress:
                progress(i + 1, len(works))
    else:
        ctx = multiprocessing.get_context("fork" if os.name == "posix" else "spawn")
        with ctx.Pool(min(jobs, len(works))) as pool:
            indexed = pool.imap_unordered(_indexed_run, list(enumerate(works)), chunksize=1)
            for k, (i, r) in enumerate(indexed):
                out[i] = r
                if progress:
                    progress(k + 1, len(works))
    return [r for r in out if r is not None]


def _indexed_run(item: tuple[int, Work]) -> tuple[int, ArmRun]:
    return item[0], run_arm(item[1])


def calibrate_shown(
    workload: str, prof: str, duration_s: float, seed: int, jobs: int, show: Progress | None
) -> Calibration:
    """:func:`~kvgate_bench.effectiveness.calibration.calibrate` (in a worker process when
    ``jobs`` > 1, so that a live display can tick the elapsed time meanwhile)."""
    phase = "calibrating none's capacity"
    if show is not None:
        show(phase, 0, 1)
    if jobs <= 1:
        cal = calibrate(workload, prof, duration_s, seed)
    else:
        ctx = multiprocessing.get_context("fork" if os.name == "posix" else "spawn")
        with ctx.Pool(1) as pool:
            res = pool.apply_async(calibrate, (workload, prof, duration_s, seed))
            while not res.ready():
                res.wait(1.0)
                if show is not None and show.live and not res.ready():
                    show(phase, 0, 1)
            cal = res.get()
    if show is not None:
        show(phase, 1, 1)
    return cal


def main(argv: list[str] | None = None, out: TextIO | None = None) -> int:
    args = parse_args(argv)
    stdout = out if out is not None else sys.stdout
    started = time.monotonic()
    show = None if args.quiet else Progress(sys.stderr, live=sys.stderr.isatty())
    steptime = profile(args.profile)
    cal = calibrate_shown(args.workload, args.profile, args.duration, args.seed, args.jobs, show)
    ctx = cal.context(steptime, args.workload)
    sched = generate(args.workload, cal.rate(args.load), args.duration, args.seed)
    tenants = {t.name: t for t in tenants_of(args.workload)}
    settings = [(arm, p) for arm in DEMO_ARMS for p in candidates(arm, tenants, short=True)]
    # kvgate first: the longest run, so the pool is not left waiting on it at the end.
    settings.sort(key=lambda s: s[0] != "kvgate")
    works: list[Work] = [(sched, ctx, steptime, arm, p) for arm, p in settings]
    runs = run_arms(works, args.jobs, show.phase("runs") if show is not None else None)
    caps = [r for r in runs if r.arm == "concurrency-cap"]
    best_cap = max(caps, key=lambda r: float(r.summary["goodput_tokens_per_s"]))
    by = {r.arm: r for r in runs if r.arm != "concurrency-cap"}
    chosen = [by["none"], best_cap, by["kvgate"]]

    def p(text: str = "") -> None:
        print(text, file=stdout)

    p(setup_text(args, steptime, ctx, cal, sched, len(caps)))
    p()
    p(
        "per arm (goodput, throughput: output tokens/s; SLO met: share of all requests;\n"
        "TTFT/TPOT p99: of the interactive requests served; * the tuned cap)"
    )
    p(arm_table(chosen))
    p()
    p("concurrency-cap sweep on this schedule (goodput, output tokens/s; * = the best):")
    for line in sweep_lines(caps, best_cap):
        p(line)
    p(f"  * cap={best_cap.params['cap']}, queue timeout {best_cap.params['queue_timeout_s']:g} s")
    p()
    p("per tenant (goodput: output tokens/s; TTFT p99 over the tenant's requests served)")
    for r in chosen:
        p(tenant_table(r))
    p()
    p("takeaway (measured in this run):")
    for line in takeaway(chosen):
        indent = "      " if line.startswith("  - ") else "    "
        p(textwrap.fill("  " + line, WIDTH, subsequent_indent=indent, break_on_hyphens=False))
    cpu = sum(float(r.summary["cpu_s"]) for r in runs)
    p()
    p(
        f"{len(runs)} runs of {len(sched.requests)} requests, {cpu:.0f} CPU s simulated; "
        f"wall {time.monotonic() - started:.0f} s (calibration included).\nThe same kind of "
        "story over real HTTP through the sidecar: python -m kvgate_bench.demo"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
