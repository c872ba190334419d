"""Whether the virtual twin of a real cell agrees with it, and where not, which part of the
engine model is off (pure).

**Agrees** (the issue's rule): the virtual row's goodput is within :data:`TOLERANCE` (15 %) of
the real row's, or inside the real row's ``goodput_ci95``; *and* its SLO attainment (the
well-behaved tenants' where the cell has a noisy tenant, ``isolation``; all requests'
otherwise) is within 15 % of the real one (relative), or inside the real one's Wilson 95 %
interval. Two rows that both served nothing agree.

**The interval rule needs a verdict-sized real row**: on a few dozen requests the 95 %
intervals are so wide that "inside" holds almost whatever the twin predicts. The "or inside
the real row's interval" halves count only when the real row has the verdict's requests
(:func:`kvgate_bench.real_engine.plan.required`: 200, ``isolation`` 120 well-behaved);
otherwise only the 15 % rule applies, and the comparison says so (``interval_rule`` false,
``rule`` naming both counts).

**Disagreement** (:func:`diagnose`): the medians the twin predicts next to the real ones, in
the order the model produces them, the first that is off by more than :data:`TOLERANCE` named:

* ``refused_share`` off: the *gate* decides differently (its inputs: the engine's slots, KV or
  the adaptive limit's view of the step time);
* ``queue_wait_p50_s`` off: the gate holds requests for another time (the service times it
  waits on, i.e. the step time under load);
* ``ttft_p50_s`` off (the waits agreeing): the *prefill* cost or the engine's own queue;
* ``tpot_p50_s`` off: the *decode step time* at the batch sizes the run had.

A median difference under :data:`ABS_FLOOR_S` seconds (or refusal shares under 0.02 apart)
counts as agreeing: 15 % of a few milliseconds is noise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvgate_bench.real_engine.plan import required, row_requests
from kvgate_bench.real_engine.stats import wilson

TOLERANCE = 0.15
#: Median differences under this many seconds agree whatever their ratio.
ABS_FLOOR_S = 0.02
#: Refusal shares this close agree.
ABS_FLOOR_SHARE = 0.02


def _close(real: float | None, virt: float | None, floor: float) -> bool:
    if real is None or virt is None:
        return real is None and virt is None
    return abs(virt - real) <= max(floor, TOLERANCE * abs(real))


def attainment(row: Mapping[str, Any]) -> tuple[int, int] | None:
    """(met, requests) of the attainment the rule compares: the well-behaved tenants' where
    counted, else all requests'; None without requests."""
    if row.get("well_behaved_requests"):
        return int(row["well_behaved_met"]), int(row["well_behaved_requests"])
    n = int(row.get("requests") or 0)
    if not n:
        return None
    return round(float(row.get("slo_attainment") or 0.0) * n), n


def interval_rule(real: Mapping[str, Any]) -> bool:
    """Whether the real row is large enough for its interval to count (module docstring)."""
    return row_requests(real) >= required(str(real.get("workload")))


def goodput_agrees(real: Mapping[str, Any], virt: Mapping[str, Any]) -> bool:
    """The goodput half of the rule (module docstring)."""
    rg, vg = float(real["goodput_tokens_per_s"]), float(virt["goodput_tokens_per_s"])
    if rg == 0 and vg == 0:
        return True
    lo, hi = real.get("goodput_ci95") or (rg, rg)
    inside = interval_rule(real) and lo <= vg <= hi
    return abs(vg - rg) <= TOLERANCE * rg or inside


def attainment_agrees(real: Mapping[str, Any], virt: Mapping[str, Any]) -> bool:
    """The SLO-attainment half of the rule (module docstring)."""
    ra, va = attainment(real), attainment(virt)
    if ra is None or va is None:
        return ra is None and va is None
    rp, vp = ra[0] / ra[1], va[0] / va[1]
    bounds = wilson(*ra)
    inside = interval_rule(real) and bounds is not None and bounds[0] <= vp <= bounds[1]
    return abs(vp - rp) <= TOLERANCE * rp or inside


def diagnose(real: Mapping[str, Any], virt: Mapping[str, Any]) -> str | None:
    """The first part of the model that is off (module docstring), as a sentence with both
    figures; None when all four medians agree."""
    checks = (
        ("refused_share", ABS_FLOOR_SHARE, "the gate refuses differently (its view of the engine)"),
        (
            "queue_wait_p50_s",
            ABS_FLOOR_S,
            "the gate's queue wait differs (service times under load)",
        ),
        ("ttft_p50_s", ABS_FLOOR_S, "TTFT differs with the waits agreeing (prefill cost)"),
        ("tpot_p50_s", ABS_FLOOR_S, "TPOT differs (the decode step time at the run's batch sizes)"),
    )
    for key, floor, what in checks:
        rv, vv = real.get(key), virt.get(key)
        if key == "queue_wait_p50_s" and (rv is None or vv is None):
            continue  # nothing admitted on one side: the refusals said it
        if not _close(rv, vv, floor):
            return f"{what}: {key} real {_fmt(rv)}, virtual {_fmt(vv)}"
    return None


def _fmt(x: Any) -> str:
    return "-" if x is None else f"{float(x):.3g}"


def compare(real: Mapping[str, Any], virt: Mapping[str, Any]) -> dict[str, Any]:
    """One comparison row of a real row and its twin: both goodputs, attainments and medians,
    ``agrees`` (and its halves, ``goodput_agrees`` and ``attainment_agrees``),
    ``interval_rule`` and ``rule`` (which rule applied, module docstring) and,
    where it does not agree, ``disagreement`` (:func:`diagnose`, or the two figures when every
    median agrees)."""
    g_ok, a_ok = goodput_agrees(real, virt), attainment_agrees(real, virt)
    sized = interval_rule(real)
    n, need = row_requests(real), required(str(real.get("workload")))
    out: dict[str, Any] = {
        "workload": real["workload"],
        "load": real["load"],
        "arm": real["arm"],
        "seed": real["seed"],
        "real_goodput": real["goodput_tokens_per_s"],
        "virtual_goodput": virt["goodput_tokens_per_s"],
        "real_goodput_ci95": real.get("goodput_ci95"),
        "real_attainment": _share(attainment(real)),
        "virtual_attainment": _share(attainment(virt)),
        "agrees": g_ok and a_ok,
        "goodput_agrees": g_ok,
        "attainment_agrees": a_ok,
        "interval_rule": sized,
        "rule": "15 % or the real row's 95 % interval"
        if sized
        else f"15 % only ({n} requests, {need} needed for the interval rule)",
    }
    for key in ("ttft_p50_s", "tpot_p50_s", "queue_wait_p50_s", "refused_share"):
        out[f"real_{key}"], out[f"virtual_{key}"] = real.get(key), virt.get(key)
    if not out["agrees"]:
        why = diagnose(real, virt)
        if why is None:
            parts = [] if g_ok else ["goodput"]
            parts += [] if a_ok else ["SLO attainment"]
            why = f"{' and '.join(parts)} off with every median within 15 %"
        out["disagreement"] = why
    return out


def _share(x: tuple[int, int] | None) -> float | None:
    return x[0] / x[1] if x else None


def compare_cell(
    real: Sequence[Mapping[str, Any]], virtual: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """:func:`compare` for each real row whose arm has a virtual row."""
    by_arm = {v["arm"]: v for v in virtual}
    return [compare(r, by_arm[r["arm"]]) for r in real if r["arm"] in by_arm]
