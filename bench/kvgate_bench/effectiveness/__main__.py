"""``python -m kvgate_bench.effectiveness``: admission effectiveness in virtual time.

Usage::

    python -m kvgate_bench.effectiveness [--short] [--workloads W,...] [--loads 0.5,1,1.5,2,3]
        [--seeds N] [--seed S] [--tune-seed S] [--json FILE] [--plots DIR] [--profile P]
        [--duration S] [--jobs J] [--arms A,...] [--replays K] [--noisy-load K,...] [--progress]
    python -m kvgate_bench.effectiveness --replicas N[,N...] [--routers random,least-request,epp]
        [--arms none,concurrency-cap,kvgate,flow-control] [--loads ...] [--seeds N]
        [--tune-seed S] [--json F]
        (``--routers`` also takes ``epp-affinity``, ``--arms`` ``dynamo-drr`` and
        ``kvgate-exchange``: run when named)

Calibrates the ``none`` arm's goodput capacity per workload, runs every arm setting on the same
seeded schedules, chooses each arm's best setting per workload and load on the tuning seed alone
(``--tune-seed``, default ``--seed``; each reported row carries ``tuning_seed``, true on that
seed's, and ``meta`` the ``tuning_seed``, the ``report_seeds`` and the rule in words), prints
per workload and load each arm's best setting with its figures (with more than one seed, means
over the report seeds, the seeds other than the tuning seed) and
its goodput ratio to ``none`` measured in the same run, the headline ratios of ``kvgate`` (to
``none``, the best baseline, the oracle and ``kvgate-maxtokens``), and the sweeps. ``--json``
writes ``{"results": [...], "sweeps": [...], "calibration": {...}, "meta": {...}}``.
``--short`` (``conversation`` and ``multi-tenant`` at loads 1 and 2, one seed, 300 s schedules,
fewer settings and replays) finishes within 5 minutes on 2 cores. The ``isolation`` workload
runs at each ``--noisy-load`` (default 3; ``--loads`` does not shape it): its rows' ``load`` is
the total offered, 0.6 + K, and they carry ``noisy_load`` and the isolation figures
(``well_behaved_slo_attainment``, ``well_behaved_min_tenant_slo_attainment``,
``noisy_goodput_tokens_per_s``), printed in a second table per point.

``--profile`` names a built-in engine profile or a JSON engine profile file
(:mod:`kvgate_bench.sim.profile_file`; examples in ``examples/profiles/``): a file sets the
engine model, its shape and the SLO the rows are scored under (derived from unloaded latencies
when it states none; :mod:`kvgate_bench.effectiveness.model.engines`), and rows carry its
``name`` as
``profile``. A missing or invalid file exits 2 with one line on stderr.

Reject precision and the Retry-After error are measured by replaying up to ``--replays``
(default 16; ``--short`` 3) sampled rejections of each reported row (see
:mod:`kvgate_bench.effectiveness.model.metrics`); their CPU time is printed apart from the runs'.
With ``--replicas`` it runs the pool instead (several replicas behind a router; see
:mod:`kvgate_bench.effectiveness.pool.report`). ``--plots DIR`` writes the PNGs of
:mod:`kvgate_bench.effectiveness.report.plots`. A progress line
(phase, done / total, elapsed, ETA) goes to stderr when it is a terminal or with
``--progress``; stdout carries the report only.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from kvgate_bench.effectiveness.arms.registry import ABLATIONS, ARM_NAMES
from kvgate_bench.effectiveness.calibration import Calibration, calibrate_all, calibration_json
from kvgate_bench.effectiveness.model.engines import engine_of, is_builtin
from kvgate_bench.effectiveness.model.workloads import ALL_WORKLOADS, EXTRA_WORKLOADS, WORKLOADS
from kvgate_bench.effectiveness.pool.report import json_path_problem, run_pool_mode
from kvgate_bench.effectiveness.replay import DEFAULT_REPLAYS, PROBE_DELTAS_S
from kvgate_bench.effectiveness.report.progress import Progress
from kvgate_bench.effectiveness.report.tables import sweep_table, table
from kvgate_bench.effectiveness.runner import (
    build_tasks,
    pick_best,
    replay_best,
    report_rows,
    run_all,
    tuning_plan,
)
from kvgate_bench.sim.steptime import PROFILES

#: Rejections replayed per reported row under ``--short`` (a replay costs about a run).
SHORT_REPLAYS = 3
#: The keys of every ``results`` row, in the issue's order (more may follow).
RESULT_KEYS: tuple[str, ...] = (
    "workload",
    "load",
    "arm",
    "seed",
    "goodput_tokens_per_s",
    "interactive_goodput_tokens_per_s",
    "throughput_tokens_per_s",
    "slo_attainment",
    "preemptions_per_1k",
    "ttft_p99_s",
    "tpot_p99_s",
    "jain",
    "reject_precision",
    "kv_utilisation",
    "rejected",
    "degraded",
    "well_behaved_slo_attainment",
    "well_behaved_min_tenant_slo_attainment",
    "noisy_goodput_tokens_per_s",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m kvgate_bench.effectiveness",
        description="Admission effectiveness of kvgate and the baselines, in virtual time.",
    )
    p.add_argument(
        "--short",
        action="store_true",
        help="a quick run (< 5 min on 2 cores; pool mode: 120 s schedules, fewer settings)",
    )
    p.add_argument(
        "--workloads",
        help=f"comma-separated, from {','.join(ALL_WORKLOADS)} (default {','.join(WORKLOADS)}; "
        f"--short: conversation,multi-tenant; {' and '.join(EXTRA_WORKLOADS)} only when named)",
    )
    p.add_argument(
        "--loads",
        help="comma-separated loads (x the none arm's goodput capacity; default 0.5,1,1.5,2,3, "
        "--short 1,2; pool mode: x N pods', default 0.8,1.5,2,3)",
    )
    p.add_argument("--seeds", type=int, help="seeds per point (default 3, pool mode 2; --short 1)")
    p.add_argument("--seed", type=int, default=1, help="first seed (default 1)")
    p.add_argument(
        "--tune-seed",
        type=int,
        help="the seed each baseline's setting is chosen on (default --seed; one of the seeds "
        "run); with more than one seed the printed figures average the others (report seeds)",
    )
    p.add_argument("--json", type=Path, help="write the results to this file")
    p.add_argument("--plots", type=Path, help="write PNG plots here (needs matplotlib)")
    p.add_argument(
        "--profile",
        default="h100-llama3-8b",
        help=f"the engine: a built-in profile ({', '.join(sorted(PROFILES))}; default "
        "h100-llama3-8b) or a JSON engine profile file (examples/profiles/; "
        "kvgate_bench.sim.profile_file), whose engine shape and SLO the run takes",
    )
    p.add_argument(
        "--kv-capacity-tokens",
        type=int,
        help="replace the profile's KV pool (tokens), e.g. 65536: a KV-bound server",
    )
    p.add_argument(
        "--duration",
        type=float,
        help="schedule length, s (default 600; --short 300; pool mode 300, --short 120)",
    )
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="processes")
    p.add_argument(
        "--arms",
        help=f"comma-separated, from {','.join(ARM_NAMES + ABLATIONS)} (default: all but the "
        "ablations)",
    )
    p.add_argument(
        "--replays",
        type=int,
        help=f"rejections replayed per reported run (default {DEFAULT_REPLAYS}; --short "
        f"{SHORT_REPLAYS}; 0: none)",
    )
    p.add_argument(
        "--noisy-load",
        default="3",
        help="comma-separated noisy offers of the isolation workload, x capacity (default 3)",
    )
    p.add_argument(
        "--progress", action="store_true", help="progress on stderr even when not a terminal"
    )
    p.add_argument(
        "--replicas",
        help="pool mode: comma-separated replica counts (e.g. 2,4,8) behind each router",
    )
    p.add_argument(
        "--routers",
        help="pool mode: comma-separated, from random,least-request,epp,epp-affinity "
        "(default: all but epp-affinity)",
    )
    p.add_argument(
        "--retry-after-cap",
        type=float,
        help="pool mode: the longest Retry-After a retry waits, s (Envoy's max_interval; "
        "default 0.5: a longer one, as every whole-second header, takes the 25 ms back-off)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        engine = engine_of(args.profile)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    if engine.file is not None and (args.replicas is not None or args.kv_capacity_tokens):
        given = "--replicas" if args.replicas is not None else "--kv-capacity-tokens"
        print(f"{given} takes a built-in --profile (a file sets its own engine)", file=sys.stderr)
        return 2
    if args.replicas is not None or args.routers is not None or args.retry_after_cap is not None:
        if args.replicas is None:
            given = "--routers" if args.routers is not None else "--retry-after-cap"
            print(f"{given} needs --replicas (the pool mode)", file=sys.stderr)
            return 2
        show = Progress(sys.stderr, live=sys.stderr.isatty())
        shown = args.progress or sys.stderr.isatty()
        return run_pool_mode(args, show.phase("pool runs") if shown else None)
    started = time.monotonic()
    short = args.short
    workloads = (
        args.workloads.split(",") if args.workloads is not None else
        (["conversation", "multi-tenant"] if short else list(WORKLOADS))
    )  # fmt: skip
    loads = [float(x) for x in args.loads.split(",")] if args.loads else (
        [1.0, 2.0] if short else [0.5, 1.0, 1.5, 2.0, 3.0]
    )  # fmt: skip
    try:
        noisy_loads = [float(x) for x in args.noisy_load.split(",")]
    except ValueError:
        noisy_loads = []
    if not noisy_loads or any(k <= 0 for k in noisy_loads):
        print(f"--noisy-load wants positive numbers, got {args.noisy_load!r}", file=sys.stderr)
        return 2
    n_seeds = args.seeds if args.seeds is not None else (1 if short else 3)
    duration = args.duration if args.duration is not None else (300.0 if short else 600.0)
    arms = args.arms.split(",") if args.arms else list(ARM_NAMES)
    for a in arms:
        if a not in ARM_NAMES + ABLATIONS:
            print(
                f"unknown arm {a!r}; choose from {','.join(ARM_NAMES + ABLATIONS)}",
                file=sys.stderr,
            )
            return 2
    for w in workloads:
        if w not in ALL_WORKLOADS:
            print(f"unknown workload {w!r}; choose from {','.join(ALL_WORKLOADS)}", file=sys.stderr)
            return 2
    if "none" not in arms:
        arms.insert(0, "none")
    if (problem := json_path_problem(args.json)) is not None:
        print(problem, file=sys.stderr)
        return 2
    if args.plots is not None and importlib.util.find_spec("matplotlib") is None:
        print("--plots: matplotlib is not installed in this environment; skipping plots")
        args.plots = None
    show = Progress(sys.stderr, live=sys.stderr.isatty())
    shown = args.progress or sys.stderr.isatty()
    if n_seeds < 1:
        print("--seeds wants at least 1", file=sys.stderr)
        return 2
    seeds = list(range(args.seed, args.seed + n_seeds))
    try:
        tune_seed, report_seeds, tuning = tuning_plan(seeds, args.tune_seed)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(
        f"effectiveness: profile {engine.name}, workloads {','.join(workloads)}, loads "
        f"{','.join(f'{x:g}' for x in loads)}, seeds {seeds}, {duration:g} s schedules, "
        f"{args.jobs} process(es)"
        + (
            f", noisy loads {','.join(f'{k:g}' for k in noisy_loads)}"
            if "isolation" in workloads
            else ""
        ),
        flush=True,
    )
    if len(seeds) > 1:
        print(tuning, flush=True)
    if shown:
        show("calibration", 0, len(workloads))
    if args.kv_capacity_tokens is not None:
        if args.kv_capacity_tokens < 8192:  # one max_model_len sequence must fit
            print("--kv-capacity-tokens must be at least 8192", file=sys.stderr)
            return 2
        args.profile = f"{args.profile}@{args.kv_capacity_tokens}"
    if not is_builtin(args.profile):
        ttft, tpot = engine.score_slo
        print(f"engine: profile file {args.profile}; SLO TTFT <= {ttft:.3g} s, TPOT <= "
              f"{tpot * 1e3:.3g} ms ({engine.slo_source})", flush=True)  # fmt: skip
    found = calibrate_all(workloads, args.profile, duration, args.seed, args.jobs)
    if shown:
        show("calibration", len(workloads), len(workloads))
    cals: dict[str, Calibration] = dict(zip(workloads, found, strict=True))
    for w, cal in cals.items():
        print(
            f"calibration {w}: none's goodput capacity {cal.capacity_goodput_tokens_per_s:.0f} "
            f"output tokens/s (peak at {cal.peak_rate_rps:.2f} req/s; {len(cal.probes)} probes); "
            f"E[out] {cal.mean_output_tokens:.0f} tokens, so load 1 = "
            f"{cal.load1_rate_rps:.2f} req/s",
            flush=True,
        )
    tasks = build_tasks(
        workloads, loads, seeds, cals, args.profile, duration, short, arms, noisy_loads
    )
    if args.replays is None:
        args.replays = SHORT_REPLAYS if short else DEFAULT_REPLAYS
    tasks = [replace(t, replays=max(0, args.replays)) for t in tasks]
    rows = run_all(tasks, args.jobs, show.phase("runs") if shown else None)
    chosen, sweeps = pick_best(rows, tune_seed)
    replay_cpu = replay_best(
        tasks, rows, chosen, args.jobs, show.phase("replays") if shown else None
    )
    reported = report_rows(chosen)
    if len(seeds) > 1:
        print(f"\n{tuning}")
        text, heads = table(reported, arms, f"report seeds {','.join(map(str, report_seeds))}")
    else:
        text, heads = table(chosen, arms)
    print(text)
    print(sweep_table(sweeps))
    elapsed = time.monotonic() - started
    cpu = sum(float(r["cpu_s"]) for r in rows)
    print("\nheadline (goodput ratios measured in this run):")
    for h in heads:
        print("  " + h)
    print(
        f"\n{len(rows)} runs, {sum(int(r['requests']) for r in rows)} requests simulated, "
        f"{cpu:.0f} CPU s in the runs; replays of the reported rows (reject precision, "
        f"Retry-After): {replay_cpu:.0f} CPU s more ({100 * replay_cpu / max(cpu, 1e-9):.0f}% "
        f"of the runs'); wall {elapsed:.0f} s"
    )
    if args.json is not None:
        results = [{**{k: r.get(k) for k in RESULT_KEYS}, **r} for r in chosen]
        doc = {
            "results": results,
            "sweeps": sweeps,
            "calibration": {w: calibration_json(c) for w, c in cals.items()},
            "meta": {
                **engine_of(args.profile).meta(),
                "duration_s": duration,
                "seeds": seeds,
                "short": short,
                "wall_s": elapsed,
                "runs": len(rows),
                "cpu_s": cpu,
                "replays": max(0, args.replays),
                "replay_cpu_s": replay_cpu,
                "probe_deltas_s": list(PROBE_DELTAS_S),
                "tuning_seed": tune_seed,
                "report_seeds": report_seeds,
                "tuning": tuning,
            },
        }
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.plots is not None:
        from kvgate_bench.effectiveness.report.plots import write_plots

        for path in write_plots(reported, args.plots):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
