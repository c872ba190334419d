"""The pool mode of ``python -m kvgate_bench.effectiveness``: ``--replicas N[,N...]`` with
``--routers random,least-request,epp`` (and, when named, ``epp-affinity``).

Calibrates one pod (the single-pod calibration: a pool of ``N`` is offered ``load x N x`` one
pod's load-1 rate), runs every router x arm pair of :mod:`.pool_runner` on the same seeded
schedules, keeps each tuned arm's best setting (its goodput on the tuning seed alone,
``--tune-seed``, default ``--seed``; the reported rows of every seed carry ``tuning_seed``, true
on that seed's), and prints per (workload, load, replicas) a table of the pairs and the headline
ratios, all measured in the same run (with more than one seed, means over the report seeds, the
seeds other than the tuning seed):

* ``epp`` + per-pod ``kvgate`` (the EPP reading kvgate's gauges) against ``epp`` +
  ``flow-control`` (llm-d's flow control, tuned) and against the best other pair;
* per router, ``kvgate`` against ``none`` behind the same router, and the share of requests
  finally refused while another replica had room (``refused_while_room``);
* on a workload with tenant classes (``tiers``), each pair's ``class_service_ratio`` (a
  ``c-ratio`` column, and a headline per router against issue 34's target, >= 3.5).

``--json`` writes ``{"results": [...], "sweeps": [...], "calibration": {...}, "meta": {...}}``
with rows keyed as the single-pod rows plus ``replicas``, ``router``, ``refused_while_room``,
``retries`` and ``per_replica_requests``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvgate_bench.effectiveness.calibration import Calibration, calibrate_all, calibration_json
from kvgate_bench.effectiveness.model.metrics import ratio_text
from kvgate_bench.effectiveness.pool.routers import ALL_ROUTERS, ROUTER_NAMES, RetryPolicy
from kvgate_bench.effectiveness.pool.runner import (
    ALL_POOL_ARMS,
    POOL_ARMS,
    build_pool_tasks,
    pairs,
    pick_best_pool,
    run_pool_all,
)
from kvgate_bench.effectiveness.runner import report_rows, tuning_plan, tuning_seed_of

#: Loads of a pool run when ``--loads`` is not given (the issue's: 0.8 for the refusal target,
#: 1.5, 2 and 3 for the EPP target).
POOL_LOADS: tuple[float, ...] = (0.8, 1.5, 2.0, 3.0)
#: The workload of a pool run when ``--workloads`` is not given.
POOL_WORKLOAD = "conversation"
#: Issue 34's target for ``class_service_ratio`` (weights 4:1).
CLASS_RATIO_TARGET = 3.5


def _mean(rows: list[dict[str, Any]], key: str) -> float | None:
    xs = [float(r[key]) for r in rows if r.get(key) is not None]
    return sum(xs) / len(xs) if xs else None


def _f(v: float | None, spec: str = ".0f", scale: float = 1.0) -> str:
    return "-" if v is None else format(v * scale, spec)


def parse_list(text: str | None, what: str, cast: Callable[[str], Any], allowed: Any = None) -> Any:
    """A comma-separated option as a list; raises ``ValueError`` naming ``what`` on a bad item."""
    if not text:
        return None
    out = []
    for item in text.split(","):
        try:
            v = cast(item.strip())
        except ValueError:
            raise ValueError(f"{what}: {item!r} is not valid") from None
        if allowed is not None and v not in allowed:
            raise ValueError(f"{what}: {item!r}; choose from {','.join(map(str, allowed))}")
        out.append(v)
    return out


def pool_table(rows: list[dict[str, Any]], over: str = "seeds") -> tuple[str, list[str]]:
    """The printed tables (means over the seeds of ``rows``, named ``over`` in each table's
    title; one per workload, load, replicas) and headlines."""
    lines: list[str] = []
    heads: list[str] = []
    header = (
        f"{'router':<14} {'arm':<16} {'setting':<44} {'goodput':>8} {'SLO%':>5} {'TTFTp99':>8} "
        f"{'pre/1k':>6} {'refused':>7} {'rwr%':>6} {'retries':>7} {'vs none':>7}"
    )
    lines.append(
        "goodput: output tokens/s of requests within the SLO; pre/1k: preemptions per 1,000 "
        "requests; refused: requests the client finally saw refused; rwr%: of all requests, those "
        "finally refused while another replica had room; retries: attempts after the first"
    )
    points = sorted({(r["workload"], r["load"], r["replicas"]) for r in rows})
    for w, load, n in points:
        at = [r for r in rows if (r["workload"], r["load"], r["replicas"]) == (w, load, n)]
        classes = any(r.get("class_service_ratio") is not None for r in at)
        lines.append(
            f"\n{w}, {n} replicas, load {load:g} (x {n} pods' capacity; means over {over})"
        )
        lines.append(header + (f" {'c-ratio':>7}" if classes else ""))
        lines.append("-" * len(lines[-1]))
        gp: dict[tuple[str, str], float | None] = {}
        for router, arm in pairs(ALL_ROUTERS, ALL_POOL_ARMS):
            rs = [r for r in at if r["router"] == router and r["arm"] == arm]
            if not rs:
                continue
            gp[router, arm] = _mean(rs, "goodput_tokens_per_s")
            requests = _mean(rs, "requests") or 1.0
            rwr = _mean(rs, "refused_while_room")
            setting = ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                               for k, v in rs[0]["params"].items()) or "-"  # fmt: skip
            lines.append(
                f"{router:<14} {arm:<16} {setting:<44} {_f(gp[router, arm]):>8} "
                f"{_f(_mean(rs, 'slo_attainment'), '.1f', 100):>5} "
                f"{_f(_mean(rs, 'ttft_p99_s'), '.2f'):>7}s "
                f"{_f(_mean(rs, 'preemptions_per_1k'), '.1f'):>6} "
                f"{_f(_mean(rs, 'rejected')):>7} "
                f"{_f(None if rwr is None else rwr / requests, '.2f', 100):>6} "
                f"{_f(_mean(rs, 'retries')):>7} "
                f"{ratio_text(gp[router, arm], gp.get((router, 'none'))):>7}"
                + (f" {_f(_mean(rs, 'class_service_ratio'), '.2f'):>7}" if classes else "")
            )
        heads.extend(_headlines(w, load, n, gp, at))
        if classes:
            heads.extend(_class_headlines(w, load, n, at))
    return "\n".join(lines), heads


def _headlines(
    w: str,
    load: float,
    n: int,
    gp: dict[tuple[str, str], float | None],
    at: list[dict[str, Any]],
) -> list[str]:
    out: list[str] = []
    mine = gp.get(("epp", "kvgate"))
    if mine is not None:
        msg = f"{w}, {n} replicas, load {load:g}: epp+kvgate goodput {_f(mine)}"
        fc = gp.get(("epp", "flow-control"))
        if fc is not None:
            msg += f" = {ratio_text(mine, fc)} epp+flow-control ({_f(fc)})"
        others = {k: v for k, v in gp.items() if k != ("epp", "kvgate") and v is not None}
        if others:
            best = max(others, key=lambda k: others[k] or 0.0)
            msg += f", {ratio_text(mine, others[best])} the best other pair ({'+'.join(best)} "
            msg += f"{_f(others[best])})"
        out.append(msg)
    for router in ALL_ROUTERS:
        k, none = gp.get((router, "kvgate")), gp.get((router, "none"))
        if k is None:
            continue
        rs = [r for r in at if r["router"] == router and r["arm"] == "kvgate"]
        rwr = sum(int(r["refused_while_room"]) for r in rs)
        requests = sum(int(r["requests"]) for r in rs)
        out.append(
            f"{w}, {n} replicas, load {load:g}: {router}+kvgate = {ratio_text(k, none)} "
            f"{router}+none; "
            f"refused while another replica had room: {rwr} of {requests} requests "
            f"({100 * rwr / max(1, requests):.2f} %)"
        )
    return out


def _class_headlines(w: str, load: float, n: int, at: list[dict[str, Any]]) -> list[str]:
    """Per router, each arm's ``class_service_ratio`` (mean over seeds) against the target."""
    out: list[str] = []
    for router in ALL_ROUTERS:
        got = []
        for arm in ALL_POOL_ARMS:
            rs = [r for r in at if r["router"] == router and r["arm"] == arm]
            if rs:
                got.append(f"{arm} {_f(_mean(rs, 'class_service_ratio'), '.2f')}")
        if got:
            out.append(
                f"{w}, {n} replicas, load {load:g}: {router} class_service_ratio "
                f"(target >= {CLASS_RATIO_TARGET:g}): {', '.join(got)}"
            )
    return out


