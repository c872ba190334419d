"""``python -m kvgate_bench.effectiveness.realtime``: one schedule over HTTP through the kvgate
sidecar and kvgate-sim, next to the same schedule in virtual time (the two rows, whether they
agree, whether the machine kept up; ``--json`` writes both summaries).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from kvgate_bench.effectiveness.model.workloads import DEFAULT_NOISY_LOAD, WORKLOADS
from kvgate_bench.effectiveness.realtime.agreement import DEFAULT_KVGATE_ARM, compare
from kvgate_bench.effectiveness.realtime.plan import (
    ISOLATION,
    isolation_agree,
    isolation_text,
    plan,
    tenant_slo,
)
from kvgate_bench.effectiveness.realtime.run import steptime_with_pool
from kvgate_bench.sim.steptime import PROFILES


def _row(label: str, s: dict[str, Any], pre: int) -> str:
    iso = isolation_text(s)
    return (
        f"  {label:<8} goodput {s['goodput_tokens_per_s']:8.1f} tok/s  throughput "
        f"{s['throughput_tokens_per_s']:8.1f}  SLO {s['slo_attainment']:.3f}  preemptions "
        f"{pre:4d}  rejected {s['rejected']:3d}  degraded {s['degraded']:3d}  TTFT p99 "
        f"{s['ttft_p99_s'] or 0:.3f} s  span {s['span_s']:.1f} s"
        + (f"\n{'':11}{iso}" if iso else "")
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m kvgate_bench.effectiveness.realtime",
        description="One schedule over HTTP through the kvgate sidecar and kvgate-sim, "
        "next to the same schedule in virtual time.",
    )
    p.add_argument("--workload", default="conversation", choices=WORKLOADS)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--load", type=float, help="x the none arm's calibrated capacity (default 1)")
    g.add_argument("--rate", type=float, help="arrivals per second (instead of --load)")
    p.add_argument(
        "--noisy-load",
        type=float,
        help="isolation only: the noisy tenant's offer, x capacity (default 3; load 0.6 + K)",
    )
    p.add_argument("--duration", type=float, default=60.0, help="schedule length, s")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--arm", default="none", help=f"none or a kvgate arm ({DEFAULT_KVGATE_ARM})")
    p.add_argument("--profile", default="h100-llama3-8b", choices=sorted(PROFILES))
    p.add_argument("--kv-capacity-tokens", type=int, help="KV pool, tokens (default: profile's)")
    p.add_argument("--time-scale", type=float, default=1.0, help="real s per modelled s")
    p.add_argument("--in-process", action="store_true", help="kvgate-sim in this process")
    p.add_argument(
        "--chat",
        action="store_true",
        help="chat completions of words (the sidecar counts them with a word-level tokenizer) "
        "instead of completions of token ids",
    )
    p.add_argument(
        "--sidecar-process",
        action="store_true",
        help="the sidecar as a kvgate-agent child process (time scale 1 only)",
    )
    p.add_argument(
        "--real-profile",
        choices=sorted(PROFILES),
        help="run kvgate-sim on this profile instead (a check that a mismatch shows)",
    )
    p.add_argument("--json", type=Path, help="write both summaries here")
    return p.parse_args(argv)


async def _main(args: argparse.Namespace) -> int:
    steptime = steptime_with_pool(args.profile, args.kv_capacity_tokens)
    if args.rate is None and args.kv_capacity_tokens is not None:
        print("--load calibrates on the profile's own pool: give --rate", file=sys.stderr)
        return 2
    sched, ctx = plan(
        args.workload,
        args.profile,
        steptime,
        args.duration,
        args.seed,
        load=args.load,
        rate=args.rate,
        noisy_load=args.noisy_load,
    )
    rate = sched.rate_rps
    noisy = (
        f" (noisy load {DEFAULT_NOISY_LOAD if args.noisy_load is None else args.noisy_load:g})"
        if args.workload == ISOLATION
        else ""
    )
    print(
        f"{args.workload}{noisy} at {rate:.2f} req/s for {args.duration:g} s (seed {args.seed}): "
        f"{len(sched.requests)} requests, arm {args.arm}, {args.profile}, KV pool "
        f"{ctx.kv_capacity_tokens} tokens, time scale {args.time_scale:g}",
        flush=True,
    )
    a = await compare(
        sched,
        args.arm,
        ctx,
        args.profile,
        steptime,
        time_scale=args.time_scale,
        sim_subprocess=not args.in_process,
        sidecar_process=args.sidecar_process,
        chat=args.chat,
        real_profile=args.real_profile,
    )
    print(_row("virtual", a.virtual, a.virtual_preemptions))
    print(_row("real", a.real, a.real_preemptions))
    run = a.run
    print(
        f"  {'agree' if a.agree else 'DISAGREE'}: real/virtual goodput {a.goodput_ratio:.3f}; "
        f"wall {run.wall_s:.1f} s, kvgate-sim lag max {run.sim_lag_max_s * 1000:.1f} ms "
        f"(written off {run.late_s:.3f} s), "
        f"send lag p99 {run.send_lag_p99_s * 1000:.1f} ms, max {run.send_lag_max_s * 1000:.1f} ms"
    )
    if args.workload == ISOLATION:
        rs = a.isolation_ratios
        print(
            f"  isolation {'agrees' if isolation_agree(a.virtual, a.real) else 'DISAGREES'}: "
            + ", ".join(f"{k} {v:.3f}" for k, v in rs.items() if v is not None)
        )
    if not run.kept_up:
        print(
            "  the machine did not keep up (lags above): the real-time figures are not a fair "
            "comparison; rerun with a larger --time-scale",
            flush=True,
        )
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "arm": args.arm,
                    "workload": args.workload,
                    "noisy_load": args.noisy_load,
                    "rate_rps": rate,
                    "time_scale": run.time_scale,
                    "kept_up": run.kept_up,
                    "send_lag_p99_s": run.send_lag_p99_s,
                    "sim_lag_max_s": run.sim_lag_max_s,
                    "isolation_ratios": a.isolation_ratios,
                    "tenant_slo": {  # well-behaved tenants: [met SLO, requests]
                        "virtual": tenant_slo(a.virtual_run.records) if a.virtual_run else None,
                        "real": tenant_slo(run.result.records),
                    },
                    "virtual": a.virtual,
                    "real": a.real,
                    "virtual_preemptions": a.virtual_preemptions,
                    "real_preemptions": a.real_preemptions,
                    "wall_s": run.wall_s,
                    "late_s": run.late_s,
                },
                indent=2,
            )
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m kvgate_bench.effectiveness.realtime``; the exit status."""
    coro = _main(parse_args(argv))
    try:
        try:
            import uvloop
        except ImportError:
            return asyncio.run(coro)
        return uvloop.run(coro)  # the client and the sidecar share this loop: the faster the better
    except ValueError as exc:  # e.g. an arm with no real-time counterpart
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
