"""The virtual-time demo's report (:mod:`kvgate_bench.demo.virtual`): each arm's figures
(:class:`ArmRun`, :class:`TenantFigures`), the setup text, the tables, the concurrency-cap
sweep and the takeaway, whose every figure is computed from the runs (pure: no I/O).

Units: times in seconds, lengths in tokens, goodput and throughput in output tokens/s.
"""

from __future__ import annotations

import argparse
import textwrap
from dataclasses import dataclass
from typing import Any

from kvgate_agent.contract.policy import RateLimitPolicySpec
from kvgate_bench.demo.common import figure, row
from kvgate_bench.effectiveness.arms.context import ArmContext
from kvgate_bench.effectiveness.arms.kvgate_arms import KvgateMaxTokensArm
from kvgate_bench.effectiveness.arms.registry import make_arm
from kvgate_bench.effectiveness.calibration import Calibration
from kvgate_bench.effectiveness.model.metrics import BATCH_SLO_S, TPOT_SLO_S, TTFT_SLO_S
from kvgate_bench.effectiveness.model.metrics import ratio_text as _ratio
from kvgate_bench.effectiveness.model.schedule import MAX_TOKENS_CHOICES, Schedule
from kvgate_bench.effectiveness.model.sessions import THINK_MEAN_S
from kvgate_bench.effectiveness.model.workloads import (
    CODE_OFF_MEAN_S,
    CODE_ON_MEAN_S,
    MULTI_TENANT_CV,
    NOISY_MAX_TOKENS,
    tenants_of,
)
from kvgate_bench.sim.steptime import StepTimeModel

#: Width of the setup text, characters.
WIDTH = 100
#: How each workload's arrivals come (for the setup text).
ARRIVALS: dict[str, str] = {
    "conversation": "Poisson arrivals",
    "isolation": "Poisson arrivals (the noisy tenant's too, at its own rate)",
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


@dataclass(frozen=True)
class TenantFigures:
    """One tenant's figures in one run.

    Attributes:
        tenant, tier: the tenant and its tier.
        demand: the share of the arrivals it sends relative to the others (its weight is 1).
        requests: its requests in the schedule.
        slo_met: how many met their SLO (:func:`~kvgate_bench.effectiveness.model.metrics.met_slo`).
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
    :func:`~kvgate_bench.effectiveness.model.metrics.summarize`'s dict, ``tenants`` in schedule
    tenant order, ``retry_after`` the refusals that carried a Retry-After."""

    arm: str
    params: dict[str, Any]
    summary: dict[str, Any]
    tenants: list[TenantFigures]
    retry_after: int


def _setting(params: dict[str, Any]) -> str:
    if not params:
        return "-"
    return ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def label(run: ArmRun) -> str:
    """The arm's name in the tables: ``concurrency-cap`` is the tuned one."""
    return "concurrency-cap*" if run.arm == "concurrency-cap" else run.arm


#: The per-arm table's columns: (name, width in characters); the first two left-aligned.
ARM_COLUMNS: tuple[tuple[str, int], ...] = (
    ("arm", 17), ("setting", 26), ("goodput", 8), ("thrpt", 8), ("SLO met", 7), ("pre/1k", 6),
    ("rejected", 8), ("TTFT p99", 8), ("TPOT p99", 8),
)  # fmt: skip
ARM_WIDTHS = [w for _, w in ARM_COLUMNS]
ARM_HEADER = row([n for n, _ in ARM_COLUMNS], ARM_WIDTHS, sep=" ")


def arm_table(runs: list[ArmRun]) -> str:
    """The per-arm table."""
    lines = [ARM_HEADER, "-" * len(ARM_HEADER)]
    for r in runs:
        s = r.summary
        setting = "default policy" if r.arm == "kvgate" else _setting(r.params)
        cells = [
            label(r),
            setting,
            figure(s["goodput_tokens_per_s"], ".1f"),
            figure(s["throughput_tokens_per_s"], ".1f"),
            figure(s["slo_attainment"], ".1f", 100) + "%",
            figure(s["preemptions_per_1k"], ".1f"),
            str(s["rejected"]),
            figure(s["ttft_p99_s"], ".2f") + "s",
            figure(s["tpot_p99_s"], ".0f", 1e3) + "ms",
        ]
        lines.append(row(cells, ARM_WIDTHS, sep=" "))
    return "\n".join(lines)


#: The per-tenant tables' columns: (name, width in characters); the first two left-aligned.
TENANT_COLUMNS: tuple[tuple[str, int], ...] = (
    ("tenant", 10), ("tier", 12), ("requests", 8), ("SLO met", 7), ("goodput", 8),
    ("rejected", 8), ("TTFT p99", 8),
)  # fmt: skip
TENANT_WIDTHS = [w for _, w in TENANT_COLUMNS]
TENANT_HEADER = "  " + row([n for n, _ in TENANT_COLUMNS], TENANT_WIDTHS, sep=" ")


def tenant_table(run: ArmRun) -> str:
    """The per-tenant table of one arm."""
    lines = [f"{label(run)}:", TENANT_HEADER]
    for t in run.tenants:
        cells = [
            t.tenant,
            t.tier,
            str(t.requests),
            figure(t.slo_met_share, ".1f", 100) + "%",
            f"{t.goodput_tokens_per_s:.1f}",
            str(t.rejected),
            figure(t.ttft_p99_s, ".2f") + "s",
        ]
        lines.append("  " + row(cells, TENANT_WIDTHS, sep=" "))
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
            g = figure(None if r is None else r.summary["goodput_tokens_per_s"])
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
    kvgate_policy = describe_policy(make_arm("kvgate", ctx, {}))
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
        "yesterday's traffic). kvgate: " + kvgate_policy,
    ]
    return "\n".join(
        textwrap.fill(x, WIDTH, subsequent_indent=" " * (8 if i else 0), break_on_hyphens=False)
        for i, x in enumerate(paragraphs)
    )


