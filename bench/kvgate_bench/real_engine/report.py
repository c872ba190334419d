"""The printed lines of the real-engine benchmark (pure): one line per row as it finishes
(:func:`row_text`) and the ``--json`` document of an invocation (:func:`report_json`). The rows
themselves: :mod:`kvgate_bench.real_engine.rows`; the verdict:
:mod:`kvgate_bench.real_engine.verdict`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvgate_bench.real_engine.rows import VECTOR_KEYS


def _f(x: Any, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def row_text(r: Mapping[str, Any]) -> str:
    """One line of a real row: the arm and setting, goodput and its interval (tokens/s), SLO
    met (the well-behaved tenants' too), TTFT and TPOT medians (s), refusals, 5xx, timeouts,
    cached prompt tokens, the outputs' median and EOS share, the sidecar's limit after 20
    completions (``kvgate`` arms) and the client's send lag; ``INVALID`` when llama-server took
    prompt tokens from a cache."""
    ci = r.get("goodput_ci95") or [None, None]
    params = r.get("params") or {}
    setting = " ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in params.items())  # fmt: skip
    lim = r.get("limit_after_20_completions")
    return (
        f"  {r['arm']:<16}{(' ' + setting) if setting else ''}  goodput "
        f"{r['goodput_tokens_per_s']:6.1f} [{_f(ci[0], '.1f')}, {_f(ci[1], '.1f')}] tok/s  "
        f"SLO {_f(r.get('slo_attainment'), '.2f')} wb "
        f"{_f(r.get('well_behaved_slo_attainment'), '.2f')}  TTFT/TPOT p50 "
        f"{_f(r.get('ttft_p50_s'), '.2f')} s/{_f(r.get('tpot_p50_s'), '.3f')} s  refused "
        f"{r.get('rejected', 0)}  5xx {r.get('errors_5xx', 0)}  timeouts {r.get('timeouts', 0)}"
        f"  cached {r.get('cached_prompt_tokens', '-')}  out p50 "
        f"{_f(r.get('output_tokens_p50'), '.0f')} EOS {_f(r.get('eos_share'), '.2f')}"
        f"{'' if lim is None else f'  limit@20 {lim:g}'}  lag p99 "
        f"{r.get('send_lag_p99_s', 0.0) * 1e3:.0f} ms"
        f"{'  INVALID: prompt tokens came from a cache' if r.get('cached_prompt_tokens') else ''}"
    )


def slim(row: Mapping[str, Any]) -> dict[str, Any]:
    """``row`` without its per-request vectors and lengths by id (for a readable ``--json``)."""
    drop = {*VECTOR_KEYS, "prompt_tokens_by_id", "natural_output_tokens_by_id"}
    return {k: v for k, v in row.items() if k not in drop}


def report_json(
    meta: Mapping[str, Any], doc: Mapping[str, Any], verdict: Mapping[str, Any]
) -> dict[str, Any]:
    """What ``--json`` writes: ``{"meta", "calibration", "tuned", "cells", "verdict"}``, the
    cells' rows slimmed (:func:`slim`; the resume file keeps them whole)."""
    cells = [
        {**c, "rows": [slim(r) for r in c["rows"]], "virtual": [slim(r) for r in c["virtual"]]}
        for c in doc["cells"]
    ]
    return {
        "meta": dict(meta),
        "calibration": doc["calibration"],
        "tuned": doc["tuned"],
        "cells": cells,
        "verdict": dict(verdict),
    }
