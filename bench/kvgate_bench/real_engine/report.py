"""Rows, targets and the virtual-time comparison of the real-engine benchmark, its printed end
(:func:`summary_lines`) and its ``--json`` document (:func:`report_json`) (pure).

A row is :func:`kvgate_bench.effectiveness.metrics.summarize`'s dict (the virtual benchmark's
``--json`` row schema: ``goodput_tokens_per_s``, ``slo_attainment``,
``well_behaved_slo_attainment``, ``ttft_p99_s``, ``rejected``, ...) scored under the calibrated
SLO, plus ``workload``, ``load``, ``arm``, ``seed`` and what only a real engine has:
``timeouts``, ``errors_5xx``, ``statuses``, the send lag and ``kept_up``, llama-server's gauges
(``engine``), the load average before and after, and the outputs' lengths and EOS share.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvgate_bench.effectiveness.metrics import ratio_text

#: A virtual/real goodput ratio outside 1 +- this is a disagreement in the comparison table.
AGREE_TOLERANCE = 0.25


def build_row(
    summary: Mapping[str, Any],
    *,
    workload: str,
    load: float,
    arm: str,
    seed: int,
    extra: Mapping[str, Any],
) -> dict[str, Any]:
    """One JSON row: ``summary`` with the cell's keys and ``extra`` (module docstring)."""
    return {"workload": workload, "load": load, "arm": arm, "seed": seed, **summary, **extra}


