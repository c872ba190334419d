"""llama-server's virtual counterpart: the engine the virtual benchmark simulates in its place,
the arms' context, the capacity that engine predicts and the virtual rows of a cell (step 3 of
:mod:`kvgate_bench.real_engine.__main__`).

The step-time model is the one fitted to llama-server
(:func:`kvgate_bench.real_engine.calibration.fit_steptime`); the schedules are the real ones with
the prompt and output lengths llama-server reported
(:func:`kvgate_bench.real_engine.calibration.with_lengths`). Times are virtual seconds.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from kvgate_bench.effectiveness.arms import ArmContext, make_arm
from kvgate_bench.effectiveness.driver import simulate
from kvgate_bench.effectiveness.metrics import summarize
from kvgate_bench.effectiveness.workloads import Schedule, generate, tenants_of
from kvgate_bench.real_engine import calibration as cal
from kvgate_bench.real_engine.client import NONE, ArmRun
from kvgate_bench.real_engine.report import build_row
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


def arm_context(
    workload: str, args: argparse.Namespace, capacity_rps: float, mean_total: float, slo: cal.Slo
) -> ArmContext:
    """The arms' context for ``workload`` on the server of ``args`` (:func:`engine_config`):
    its tenants, the capacity (requests/s, and tokens/s at ``mean_total`` prompt + output tokens
    a request) and the calibrated SLO."""
    return ArmContext(
        engine_config(args.parallel, args.ctx),
        {t.name: t for t in tenants_of(workload)},
        capacity_rps,
        capacity_rps * mean_total,
        slo.pair(),
    )


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


def virtual_rows(
    schedule: Schedule,
    none_run: ArmRun,
    cell_rows: Mapping[str, Mapping[str, Any]],
    ctx: ArmContext,
    fitted: StepTimeModel,
    slo: cal.Slo,
    *,
    workload: str,
    load: float,
    args: argparse.Namespace,
) -> list[dict[str, Any]]:
    """One virtual row per real row of a cell (``cell_rows``: arm -> row, its ``params`` the
    setting run): ``schedule`` with the lengths of ``none_run`` simulated through the same arm
    and setting on the fitted engine, scored under the calibrated SLO."""
    vs = cal.with_lengths(
        schedule,
        none_run.prompt_tokens,
        none_run.output_tokens,
        args.max_tokens,
        args.seed,
    )
    vrows: list[dict[str, Any]] = []
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
    return vrows
