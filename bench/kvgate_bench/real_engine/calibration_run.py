"""Step 1 of :mod:`kvgate_bench.real_engine.__main__` against llama-server: the calibration run.

Unloaded requests of three prompt lengths (five without ``--short``), one at a time, after a
warm-up; two bursts of 2 and ``parallel`` equal requests; llama-server's counters; the step-time
fit; then ``none``'s capacity probes on ``conversation``, the first at the rate the fitted engine
predicts (:func:`kvgate_bench.real_engine.virtual.predicted_capacity`). Each request opens its
own connection. The arithmetic (SLO, fit, capacity, next probe) is
:mod:`kvgate_bench.real_engine.calibration`'s; this module sends the requests and keeps the
figures.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp

from kvgate_bench.effectiveness.metrics import summarize
from kvgate_bench.effectiveness.workloads import generate
from kvgate_bench.kit.sse import sse_json
from kvgate_bench.kit.toolkit import percentile
from kvgate_bench.real_engine import calibration as cal
from kvgate_bench.real_engine.client import NONE, prompt_for, request_body, run_arm
from kvgate_bench.real_engine.engine import metric_totals
from kvgate_bench.real_engine.virtual import arm_context, predicted_capacity
from kvgate_bench.sim.steptime import StepTimeModel


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
        async for obj in sse_json(r.content):
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
    """Step 1 of :mod:`kvgate_bench.real_engine.__main__`'s docstring; the calibration as
    JSON-ready values (``slo`` a :class:`~kvgate_bench.real_engine.calibration.Slo` and
    ``steptime`` a :class:`~kvgate_bench.sim.steptime.StepTimeModel` until
    :func:`kvgate_bench.real_engine.report.report_json` turns them into dicts)."""
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
        ctx = arm_context("conversation", args, rate, mean_total, slo)
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


def calibration_text(c: dict[str, Any]) -> str:
    """The printed line of :func:`calibrate`'s result: the SLO (and the unloaded p50s it comes
    from), the capacity, the mean output and the fitted step-time coefficients."""
    slo: cal.Slo = c["slo"]
    fitted: StepTimeModel = c["steptime"]
    return (
        f"  SLO TTFT <= {slo.ttft_s:.3f} s, TPOT <= {slo.tpot_s * 1e3:.0f} ms (unloaded "
        f"p50 {slo.unloaded_ttft_p50_s:.3f} s, {slo.unloaded_tpot_p50_s * 1e3:.0f} ms); "
        f"capacity {c['capacity_rps']:.3f} req/s; mean output "
        f"{c['mean_output_tokens']:.0f} tokens; fit a {fitted.a_s * 1e3:.2f} ms, b "
        f"{fitted.b_s * 1e6:.1f} us, c {fitted.c_s * 1e3:.2f} ms, d "
        f"{fitted.d_s * 1e6:.3f} us (rms error {c['fit_rmse'] * 100:.0f} %)"
    )
