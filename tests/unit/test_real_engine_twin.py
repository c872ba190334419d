"""The real-engine twin recomputed by ``--report`` (:mod:`kvgate_bench.real_engine.twin`), pure:
the engine speed of a pair, leave-one-out over a cell's other arms, the speed from an arm's own
engine check, the scaled profile, and a cell whose "real" rows come from a slower engine: the
calibrated twin is optimistic, the twin at the arms' speed finds the slowdown from the other
arms and agrees; and the engine check a new run takes on each arm's server."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web

from kvgate_bench.real_engine import calibration_run, plan, twin
from kvgate_bench.real_engine.calibration_run import engine_check
from kvgate_bench.real_engine.profile_fit import Burst, refit
from kvgate_bench.real_engine.verdict_text import twin_lines


def pair(
    arm: str, ttft: float, wait: float, tpot: float, scale: tuple[float, float] = (1.0, 1.0)
) -> dict[str, Any]:
    return {
        "arm": arm,
        "real_ttft_p50_s": wait + (ttft - wait) * scale[0],
        "virtual_ttft_p50_s": ttft,
        "real_queue_wait_p50_s": wait,
        "virtual_queue_wait_p50_s": wait,
        "real_tpot_p50_s": tpot * scale[1],
        "virtual_tpot_p50_s": tpot,
    }


def test_speed_ratios_take_the_engine_part_of_ttft_and_the_tpot() -> None:
    assert twin.speed_ratios(pair("kvgate", 2.0, 0.5, 0.013, (1.4, 1.2))) == pytest.approx(
        (1.4, 1.2)
    )
    assert twin.speed_ratios({"arm": "none", "real_tpot_p50_s": None}) == (None, None)


def test_leave_one_out_never_reads_the_arm_compared() -> None:
    pairs = [
        pair("none", 3.0, 0.0, 0.08, (9.0, 9.0)),
        pair("concurrency-cap", 2.0, 0.6, 0.013, (1.3, 1.5)),
        pair("kvgate", 1.5, 0.0, 0.013, (1.4, 1.6)),
        pair("token-bucket", 1.3, 0.0, 0.013, (1.5, 1.7)),
    ]
    assert twin.leave_one_out(pairs, "none") == pytest.approx((1.4, 1.6))
    sp, sd = twin.leave_one_out(pairs, "kvgate")
    assert sp == pytest.approx(1.5) and sd == pytest.approx(1.7)  # median of 9, 1.3, 1.5
    assert twin.leave_one_out(pairs[:1], "none") == (1.0, 1.0)


def test_check_speed_compares_the_arms_unloaded_request_with_the_calibrations() -> None:
    ref = {"prompt_n": 100, "prompt_ms": 500.0, "predicted_n": 40, "predicted_per_token_ms": 13.0}
    cal = {"unloaded": [{"timings": ref}]}
    slow = {**ref, "prompt_ms": 700.0, "predicted_per_token_ms": 19.5}
    assert twin.check_speed({"engine_check": [slow, ref]}, cal) == pytest.approx((1.2, 1.25))
    assert twin.check_speed({}, cal) is None
    assert twin.check_speed({"engine_check": [None]}, cal) is None


def test_scaled_multiplies_prefill_table_and_context() -> None:
    p = refit(calibration())
    q = twin.scaled(p, (1.5, 2.0))
    assert q.prefill_ms_per_token == pytest.approx(1.5 * p.prefill_ms_per_token)
    assert q.decode_step_ms == pytest.approx({k: 2 * v for k, v in p.decode_step_ms.items()})
    assert q.context_us_per_token == pytest.approx(2 * p.context_us_per_token)
    assert q.name == p.name and q.max_num_seqs == p.max_num_seqs


def calibration() -> dict[str, Any]:
    """A calibration of a 4-slot engine: 5 ms/token prefill, decode 10/20/30/35 ms."""

    def t(prompt: int) -> dict[str, Any]:
        return {"prompt_n": prompt, "prompt_ms": 5.0 * prompt, "predicted_n": 40,
                "predicted_per_token_ms": 10.0}  # fmt: skip

    steps = ((1, 10.0), (2, 20.0), (3, 30.0), (4, 35.0))
    bursts = [Burst(k, (124.0,) * k, (ms,) * k, 48) for k, ms in steps]
    return {
        "profile": {"name": "synthetic-p4", "max_num_seqs": 4, "kv_capacity_tokens": 4096},
        "slo": {
            "ttft_s": 5.0,
            "tpot_s": 0.05,
            "unloaded_ttft_p50_s": 0.5,
            "unloaded_tpot_p50_s": 0.01,
        },
        "unloaded": [{"timings": t(p)} for p in (66, 156, 315)],
        "bursts": [b.__dict__ for b in bursts],
        "capacity_rps": 0.12,
        "mean_total_tokens": 300.0,
    }


def test_a_cell_run_on_a_slower_engine_agrees_at_the_speed_of_its_other_arms() -> None:
    cfg = {"parallel": 4, "ctx": 4096, "max_tokens": 256, "duration_s": 60.0, "min_requests": 40}
    doc: dict[str, Any] = {"config": cfg, "calibration": calibration(), "cells": []}
    cell: dict[str, Any] = {"cell": "multi-tenant:2", "workload": "multi-tenant", "load": 2.0,
                            "seed": 3}  # fmt: skip
    sched = plan.sized_schedule("multi-tenant", 2.0, 0.12, 3, min_duration_s=60.0,
                                min_requests=40, max_model_len=1024)  # fmt: skip
    cell["requests"] = len(sched.requests)
    arms = [{"arm": a, "params": p} for a, p in (("none", {}), ("kvgate", {}),
            ("concurrency-cap", {"cap": 1, "queue_timeout_s": 2.0}),
            ("token-bucket", {"factor": 2.0, "burst_s": 10.0}))]  # fmt: skip
    slow = twin.scaled(refit(doc["calibration"]), (1.5, 1.5))
    cell["rows"] = twin.twin_rows(doc, cell, sched, slow, arms)
    doc["cells"] = [cell]
    assert twin.schedule_of(doc, cell) is not None
    got = twin.recompute(doc, [3])
    assert got is not None and got["not_rebuilt"] == []
    cal, fast = got["calibrated"], got["at_speed"]
    assert fast["pairs"] == cal["pairs"] == 4
    assert cal["agree"] == 0 and fast["agree"] == 4
    assert all("speed 1.5" in line and "(other arms)" in line for line in fast["pairs_list"])
    assert any("the engine ran at" in d for d in cal["disagreements"])
    assert got["speed_apart"] == []  # every arm at one speed
    lines = twin_lines(got)
    assert lines[0].startswith("virtual twin recomputed on today's fit")
    assert any(line.startswith("  at each arm's engine speed") for line in lines)
    assert twin.recompute(doc, [4]) is None
    assert twin.recompute({**doc, "calibration": None}, [3]) is None
    assert twin_lines(None) == []


def test_an_isolation_alone_cell_is_simulated_on_isolations_tenants() -> None:
    cfg = {"parallel": 4, "ctx": 4096, "max_tokens": 256, "duration_s": 60.0, "min_requests": 40}
    doc: dict[str, Any] = {"config": cfg, "calibration": calibration()}
    cell: dict[str, Any] = {"cell": "isolation-alone:3", "workload": "isolation-alone",
                            "load": 3.0, "seed": 3}  # fmt: skip
    sched = plan.sized_schedule("isolation-alone", 3.0, 0.12, 3, min_duration_s=60.0,
                                min_requests=40, max_model_len=1024)  # fmt: skip
    cell["requests"] = len(sched.requests)
    cell["rows"] = twin.twin_rows(doc, cell, sched, refit(doc["calibration"]),
                                  [{"arm": "none"}, {"arm": "kvgate"}])  # fmt: skip
    doc["cells"] = [cell]
    got = twin.recompute(doc, [3])
    assert got is not None and got["at_speed"]["pairs"] == 2 == got["calibrated"]["agree"]


def test_a_schedule_that_cannot_be_rebuilt_is_left_out() -> None:
    cfg = {"parallel": 4, "ctx": 4096, "max_tokens": 256, "duration_s": 60.0, "min_requests": 40}
    doc = {"config": cfg, "calibration": calibration()}
    cell = {"cell": "multi-tenant:2", "workload": "multi-tenant", "load": 2.0, "seed": 3,
            "requests": 1}  # fmt: skip
    assert twin.schedule_of(doc, cell) is None


TIMINGS = {"prompt_n": 150, "prompt_ms": 900.0, "predicted_n": 32, "predicted_per_token_ms": 16.0}


async def _check_against_fake(busy: list[int]) -> dict[str, Any] | None:
    """:func:`engine_check` against a fake llama-server whose ``/metrics`` says ``busy``
    requests processing (then 0) and whose completions stream one token and ``TIMINGS``."""

    async def metrics(_: web.Request) -> web.Response:
        n = busy.pop(0) if busy else 0
        return web.Response(
            text=f"llamacpp:requests_processing {n}\nllamacpp:requests_deferred 0\n"
        )

    async def chat(req: web.Request) -> web.StreamResponse:
        body = await req.json()
        resp = web.StreamResponse()
        await resp.prepare(req)
        for obj in (
            {"choices": [{"delta": {"content": "hi"}}]},
            {"choices": [{"delta": {"content": " there"}}]},
            {"choices": [], "usage": {"completion_tokens": 2, "prompt_tokens": 150},
             "timings": {**TIMINGS, "ignore_eos": body.get("ignore_eos", False)}},
        ):  # fmt: skip
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        return await engine_check(f"http://127.0.0.1:{port}", ["word"] * 50, "m")
    finally:
        await runner.cleanup()


def test_engine_check_waits_for_an_idle_engine_and_returns_its_timings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    got = asyncio.run(_check_against_fake([2, 0]))
    assert got is not None and got["prompt_ms"] == 900.0 and got["ignore_eos"] is True
    monkeypatch.setattr(calibration_run, "CHECK_IDLE_S", 0.2)
    assert asyncio.run(_check_against_fake([1] * 100)) is None  # never idle
    assert asyncio.run(engine_check("http://127.0.0.1:9", [], "m")) is None  # nothing there


def test_arms_on_engines_of_different_speeds_are_named() -> None:
    def at(arm: str, sp: float) -> dict[str, Any]:
        return {"arm": arm, "engine_speed": [sp, 1.0]}

    assert twin.speed_apart([at("none", 1.3), at("kvgate", 1.6)]) is None  # within 1.25x
    assert twin.speed_apart([at("none", 1.32), at("kvgate", 1.93), at("concurrency-cap", 1.5)]) == (
        "1.32 (none) to 1.93 (kvgate), 1.46x apart"
    )
    assert twin.speed_apart([at("none", 2.0)]) is None
    lines = twin_lines({"profile": {"decode_step_ms": {"1": 12.0}, "prefill_ms_per_token": 5.0},
                        "not_rebuilt": [], "speed_apart": ["multi-tenant:2@3: 1.32 (none) to"],
                        "calibrated": {"agree": 0, "pairs": 0, "pairs_list": [],
                                       "disagreements": []},
                        "at_speed": {"agree": 0, "pairs": 0, "pairs_list": [],
                                     "disagreements": []}})  # fmt: skip
    assert lines[1].startswith("  cells whose arms ran on engines of different speeds")
    assert lines[2] == "    multi-tenant:2@3: 1.32 (none) to"
