"""The verdict of a real-engine run from its resume file (pure): the ratios between arms with
their intervals, the issue's targets that apply to a real engine, and the twin's agreement.

**Ratios** (per cell, per report seed and pooled over the report seeds; goodput unless named;
:func:`kvgate_bench.real_engine.stats.ratio_ci95`, paired and stratified):
``kvgate / best baseline`` (per seed, the better of the tuned ``concurrency-cap`` and
``token-bucket`` by goodput), ``kvgate / none``, ``kvgate-empty / tuned cap``, ``kvgate-empty /
best baseline`` and ``kvgate / none (throughput)``.

**Size.** A cell is a verdict only when it finished on every report seed, each of its arms
had the issue's requests on each (:func:`kvgate_bench.real_engine.plan.required`: 200;
``isolation``: 120 well-behaved; ``--min-requests`` sizes a run, not this), and the file is
not a ``--short`` run; otherwise it is labelled ``not a verdict (N requests an arm, M
required)``, with ``; on seed 3 only, not 2, 4`` where seeds are missing,
(:func:`sizes`) and the targets on it are ``indicative``, neither met nor missed.

**Targets** (issue 33), each on the pooled figure of the report seeds; ``status``: ``met``
when the point estimate reaches the goal (``ci95`` says how sure; a ratio target's
``clears`` says whether the interval's low end reaches the goal too, None without an
interval), ``MISSED``, ``indicative`` (its cell is not a verdict; ``reached`` says what the
point estimate did) or ``not measured`` (``met`` None for the last two); a cell finished on
some of the report seeds only pools those, and its targets' ``partial`` names them:

* ``multi-tenant`` at 2 and 3: kvgate / best baseline >= 1.0, kvgate / none >= 1.5, no 5xx;
* ``isolation`` at 3: the well-behaved tenants' SLO attainment >= 0.95 and its Wilson lower
  bound >= 0.90 (all their requests over the seeds), the noisy tenant served on every seed;
* ``multi-tenant`` at 2: kvgate-empty / tuned cap >= 0.8; at 1: kvgate / none throughput >= 0.97;
* both kvgate arms' limit after 20 completions within +-1 of the cell's best swept cap
  (``multi-tenant`` at 2 and 3); a run with fewer than 20 completions has no such limit:
  ``not measured (N completions)`` when no run has one, else left out and named;
* every row carries the issue's fields, and no real row had a cached prompt token.

An ``isolation-alone`` cell adds no target: its arms' SLO attainment (status ``reference``,
``met`` None, Wilson's interval, ``met/requests`` as its note) is what the well-behaved tenants
get with no noisy tenant, the ceiling the isolation target reads against. Their load alone is
``ISOLATION_WELL_BEHAVED_LOAD`` (0.6) x the calibrated load-1 rate (``none``'s peak goodput over
its mean output); where the top of ``none``'s interval is below 90 % (``CAPACITY_ATTAINMENT``),
the note says that the engine alone misses the SLO for more than a tenth of these requests (a
slow engine, or one that ran the arms slower than calibrated), so the isolation target is out
of reach of a gate that serves them all.

A cell whose real rows counted a cached prompt token is *invalid*: listed, and left out of the
ratios and targets. The printed form: :mod:`kvgate_bench.real_engine.verdict_text`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvgate_bench.effectiveness.model.workloads import ISOLATION_WELL_BEHAVED_LOAD
from kvgate_bench.real_engine.agreement import compare_cell
from kvgate_bench.real_engine.calibration import CAPACITY_ATTAINMENT, capacity_note
from kvgate_bench.real_engine.limit_trace import COLD_START_COMPLETIONS
from kvgate_bench.real_engine.plan import (
    ALONE,
    ALONE_ARMS,
    BUCKET,
    CAP,
    KVGATE,
    KVGATE_EMPTY,
    NONE,
    required,
    row_requests,
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


def report_seeds(
    doc: Mapping[str, Any], seeds: Sequence[int] | None = None
) -> tuple[list[int], list[int]]:
    """(report seeds, absent seeds): ``seeds`` that have a finished cell in ``doc`` and those
    that have none, when given; else every seed of a finished cell but the tune seed, and
    none absent."""
    held = {int(c["seed"]) for c in doc["cells"]}
    if seeds is not None:
        return sorted(set(seeds) & held), sorted(set(seeds) - held)
    return sorted(held - {int(doc["tune_seed"])}), []


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


def sizes(doc: Mapping[str, Any], seeds: Sequence[int] = ()) -> dict[str, dict[str, Any]]:
    """Per finished cell of ``doc``: ``requests`` (the fewest an arm had on a seed; isolation:
    well-behaved ones), ``required``, ``seeds`` (those it finished on), ``verdict`` (enough,
    on every one of the report ``seeds`` when given, and not a ``--short`` run) and ``label``
    (module docstring)."""
    short = bool((doc.get("config") or {}).get("short"))
    fewest: dict[str, int] = {}
    on: dict[str, set[int]] = {}
    for c in doc["cells"]:
        n = min((row_requests(r) for r in c["rows"]), default=0)
        fewest[c["cell"]] = min(n, fewest.get(c["cell"], n))
        on.setdefault(c["cell"], set()).add(int(c["seed"]))
    out: dict[str, dict[str, Any]] = {}
    for cell, n in sorted(fewest.items()):
        need = required(cell.partition(":")[0])
        missing = sorted(set(seeds) - on[cell])
        ok = n >= need and not short and not missing
        label = f"{n} requests an arm ({need} required)"
        if not ok:
            why = "; a --short run" if short else ""
            if missing:
                have = ", ".join(map(str, sorted(on[cell])))
                why += f"; on seed{'s' if len(on[cell]) > 1 else ''} {have} only, not " + (
                    ", ".join(map(str, missing))
                )
            label = f"not a verdict ({n} requests an arm, {need} required{why})"
        out[cell] = {"requests": n, "required": need, "seeds": sorted(on[cell]), "verdict": ok,
                     "label": label}  # fmt: skip
    return out


def _ratio_target(rs: Sequence[Mapping[str, Any]], cell: str, name: str, goal: float) -> Any:
    for r in rs:
        if r["cell"] == cell and r["ratio"] == name:
            v = r["value"]
            t = _target(
                f"{cell}: {name}", v, goal, v is not None and v >= goal, r["ci95"], cell=cell
            )
            t["clears"] = bool(r["ci95"][0] >= goal) if r["ci95"] else None
            return t
    return None


def _target(
    name: str,
    value: Any,
    goal: float | str,
    met: bool,
    ci95: Any = None,
    *,
    cell: str | None = None,
) -> dict[str, Any]:
    g = goal if isinstance(goal, str) else f">= {goal:g}"
    return {"target": name, "value": value, "goal": g, "met": met, "ci95": ci95, "cell": cell,
            "status": "met" if met else "MISSED"}  # fmt: skip


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
                share is not None and share >= 0.95, list(bounds) if bounds else None, cell=cell),
        _target(f"{cell}: kvgate well-behaved Wilson lower bound", bounds[0] if bounds else None,
                0.90, bounds is not None and bounds[0] >= 0.90, cell=cell),
        _target(f"{cell}: the noisy tenant served on every seed", served, "true", served,
                cell=cell),
    ]  # fmt: skip


def _alone(cell: str, by_seed: Mapping[int, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The ``isolation-alone`` reference (no target of its own, status ``reference``): each
    arm's SLO attainment over the cell's seeds, with Wilson's 95 % interval; every request of
    such a cell is a well-behaved tenant's, so it reads against the isolation target."""
    out: list[dict[str, Any]] = []
    for arm in ALONE_ARMS:
        rows = [r[arm] for r in by_seed.values() if arm in r]
        n = sum(int(r.get("requests") or 0) for r in rows)
        met = sum(round(float(r.get("slo_attainment") or 0.0) * int(r.get("requests") or 0))
                  for r in rows)  # fmt: skip
        if not n:
            continue
        bounds = wilson(met, n)
        t = _target(f"{cell}: {arm}'s SLO met with no noisy tenant (the well-behaved alone)",
                    met / n, 0.95, met / n >= 0.95, list(bounds) if bounds else None,
                    cell=cell)  # fmt: skip
        t.update(status="reference", met=None, note=f"{met}/{n}")
        if arm == "none" and bounds and bounds[1] < CAPACITY_ATTAINMENT:
            t["note"] += (
                f"; none misses the SLO for more than {1 - CAPACITY_ATTAINMENT:.0%} of the"
                f" well-behaved requests alone, at {ISOLATION_WELL_BEHAVED_LOAD:g}x load 1: the"
                " engine (or its speed during the arms) falls short of the isolation target"
                " with no noisy tenant"
            )
        out.append(t)
    return out


