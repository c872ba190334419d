"""llama-server's virtual twin: the engine the virtual benchmark simulates in its place (the
engine profile fitted by the calibration, :mod:`kvgate_bench.real_engine.profile_fit`), the
arms' context, the capacity that engine predicts and the virtual rows of a cell.

A cell's twin runs the cell's schedule with the prompt and output lengths llama-server
reported (:func:`lengths_of`, :func:`kvgate_bench.real_engine.calibration.with_lengths`)
through each arm at the setting the real arm ran, in virtual time (seconds) on the profile's
step times and shape (:meth:`kvgate_bench.sim.profile_file.EngineProfile.steptime`,
:meth:`~kvgate_bench.sim.profile_file.EngineProfile.engine_config`), scored under the
calibrated SLO; :mod:`kvgate_bench.real_engine.agreement` compares each pair.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

from kvgate_bench.effectiveness.arms.context import ArmContext
from kvgate_bench.effectiveness.arms.registry import make_arm
from kvgate_bench.effectiveness.model.driver import simulate
from kvgate_bench.effectiveness.model.metrics import summarize
from kvgate_bench.effectiveness.model.schedule import Schedule
from kvgate_bench.effectiveness.model.workloads import generate, tenants_of
from kvgate_bench.real_engine import calibration as cal
from kvgate_bench.real_engine.plan import NONE
from kvgate_bench.real_engine.profile_fit import BLOCK, LLAMA_BATCH
from kvgate_bench.real_engine.rows import build_row
from kvgate_bench.sim.profile_file import EngineProfile
from kvgate_bench.sim.sequences import EngineConfig


def engine_config(parallel: int, ctx: int) -> EngineConfig:
    """The virtual engine of llama-server ``--parallel P -c C --no-kv-unified``: P sequences,
    each of at most C / P tokens, a KV pool of C tokens (in 16-token blocks), prompts chunked
    within llama.cpp's 2048-token batch (the fitted profile's shape too)."""
    return EngineConfig(
        num_gpu_blocks=ctx // BLOCK,
        block_size=BLOCK,
        max_model_len=ctx // parallel,
        max_num_seqs=parallel,
        max_num_batched_tokens=LLAMA_BATCH,
        chunked_prefill=True,
    )


def arm_context(
    workload: str,
    args: argparse.Namespace,
    capacity_rps: float,
    mean_total: float,
    slo: cal.Slo,
    load: float = 3.0,
) -> ArmContext:
    """The arms' context for ``workload`` (``isolation``: its noisy tenant at ``load``) on the
    server of ``args`` (:func:`engine_config`): its tenants, the capacity (requests/s, and
    tokens/s at ``mean_total`` prompt + output tokens a request) and the calibrated SLO."""
    noisy = load if workload == "isolation" else 3.0
    return ArmContext(
        engine_config(args.parallel, args.ctx),
        {t.name: t for t in tenants_of(workload, noisy)},
        capacity_rps,
        capacity_rps * mean_total,
        slo.pair(),
    )


#: The twin's goodput probes: 300 s schedules from 0.01 requests/s, x1.25 apart, up to 10
#: requests/s, stopping once goodput has fallen below half its peak.
TWIN_PROBE_S = 300.0


def predicted_capacity(
    profile: EngineProfile,
    args: argparse.Namespace,
    slo: cal.Slo,
    prompts: dict[str, int],
    outputs: dict[str, int],
) -> tuple[float, list[tuple[float, float]]]:
    """The rate (requests/s) at which ``none``'s goodput on ``conversation`` peaks in virtual
    time on the fitted profile (prompt and output lengths drawn from the measured ones;
    :data:`TWIN_PROBE_S` schedules), and the virtual probes (rate requests/s, goodput output
    tokens/s); (0.0, probes) when no rate had goodput."""
    probes: list[tuple[float, float]] = []
    cfg = profile.engine_config()
    steptime = profile.steptime()
    ctx = ArmContext(cfg, {}, 1.0, 1.0, slo.pair())
    rate = 0.01
    while rate < 10:
        sched = generate(
            "conversation", rate, TWIN_PROBE_S, args.tune_seed + 50,
            max_model_len=cfg.max_model_len,
        )  # fmt: skip
        sched = cal.with_lengths(sched, prompts, outputs, args.max_tokens, args.tune_seed)
        run = simulate(sched, make_arm(NONE, ctx, {}), steptime, cfg)
        goodput = float(summarize(run, slo.pair())["goodput_tokens_per_s"])
        probes.append((rate, goodput))
        if goodput < 0.5 * max(g for _, g in probes):
            break
        rate *= 1.25
    peak_rate, peak = max(probes, key=lambda p: p[1])
    return (peak_rate if peak > 0 else 0.0), probes


def lengths_of(
    rows: Sequence[Mapping[str, Any]],
) -> tuple[dict[str, int], dict[str, int]]:
    """(prompt tokens, output tokens) by request id as llama-server reported them in a cell's
    real rows (``prompt_tokens_by_id``, ``output_tokens_by_id``): ``none``'s first (it cut
    nothing short), then the other arms' for what ``none`` did not serve, an output only from
    a request that ended on its own (EOS) or at the ceiling it was sent."""
    order = sorted(rows, key=lambda r: r["arm"] != NONE)
    prompts: dict[str, int] = {}
    outputs: dict[str, int] = {}
    for r in order:
        for rid, n in (r.get("prompt_tokens_by_id") or {}).items():
            prompts.setdefault(rid, int(n))
        for rid, n in (r.get("natural_output_tokens_by_id") or {}).items():
            outputs.setdefault(rid, int(n))
    return prompts, outputs


def virtual_rows(
    schedule: Schedule,
    real_rows: Sequence[Mapping[str, Any]],
    ctx: ArmContext,
    profile: EngineProfile,
    slo: cal.Slo,
    *,
    workload: str,
    load: float,
    seed: int,
    max_tokens: int,
) -> list[dict[str, Any]]:
    """One virtual row per real row of a cell (its ``params`` the setting run): ``schedule``
    with the real lengths (:func:`lengths_of`) simulated through the same arm and setting on
    ``profile`` (the context's engine replaced by the profile's), scored under ``slo``."""
    prompts, outputs = lengths_of(real_rows)
    vs = cal.with_lengths(schedule, prompts, outputs, max_tokens, seed)
    cfg, steptime = profile.engine_config(), profile.steptime()
    vctx = ArmContext(cfg, ctx.tenants, ctx.capacity_rps, ctx.capacity_tokens_per_s, ctx.slo)
    out: list[dict[str, Any]] = []
    for row in real_rows:
        arm, params = row["arm"], dict(row.get("params") or {})
        vrun = simulate(vs, make_arm(arm, vctx, params), steptime, cfg)
        out.append(
            build_row(
                vrun, slo.pair(), workload=workload, load=load, arm=arm, seed=seed,
                profile=profile.name, extra={"params": params},
            )
        )  # fmt: skip
    return out
