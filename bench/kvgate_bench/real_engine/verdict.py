"""The verdict of a real-engine run from its resume file (pure): the ratios between arms with
their intervals, the issue's targets that apply to a real engine, and the twin's agreement.

**Ratios** (per cell, per report seed and pooled over the report seeds; goodput unless named;
:func:`kvgate_bench.real_engine.stats.ratio_ci95`, paired and stratified):
``kvgate / best baseline`` (per seed, the better of the tuned ``concurrency-cap`` and
``token-bucket`` by goodput), ``kvgate / none``, ``kvgate-empty / tuned cap``, ``kvgate-empty /
best baseline`` and ``kvgate / none (throughput)``.

**Targets** (issue 33), each on the pooled figure of the report seeds, ``met`` when the point
estimate reaches the goal (``ci95`` says how sure):

* ``multi-tenant`` at 2 and 3: kvgate / best baseline >= 1.0, kvgate / none >= 1.5, no 5xx;
* ``isolation`` at 3: the well-behaved tenants' SLO attainment >= 0.95 and its Wilson lower
  bound >= 0.90 (all their requests over the seeds), the noisy tenant served on every seed;
* ``multi-tenant`` at 2: kvgate-empty / tuned cap >= 0.8; at 1: kvgate / none throughput >= 0.97;
* both kvgate arms' limit after 20 completions within +-1 of the cell's best swept cap
  (``multi-tenant`` at 2 and 3);
* every row carries the issue's fields, and no real row had a cached prompt token.

A cell whose real rows counted a cached prompt token is *invalid*: listed, and left out of the
ratios and targets.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvgate_bench.real_engine import progress
from kvgate_bench.real_engine.agreement import compare_cell
from kvgate_bench.real_engine.plan import (
    BUCKET,
    CAP,
    KVGATE,
    KVGATE_EMPTY,
    MIN_REQUESTS,
    NONE,
    required,
)
from kvgate_bench.real_engine.rows import row_seed
from kvgate_bench.real_engine.stats import Arm, ratio_ci95, wilson

#: Keys every row must carry (``cached_prompt_tokens``: real rows only; the two isolation keys
#: may be None outside ``isolation``).
ROW_KEYS = (
    "requests",
    "goodput_tokens_per_s",
    "goodput_ci95",
    "well_behaved_slo_attainment",
    "well_behaved_wilson_lo",
    "profile",
)
#: (name, numerator arm, denominator arm or "best", per-request vector).
RATIOS: tuple[tuple[str, str, str, str], ...] = (
    ("kvgate / best baseline", KVGATE, "best", "good_tokens"),
    ("kvgate / none", KVGATE, NONE, "good_tokens"),
    ("kvgate-empty / tuned cap", KVGATE_EMPTY, CAP, "good_tokens"),
    ("kvgate-empty / best baseline", KVGATE_EMPTY, "best", "good_tokens"),
    ("kvgate / none (throughput)", KVGATE, NONE, "served_tokens"),
)


def report_seeds(doc: Mapping[str, Any], seeds: Sequence[int] | None = None) -> list[int]:
    """``seeds`` when given, else every seed of a finished cell but the tune seed; sorted."""
    if seeds is not None:
        return sorted(seeds)
    return sorted({int(c["seed"]) for c in doc["cells"]} - {int(doc["tune_seed"])})


def invalid_cells(doc: Mapping[str, Any]) -> list[str]:
    """``cell@seed`` of each finished cell with a real row that counted cached prompt tokens."""
    return [
        f"{c['cell']}@{c['seed']}"
        for c in doc["cells"]
        if any(int(r.get("cached_prompt_tokens") or 0) != 0 for r in c["rows"])
    ]


def _cells(doc: Mapping[str, Any], seeds: Sequence[int]) -> dict[str, dict[int, dict[str, Any]]]:
    """cell -> seed -> arm -> row, for the valid finished cells of ``seeds``."""
    bad = set(invalid_cells(doc))
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for c in doc["cells"]:
        seed = int(c["seed"])
        if seed in seeds and f"{c['cell']}@{seed}" not in bad:
            out.setdefault(c["cell"], {})[seed] = {r["arm"]: r for r in c["rows"]}
    return out


def best_baseline(rows: Mapping[str, Any]) -> Any:
    """The tuned baseline row with the higher goodput (cap first on a tie); None without one."""
    found = [rows[a] for a in (CAP, BUCKET) if a in rows]
    return max(found, key=lambda r: r["goodput_tokens_per_s"]) if found else None


def _arm(row: Mapping[str, Any], vector: str) -> Arm:
    return Arm(row[vector], float(row["span_s"]))


def ratios(doc: Mapping[str, Any], seeds: Sequence[int]) -> list[dict[str, Any]]:
    """Each cell's :data:`RATIOS` per seed and pooled (module docstring)."""
    out: list[dict[str, Any]] = []
    for cell, by_seed in sorted(_cells(doc, seeds).items()):
        for name, num, den, vector in RATIOS:
            pairs: dict[int, tuple[Arm, Arm]] = {}
            for seed, rows in sorted(by_seed.items()):
                d = best_baseline(rows) if den == "best" else rows.get(den)
                if num in rows and d is not None:
                    pairs[seed] = (_arm(rows[num], vector), _arm(d, vector))
            if not pairs:
                continue
            per_seed = {
                str(s): ratio_ci95([p], row_seed(cell, name, s)).as_json() for s, p in pairs.items()
            }
            pooled = ratio_ci95(list(pairs.values()), row_seed(cell, name, "pooled"))
            out.append(
                {"cell": cell, "ratio": name, "seeds": sorted(pairs), "per_seed": per_seed,
                 **pooled.as_json()}
            )  # fmt: skip
    return out


