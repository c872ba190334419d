"""The printed verdict of a real-engine run (pure): :func:`verdict_lines` of
:func:`kvgate_bench.real_engine.verdict.verdict`'s document.

The first line says whether it is a verdict at all: ``verdict:`` when every cell reported has
the issue's size, ``not a verdict:`` when none has (or none is finished), ``verdict on N of M
cells:`` otherwise; then what is left (:mod:`kvgate_bench.real_engine.progress`), the seeds and
cells asked for but absent, each cell's size, the ratios, the targets (``met``, ``MISSED``,
``indicative`` on a cell that is not a verdict, ``-`` when not measured; a ratio target met or
missed says whether its 95 % interval clears the goal or reaches below it, "not separated";
one whose cell finished on some of the report seeds only names them)
and the twin (as the cells stored it; with ``--report``, also recomputed: :func:`twin_lines`).
``N cells x seeds finished`` counts each cell once per seed it finished on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvgate_bench.real_engine import progress
from kvgate_bench.real_engine.calibration import (
    CAPACITY_ATTAINMENT,
    GOODPUT_PEAK,
    PROBE_REQUESTS,
)
from kvgate_bench.real_engine.plan import MIN_REQUESTS, required

#: The width of the cell column of the sizes and the ratios (``isolation-alone:3`` fits).
CELL_WIDTH = 17
#: The mark printed before a target, by status.
MARKS = {
    "met": "met",
    "MISSED": "MISSED",
    "indicative": "indicative",
    "not measured": "-",
    "reference": "reference",
}


def _v(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def _ci(ci: Any, digits: int | None = None) -> str:
    """An interval's bounds to ``digits`` decimals, or (None) to 3 significant figures as
    :func:`_v` prints a value, so a ratio of 54.6 reads [23.3, 236], not [23.26, 236.27]."""
    if not ci:
        return ""
    if digits is None:
        return f" [{ci[0]:.3g}, {ci[1]:.3g}]"
    return f" [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"


def _ints(xs: Any) -> str:
    return ", ".join(map(str, xs))


def headline(v: Mapping[str, Any]) -> str:
    """The first line (module docstring)."""
    sized = [s["verdict"] for s in v["sizes"].values()]
    if sized and all(sized):
        word = "verdict"
    elif any(sized):
        word = f"verdict on {sum(sized)} of {len(sized)} cells"
    else:
        word = "not a verdict"
    open_runs = v["unfinished_runs"]
    return (
        f"{word}: baselines tuned on seed {v['tune_seed']}, reported on seeds "
        f"{_ints(v['report_seeds']) or '-'}; {len(v['cells'])} cells x seeds finished"
        f"{f', {open_runs} arm runs of unfinished cells' if open_runs else ''}"
    )


def _target_line(t: Mapping[str, Any]) -> str:
    status = t.get("status") or ("met" if t["met"] else "MISSED")
    # A ratio target's interval to 3 decimals: its low end against the goal can be read.
    digits = 3 if t.get("clears") is not None else 2
    value = t["note"] if status == "not measured" else f"{_v(t['value'])}{_ci(t['ci95'], digits)}"
    # A met or missed target's note: the runs it left out (an indicative one's is its cell's
    # size, printed with the cells; a not measured one's is its value).
    tail = f"; {t['note']}" if t.get("note") and status in ("met", "MISSED", "reference") else ""
    if t.get("clears") is not None and status in ("met", "MISSED"):
        tail += (
            "; the 95 % interval clears the goal"
            if t["clears"]
            else "; the 95 % interval reaches below the goal: not separated"
        )
    if t.get("partial"):  # its cell finished on some of the report seeds only
        tail += f"; {t['partial']}"
    return f"  {MARKS[status]:<10} {t['target']}: {value} (goal {t['goal']}{tail})"


def capacity_lines(c: Mapping[str, Any] | None) -> list[str]:
    """The capacity every load is a multiple of, and the probes it was read from
    (:func:`kvgate_bench.real_engine.calibration.capacity_note`); a warning when some held fewer
    requests than a probe needs, when the goodput probes stopped still climbing, or (a file of
    the first definition) when no probe met 90 %."""
    if not c:
        return []
    if c["definition"] == GOODPUT_PEAK:
        probes = ", ".join(
            f"{r:.3f}: goodput {g:.2f} tokens/s, met {a:.2f} of {n}" for r, a, n, g in c["probes"]
        )
        head = f"load 1 {c['capacity_rps']:.3f} req/s, none's peak goodput (probes, req/s: "
    else:
        probes = ", ".join(f"{r:.3f} met {a:.2f} of {n}" for r, a, n, _ in c["probes"])
        head = (
            f"capacity {c['capacity_rps']:.3f} req/s, where none met the SLO for "
            f"{CAPACITY_ATTAINMENT:.0%} (probes, req/s: "
        )
    out = [f"{head}{probes})"]
    if c["thin"]:
        out.append(
            f"  {c['thin']} of {len(c['probes'])} probes held fewer than {PROBE_REQUESTS} "
            "requests: the capacity is uncertain, and every cell's load is a multiple of it"
        )
    if c.get("still_climbing"):
        out.append(
            "  the probes stopped while none's goodput still grew: load 1 may be understated"
        )
    if c.get("none_met"):
        out.append(
            f"  no probe met the SLO for {CAPACITY_ATTAINMENT:.0%} of its requests: the capacity"
            " is extrapolated below the lowest probe (attainment / 0.9 of its rate), and 'load"
            " 1' is not a rate at which none was seen to meet it"
        )
    return out


def verdict_lines(v: Mapping[str, Any]) -> list[str]:
    """The printed verdict of :func:`kvgate_bench.real_engine.verdict.verdict`'s document."""
    lines = [headline(v)]
    if v.get("left"):
        lines += progress.lines(v["left"], int(v["tune_seed"]))
    if v.get("absent_seeds"):
        lines.append("  seeds asked but absent from the file (no finished cell), not reported: "
                     f"{_ints(v['absent_seeds'])}")  # fmt: skip
    if v.get("absent_cells"):
        lines.append("  cells asked but not finished on the report seeds, not reported: "
                     f"{', '.join(v['absent_cells'])}")  # fmt: skip
    lines += capacity_lines(v.get("capacity"))
    if v["sizes"]:
        lines.append(
            f"cells (the fewest requests an arm had on a seed; a verdict needs {MIN_REQUESTS}, "
            f"isolation {required('isolation')} well-behaved):"
        )
        lines += [f"  {cell:<{CELL_WIDTH}} {s['label']}" for cell, s in v["sizes"].items()]
    if v["invalid"]:
        lines.append(f"  INVALID (cached prompt tokens): {', '.join(v['invalid'])}")
    lines.append("ratios (pooled over the report seeds, bootstrap 95 %; per seed):")
    for r in v["ratios"]:
        per = "  ".join(f"s{s} {_v(x['value'])}" for s, x in r["per_seed"].items())
        value = f"{_v(r['value'])}{_ci(r['ci95'])}"
        lines.append(f"  {r['cell']:<{CELL_WIDTH}} {r['ratio']:<30} {value}  ({per})")
    lines.append("targets:")
    lines += [_target_line(t) for t in v["targets"]]
    a = v["agreement"]
    small = a.get("fifteen_percent_only", 0)
    lines.append(
        f"virtual twin (as each cell's run recorded it): {a['agree']} of {a['pairs']} row pairs "
        "agree"
        + (f"; {small} of them judged on the 15 % rule only (real rows under the verdict's "
           f"{MIN_REQUESTS} requests an arm, isolation {required('isolation')} well-behaved: "
           "their 95 % intervals do not count)" if small else "")
    )  # fmt: skip
    lines += [f"  {d}" for d in a["disagreements"]]
    return lines + twin_lines(v.get("twin"))