def describe_policy(arm: object) -> str:
    """What the ``kvgate`` arm enforces, read from its policy as the sidecar would resolve it
    (the contract's defaults filled in), so the text cannot drift from the arm."""
    raw = arm.policy() if isinstance(arm, KvgateMaxTokensArm) else {}
    spec = RateLimitPolicySpec.model_validate(raw)
    cap, queue, over = spec.capacity, spec.queue, spec.overload
    classes = ", ".join(
        f"{c.name} (weight {c.weight:g}, {'batch' if c.batch else 'the SLO'})"
        for c in spec.tenants.classes
    )
    rates = f"{len(spec.rate_limits)} rate limit(s)" if spec.rate_limits else "no rate limit"
    actions = ", ".join(a.value for a in over.actions)
    degrade = "" if over.degrade is None else f" (Degrade to {over.degrade.min_max_tokens} tokens)"
    wait = "unbounded" if queue.max_wait_seconds is None else f"{queue.max_wait_seconds:g} s"
    return (
        "the README's recommended policy, not tuned to this workload: the SLOs above as "
        f"slo.ttftSeconds / tpotSeconds; tenant classes {classes or 'none'}; KV reservation "
        f"{cap.reservation.value} (prompt + the {cap.reservation_quantile:g} quantile of learned "
        f"output lengths, grown as tokens stream); overload actions {actions}{degrade}; a "
        f"{queue.order.value} fair queue of "
        f"{queue.max_length}, waits up to {wait}; concurrency and shedding "
        f"driven by the SLOs; {rates}."
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
        f"goodput: kvgate {figure(gk, '.1f')} tokens/s = {_ratio(gk, gn)} none "
        f"({figure(gn, '.1f')}) and {_ratio(gk, gc)} the tuned concurrency cap "
        f"({figure(gc, '.1f')}, {_setting(c.params)}).",
        f"interactive tenants' goodput: kvgate {figure(ik, '.1f')} tokens/s = "
        f"{_ratio(ik, in_)} none ({figure(in_, '.1f')}) and {_ratio(ik, ic)} the tuned cap "
        f"({figure(ic, '.1f')}).",
        f"SLO attainment: kvgate {figure(v(ks, 'slo_attainment'), '.1f', 100)}%, none "
        f"{figure(v(ns, 'slo_attainment'), '.1f', 100)}%, tuned cap "
        f"{figure(v(cs, 'slo_attainment'), '.1f', 100)}%; preemptions per 1,000 requests: "
        f"{figure(v(ks, 'preemptions_per_1k'), '.1f')}, "
        f"{figure(v(ns, 'preemptions_per_1k'), '.1f')}, "
        f"{figure(v(cs, 'preemptions_per_1k'), '.1f')}; interactive TTFT p99: "
        f"{figure(v(ks, 'ttft_p99_s'), '.2f')} s, {figure(v(ns, 'ttft_p99_s'), '.2f')} s, "
        f"{figure(v(cs, 'ttft_p99_s'), '.2f')} s.",
    ]
    losses = []
    for what, key, hb, spec, scale, unit in FIGURES:
        kv = v(ks, key)
        beaten = [
            f"{label(o)} {figure(v(o.summary, key), spec, scale)}{unit}"
            for o in (n, c)
            if _worse(kv, v(o.summary, key), hb)
        ]
        if beaten:
            losses.append(f"{what}: {figure(kv, spec, scale)}{unit} vs " + ", ".join(beaten))
    for i, kt in enumerate(k.tenants):
        beaten = [
            f"{label(o)} {figure(o.tenants[i].slo_met_share, '.1f', 100)}%"
            for o in (n, c)
            if _worse(kt.slo_met_share, o.tenants[i].slo_met_share, True)
        ]
        if beaten:
            why = f" (it sends {kt.demand:g}x its share)" if kt.demand != 1 else ""
            losses.append(
                f"{kt.tenant}'s SLO met{why}: {figure(kt.slo_met_share, '.1f', 100)}% vs "
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