def output_stats(outputs: Mapping[str, int], finish: Mapping[str, str]) -> dict[str, Any]:
    """``output_tokens_mean``, ``output_tokens_p50`` and ``eos_share`` (the share of finished
    outputs llama-server ended with ``stop``: the model's EOS, not the max_tokens cap)."""
    xs = sorted(outputs.values())
    ends = list(finish.values())
    return {
        "output_tokens_mean": sum(xs) / len(xs) if xs else None,
        "output_tokens_p50": xs[len(xs) // 2] if xs else None,
        "eos_share": sum(1 for f in ends if f == "stop") / len(ends) if ends else None,
    }


def best_setting(results: Sequence[tuple[dict[str, Any], float]]) -> dict[str, Any]:
    """The setting with the highest goodput of (setting, goodput tokens/s) pairs (the first
    on a tie). Raises ``ValueError`` for none."""
    if not results:
        raise ValueError("no settings")
    return max(results, key=lambda sg: sg[1])[0]


def _find(rows: Sequence[Mapping[str, Any]], workload: str, load: float, arm: str) -> Any:
    for r in rows:
        if r["workload"] == workload and r["load"] == load and r["arm"] == arm:
            return r
    return None


def _ratio_target(name: str, num: float, den: float, goal: float) -> dict[str, Any]:
    """A ``num / den >= goal`` target. With ``den`` 0 the ratio is undefined (value None) and
    met only when ``num`` is positive (anything beats nothing; nothing never does)."""
    v = num / den if den else None
    met = v >= goal if v is not None else num > 0
    return {"target": name, "value": v, "goal": f">= {goal:g}", "met": met}


def targets(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets on ``rows`` (those whose cells ran): name, value, goal, met."""
    out: list[dict[str, Any]] = []
    k, n, c = (_find(rows, "multi-tenant", 2.0, a) for a in ("kvgate", "none", "concurrency-cap"))
    gp = "goodput_tokens_per_s"
    if k and n:
        name = "multi-tenant x2: kvgate goodput / none"
        out.append(_ratio_target(name, k[gp], n[gp], 1.5))
    if k and c:
        name = "multi-tenant x2: kvgate goodput / tuned cap"
        out.append(_ratio_target(name, k[gp], c[gp], 1.0))
    if k:
        v = k["errors_5xx"] / k["requests"] if k["requests"] else 0.0
        out.append(
            {"target": "multi-tenant x2: kvgate 5xx share", "value": v, "goal": "< 0.01",
             "met": v < 0.01}
        )  # fmt: skip
    ki = _find(rows, "isolation", 3.0, "kvgate")
    if ki:
        v = ki["well_behaved_slo_attainment"]
        out.append(
            {"target": "isolation noisy x3: kvgate well-behaved SLO met", "value": v,
             "goal": ">= 0.95", "met": v is not None and v >= 0.95}
        )  # fmt: skip
    k1, n1 = _find(rows, "multi-tenant", 1.0, "kvgate"), _find(rows, "multi-tenant", 1.0, "none")
    if k1 and n1:
        tp = "throughput_tokens_per_s"
        name = "multi-tenant x1: kvgate throughput / none"
        out.append(_ratio_target(name, k1[tp], n1[tp], 0.95))
    return out


def comparison(
    real: Sequence[Mapping[str, Any]], virtual: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """Per cell and arm present in both: real and virtual goodput and SLO attainment, their
    ratio and whether they agree within :data:`AGREE_TOLERANCE`."""
    out = []
    for r in real:
        v = _find(virtual, r["workload"], r["load"], r["arm"])
        if v is None:
            continue
        rg, vg = r["goodput_tokens_per_s"], v["goodput_tokens_per_s"]
        ratio = rg / vg if vg else None
        out.append(
            {
                "workload": r["workload"],
                "load": r["load"],
                "arm": r["arm"],
                "real_goodput": rg,
                "virtual_goodput": vg,
                "real_over_virtual": ratio,
                "real_slo": r["slo_attainment"],
                "virtual_slo": v["slo_attainment"],
                "real_ttft_p99_s": r["ttft_p99_s"],
                "virtual_ttft_p99_s": v["ttft_p99_s"],
                "agree": (ratio is not None and abs(ratio - 1) <= AGREE_TOLERANCE)
                or (rg == 0 and vg == 0),
            }
        )
    return out


def _f(x: Any, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def row_text(r: Mapping[str, Any], none: Mapping[str, Any] | None) -> str:
    """One line of the printed table."""
    eng = r.get("engine") or {}
    wb = r.get("well_behaved_slo_attainment")
    vs = ratio_text(r["goodput_tokens_per_s"], none["goodput_tokens_per_s"]) if none else "-"
    return (
        f"  {r['arm']:<16} goodput {r['goodput_tokens_per_s']:6.1f} tok/s ({vs:>6} none)  "
        f"SLO {_f(r['slo_attainment'], '.2f')}  wb {_f(wb, '.2f')}"
        f"  TTFT p50/p99 {_f(r['ttft_p50_s'], '.2f')}/{_f(r['ttft_p99_s'], '.2f')} s  "
        f"refused {r['rejected']:3d}  5xx {r['errors_5xx']}  timeouts {r['timeouts']}  "
        f"deferred {_f(eng.get('deferred_mean'), '.1f')}  "
        f"proc {_f(eng.get('processing_mean'), '.1f')}"
        f"  KV {_f(eng.get('kv_use_mean'), '.2f')}  lag p99 {r['send_lag_p99_s'] * 1e3:.0f} ms"
    )


def summary_lines(comp: Sequence[Mapping[str, Any]], tg: Sequence[Mapping[str, Any]]) -> list[str]:
    """The printed end of a run: the real-vs-virtual table (:func:`comparison`'s rows) and the
    targets (:func:`targets`), each under its heading."""
    lines = ["real vs virtual (fitted engine), goodput tok/s and SLO met:"]
    for x in comp:
        lines.append(
            f"  {x['workload']:<12} {x['load']:g}  {x['arm']:<16} real {x['real_goodput']:6.1f} "
            f"virtual {x['virtual_goodput']:6.1f}  ratio "
            f"{'-' if x['real_over_virtual'] is None else format(x['real_over_virtual'], '.2f')}  "
            f"SLO {x['real_slo'] or 0:.2f} / {x['virtual_slo'] or 0:.2f}"
            f"{'' if x['agree'] else '  DISAGREE'}"
        )
    lines.append("targets:")
    for t in tg:
        v = "-" if t["value"] is None else f"{t['value']:.2f}"
        lines.append(
            f"  {'met   ' if t['met'] else 'MISSED'} {t['target']}: {v} (goal {t['goal']})"
        )
    return lines


def report_json(
    meta: Mapping[str, Any],
    calibration: Mapping[str, Any],
    rows: Sequence[Mapping[str, Any]],
    virtual: Sequence[Mapping[str, Any]],
    comp: Sequence[Mapping[str, Any]],
    tg: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
    """What ``--json`` writes: ``{"meta", "calibration", "rows", "virtual", "comparison",
    "targets"}``, the calibration's ``slo`` and ``steptime`` as dicts of their fields."""
    c_json = {
        **calibration,
        "slo": calibration["slo"].__dict__,
        "steptime": calibration["steptime"].__dict__,
    }
    return {
        "meta": meta,
        "calibration": c_json,
        "rows": rows,
        "virtual": virtual,
        "comparison": comp,
        "targets": tg,
    }