def twin_lines(t: Mapping[str, Any] | None) -> list[str]:
    """The twin recomputed by ``--report`` (:func:`kvgate_bench.real_engine.twin.recompute`):
    on today's fit of the calibration, then at each arm's engine speed, each pair on a line
    (goodput and attainment real/virtual, which half is off) and each disagreement; nothing
    when not recomputed."""
    if not t:
        return []
    p = t["profile"]
    table = ", ".join(f"{k}: {ms:.1f}" for k, ms in p["decode_step_ms"].items())
    lines = [
        f"virtual twin recomputed on today's fit of the calibration (decode step ms "
        f"{{{table}}}, prefill {p['prefill_ms_per_token']:.3f} ms/token):"
    ]
    if t["not_rebuilt"]:
        lines.append(f"  schedule not rebuilt (left out): {', '.join(t['not_rebuilt'])}")
    if t.get("speed_apart"):
        lines.append(
            "  cells whose arms ran on engines of different speeds (prefill x the calibrated, "
            "the slowest arm's to the fastest's):"
        )
        lines += [f"    {x}" for x in t["speed_apart"]]
    for key, what in (
        ("calibrated", "at the calibrated speed"),
        ("at_speed", "at each arm's engine speed (s_p prefill / s_d decode x the calibrated)"),
    ):
        a = t[key]
        lines.append(f"  {what}: {a['agree']} of {a['pairs']} row pairs agree")
        lines += [f"    {x}" for x in a["pairs_list"]]
        lines += [f"    off: {d}" for d in a["disagreements"]]
    return lines
