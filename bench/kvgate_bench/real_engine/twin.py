"""The virtual twin recomputed from a resume file (``--report``): on today's fit of the
calibration, and at the engine speed each arm ran at (pure; simulation only).

A finished cell keeps the twin rows it was closed with (the profile fitted then). The report
recomputes two twins of each finished cell of the report seeds, the schedule rebuilt as the
run built it (:func:`schedule_of`), each real row's arm and setting simulated again
(:func:`kvgate_bench.real_engine.virtual.virtual_rows`) and compared
(:func:`kvgate_bench.real_engine.agreement.compare_cell`):

1. **calibrated**: on the profile today's fit makes from the calibration's raw data
   (:func:`kvgate_bench.real_engine.profile_fit.refit`): what the calibration alone predicts.
2. **at the arm's engine speed**: the same profile with its prefill cost x ``s_p`` and its
   decode table and context cost x ``s_d``, the engine's speed while the arm ran relative to
   the calibration. A row that carries ``engine_check`` (llama-server's ``timings`` of one
   unloaded request on the arm's own server before and after the arm,
   :mod:`kvgate_bench.real_engine.cells`) gives it directly (:func:`check_speed`). A row
   without (files written before) gets it *leave-one-out* from the cell's other arms
   (:func:`leave_one_out`): per other arm, the real medians over the calibrated twin's,
   ``s_p`` = (TTFT p50 - queue wait p50) real / virtual and ``s_d`` = TPOT p50 real /
   virtual (:func:`speed_ratios`), the median over those arms. The arm compared never sets
   its own speed, so the comparison is not fitted to the row it judges. The TTFT ratio is
   the prefill speed where the engine does not queue (the gated arms); an arm that overloads
   it (``none`` at 3x) amplifies it through llama-server's own queue, hence the median.

Why the second: the calibration measures the engine once, and a cell runs hours later on a
machine shared with other work. On the issue-33 file (``issue33-pass3``) the
cells' lone requests prefilled at about 1.3-1.5x and decoded at 1.1-1.6x the calibrated times,
while the calibration's own loaded measurement (the bursts' prefill stalls,
:func:`kvgate_bench.real_engine.profile_fit.stall_prefill`) found prefill beside decodes as
cheap as alone, and the first run on the same calibration (``issue33-pass1``) ran at the
calibrated speed. ``s_p`` and ``s_d`` name that part of the model: the engine's speed.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from kvgate_bench.effectiveness.model.schedule import Schedule
from kvgate_bench.real_engine import plan
from kvgate_bench.real_engine.agreement import compare_cell
from kvgate_bench.real_engine.calibration_run import slo_of
from kvgate_bench.real_engine.profile_fit import refit
from kvgate_bench.real_engine.virtual import arm_context, virtual_rows
from kvgate_bench.sim.profile_file import EngineProfile

Speed = tuple[float, float]


def schedule_of(doc: Mapping[str, Any], cell: Mapping[str, Any]) -> Schedule | None:
    """The cell's schedule as the run built it (:func:`kvgate_bench.real_engine.plan.
    sized_schedule` from the calibration's capacity and the file's ``config``); None when the
    rebuilt one has not the cell's ``requests`` (another version of the generator)."""
    sched = plan.configured_schedule(
        doc["config"], float(doc["calibration"]["capacity_rps"]), str(cell["workload"]),
        float(cell["load"]), int(cell["seed"]),
    )  # fmt: skip
    return sched if len(sched.requests) == int(cell["requests"]) else None


def twin_rows(
    doc: Mapping[str, Any],
    cell: Mapping[str, Any],
    sched: Schedule,
    profile: EngineProfile,
    rows: Sequence[Mapping[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """The virtual rows of the cell's real ``rows`` (default all) on ``profile``, as
    :meth:`kvgate_bench.real_engine.cells.Runner.close` makes them."""
    cfg, c = doc["config"], doc["calibration"]
    args = argparse.Namespace(parallel=int(cfg["parallel"]), ctx=int(cfg["ctx"]))
    workload, load = str(cell["workload"]), float(cell["load"])
    ctx = arm_context(plan.base_workload(workload), args, float(c["capacity_rps"]),
                      float(c["mean_total_tokens"]), slo_of(c), load)  # fmt: skip
    return virtual_rows(
        sched, cell["rows"] if rows is None else rows, ctx, profile, slo_of(c),
        workload=workload, load=load, seed=int(cell["seed"]), max_tokens=int(cfg["max_tokens"]),
    )  # fmt: skip


def _ratio(real: Any, virt: Any) -> float | None:
    if real is None or virt is None or float(virt) <= 0 or float(real) <= 0:
        return None
    return float(real) / float(virt)


def speed_ratios(pair: Mapping[str, Any]) -> tuple[float | None, float | None]:
    """(prefill, decode) speed of one comparison row (:func:`kvgate_bench.real_engine.
    agreement.compare`) as real / virtual: (TTFT p50 - queue wait p50) and TPOT p50; None
    where a median is missing or not above 0."""

    def engine_ttft(side: str) -> float | None:
        t = pair.get(f"{side}_ttft_p50_s")
        return None if t is None else float(t) - float(pair.get(f"{side}_queue_wait_p50_s") or 0)

    return (
        _ratio(engine_ttft("real"), engine_ttft("virtual")),
        _ratio(pair.get("real_tpot_p50_s"), pair.get("virtual_tpot_p50_s")),
    )


def leave_one_out(pairs: Sequence[Mapping[str, Any]], arm: str) -> Speed:
    """(s_p, s_d): the medians of :func:`speed_ratios` over the cell's pairs of arms other
    than ``arm``; 1.0 where no other arm has one."""
    others = [speed_ratios(p) for p in pairs if p["arm"] != arm]
    sp = [x for x, _ in others if x is not None]
    sd = [y for _, y in others if y is not None]
    return (statistics.median(sp) if sp else 1.0, statistics.median(sd) if sd else 1.0)


def check_speed(row: Mapping[str, Any], calibration: Mapping[str, Any]) -> Speed | None:
    """(s_p, s_d) from the row's ``engine_check`` (llama-server ``timings`` of the unloaded
    requests on the arm's server): their sum(prompt_ms) / sum(prompt_n) over the calibration's
    unloaded requests', and their mean ``predicted_per_token_ms`` over the calibration's;
    None without a check."""
    checks = [t for t in row.get("engine_check") or () if t]
    ref = [m["timings"] for m in calibration["unloaded"]]
    if not checks or not ref:
        return None

    def prefill(ts: Sequence[Mapping[str, Any]]) -> float | None:
        n = sum(float(t["prompt_n"]) for t in ts)
        return sum(float(t["prompt_ms"]) for t in ts) / n if n > 0 else None

    def decode(ts: Sequence[Mapping[str, Any]]) -> float | None:
        xs = [float(t["predicted_per_token_ms"]) for t in ts if int(t.get("predicted_n", 0)) > 1]
        return statistics.fmean(xs) if xs else None

    sp, sd = _ratio(prefill(checks), prefill(ref)), _ratio(decode(checks), decode(ref))
    return (sp or 1.0, sd or 1.0)


def scaled(profile: EngineProfile, speed: Speed) -> EngineProfile:
    """``profile`` with its prefill cost x ``s_p`` and its decode table and context cost x
    ``s_d`` (the name kept)."""
    sp, sd = speed
    p = profile.to_json()
    p["prefill_ms_per_token"] = profile.prefill_ms_per_token * sp
    p["decode_step_ms"] = {str(k): ms * sd for k, ms in profile.decode_step_ms.items()}
    p["context_us_per_token"] = profile.context_us_per_token * sd
    return EngineProfile(**p)


def recompute_cell(
    doc: Mapping[str, Any], cell: Mapping[str, Any], profile: EngineProfile
) -> dict[str, Any] | None:
    """Both twins of one finished cell (module docstring): ``{"calibrated": [comparison
    rows], "at_speed": [comparison rows, each with "engine_speed": [s_p, s_d] and
    "speed_from": "engine_check" or "other arms"]}``; None when the schedule cannot be
    rebuilt."""
    sched = schedule_of(doc, cell)
    if sched is None:
        return None
    calibrated = compare_cell(cell["rows"], twin_rows(doc, cell, sched, profile))
    at_speed: list[dict[str, Any]] = []
    for row in cell["rows"]:
        direct = check_speed(row, doc["calibration"])
        speed = direct or leave_one_out(calibrated, row["arm"])
        virt = twin_rows(doc, cell, sched, scaled(profile, speed), [row])
        for x in compare_cell([row], virt):
            x["engine_speed"] = [round(speed[0], 3), round(speed[1], 3)]
            x["speed_from"] = "engine_check" if direct else "other arms"
            at_speed.append(x)
    for x in calibrated:
        if not x["agrees"]:
            sp, sd = leave_one_out(calibrated, x["arm"])
            x["disagreement"] += (
                f"; in the cell's other arms the engine ran at {sp:.2f}x the calibrated "
                f"prefill and {sd:.2f}x the decode step times"
            )
    return {"calibrated": calibrated, "at_speed": at_speed}


def recompute(
    doc: Mapping[str, Any], seeds: Sequence[int], cells: Sequence[str] | None = None
) -> dict[str, Any] | None:
    """Both twins of the finished ``cells`` (default all) of ``seeds``, on today's fit of the
    calibration: ``{"profile": its JSON, "calibrated": {...}, "at_speed": {...},
    "not_rebuilt": ["cell@seed", ...], "speed_apart": ["cell@seed: ...", ...]}``
    (:func:`speed_apart`), each twin's ``pairs``, ``agree``, ``pairs_list``
    (arm, cell, goodput and attainment agreeing, the speed) and ``disagreements``; None when
    no such cell is finished or the calibration kept no raw data to refit from."""
    c = doc.get("calibration") or {}
    chosen = [
        cell
        for cell in doc["cells"]
        if int(cell["seed"]) in seeds and (cells is None or cell["cell"] in cells)
    ]
    if not chosen or not c.get("unloaded") or not c.get("bursts") or not c.get("profile"):
        return None
    profile = refit(c)
    out: dict[str, Any] = {"profile": profile.to_json(), "not_rebuilt": [], "speed_apart": []}
    found: dict[str, list[dict[str, Any]]] = {"calibrated": [], "at_speed": []}
    for cell in chosen:
        got = recompute_cell(doc, cell, profile)
        if got is None:
            out["not_rebuilt"].append(f"{cell['cell']}@{cell['seed']}")
            continue
        for k, xs in got.items():
            found[k] += xs
        apart = speed_apart(got["at_speed"])
        if apart is not None:
            out["speed_apart"].append(f"{cell['cell']}@{cell['seed']}: {apart}")
    for k, xs in found.items():
        out[k] = {
            "pairs": len(xs),
            "agree": sum(1 for x in xs if x["agrees"]),
            "pairs_list": [_pair_line(x) for x in xs],
            "disagreements": [f"{_where(x)}: {x['disagreement']}" for x in xs if not x["agrees"]],
        }
    return out


#: Prefill speeds of one cell's arms further apart than this (max / min) are named by the report:
#: its ratios then compare arms that ran on engines of different speeds.
SPEED_APART = 1.25


def speed_apart(at_speed: Sequence[Mapping[str, Any]]) -> str | None:
    """The slowest and fastest arm of one cell by prefill speed ``s_p`` (``at_speed`` rows of
    :func:`recompute_cell`), as ``"1.32 (kvgate) to 1.89 (none), 1.43x apart"``, when they are
    more than :data:`SPEED_APART` apart; None otherwise."""
    xs = sorted((float(x["engine_speed"][0]), str(x["arm"])) for x in at_speed)
    if len(xs) < 2 or xs[-1][0] <= SPEED_APART * xs[0][0]:
        return None
    (lo, slow_arm), (hi, fast_arm) = xs[0], xs[-1]
    return f"{lo:.2f} ({slow_arm}) to {hi:.2f} ({fast_arm}), {hi / lo:.2f}x apart"


def _where(x: Mapping[str, Any]) -> str:
    return f"{x['workload']}:{x['load']:g}@{x['seed']} {x['arm']}"


def _pair_line(x: Mapping[str, Any]) -> str:
    """One pair: where, goodput real/virtual, attainment real/virtual, agrees or which half
    not, and the engine speed used."""
    ra, va = x.get("real_attainment"), x.get("virtual_attainment")
    att = "-" if ra is None or va is None else f"{ra:.3f}/{va:.3f}"
    speed = x.get("engine_speed")
    tail = "" if speed is None else f"  speed {speed[0]:.2f}/{speed[1]:.2f} ({x['speed_from']})"
    off = [k for k in ("goodput", "attainment") if not x.get(f"{k}_agrees", x["agrees"])]
    verdict = "agrees" if x["agrees"] else f"{' and '.join(off) or 'the pair'} off"
    return (
        f"{_where(x)}: goodput {x['real_goodput']:.2f}/{x['virtual_goodput']:.2f}, "
        f"attainment {att}: {verdict}{tail}"
    )
