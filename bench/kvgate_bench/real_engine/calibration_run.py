"""Step 1 of :mod:`kvgate_bench.real_engine.__main__` against llama-server: the calibration run.

On a server of its own (prompt cache off, as for every arm), after a warm-up:

1. **Unloaded requests** of five prompt lengths (three with ``--short``), one at a time, then
   :data:`~kvgate_bench.real_engine.calibration.SLO_REQUESTS` (``--short`` 1) at
   ``conversation``'s median prompt: TTFT, TPOT and llama-server's ``timings``; the SLO
   (:func:`kvgate_bench.real_engine.calibration.slo_from_unloaded`: the TTFT p50 of the
   median-prompt requests, the TPOT p50 of all).
2. **Bursts**: for each batch size k = 1 .. ``parallel``,
   :data:`~kvgate_bench.real_engine.profile_fit.MIN_BURSTS` bursts of k equal requests sent
   together (a fresh prompt per burst, :data:`BURST_TOKENS` output tokens each, EOS ignored so
   that all k decode to the end side by side); the engine profile
   (:func:`kvgate_bench.real_engine.profile_fit.fit_profile`: a decode table by batch size,
   the prefill and context costs).
3. **Capacity**: ``none``'s probes on ``conversation`` (Poisson chat arrivals), the first at the
   rate where the fitted profile's goodput peaks in virtual time
   (:func:`kvgate_bench.real_engine.virtual.predicted_capacity`), the next climbing or stepping
   down towards the real peak (:func:`kvgate_bench.real_engine.calibration.next_goodput_probe`),
   each long enough for :data:`~kvgate_bench.real_engine.calibration.PROBE_REQUESTS` (40)
   requests (:func:`~kvgate_bench.real_engine.calibration.probe_schedule`), up to
   :data:`~kvgate_bench.real_engine.calibration.MAX_PROBES` (5) of them; load 1 is the peak
   goodput over the probes' mean output
   (:func:`~kvgate_bench.real_engine.calibration.load1_rate`); ``--short``: 2 probes of 15.

Each request opens its own connection. The result is JSON-ready (:func:`calibrate`), so that a
resume file keeps it and later invocations reuse it (:func:`slo_of`, :func:`profile_of`).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp

from kvgate_bench.effectiveness.model.metrics import summarize
from kvgate_bench.effectiveness.model.schedule import Request
from kvgate_bench.kit.sse import sse_json
from kvgate_bench.kit.toolkit import percentile
from kvgate_bench.real_engine import calibration as cal
from kvgate_bench.real_engine import profile_fit as pf
from kvgate_bench.real_engine.client import run_arm
from kvgate_bench.real_engine.engine import metric_totals, wait_idle
from kvgate_bench.real_engine.plan import NONE
from kvgate_bench.real_engine.prompts import MODELS, prompt_for, request_body
from kvgate_bench.real_engine.stats import wilson
from kvgate_bench.real_engine.virtual import arm_context, predicted_capacity
from kvgate_bench.sim.profile_file import EngineProfile

#: Output tokens of each burst request (EOS ignored).
BURST_TOKENS = 48


async def one_request(
    session: aiohttp.ClientSession,
    url: str,
    prompt: str,
    max_tokens: int,
    alias: str,
    ignore_eos: bool = False,
) -> dict[str, Any]:
    """One streamed request: TTFT, TPOT (seconds), llama-server's ``timings`` and usage."""
    body = request_body(prompt, max_tokens, alias)
    if ignore_eos:
        body["ignore_eos"] = True
    t0 = time.perf_counter()
    first = last = None
    timings: dict[str, Any] = {}
    usage: dict[str, Any] = {}
    async with session.post(url + "/v1/chat/completions", json=body) as r:
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


def _prompt(name: str, tokens: int, words: list[str]) -> str:
    return prompt_for(Request(name, 0, "c", "interactive", tokens, None, 1), words)


async def _measure(
    url: str, args: argparse.Namespace, words: list[str], alias: str, median_prompt: int
) -> tuple[list[dict[str, Any]], list[pf.Burst]]:
    """Steps 1 and 2 of the module docstring: the unloaded requests (those at
    ``median_prompt`` nominal tokens marked ``"slo": True``) and the bursts."""
    unloaded: list[dict[str, Any]] = []
    bursts: list[pf.Burst] = []
    # A fresh connection per request: llama-server may close one after a stream (a reused,
    # half-closed keep-alive connection fails the next request's write).
    connector = aiohttp.TCPConnector(force_close=True)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await one_request(session, url, "Hello", 4, alias)  # warm-up (first touch of weights)
        lengths = (48, 320, 640) if args.short else (48, 160, 320, 480, 640)
        for i, pt in enumerate(lengths):
            m = await one_request(
                session, url, _prompt(f"unloaded-{i}", pt, words), args.max_tokens, alias
            )
            unloaded.append(m)
        for i in range(1 if args.short else cal.SLO_REQUESTS):
            m = await one_request(
                session, url, _prompt(f"slo-{i}", median_prompt, words), args.max_tokens, alias
            )
            unloaded.append({**m, "slo": True})
        for k in range(1, args.parallel + 1):
            for i in range(pf.MIN_BURSTS):
                prompt = _prompt(f"burst-{k}-{i}", 320, words)
                ms = await asyncio.gather(
                    *(
                        one_request(session, url, prompt, BURST_TOKENS, alias, ignore_eos=True)
                        for _ in range(k)
                    )
                )
                bursts.append(pf.burst_from_timings([m["timings"] for m in ms]))
    return unloaded, bursts