def sweeps_of(rows: list[dict[str, Any]], tune_seed: int | None = None) -> list[dict[str, Any]]:
    """Every setting's mean goodput over all seeds per point (the tuned arms' sweeps), with its
    goodput on the tuning seed (``tune_seed``, default the first seed), the one that chose."""
    acc: dict[tuple[Any, ...], list[float]] = {}
    tuned: dict[tuple[Any, ...], list[float]] = {}
    tune = tuning_seed_of(rows, tune_seed) if rows else None
    for r in rows:
        key = (r["workload"], r["load"], r["replicas"], r["router"], r["arm"])
        full = (*key, json.dumps(r["params"], sort_keys=True))
        acc.setdefault(full, []).append(float(r["goodput_tokens_per_s"]))
        if r["seed"] == tune:
            tuned.setdefault(full, []).append(float(r["goodput_tokens_per_s"]))
    return [
        {
            "workload": k[0],
            "load": k[1],
            "replicas": k[2],
            "router": k[3],
            "arm": k[4],
            "params": json.loads(k[5]),
            "goodput_tokens_per_s": sum(v) / len(v),
            "tuning_seed": tune,
            "tuning_goodput_tokens_per_s": (
                sum(tuned[k]) / len(tuned[k]) if tuned.get(k) else None
            ),
        }
        for k, v in sorted(acc.items())
    ]


