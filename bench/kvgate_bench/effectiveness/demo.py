"""``python -m kvgate_bench.effectiveness.demo``: what kvgate changes, on one realistic schedule.

Usage::

    python -m kvgate_bench.effectiveness.demo [--workload multi-tenant] [--load 2]
        [--duration 300] [--seed 1] [--jobs 2] [--profile h100-llama3-8b] [--quiet]

In virtual time (:mod:`kvgate_bench.effectiveness.driver`: the engine model and the admission
core in one process, nothing sleeps), on the ``h100-llama3-8b`` engine profile
(:mod:`kvgate_bench.sim.steptime`):

1. calibrate the ``none`` arm's goodput capacity ``C`` for the workload
   (:func:`kvgate_bench.effectiveness.runner.calibrate`), so that load 1 is ``C / E[out]``
   requests per second;
2. generate ONE seeded schedule at ``--load`` x that rate
   (:func:`kvgate_bench.effectiveness.workloads.generate`);
3. run that same schedule through ``none`` (the engine alone), every ``concurrency-cap``
   setting of :func:`kvgate_bench.effectiveness.arms.candidates` (``short=True``) and
   ``kvgate`` on its one default policy, each into a fresh engine; the tuned cap is the setting
   with the best goodput on this very schedule (a generous tuning: an operator tunes on past
   traffic, not on the traffic it will meet);
4. print the setup, a table per arm (goodput, throughput, SLO attainment, preemptions per
   1,000 requests, rejections, interactive TTFT and TPOT p99), a table per tenant for each arm
   (requests, SLO met, goodput, rejections, TTFT p99) and a takeaway whose every figure is
   computed from this run's numbers (ratios kvgate / none and kvgate / the tuned cap; where
   kvgate does worse than either on a figure, it says so).

The figures' definitions are :mod:`kvgate_bench.effectiveness.metrics`' (SLOs, goodput, span).
A progress display goes to stderr (one line rewritten in place on a terminal, a line per tenth
of a phase otherwise; ``--quiet``: none); stdout carries the report only. With the defaults it
takes about 45 s on 2 cores. The real-time counterpart over HTTP, through the sidecar and
kvgate-sim, is ``python -m kvgate_bench.demo``.

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
from dataclasses import dataclass
from typing import Any, TextIO

from kvgate_bench.effectiveness.arms import (
    ArmContext,
    KvgateMaxTokensArm,
    candidates,
    make_arm,
)
from kvgate_bench.effectiveness.driver import REJECTED, RunResult, simulate
from kvgate_bench.effectiveness.metrics import (
    BATCH_SLO_S,
    TPOT_SLO_S,
    TTFT_SLO_S,
    met_slo,
    summarize,
    ttft_s,
)
from kvgate_bench.effectiveness.metrics import ratio_text as _ratio
from kvgate_bench.effectiveness.progress import Progress
from kvgate_bench.effectiveness.runner import Calibration, calibrate
from kvgate_bench.effectiveness.sessions import THINK_MEAN_S
from kvgate_bench.effectiveness.workloads import (
    CODE_OFF_MEAN_S,
    CODE_ON_MEAN_S,
    MAX_TOKENS_CHOICES,
    MULTI_TENANT_CV,
    NOISY_MAX_TOKENS,
    WORKLOADS,
    Schedule,
    generate,
    tenants_of,
)
from kvgate_bench.sim.steptime import PROFILES, StepTimeModel, profile
from kvgate_bench.toolkit import percentile

#: Width of the setup text, characters.
WIDTH = 100
#: The arms compared, in report order.
DEMO_ARMS: tuple[str, ...] = ("none", "concurrency-cap", "kvgate")
#: How each workload's arrivals come (for the setup text).
ARRIVALS: dict[str, str] = {
    "conversation": "Poisson arrivals",
    "code": (
        f"on/off bursts (ON {CODE_ON_MEAN_S:g} s, OFF {CODE_OFF_MEAN_S:g} s on average: "
        f"{(CODE_ON_MEAN_S + CODE_OFF_MEAN_S) / CODE_ON_MEAN_S:g}x the mean rate while ON)"
    ),
    "multi-tenant": f"Gamma inter-arrival times, coefficient of variation {MULTI_TENANT_CV:g}",
    "multi-turn": (
        "sessions starting at Poisson times, each turn resending the conversation after the "
        f"previous answer plus a think time ({THINK_MEAN_S:g} s on average)"
    ),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m kvgate_bench.effectiveness.demo",
        description="One schedule through no admission, a tuned concurrency cap and kvgate, "
        "in virtual time on a realistic engine model.",
    )
    p.add_argument("--workload", default="multi-tenant", choices=WORKLOADS)
    p.add_argument(
        "--load", type=float, default=2.0, help="x the none arm's goodput capacity (default 2)"
    )
    p.add_argument("--duration", type=float, default=300.0, help="schedule length, s (300)")
    p.add_argument("--seed", type=int, default=1, help="schedule seed (default 1)")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="processes")
    p.add_argument("--profile", default="h100-llama3-8b", choices=sorted(PROFILES))
    p.add_argument("--quiet", action="store_true", help="no progress display on stderr")
    args = p.parse_args(argv)
    if args.load <= 0 or args.duration <= 0 or args.jobs < 1:
        p.error("--load and --duration must be > 0, --jobs >= 1")
    return args


@dataclass(frozen=True)
class TenantFigures:
    """One tenant's figures in one run.

    Attributes:
        tenant, tier: the tenant and its tier.
        demand: the share of the arrivals it sends relative to the others (its weight is 1).
        requests: its requests in the schedule.
        slo_met: how many met their SLO (:func:`~kvgate_bench.effectiveness.metrics.met_slo`).
        goodput_tokens_per_s: output tokens of those / the run's span, tokens/s.
        rejected: how many were refused (by the arm, or by the engine as too long).
        ttft_p99_s: p99 TTFT of those that produced a token, seconds (None: none did).
    """

    tenant: str
    tier: str
    demand: float
    requests: int
    slo_met: int
    goodput_tokens_per_s: float
    rejected: int
    ttft_p99_s: float | None

    @property
    def slo_met_share(self) -> float | None:
        """``slo_met / requests`` (None without requests)."""
        return self.slo_met / self.requests if self.requests else None


@dataclass(frozen=True)
class ArmRun:
    """One arm setting's run of the schedule: ``summary`` is
    :func:`~kvgate_bench.effectiveness.metrics.summarize`'s dict, ``tenants`` in schedule
    tenant order, ``retry_after`` the refusals that carried a Retry-After."""

    arm: str
    params: dict[str, Any]
    summary: dict[str, Any]
    tenants: list[TenantFigures]
    retry_after: int


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
    """:func:`~kvgate_bench.effectiveness.runner.calibrate` (in a worker process when
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


# --- formatting ---------------------------------------------------------------------------


def _num(v: float | None, spec: str = ".0f", scale: float = 1.0) -> str:
    return "-" if v is None else format(v * scale, spec)


def _setting(params: dict[str, Any]) -> str:
    if not params:
        return "-"
    return ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def label(run: ArmRun) -> str:
    """The arm's name in the tables: ``concurrency-cap`` is the tuned one."""
    return "concurrency-cap*" if run.arm == "concurrency-cap" else run.arm


ARM_HEADER = (
    f"{'arm':<17} {'setting':<26} {'goodput':>8} {'thrpt':>8} {'SLO met':>7} {'pre/1k':>6} "
    f"{'rejected':>8} {'TTFT p99':>8} {'TPOT p99':>8}"
)


def arm_table(runs: list[ArmRun]) -> str:
    """The per-arm table."""
    lines = [ARM_HEADER, "-" * len(ARM_HEADER)]
    for r in runs:
        s = r.summary
        setting = "default policy" if r.arm == "kvgate" else _setting(r.params)
        lines.append(
            f"{label(r):<17} {setting:<26} {_num(s['goodput_tokens_per_s'], '.1f'):>8} "
            f"{_num(s['throughput_tokens_per_s'], '.1f'):>8} "
            f"{_num(s['slo_attainment'], '.1f', 100):>6}% "
            f"{_num(s['preemptions_per_1k'], '.1f'):>6} {s['rejected']:>8} "
            f"{_num(s['ttft_p99_s'], '.2f'):>7}s {_num(s['tpot_p99_s'], '.0f', 1e3):>6}ms"
        )
    return "\n".join(lines)


TENANT_HEADER = (
    f"  {'tenant':<10} {'tier':<12} {'requests':>8} {'SLO met':>7} {'goodput':>8} "
    f"{'rejected':>8} {'TTFT p99':>8}"
)


def tenant_table(run: ArmRun) -> str:
    """The per-tenant table of one arm."""
    lines = [f"{label(run)}:", TENANT_HEADER]
    for t in run.tenants:
        lines.append(
            f"  {t.tenant:<10} {t.tier:<12} {t.requests:>8} "
            f"{_num(t.slo_met_share, '.1f', 100):>6}% {t.goodput_tokens_per_s:>8.1f} "
            f"{t.rejected:>8} {_num(t.ttft_p99_s, '.2f'):>7}s"
        )
    return "\n".join(lines)


def sweep_lines(caps: list[ArmRun], best: ArmRun) -> list[str]:
    """The concurrency-cap sweep as a grid: goodput per cap (rows) and queue timeout
    (columns), ``best`` marked ``*``."""
    timeouts = sorted({float(r.params["queue_timeout_s"]) for r in caps})
    by = {(int(r.params["cap"]), float(r.params["queue_timeout_s"])): r for r in caps}
    head = "  cap \\ queue timeout " + " ".join(f"{t:>8g}s" for t in timeouts)
    lines = [head]
    for cap in sorted({c for c, _ in by}):
        cells = []
        for t in timeouts:
            r = by.get((cap, t))
            g = _num(None if r is None else r.summary["goodput_tokens_per_s"])
            cells.append(f"{g + ('*' if r is best else ' '):>9}")
        lines.append(f"  {cap:>20} " + " ".join(cells))
    return lines


def setup_text(
    args: argparse.Namespace,
    steptime: StepTimeModel,
    ctx: ArmContext,
    cal: Calibration,
    sched: Schedule,
    n_caps: int,
) -> str:
    """The explanation printed before the tables: engine, tenants, SLOs, load and arms."""
    eng = ctx.engine
    tenants = []
    for t in tenants_of(args.workload):
        extra = f", sends {t.demand:g}x its share" if t.demand != 1 else ""
        if t.name == "noisy":
            extra += f", always max_tokens {NOISY_MAX_TOKENS}"
        tenants.append(f"{t.name} ({t.tier}{extra})")
    mts = "/".join("unset" if m is None else str(m) for m in MAX_TOKENS_CHOICES)
    kv = make_arm("kvgate", ctx, {})
    pol = kv.policy() if isinstance(kv, KvgateMaxTokensArm) else {}
    cap_pol, queue = pol.get("capacity", {}), pol.get("queue", {})
    degrade = pol.get("overload", {}).get("degrade", {})
    rate = sched.rate_rps
    paragraphs = [
        f"kvgate demo, in virtual time: the {args.workload} workload, one seeded "
        f"{args.duration:g} s schedule (seed {args.seed}, {len(sched.requests)} requests, "
        f"{rate:.2f} req/s) through three admission arms, each in front of a fresh engine.",
        "",
        f"engine  the {steptime.name} model of vLLM V1 (FCFS waiting queue, max_num_seqs "
        f"{eng.max_num_seqs}, chunked prefill of {eng.max_num_batched_tokens} tokens a step, "
        f"KV pool {ctx.kv_capacity_tokens:,} tokens in {eng.block_size}-token blocks, "
        "recompute preemption); a step takes "
        f"{steptime.a_s * 1e3:g} ms + {steptime.b_s * 1e6:g} us/prefill token + "
        f"{steptime.c_s * 1e6:g} us/decoding sequence + {steptime.d_s * 1e6:g} us/context "
        "token (derivation: kvgate_bench/sim/steptime.py). A request stops at its true "
        "output length (Azure LLM trace 2023 fits) or its max_tokens.",
        f"tenants {', '.join(tenants)}; {ARRIVALS[args.workload]}; clients' max_tokens "
        f"drawn from {mts}.",
        f"SLOs    interactive: TTFT <= {TTFT_SLO_S:g} s and TPOT <= {TPOT_SLO_S * 1e3:g} ms; "
        f"batch: finished within {BATCH_SLO_S:g} s. A refused request misses, so does one "
        "cut short. Goodput = output tokens/s of the requests that met their SLO, over the "
        "run until its backlog drained.",
        f"load    {args.load:g} = {args.load:g}x the arrival rate at which `none` reaches "
        f"its peak goodput: calibrated here, C = {cal.capacity_goodput_tokens_per_s:.0f} "
        f"tokens/s (at {cal.peak_rate_rps:.2f} req/s, {len(cal.probes)} probes), E[out] "
        f"{cal.mean_output_tokens:.0f} tokens, so load 1 = C / E[out] = "
        f"{cal.load1_rate_rps:.2f} req/s.",
        "arms    none: the engine alone. concurrency-cap*: at most `cap` requests in the "
        f"engine, a FIFO queue with a timeout in front; all {n_caps} settings swept on this "
        "very schedule and the best goodput kept: a generous tuning (an operator tunes on "
        "yesterday's traffic). kvgate: the admission core on its one default policy, not "
        f"tuned to this workload (reservation {cap_pol.get('reservation', 'MaxTokens')} at "
        f"the {cap_pol.get('reservationQuantile', '-')} quantile of learned output lengths, "
        f"grown as tokens stream; a {queue.get('order')} queue of {queue.get('maxLength')} "
        f"for {queue.get('maxWaitSeconds')} s; Degrade to {degrade.get('minMaxTokens')} "
        "tokens; concurrency and shedding driven by the SLOs above, which its policy states "
        "as slo.ttftSeconds / tpotSeconds, interactive clients sending priority 1; a per-tenant "
        "token budget of half the server's measured capacity).",
    ]
    return "\n".join(
        textwrap.fill(x, WIDTH, subsequent_indent=" " * (8 if i else 0), break_on_hyphens=False)
        for i, x in enumerate(paragraphs)
    )


def _worse(k: float | None, other: float | None, higher_better: bool) -> bool:
    if k is None or other is None:
        return False
    return k < other if higher_better else k > other


#: The figures the takeaway compares: (what, summary key, higher is better, format, scale,
#: unit).
FIGURES: tuple[tuple[str, str, bool, str, float, str], ...] = (
    ("goodput", "goodput_tokens_per_s", True, ".1f", 1.0, " tokens/s"),
    ("interactive goodput", "interactive_goodput_tokens_per_s", True, ".1f", 1.0, " tokens/s"),
    ("throughput", "throughput_tokens_per_s", True, ".1f", 1.0, " tokens/s"),
    ("SLO attainment", "slo_attainment", True, ".1f", 100.0, "%"),
    ("preemptions per 1k", "preemptions_per_1k", False, ".1f", 1.0, ""),
    ("rejections", "rejected", False, ".0f", 1.0, ""),
    ("interactive TTFT p99", "ttft_p99_s", False, ".3f", 1.0, " s"),
    ("interactive TPOT p99", "tpot_p99_s", False, ".1f", 1e3, " ms"),
)


def takeaway(runs: list[ArmRun]) -> list[str]:
    """The takeaway lines, every figure from ``runs`` (none, the tuned cap, kvgate)."""
    by = {r.arm: r for r in runs}
    k, n, c = by["kvgate"], by["none"], by["concurrency-cap"]
    ks, ns, cs = k.summary, n.summary, c.summary

    def v(s: dict[str, Any], key: str) -> float | None:
        x = s.get(key)
        return None if x is None else float(x)

    gk, gn, gc = (v(x, "goodput_tokens_per_s") for x in (ks, ns, cs))
    ik, in_, ic = (v(x, "interactive_goodput_tokens_per_s") for x in (ks, ns, cs))
    lines = [
        f"goodput: kvgate {_num(gk, '.1f')} tokens/s = {_ratio(gk, gn)} none "
        f"({_num(gn, '.1f')}) and {_ratio(gk, gc)} the tuned concurrency cap "
        f"({_num(gc, '.1f')}, {_setting(c.params)}).",
        f"interactive tenants' goodput: kvgate {_num(ik, '.1f')} tokens/s = "
        f"{_ratio(ik, in_)} none ({_num(in_, '.1f')}) and {_ratio(ik, ic)} the tuned cap "
        f"({_num(ic, '.1f')}).",
        f"SLO attainment: kvgate {_num(v(ks, 'slo_attainment'), '.1f', 100)}%, none "
        f"{_num(v(ns, 'slo_attainment'), '.1f', 100)}%, tuned cap "
        f"{_num(v(cs, 'slo_attainment'), '.1f', 100)}%; preemptions per 1,000 requests: "
        f"{_num(v(ks, 'preemptions_per_1k'), '.1f')}, {_num(v(ns, 'preemptions_per_1k'), '.1f')}, "
        f"{_num(v(cs, 'preemptions_per_1k'), '.1f')}; interactive TTFT p99: "
        f"{_num(v(ks, 'ttft_p99_s'), '.2f')} s, {_num(v(ns, 'ttft_p99_s'), '.2f')} s, "
        f"{_num(v(cs, 'ttft_p99_s'), '.2f')} s.",
    ]
    losses = []
    for what, key, hb, spec, scale, unit in FIGURES:
        kv = v(ks, key)
        beaten = [
            f"{label(o)} {_num(v(o.summary, key), spec, scale)}{unit}"
            for o in (n, c)
            if _worse(kv, v(o.summary, key), hb)
        ]
        if beaten:
            losses.append(f"{what}: {_num(kv, spec, scale)}{unit} vs " + ", ".join(beaten))
    for i, kt in enumerate(k.tenants):
        beaten = [
            f"{label(o)} {_num(o.tenants[i].slo_met_share, '.1f', 100)}%"
            for o in (n, c)
            if _worse(kt.slo_met_share, o.tenants[i].slo_met_share, True)
        ]
        if beaten:
            why = f" (it sends {kt.demand:g}x its share)" if kt.demand != 1 else ""
            losses.append(
                f"{kt.tenant}'s SLO met{why}: {_num(kt.slo_met_share, '.1f', 100)}% vs "
                + ", ".join(beaten)
            )
    if losses:
        lines.append("where kvgate does worse (kvgate vs the arm that does better):")
        lines.extend("  - " + x for x in losses)
    else:
        lines.append("kvgate does no worse than none or the tuned cap on any figure above.")
    lines.append(
        f"refused (counted as SLO misses above): kvgate {ks['rejected']} of {ks['requests']} "
        f"requests ({k.retry_after} with a Retry-After), none {ns['rejected']}, the tuned cap "
        f"{cs['rejected']} ({c.retry_after} with a Retry-After)."
    )
    return lines


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