async def calibrate(
    url: str, args: argparse.Namespace, words: list[str], workdir: Path
) -> dict[str, Any]:
    """The module docstring's calibration on the llama-server at ``url``, as JSON-ready values:
    ``slo`` (:class:`~kvgate_bench.real_engine.calibration.Slo`'s fields), ``profile`` (the
    engine profile's JSON), ``capacity_rps`` (the load-1 rate, requests/s), the probes, the
    unloaded requests and bursts, the outputs' mean and median length, llama-server's
    counters."""
    alias = MODELS[args.model].alias
    median_prompt = cal.median_prompt_tokens(args.ctx // args.parallel, args.tune_seed)
    unloaded, bursts = await _measure(url, args, words, alias, median_prompt)
    slo = cal.slo_from_unloaded(
        [m["ttft_s"] for m in unloaded if m.get("slo")], [m["tpot_s"] for m in unloaded]
    )
    profile = pf.fit_profile(
        f"llama-server-{args.model}-p{args.parallel}",
        parallel=args.parallel,
        ctx=args.ctx,
        unloaded=[m["timings"] for m in unloaded],
        bursts=bursts,
        slo=slo,
    )
    outs = [int(m["usage"]["completion_tokens"]) for m in unloaded]
    prompts = {f"u{i}": int(m["usage"]["prompt_tokens"]) for i, m in enumerate(unloaded)}
    rate, _ = predicted_capacity(
        profile, args, slo, prompts, {f"u{i}": o for i, o in enumerate(outs)}
    )
    predicted_rate = rate
    if rate <= 0:  # the fitted engine has no goodput at any rate: a rough guess
        service = sum(m["ttft_s"] + m["tpot_s"] * o for m, o in zip(unloaded, outs, strict=True))
        rate = 0.5 * args.parallel / (service / len(outs))
    mean_total = sum(outs) / len(outs) + sum(prompts.values()) / len(prompts)
    probes: list[tuple[float, float]] = []
    probe_rows = []
    probe_outs: list[int] = []
    if args.short:
        n_probes, need = 2, cal.SHORT_PROBE_REQUESTS
        longest = cal.SHORT_PROBE_SPAN * args.probe_duration
    else:
        n_probes, need, longest = cal.MAX_PROBES, cal.PROBE_REQUESTS, cal.PROBE_MAX_S
    for i in range(n_probes):
        sched = cal.probe_schedule(
            rate, args.tune_seed + 100 + i, args.probe_duration, longest, need,
            max_model_len=args.ctx // args.parallel,
        )  # fmt: skip
        ctx = arm_context("conversation", args, rate, mean_total, slo)
        run = await run_arm(
            url, sched, NONE, ctx, {}, max_tokens=args.max_tokens, drain_s=args.drain,
            words=words, workdir=workdir, alias=alias,
        )  # fmt: skip
        s = summarize(run.result, slo.pair())
        att = float(s["slo_attainment"] or 0.0)
        goodput = float(s["goodput_tokens_per_s"])
        probes.append((rate, goodput))
        probe_outs += list(run.output_tokens.values())
        n = int(s["requests"])
        interval = wilson(round(att * n), n)
        probe_rows.append(
            {"rate_rps": rate, "slo_attainment": att, "requests": n,
             "goodput_tokens_per_s": goodput, "slo_attainment_wilson95": interval,
             "timeouts": run.timeouts, "send_lag_p99_s": run.send_lag_p99_s,
             "cached_prompt_tokens": run.cached_prompt_tokens}
        )  # fmt: skip
        shown = f" [{interval[0]:.2f}, {interval[1]:.2f}]" if interval else ""
        print(
            f"  capacity probe {rate:.3f} req/s: goodput {goodput:.2f} tokens/s, SLO met "
            f"{att:.2f}{shown} ({n} requests)",
            flush=True,
        )
        nxt = cal.next_goodput_probe(probes)
        if nxt is None:
            break
        rate = nxt
    outs += probe_outs
    probe_mean_out = sum(probe_outs) / len(probe_outs) if probe_outs else sum(outs) / len(outs)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        totals = await metric_totals(session, url)
    return {
        "slo": slo.__dict__,
        "profile": profile.to_json(),
        "capacity_rps": cal.load1_rate(probes, probe_mean_out),
        "capacity_definition": cal.GOODPUT_PEAK,
        "probe_mean_output_tokens": probe_mean_out,
        "probes": probe_rows,
        "predicted_capacity_rps": predicted_rate,
        "unloaded": [
            {k: m[k] for k in ("ttft_s", "tpot_s", "usage", "timings", "slo") if k in m}
            for m in unloaded
        ],
        "slo_prompt_tokens": median_prompt,
        "bursts": [b.__dict__ for b in bursts],
        "engine_totals": totals,
        "mean_output_tokens": sum(outs) / len(outs),
        "mean_total_tokens": mean_total,
        "output_tokens_p50": percentile([float(o) for o in outs], 50),
    }


#: The engine check's prompt (nominal tokens, about 150 real) and output tokens (EOS ignored).
CHECK_PROMPT_TOKENS = 320
CHECK_OUTPUT_TOKENS = 32
#: How long the engine check waits for an idle engine, seconds (the checks, about 2 s each,
#: fit in the slack of :data:`kvgate_bench.real_engine.plan.RESTART_S`).
CHECK_IDLE_S = 10.0


async def engine_check(url: str, words: list[str], alias: str) -> dict[str, Any] | None:
    """llama-server's ``timings`` of one unloaded request (once the engine is idle, after a
    4-token warm-up), a prompt of :data:`CHECK_PROMPT_TOKENS` nominal tokens and
    :data:`CHECK_OUTPUT_TOKENS` output tokens: the engine's speed at this moment, to set
    against the calibration's unloaded requests
    (:func:`kvgate_bench.real_engine.twin.check_speed`). None when the engine stays busy for
    :data:`CHECK_IDLE_S` seconds (an arm's cut requests) or the request fails (the arm runs
    regardless)."""
    connector = aiohttp.TCPConnector(force_close=True)
    try:
        async with aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=60), connector=connector
        ) as session:
            await wait_idle(session, url, CHECK_IDLE_S)
            await one_request(session, url, "Hello", 4, alias)
            prompt = _prompt("engine-check", CHECK_PROMPT_TOKENS, words)
            m = await one_request(session, url, prompt, CHECK_OUTPUT_TOKENS, alias, ignore_eos=True)
    except (aiohttp.ClientError, TimeoutError, OSError):
        return None
    return dict(m["timings"]) or None


