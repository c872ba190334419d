"""``python -m kvgate_bench.real_engine``: kvgate's goodput in front of llama-server (issue 24).

Starts llama-server (:func:`kvgate_bench.real_engine.engine.find_llama`: the test command's
build; ``--parallel 4 -c 4096 --no-kv-unified -t 1`` by default, the issue's), pinned to the
last CPU with this process and the sidecar on the others (``taskset``, where there are two CPUs
or more), then:

1. **Calibrates**: unloaded requests of three prompt lengths, one at a time (TTFT, TPOT, the
   outputs' lengths; the SLO: :mod:`kvgate_bench.real_engine.calibration`); two bursts of 2 and
   ``parallel`` equal requests (decode steps of several sequences); the step-time model fitted to
   llama-server's ``timings``; then ``none``'s probes on ``conversation`` (Poisson chat
   arrivals), the first at the capacity the fitted engine predicts in virtual time
   (:func:`predicted_capacity`), the next bracketing the rate at which ``none`` meets the SLO
   for 90 % (:func:`kvgate_bench.real_engine.calibration.next_probe`; 2 probes with
   ``--short``, 3 without), each long enough for 15 arrivals (15-45 s with ``--short``,
   20-60 s without: :func:`kvgate_bench.real_engine.calibration.probe_duration`).
2. **Runs** each cell (``multi-tenant`` at loads 1, 2 and 3; ``isolation`` with the noisy
   tenant at 3x, total load 3.6; ``--short``: multi-tenant 1 and 2, isolation 3) through
   ``none``, the tuned ``concurrency-cap``, the tuned ``token-bucket`` and ``kvgate``, each in
   turn against the same server, one seeded open-loop schedule per cell
   (:mod:`kvgate_bench.real_engine.client`). The baselines are swept on multi-tenant at load 2
   (cap: half the slot count and the slot count, queue wait = the TTFT SLO; bucket: factors 1
   and 1.5 of each tenant's share of the capacity, 10 s bursts; the full run adds a cap of twice
   the slots and factor 2) and their best setting runs the other cells.
3. **Compares** each row with the virtual benchmark on the same schedule (the prompts' and
   outputs' lengths llama-server reported in that cell's ``none`` run) with the fitted engine:
   ``simulate`` with the same arm and setting, 4 slots of ``ctx / parallel`` tokens.

``--json FILE`` writes ``{"meta", "calibration", "rows", "virtual", "comparison", "targets"}``.
The machine's quietness is in ``meta`` (CPUs, pinning, threads, load average) and per row
(load average before and after, the client's send lag: ``kept_up``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from kvgate_bench.effectiveness.arms import ArmContext, make_arm
from kvgate_bench.effectiveness.driver import simulate
from kvgate_bench.effectiveness.metrics import summarize
from kvgate_bench.effectiveness.workloads import generate, isolation_load, tenants_of
from kvgate_bench.kit.toolkit import percentile
from kvgate_bench.real_engine import calibration as cal
from kvgate_bench.real_engine.client import (
    BUCKET,
    CAP,
    KVGATE,
    NONE,
    ArmRun,
    corpus,
    prompt_for,
    request_body,
    run_arm,
)
from kvgate_bench.real_engine.engine import find_llama, metric_totals, start_llama
from kvgate_bench.real_engine.report import (
    best_setting,
    build_row,
    comparison,
    output_stats,
    row_text,
    targets,
)
from kvgate_bench.sim.engine import EngineConfig
from kvgate_bench.sim.steptime import StepTimeModel

#: llama.cpp's default logical batch (``-b``): the most prompt tokens one step takes.
LLAMA_BATCH = 2048
BLOCK = 16


def engine_config(parallel: int, ctx: int) -> EngineConfig:
    """The virtual engine of llama-server ``--parallel P -c C --no-kv-unified``: P sequences,
    each of at most C / P tokens, a KV pool of C tokens (in 16-token blocks), prompts chunked
    within llama.cpp's 2048-token batch."""
    return EngineConfig(
        num_gpu_blocks=ctx // BLOCK,
        block_size=BLOCK,
        max_model_len=ctx // parallel,
        max_num_seqs=parallel,
        max_num_batched_tokens=LLAMA_BATCH,
        chunked_prefill=True,
    )


def cells(short: bool) -> list[tuple[str, float]]:
    """(workload, load) cells; ``isolation``'s load is its noisy tenant's (x capacity)."""
    if short:
        return [("multi-tenant", 2.0), ("multi-tenant", 1.0), ("isolation", 3.0)]
    return [("multi-tenant", 2.0), ("multi-tenant", 1.0), ("multi-tenant", 3.0), ("isolation", 3.0)]