def option_problem(
    args: argparse.Namespace, replicas: list[int] | None, loads: list[float]
) -> str | None:
    """What is wrong with the pool mode's options (None: nothing), before anything runs: the
    replica counts and loads (positive, finite), seeds (>= 1), the Retry-After cap (>= 0) and a
    ``--json`` path that can be written (checked now, not after a half-hour run)."""
    if not replicas or any(n < 1 for n in replicas):
        return "--replicas wants positive whole numbers, e.g. 2,4,8"
    if any(not math.isfinite(x) or x <= 0 for x in loads):
        return "--loads wants positive numbers, e.g. 0.8,2"
    if args.seeds is not None and args.seeds < 1:
        return "--seeds wants at least 1"
    if args.duration is not None and not (math.isfinite(args.duration) and args.duration > 0):
        return "--duration wants a positive number of seconds"
    if args.retry_after_cap is not None and not args.retry_after_cap >= 0:
        return "--retry-after-cap wants seconds >= 0"
    return json_path_problem(args.json)


def json_path_problem(path: Path | None) -> str | None:
    """Why ``--json PATH`` could not be written at the end of a run (None: it can, or no
    ``--json``): a directory, or a folder that does not exist or is not writable."""
    if path is None:
        return None
    if path.is_dir():
        return f"--json {path}: is a directory"
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        return f"--json {path}: folder {parent} does not exist"
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        return f"--json {path}: not writable"
    return None