def slo_of(c: dict[str, Any]) -> cal.Slo:
    """The calibration's SLO."""
    return cal.Slo(**c["slo"])


def profile_of(c: dict[str, Any]) -> EngineProfile:
    """The calibration's engine profile."""
    return EngineProfile(**c["profile"])


def calibration_text(c: dict[str, Any]) -> str:
    """The printed line of :func:`calibrate`'s result: the SLO (and the unloaded p50s it comes
    from), load 1 (or a file's older capacity), the mean output, the fitted decode table and
    costs, and the prefill measured under load
    (:func:`kvgate_bench.real_engine.profile_fit.stall_prefill`)."""
    slo, p = slo_of(c), profile_of(c)
    table = ", ".join(f"{k}: {ms:.1f}" for k, ms in p.decode_step_ms.items())
    ms, n = pf.stall_prefill([pf.burst_of(b) for b in c.get("bursts") or ()])
    loaded = f" ({ms / n:.3f} under load, {n:.0f} tokens)" if n > 0 else ""
    med = c.get("slo_prompt_tokens")
    at = f" at {cal.SLO_WORKLOAD}'s median prompt, {med} nominal tokens" if med else ""
    if c.get("capacity_definition") == cal.GOODPUT_PEAK:
        peak = max(float(q["goodput_tokens_per_s"]) for q in c["probes"])
        capacity = (
            f"load 1 {c['capacity_rps']:.3f} req/s (none's peak goodput {peak:.2f} tokens/s "
            f"over {c['probe_mean_output_tokens']:.0f} tokens a request)"
        )
    else:
        capacity = f"capacity {c['capacity_rps']:.3f} req/s"
    return (
        f"  SLO TTFT <= {slo.ttft_s:.3f} s, TPOT <= {slo.tpot_s * 1e3:.0f} ms (unloaded "
        f"p50 {slo.unloaded_ttft_p50_s:.3f} s{at}, {slo.unloaded_tpot_p50_s * 1e3:.0f} ms); "
        f"{capacity}; mean output "
        f"{c['mean_output_tokens']:.0f} tokens; decode step ms by batch size {{{table}}}, "
        f"prefill {p.prefill_ms_per_token:.3f} ms/token{loaded}, context "
        f"{p.context_us_per_token:.3f} us/token"
    )