def _ratio_target(rs: Sequence[Mapping[str, Any]], cell: str, name: str, goal: float) -> Any:
    for r in rs:
        if r["cell"] == cell and r["ratio"] == name:
            v = r["value"]
            return _target(f"{cell}: {name}", v, goal, v is not None and v >= goal, r["ci95"])
    return None


def _target(
    name: str, value: Any, goal: float | str, met: bool, ci95: Any = None
) -> dict[str, Any]:
    g = goal if isinstance(goal, str) else f">= {goal:g}"
    return {"target": name, "value": value, "goal": g, "met": met, "ci95": ci95}


def _isolation(cell: str, by_seed: Mapping[int, Mapping[str, Any]]) -> list[dict[str, Any]]:
    rows = [r[KVGATE] for r in by_seed.values() if KVGATE in r]
    if not rows:
        return []
    met = sum(int(r.get("well_behaved_met") or 0) for r in rows)
    n = sum(int(r.get("well_behaved_requests") or 0) for r in rows)
    bounds = wilson(met, n)
    share = met / n if n else None
    served = all(int(r.get("noisy_served") or 0) > 0 for r in rows)
    return [
        _target(f"{cell}: kvgate well-behaved SLO met", share, 0.95,
                share is not None and share >= 0.95, list(bounds) if bounds else None),
        _target(f"{cell}: kvgate well-behaved Wilson lower bound", bounds[0] if bounds else None,
                0.90, bounds is not None and bounds[0] >= 0.90),
        _target(f"{cell}: the noisy tenant served on every seed", served, "true", served),
    ]  # fmt: skip


def _limit_target(
    cell: str, by_seed: Mapping[int, Mapping[str, Any]], tuned_cap: Mapping[str, Any] | None
) -> dict[str, Any] | None:
    if not tuned_cap:
        return None
    cap = int(tuned_cap["cap"])
    gaps: list[float] = []
    missing = False
    for rows in by_seed.values():
        for arm in (KVGATE, KVGATE_EMPTY):
            if arm in rows:
                lim = rows[arm].get("limit_after_20_completions")
                if lim is None:
                    missing = True
                else:
                    gaps.append(abs(float(lim) - cap))
    if not gaps and not missing:
        return None
    worst = max(gaps) if gaps else None
    name = f"{cell}: kvgate arms' limit after 20 completions - best swept cap {cap}, worst |gap|"
    return _target(name, worst, "<= 1", not missing and worst is not None and worst <= 1)


def targets(doc: Mapping[str, Any], seeds: Sequence[int]) -> list[dict[str, Any]]:
    """The targets of the module docstring that the finished cells allow."""
    cells = _cells(doc, seeds)
    rs = ratios(doc, seeds)
    out: list[dict[str, Any] | None] = []
    for cell, by_seed in sorted(cells.items()):
        workload, _, load_text = cell.partition(":")
        load = float(load_text)
        if workload == "multi-tenant" and load in (2.0, 3.0):
            out.append(_ratio_target(rs, cell, "kvgate / best baseline", 1.0))
            out.append(_ratio_target(rs, cell, "kvgate / none", 1.5))
            n5 = sum(int(r[KVGATE].get("errors_5xx") or 0) for r in by_seed.values() if KVGATE in r)
            out.append(_target(f"{cell}: kvgate 5xx", n5, "== 0", n5 == 0))
            out.append(_limit_target(cell, by_seed, (doc["tuned"].get(cell) or {}).get(CAP)))
        if workload == "multi-tenant" and load == 2.0:
            out.append(_ratio_target(rs, cell, "kvgate-empty / tuned cap", 0.8))
        if workload == "multi-tenant" and load == 1.0:
            out.append(_ratio_target(rs, cell, "kvgate / none (throughput)", 0.97))
        if workload == "isolation" and load == 3.0:
            out += _isolation(cell, by_seed)
    out.append(fields_target(doc))
    bad = invalid_cells(doc)
    out.append(_target("cells with cached prompt tokens (invalid)", len(bad), "== 0", not bad))
    return [t for t in out if t is not None]