def run_pool_mode(args: argparse.Namespace, progress: Any) -> int:
    """The pool mode of ``main`` (see the module docstring); returns the exit status (2 on a
    bad option)."""
    started = time.monotonic()
    try:
        replicas = parse_list(args.replicas, "--replicas", int)
        routers = parse_list(args.routers, "--routers", str, ALL_ROUTERS) or list(ROUTER_NAMES)
        arms = parse_list(args.arms, "--arms", str, ALL_POOL_ARMS) or list(POOL_ARMS)
        loads = parse_list(args.loads, "--loads", float) or list(POOL_LOADS)
        workloads = parse_list(args.workloads, "--workloads", str) or [POOL_WORKLOAD]
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    problem = option_problem(args, replicas, loads)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    if "none" not in arms:
        arms.insert(0, "none")
    short = bool(args.short)
    n_seeds = args.seeds if args.seeds is not None else (1 if short else 2)
    duration = args.duration if args.duration is not None else (120.0 if short else 300.0)
    seeds = list(range(args.seed, args.seed + n_seeds))
    try:
        tune_seed, report_seeds, tuning = tuning_plan(seeds, getattr(args, "tune_seed", None))
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(
        f"effectiveness (pool): profile {args.profile}, workloads {','.join(workloads)}, "
        f"replicas {','.join(map(str, replicas))}, routers {','.join(routers)}, loads "
        f"{','.join(f'{x:g}' for x in loads)}, seeds {seeds}, {duration:g} s schedules, "
        f"{args.jobs} process(es); retries honour a Retry-After up to "
        f"{RetryPolicy.max_interval_s if args.retry_after_cap is None else args.retry_after_cap:g}"
        " s",
        flush=True,
    )
    if len(seeds) > 1:
        print(tuning, flush=True)
    try:
        found = calibrate_all(workloads, args.profile, duration, args.seed, args.jobs)
    except ValueError as exc:  # an unknown workload or profile
        print(exc, file=sys.stderr)
        return 2
    cals: dict[str, Calibration] = dict(zip(workloads, found, strict=True))
    for w, cal in cals.items():
        print(
            f"calibration {w} (one pod): goodput capacity {cal.capacity_goodput_tokens_per_s:.0f}"
            f" output tokens/s, load 1 = {cal.load1_rate_rps:.2f} req/s per pod",
            flush=True,
        )
    cap = RetryPolicy.max_interval_s if args.retry_after_cap is None else args.retry_after_cap
    tasks = build_pool_tasks(
        workloads, loads, seeds, replicas, routers, arms, cals, args.profile, duration, short, cap
    )
    rows = run_pool_all(tasks, args.jobs, progress)
    chosen = pick_best_pool(rows, tune_seed)
    if len(seeds) > 1:
        print(f"\n{tuning}")
        text, heads = pool_table(
            report_rows(chosen), f"report seeds {','.join(map(str, report_seeds))}"
        )
    else:
        text, heads = pool_table(chosen)
    print(text)
    print("\nheadline (goodput ratios measured in this run):")
    for h in heads:
        print("  " + h)
    elapsed = time.monotonic() - started
    cpu = sum(float(r["cpu_s"]) for r in rows)
    print(f"\n{len(rows)} runs, {cpu:.0f} CPU s; wall {elapsed:.0f} s")
    if args.json is not None:
        doc = {
            "results": chosen,
            "sweeps": sweeps_of(rows, tune_seed),
            "calibration": {w: calibration_json(c) for w, c in cals.items()},
            "meta": {
                "mode": "pool",
                "profile": args.profile,
                "duration_s": duration,
                "seeds": seeds,
                "short": short,
                "replicas": replicas,
                "routers": routers,
                "retry_after_cap_s": cap,
                "wall_s": elapsed,
                "runs": len(rows),
                "cpu_s": cpu,
                "tuning_seed": tune_seed,
                "report_seeds": report_seeds,
                "tuning": tuning,
            },
        }
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0