def completions(row: Mapping[str, Any]) -> int:
    """Requests of ``row`` that finished served: its ``completions``, else (a row written before
    it was recorded) the requests with served tokens."""
    if row.get("completions") is not None:
        return int(row["completions"])
    return sum(1 for x in row.get("served_tokens") or () if x)


def _limit_target(
    cell: str, by_seed: Mapping[int, Mapping[str, Any]], tuned_cap: Mapping[str, Any] | None
) -> dict[str, Any] | None:
    if not tuned_cap:
        return None
    cap = int(tuned_cap["cap"])
    gaps: list[float] = []
    unmeasured: list[tuple[int, str, int]] = []
    for seed, rows in sorted(by_seed.items()):
        for arm in (KVGATE, KVGATE_EMPTY):
            if arm in rows:
                lim = rows[arm].get(f"limit_after_{COLD_START_COMPLETIONS}_completions")
                if lim is None:
                    unmeasured.append((seed, arm, completions(rows[arm])))
                else:
                    gaps.append(abs(float(lim) - cap))
    if not gaps and not unmeasured:
        return None
    worst = max(gaps) if gaps else None
    name = (f"{cell}: kvgate arms' limit after {COLD_START_COMPLETIONS} completions - best "
            f"swept cap {cap}, worst |gap|")  # fmt: skip
    t = _target(name, worst, "<= 1", worst is not None and worst <= 1, cell=cell)
    why = [
        f"{n} completions" if n < COLD_START_COMPLETIONS else "no limit sampled by then"
        for _, _, n in unmeasured
    ]
    if not gaps:
        fewest = min(n for _, _, n in unmeasured)
        note = f"{fewest} completions" if fewest < COLD_START_COMPLETIONS else why[0]
        t.update(status="not measured", met=None, note=f"not measured ({note})")
    elif unmeasured:
        runs = ", ".join(f"s{s} {a} ({w})" for (s, a, _), w in zip(unmeasured, why, strict=True))
        t["note"] = f"not measured on {runs}"
    return t