def sweeps(short: bool, parallel: int, ttft_slo_s: float) -> dict[str, list[dict[str, Any]]]:
    """The baselines' settings swept (module docstring)."""
    wait = round(ttft_slo_s, 3)
    caps = [{"cap": max(1, parallel // 2), "queue_timeout_s": wait}]
    caps.append({"cap": parallel, "queue_timeout_s": wait})
    buckets = [{"factor": 1.0, "burst_s": 10.0}, {"factor": 1.5, "burst_s": 10.0}]
    if not short:
        caps.append({"cap": 2 * parallel, "queue_timeout_s": wait})
        buckets.append({"factor": 2.0, "burst_s": 10.0})
    return {CAP: caps, BUCKET: buckets}


async def one_request(
    session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int
) -> dict[str, Any]:
    """One streamed request alone: TTFT, TPOT (seconds), llama-server's ``timings`` and usage."""
    req = request_body(_dummy_request(), prompt, max_tokens)
    t0 = time.perf_counter()
    first = last = None
    timings: dict[str, Any] = {}
    usage: dict[str, Any] = {}
    async with session.post(url + "/v1/chat/completions", json=req) as r:
        r.raise_for_status()
        buf = b""
        async for data in r.content.iter_any():
            buf += data
            *events, buf = buf.split(b"\n\n")
            for ev in events:
                if not ev.startswith(b"data: ") or ev[6:].strip() == b"[DONE]":
                    continue
                obj = json.loads(ev[6:])
                timings = obj.get("timings") or timings
                usage = obj.get("usage") or usage
                for ch in obj.get("choices") or ():
                    if (ch.get("delta") or {}).get("content"):
                        last = time.perf_counter()
                        first = first or last
    n = int(usage.get("completion_tokens", 0))
    ttft = (first or time.perf_counter()) - t0
    tpot = ((last or 0) - (first or 0)) / (n - 1) if n > 1 and first and last else 0.0
    return {"ttft_s": ttft, "tpot_s": tpot, "timings": timings, "usage": usage}


def _dummy_request() -> Any:
    from kvgate_bench.effectiveness.workloads import Request

    return Request("calibration", 0.0, "calibration", "interactive", 1, None, 1)


async def calibrate(
    url: str, args: argparse.Namespace, words: list[str], workdir: Path
) -> dict[str, Any]:
    """Step 1 of the module docstring; the calibration as JSON-ready values."""
    from kvgate_bench.effectiveness.workloads import Request

    timeout = aiohttp.ClientTimeout(total=600)
    obs: list[cal.StepObs] = []
    unloaded: list[dict[str, Any]] = []
    # A fresh connection per request: llama-server may close one after a stream (a reused,
    # half-closed keep-alive connection fails the next request's write).
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await one_request(session, url, "Hello", 4)  # warm-up (first-touch of the weights)
        lengths = (48, 320, 640) if args.short else (48, 160, 320, 480, 640)
        for i, pt in enumerate(lengths):
            prompt = prompt_for(Request(f"unloaded-{i}", 0, "c", "interactive", pt, None, 1), words)
            m = await one_request(session, url, prompt, args.max_tokens)
            unloaded.append(m)
            t = m["timings"]
            obs += cal.unloaded_obs(
                int(t["prompt_n"]),
                float(t["prompt_ms"]),
                int(t["predicted_n"]),
                float(t["predicted_per_token_ms"]),
            )
        bursts = []
        for k in sorted({2, args.parallel}):
            prompt = prompt_for(Request(f"burst-{k}", 0, "c", "interactive", 320, None, 1), words)
            ms = await asyncio.gather(
                *(one_request(session, url, prompt, args.max_tokens) for _ in range(k))
            )
            ctxs = [
                int(m["timings"]["prompt_n"]) + int(m["timings"]["predicted_n"]) / 2 for m in ms
            ]
            per = [float(m["timings"]["predicted_per_token_ms"]) for m in ms]
            obs.append(cal.batch_obs(ctxs, per))
            bursts.append({"k": k, "per_token_ms": per})
        totals = await metric_totals(session, url)
    slo = cal.slo_from_unloaded([m["ttft_s"] for m in unloaded], [m["tpot_s"] for m in unloaded])
    fitted, rmse = cal.fit_steptime(obs, "llama-server-fit", args.ctx)
    outs = [int(m["usage"]["completion_tokens"]) for m in unloaded]
    service = sum(m["ttft_s"] + m["tpot_s"] * o for m, o in zip(unloaded, outs, strict=True)) / len(
        outs
    )
    prompts = {f"u{i}": int(m["usage"]["prompt_tokens"]) for i, m in enumerate(unloaded)}
    outputs = {f"u{i}": o for i, o in enumerate(outs)}
    rate, predicted = predicted_capacity(fitted, args, slo, prompts, outputs)
    if rate <= 0:  # the fitted engine meets the SLO at no rate: a rough guess
        rate = 0.5 * args.parallel / service
    probes: list[tuple[float, float]] = []
    probe_rows = []
    mean_out = sum(outs) / len(outs)
    mean_total = mean_out + sum(int(m["usage"]["prompt_tokens"]) for m in unloaded) / len(unloaded)
    for i in range(2 if args.short else 3):
        sched = generate(
            "conversation",
            rate,
            cal.probe_duration(rate, args.probe_duration, 3 * args.probe_duration),
            args.seed + 100 + i,
            max_model_len=args.ctx // args.parallel,
        )
        ctx = _context("conversation", args, rate, mean_total, slo)
        run = await run_arm(
            url,
            sched,
            NONE,
            ctx,
            {},
            max_tokens=args.max_tokens,
            drain_s=args.drain,
            words=words,
            workdir=workdir,
        )
        s = summarize(run.result, slo.pair())
        att = float(s["slo_attainment"] or 0.0)
        probes.append((rate, att))
        outs += list(run.output_tokens.values())
        probe_rows.append(
            {
                "rate_rps": rate,
                "slo_attainment": att,
                "requests": s["requests"],
                "timeouts": run.timeouts,
                "send_lag_p99_s": run.send_lag_p99_s,
            }
        )
        print(
            f"  capacity probe {rate:.3f} req/s: SLO met {att:.2f} ({s['requests']} requests)",
            flush=True,
        )
        rate = cal.next_probe(probes)
    capacity = cal.capacity_rate(probes)
    return {
        "slo": slo,
        "steptime": fitted,
        "fit_rmse": rmse,
        "observations": [o.__dict__ for o in obs],
        "unloaded": [{k: m[k] for k in ("ttft_s", "tpot_s", "usage")} for m in unloaded],
        "bursts": bursts,
        "engine_totals": totals,
        "capacity_rps": capacity,
        "probes": probe_rows,
        "predicted_capacity_rps": rate if predicted else None,
        "predicted_probes": predicted,
        "mean_output_tokens": sum(outs) / len(outs),
        "mean_total_tokens": mean_total,
        "output_tokens_p50": percentile([float(o) for o in outs], 50),
    }


def predicted_capacity(
    fitted: StepTimeModel,
    args: argparse.Namespace,
    slo: cal.Slo,
    prompts: dict[str, int],
    outputs: dict[str, int],
) -> tuple[float, list[tuple[float, float]]]:
    """The capacity rate of ``none`` on ``conversation`` in virtual time on the fitted engine
    (prompt and output lengths drawn from the measured ones; 300 s schedules at rates from 0.01
    to 10 requests/s, x1.25 apart): the first measured probe's rate, and the virtual probes."""
    probes: list[tuple[float, float]] = []
    cfg = engine_config(args.parallel, args.ctx)
    ctx = ArmContext(cfg, {}, 1.0, 1.0, slo.pair())
    rate = 0.01
    while rate < 10:
        sched = generate(
            "conversation", rate, 300.0, args.seed + 50, max_model_len=cfg.max_model_len
        )
        sched = cal.with_lengths(sched, prompts, outputs, args.max_tokens, args.seed)
        run = simulate(sched, make_arm(NONE, ctx, {}), fitted, cfg)
        att = float(summarize(run, slo.pair())["slo_attainment"] or 0.0)
        probes.append((rate, att))
        if att < 0.5:
            break
        rate *= 1.25
    return cal.capacity_rate(probes), probes


def _context(
    workload: str, args: argparse.Namespace, capacity_rps: float, mean_total: float, slo: cal.Slo
) -> ArmContext:
    return ArmContext(
        engine_config(args.parallel, args.ctx),
        {t.name: t for t in tenants_of(workload)},
        capacity_rps,
        capacity_rps * mean_total,
        slo.pair(),
    )


def _row(
    run: ArmRun,
    workload: str,
    load: float,
    arm: str,
    args: argparse.Namespace,
    slo: cal.Slo,
    tuned: str,
) -> dict[str, Any]:
    s = summarize(run.result, slo.pair())
    extra = {
        "tuned": tuned,
        "timeouts": run.timeouts,
        "errors_5xx": run.errors_5xx,
        "statuses": run.statuses,
        "send_lag_p99_s": run.send_lag_p99_s,
        "kept_up": run.kept_up,
        "engine": run.engine.summary(),
        "loadavg_before": run.loadavg_before,
        "loadavg_after": run.loadavg_after,
        "wall_s": run.wall_s,
        **output_stats(run.output_tokens, run.finish),
    }
    return build_row(s, workload=workload, load=load, arm=arm, seed=args.seed, extra=extra)


async def _main(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    server, model = find_llama()
    ncpu = os.cpu_count() or 1
    pin = not args.no_pin and ncpu >= 2
    engine_cpus = str(ncpu - 1) if pin else None
    client_cpus = ",".join(str(c) for c in range(ncpu - 1)) if pin else None
    if pin:
        os.sched_setaffinity(0, set(range(ncpu - 1)))
    load0 = os.getloadavg()
    words = corpus()
    meta: dict[str, Any] = {
        "llama_server": server,
        "model": model,
        "parallel": args.parallel,
        "ctx": args.ctx,
        "threads": args.threads,
        "cpus": ncpu,
        "engine_cpus": engine_cpus,
        "client_cpus": client_cpus,
        "loadavg_start": load0,
        "short": args.short,
        "seed": args.seed,
        "duration_s": args.duration,
        "drain_s": args.drain,
        "max_tokens": args.max_tokens,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    print(
        f"real engine: llama-server {Path(server).name}, {Path(model).name}, --parallel "
        f"{args.parallel} -c {args.ctx} -t {args.threads}, engine on CPU {engine_cpus}, client "
        f"on {client_cpus}; load average {load0[0]:.2f}",
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    vrows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvgate-real-") as tmp:
        workdir = Path(tmp)
        proc = await asyncio.to_thread(
            start_llama,
            server,
            model,
            workdir / "llama.log",
            parallel=args.parallel,
            ctx=args.ctx,
            threads=args.threads,
            cpus=engine_cpus,
        )
        try:
            c = await calibrate(proc.url, args, words, workdir)
            slo: cal.Slo = c["slo"]
            fitted: StepTimeModel = c["steptime"]
            print(
                f"  SLO TTFT <= {slo.ttft_s:.3f} s, TPOT <= {slo.tpot_s * 1e3:.0f} ms (unloaded "
                f"p50 {slo.unloaded_ttft_p50_s:.3f} s, {slo.unloaded_tpot_p50_s * 1e3:.0f} ms); "
                f"capacity {c['capacity_rps']:.3f} req/s; mean output "
                f"{c['mean_output_tokens']:.0f} tokens; fit a {fitted.a_s * 1e3:.2f} ms, b "
                f"{fitted.b_s * 1e6:.1f} us, c {fitted.c_s * 1e3:.2f} ms, d "
                f"{fitted.d_s * 1e6:.3f} us (rms error {c['fit_rmse'] * 100:.0f} %)",
                flush=True,
            )
            tuned: dict[str, dict[str, Any]] = {}
            for workload, load in cells(args.short):
                total = isolation_load(load) if workload == "isolation" else load
                rate = total * c["capacity_rps"]
                sched = generate(
                    workload,
                    rate,
                    args.duration,
                    args.seed,
                    max_model_len=args.ctx // args.parallel,
                    noisy_load=load,
                )
                ctx = _context(workload, args, c["capacity_rps"], c["mean_total_tokens"], slo)
                print(
                    f"{workload} load {load:g} ({rate:.3f} req/s, {len(sched.requests)} "
                    f"requests over {args.duration:g} s)",
                    flush=True,
                )
                cell_rows: dict[str, dict[str, Any]] = {}
                none_run: ArmRun | None = None
                for arm in (NONE, CAP, BUCKET, KVGATE):
                    settings: list[dict[str, Any]] = [{}]
                    if arm in tuned:
                        settings = [tuned[arm]]
                    elif arm in (CAP, BUCKET):
                        settings = sweeps(args.short, args.parallel, slo.ttft_s)[arm]
                    found: list[tuple[dict[str, Any], float]] = []
                    for params in settings:
                        run = await run_arm(
                            proc.url,
                            sched,
                            arm,
                            ctx,
                            params,
                            max_tokens=args.max_tokens,
                            drain_s=args.drain,
                            words=words,
                            workdir=workdir,
                            client_cpus=client_cpus,
                        )
                        how = "swept" if len(settings) > 1 else ("reused" if params else "-")
                        row = _row(run, workload, load, arm, args, slo, how)
                        row["params"] = params
                        found.append((params, row["goodput_tokens_per_s"]))
                        if arm == NONE:
                            none_run = run
                        if len(settings) > 1:
                            print(
                                f"    {arm} {params}: goodput {row['goodput_tokens_per_s']:.1f}",
                                flush=True,
                            )
                        if (
                            arm not in cell_rows
                            or row["goodput_tokens_per_s"] > cell_rows[arm]["goodput_tokens_per_s"]
                        ):
                            cell_rows[arm] = row
                    if arm in (CAP, BUCKET) and arm not in tuned:
                        tuned[arm] = best_setting(found)
                    print(row_text(cell_rows[arm], cell_rows.get(NONE)), flush=True)
                rows += cell_rows.values()
                assert none_run is not None
                vs = cal.with_lengths(
                    sched,
                    none_run.prompt_tokens,
                    none_run.output_tokens,
                    args.max_tokens,
                    args.seed,
                )
                for arm, row in cell_rows.items():
                    vrun = simulate(vs, make_arm(arm, ctx, row["params"]), fitted, ctx.engine)
                    vrows.append(
                        build_row(
                            summarize(vrun, slo.pair()),
                            workload=workload,
                            load=load,
                            arm=arm,
                            seed=args.seed,
                            extra={"params": row["params"]},
                        )
                    )
        finally:
            await asyncio.to_thread(proc.stop)
    comp = comparison(rows, vrows)
    tg = targets(rows)
    print("real vs virtual (fitted engine), goodput tok/s and SLO met:")
    for x in comp:
        print(
            f"  {x['workload']:<12} {x['load']:g}  {x['arm']:<16} real {x['real_goodput']:6.1f} "
            f"virtual {x['virtual_goodput']:6.1f}  ratio "
            f"{'-' if x['real_over_virtual'] is None else format(x['real_over_virtual'], '.2f')}  "
            f"SLO {x['real_slo'] or 0:.2f} / {x['virtual_slo'] or 0:.2f}"
            f"{'' if x['agree'] else '  DISAGREE'}"
        )
    print("targets:")
    for t in tg:
        v = "-" if t["value"] is None else f"{t['value']:.2f}"
        print(f"  {'met   ' if t['met'] else 'MISSED'} {t['target']}: {v} (goal {t['goal']})")
    meta["loadavg_end"] = os.getloadavg()
    meta["wall_s"] = time.perf_counter() - t_start
    print(f"wall {meta['wall_s']:.0f} s; load average {meta['loadavg_end'][0]:.2f}")
    if args.json is not None:
        c_json = {**c, "slo": c["slo"].__dict__, "steptime": c["steptime"].__dict__}
        args.json.write_text(
            json.dumps(
                {
                    "meta": meta,
                    "calibration": c_json,
                    "rows": rows,
                    "virtual": vrows,
                    "comparison": comp,
                    "targets": tg,
                },
                indent=2,
                default=str,
            )
        )
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m kvgate_bench.real_engine",
        description="kvgate's goodput in front of a real llama-server (none, tuned cap, tuned "
        "token bucket, kvgate), next to the virtual benchmark on a fitted engine. llama-server "
        "and its model: $KVGATE_LLAMA_SERVER and $KVGATE_LLAMA_MODEL, else the test command's "
        "cache, else scripts/build-llama builds them.",
    )
    p.add_argument(
        "--short", action="store_true", help="fewer cells and shorter schedules (<8 min)"
    )
    p.add_argument("--seed", type=int, default=1, help="the schedules' seed (default 1)")
    p.add_argument("--parallel", type=int, default=4, help="llama-server slots (default 4)")
    p.add_argument(
        "--ctx", type=int, default=4096, help="llama-server context, all slots (default 4096)"
    )
    p.add_argument("--threads", type=int, default=1, help="llama-server threads (default 1)")
    p.add_argument("--max-tokens", type=int, help="cap on each request's max_tokens (default 96)")
    p.add_argument(
        "--duration", type=float, help="schedule length per cell, s (default 40; --short 20)"
    )
    p.add_argument(
        "--drain",
        type=float,
        help="seconds after a schedule before cutting requests (default 10; --short 8)",
    )
    p.add_argument(
        "--probe-duration",
        type=float,
        help="shortest capacity probe, s (a probe is long enough for 15 arrivals, up to 3x this)",
    )
    p.add_argument("--no-pin", action="store_true", help="no taskset pinning")
    p.add_argument("--json", type=Path, help="write rows, calibration and meta here")
    a = p.parse_args(argv)
    a.max_tokens = a.max_tokens or 96
    a.duration = a.duration or (20.0 if a.short else 40.0)
    a.drain = a.drain or (8.0 if a.short else 10.0)
    a.probe_duration = a.probe_duration or (15.0 if a.short else 20.0)
    return a


def main(argv: list[str] | None = None) -> int:
    """Entry point; the exit status."""
    return asyncio.run(_main(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