def fields_target(doc: Mapping[str, Any]) -> dict[str, Any]:
    """Whether every finished row (real and virtual) carries :data:`ROW_KEYS` (real rows also
    ``cached_prompt_tokens``); the value: how many rows lack one."""
    lacking = 0
    for c in doc["cells"]:
        for r in c["rows"]:
            lacking += any(k not in r for k in (*ROW_KEYS, "cached_prompt_tokens"))
        for r in c.get("virtual", ()):
            lacking += any(k not in r for k in ROW_KEYS)
    return _target("rows lacking one of the issue's fields", lacking, "== 0", lacking == 0)


def agreement(doc: Mapping[str, Any], seeds: Sequence[int]) -> dict[str, Any]:
    """How many real/virtual row pairs of the report seeds agree, how many of them on the 15 %
    rule alone (a real row under the verdict's size: its interval does not count), and the
    disagreements. Judged afresh from the rows
    (:func:`kvgate_bench.real_engine.agreement.compare_cell`), so that a file written before
    a rule changed is judged by today's; a cell without virtual rows: its stored comparison."""
    pairs: list[Mapping[str, Any]] = []
    for c in doc["cells"]:
        if int(c["seed"]) in seeds:
            virt = c.get("virtual") or []
            pairs += compare_cell(c["rows"], virt) if virt else c.get("comparison", [])
    return {
        "pairs": len(pairs),
        "agree": sum(1 for x in pairs if x["agrees"]),
        "fifteen_percent_only": sum(1 for x in pairs if not x.get("interval_rule", True)),
        "disagreements": [
            f"{x['workload']}:{x['load']:g}@{x['seed']} {x['arm']}: {x['disagreement']}"
            for x in pairs
            if not x["agrees"]
        ],
    }


def verdict(doc: Mapping[str, Any], seeds: Sequence[int] | None = None) -> dict[str, Any]:
    """The verdict document: the tune seed, the report seeds, the cells finished and missing,
    the invalid cells, the ratios, the targets and the twin's agreement."""
    rep = report_seeds(doc, seeds)
    return {
        "tune_seed": doc["tune_seed"],
        "report_seeds": rep,
        "tuned": doc["tuned"],
        "cells": sorted(f"{c['cell']}@{c['seed']}" for c in doc["cells"] if int(c["seed"]) in rep),
        "unfinished_runs": len(doc["runs"]),
        "invalid": invalid_cells(doc),
        "ratios": ratios(doc, rep),
        "targets": targets(doc, rep),
        "agreement": agreement(doc, rep),
    }


def _v(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def _ci(ci: Any) -> str:
    return "" if not ci else f" [{ci[0]:.2f}, {ci[1]:.2f}]"


def verdict_lines(v: Mapping[str, Any]) -> list[str]:
    """The printed verdict of :func:`verdict`'s document."""
    open_runs = v["unfinished_runs"]
    lines = [
        f"verdict: baselines tuned on seed {v['tune_seed']}, reported on seeds "
        f"{', '.join(map(str, v['report_seeds'])) or '-'}; {len(v['cells'])} cells finished"
        f"{f', {open_runs} arm runs of unfinished cells' if open_runs else ''}",
    ]
    if v.get("left"):
        lines += progress.lines(v["left"], int(v["tune_seed"]))
    if v["invalid"]:
        lines.append(f"  INVALID (cached prompt tokens): {', '.join(v['invalid'])}")
    lines.append("ratios (pooled over the report seeds, bootstrap 95 %; per seed):")
    for r in v["ratios"]:
        per = "  ".join(f"s{s} {_v(x['value'])}" for s, x in r["per_seed"].items())
        lines.append(
            f"  {r['cell']:<15} {r['ratio']:<30} {_v(r['value'])}{_ci(r['ci95'])}  ({per})"
        )
    lines.append("targets:")
    for t in v["targets"]:
        mark = "met   " if t["met"] else "MISSED"
        lines.append(f"  {mark} {t['target']}: {_v(t['value'])}{_ci(t['ci95'])} (goal {t['goal']})")
    a = v["agreement"]
    small = a.get("fifteen_percent_only", 0)
    lines.append(
        f"virtual twin: {a['agree']} of {a['pairs']} row pairs agree"
        + (f"; {small} of them judged on the 15 % rule only (real rows under the verdict's "
           f"{MIN_REQUESTS} requests an arm, isolation {required('isolation')} well-behaved: "
           "their 95 % intervals do not count)" if small else "")
    )  # fmt: skip
    lines += [f"  {d}" for d in a["disagreements"]]
    return lines