def targets(doc: Mapping[str, Any], seeds: Sequence[int]) -> list[dict[str, Any]]:
    """The targets of the module docstring that the finished cells allow, each cell's
    ``indicative`` where the cell is not a verdict (:func:`sizes`)."""
    found = [t for t in _targets(doc, seeds) if t is not None]
    size = sizes({**doc, "cells": [c for c in doc["cells"] if int(c["seed"]) in seeds]}, seeds)
    for t in found:
        cell = size.get(t.get("cell") or "")
        if cell is not None and not cell["verdict"] and t["status"] in ("met", "MISSED"):
            t.update(status="indicative", reached=t["met"], met=None, note=cell["label"])
    return found


def _targets(doc: Mapping[str, Any], seeds: Sequence[int]) -> list[dict[str, Any] | None]:
    cells = _cells(doc, seeds)
    rs = ratios(doc, seeds)
    out: list[dict[str, Any] | None] = []
    for cell, by_seed in sorted(cells.items()):
        first = len(out)
        workload, _, load_text = cell.partition(":")
        load = float(load_text)
        if workload == "multi-tenant" and load in (2.0, 3.0):
            out.append(_ratio_target(rs, cell, "kvgate / best baseline", 1.0))
            out.append(_ratio_target(rs, cell, "kvgate / none", 1.5))
            n5 = sum(int(r[KVGATE].get("errors_5xx") or 0) for r in by_seed.values() if KVGATE in r)
            out.append(_target(f"{cell}: kvgate 5xx", n5, "== 0", n5 == 0, cell=cell))
            out.append(_limit_target(cell, by_seed, (doc["tuned"].get(cell) or {}).get(CAP)))
        if workload == "multi-tenant" and load == 2.0:
            out.append(_ratio_target(rs, cell, "kvgate-empty / tuned cap", 0.8))
        if workload == "multi-tenant" and load == 1.0:
            out.append(_ratio_target(rs, cell, "kvgate / none (throughput)", 0.97))
        if workload == "isolation" and load == 3.0:
            out += _isolation(cell, by_seed)
        if workload == ALONE:
            out += _alone(cell, by_seed)
        if len(by_seed) < len(seeds):
            only = sorted(by_seed)
            partial = (f"on seed{'s' if len(only) > 1 else ''} {', '.join(map(str, only))} "
                       f"only, of report seeds {', '.join(map(str, sorted(seeds)))}")  # fmt: skip
            for t in out[first:]:
                if t is not None:
                    t["partial"] = partial
    out.append(fields_target(doc))
    bad = invalid_cells(doc)
    out.append(_target("cells with cached prompt tokens (invalid)", len(bad), "== 0", not bad))
    return out


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


def verdict(
    doc: Mapping[str, Any],
    seeds: Sequence[int] | None = None,
    cells: Sequence[str] | None = None,
) -> dict[str, Any]:
    """The verdict document of ``doc``'s finished ``cells`` (``multi-tenant:2``, ...; default
    all) on ``seeds`` (:func:`report_seeds`): the tune seed, the report seeds and those asked
    but absent, the cells reported and asked but absent, each cell's size
    (:func:`sizes`), the invalid cells, the ratios, the targets and the twin's agreement."""
    if cells is not None:
        doc = {**doc, "cells": [c for c in doc["cells"] if c["cell"] in cells]}
    rep, absent = report_seeds(doc, seeds)
    chosen = {**doc, "cells": [c for c in doc["cells"] if int(c["seed"]) in rep]}
    return {
        "tune_seed": doc["tune_seed"],
        "report_seeds": rep,
        "absent_seeds": absent,
        "absent_cells": sorted(set(cells or ()) - {c["cell"] for c in chosen["cells"]}),
        "tuned": doc["tuned"],
        "short": bool((doc.get("config") or {}).get("short")),
        "cells": sorted(f"{c['cell']}@{c['seed']}" for c in chosen["cells"]),
        "sizes": sizes(chosen, rep),
        "unfinished_runs": len(doc["runs"]),
        "invalid": invalid_cells(chosen),
        "ratios": ratios(chosen, rep),
        "targets": targets(chosen, rep),
        "agreement": agreement(chosen, rep),
        "capacity": capacity_note(doc.get("calibration") or {}),
    }
