"""The effectiveness benchmark's printed report: the table of each point's reported rows, the
isolation and prefix-reuse lines, the headline ratios and the sweeps (goodput in output
tokens/s, times in seconds, means over seeds)."""

from __future__ import annotations

from typing import Any

from kvgate_bench.effectiveness.arms.registry import BASELINES
from kvgate_bench.effectiveness.model.metrics import ratio_text as _ratio


def _fmt(v: Any, spec: str = ".0f", scale: float = 1.0) -> str:
    if v is None:
        return "-"
    return format(float(v) * scale, spec)


def _secs(v: float | None) -> str:
    """A signed duration: ``+1.5s``, ``-`` for None."""
    return "-" if v is None else f"{v:+.1f}s"


def _mean(rows: list[dict[str, Any]], key: str) -> float | None:
    xs = [float(r[key]) for r in rows if r.get(key) is not None]
    return sum(xs) / len(xs) if xs else None


def table(
    results: list[dict[str, Any]], arms: list[str], over: str = "seeds"
) -> tuple[str, list[str]]:
    """The printed table (means over the seeds of ``results``, named ``over`` in each point's
    title) and the headline lines."""
    lines: list[str] = []
    heads: list[str] = []
    header = (
        f"{'arm':<21} {'setting':<28} {'goodput':>8} {'int.gp':>8} {'thrpt':>8} {'SLO%':>5} "
        f"{'TTFTp99':>8} {'TPOTp99':>8} {'pre/1k':>7} {'rej':>6} {'deg':>5} {'jain':>5} "
        f"{'KV%':>4} {'rejP%':>5} {'RAerr':>6} {'vs none':>7}"
    )
    points = sorted({(r["workload"], r["load"]) for r in results}, key=lambda x: (x[0], x[1]))
    for w, load in points:
        at = [r for r in results if r["workload"] == w and r["load"] == load]
        lines.append(f"\n{w} at load {load:g} (goodput etc. in output tokens/s; means over {over})")
        lines.append(header)
        lines.append("-" * len(header))
        gp: dict[str, float | None] = {}
        igp: dict[str, float | None] = {}
        for arm in arms:
            rs = [r for r in at if r["arm"] == arm]
            if not rs:
                continue
            gp[arm] = _mean(rs, "goodput_tokens_per_s")
            igp[arm] = _mean(rs, "interactive_goodput_tokens_per_s")
            setting = ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                               for k, v in rs[0]["params"].items()) or "-"  # fmt: skip
            cells = [
                f"{arm:<21}",
                f"{setting:<28}",
                f"{_fmt(gp[arm]):>8}",
                f"{_fmt(igp[arm]):>8}",
                f"{_fmt(_mean(rs, 'throughput_tokens_per_s')):>8}",
                f"{_fmt(_mean(rs, 'slo_attainment'), '.1f', 100):>5}",
                f"{_fmt(_mean(rs, 'ttft_p99_s'), '.2f'):>7}s",
                f"{_fmt(_mean(rs, 'tpot_p99_s'), '.0f', 1e3):>6}ms",
                f"{_fmt(_mean(rs, 'preemptions_per_1k'), '.1f'):>7}",
                f"{_fmt(_mean(rs, 'rejected')):>6}",
                f"{_fmt(_mean(rs, 'degraded')):>5}",
                f"{_fmt(_mean(rs, 'jain'), '.2f'):>5}",
                f"{_fmt(_mean(rs, 'kv_utilisation'), '.0f', 100):>4}",
                f"{_fmt(_mean(rs, 'reject_precision'), '.0f', 100):>5}",
                f"{_secs(_mean(rs, 'retry_after_error_s')):>6}",
                f"{_ratio(gp[arm], gp.get('none')):>7}",
            ]
            lines.append(" ".join(cells))
        if any(r.get("well_behaved_slo_attainment") is not None for r in at):
            lines.extend(isolation_lines(at, arms))
        if any(r.get("prefix_reuse_share") is not None for r in at):
            lines.append(reuse_line(at, arms))
        for k in ("kvgate", "kvgate-maxtokens"):
            if k in gp:
                heads.append(_headline(w, load, k, gp, igp))
    return "\n".join(lines), heads


def isolation_lines(at: list[dict[str, Any]], arms: list[str]) -> list[str]:
    """The isolation figures of one point's rows (means over seeds), one line per arm."""
    out = [
        f"  {'arm':<22} {'goodput':>8} {'well-behaved SLO%':>18} {'worst tenant%':>14} "
        f"{'noisy goodput':>14}"
    ]
    for arm in arms:
        rs = [r for r in at if r["arm"] == arm]
        if rs:
            out.append(
                f"  {arm:<22} {_fmt(_mean(rs, 'goodput_tokens_per_s')):>8} "
                f"{_fmt(_mean(rs, 'well_behaved_slo_attainment'), '.1f', 100):>18} "
                f"{_fmt(_mean(rs, 'well_behaved_min_tenant_slo_attainment'), '.1f', 100):>14} "
                f"{_fmt(_mean(rs, 'noisy_goodput_tokens_per_s')):>14}"
            )
    return out


def reuse_line(at: list[dict[str, Any]], arms: list[str]) -> str:
    """The prefix reuse share of one point's rows per arm (cached / served prompt tokens, %,
    means over seeds)."""
    shares = [
        f"{arm} {_fmt(_mean(rs, 'prefix_reuse_share'), '.1f', 100)}%"
        for arm in arms
        if (rs := [r for r in at if r["arm"] == arm])
    ]
    return "  prefix reuse share (cached / served prompt tokens): " + ", ".join(shares)


def _headline(w: str, load: float, k: str, gp: dict[str, Any], igp: dict[str, Any]) -> str:
    """One headline: arm ``k``'s goodput against none, the best baseline, and (for ``kvgate``)
    the oracle, its noisy variant and kvgate-maxtokens, all measured in this run."""
    base = {b: gp[b] for b in BASELINES if gp.get(b) is not None}
    best = max(base, key=lambda b: base[b] or 0.0) if base else None
    msg = (
        f"{w} load {load:g}: {k} goodput {_fmt(gp[k])} tokens/s = "
        f"{_ratio(gp[k], gp.get('none'))} none ({_fmt(gp.get('none'))})"
    )
    if best is not None:
        msg += f", {_ratio(gp[k], base[best])} the best baseline ({best} {_fmt(base[best])})"
        ibase = {b: igp[b] for b in BASELINES if igp.get(b) is not None}
        ib = max(ibase, key=lambda b: ibase[b] or 0.0)
        msg += (
            f"; interactive goodput {_fmt(igp[k])} = {_ratio(igp[k], igp.get('none'))} "
            f"none, {_ratio(igp[k], ibase[ib])} the best baseline ({ib} {_fmt(ibase[ib])})"
        )
    if k == "kvgate":
        for other, label in (
            ("oracle", "the oracle"),
            ("kvgate-maxtokens", "kvgate-maxtokens"),
        ):
            if gp.get(other) is not None:
                msg += f"; {_ratio(gp[k], gp[other])} {label} ({_fmt(gp[other])})"
        if gp.get("kvgate-noisy") is not None and gp.get("oracle") is not None:
            msg += f"; kvgate-noisy = {_ratio(gp['kvgate-noisy'], gp['oracle'])} the oracle"
    return msg


def sweep_table(sweeps: list[dict[str, Any]]) -> str:
    """The tuned arms' sweeps: mean goodput of every setting; with more than one seed, each
    setting's goodput on the tuning seed (which chose the reported setting) and its means over
    the report seeds."""
    tuned = any(s.get("report_goodput_tokens_per_s") is not None for s in sweeps)
    if tuned:
        tune = next(s["tuning_seed"] for s in sweeps)
        head = (
            f"\nsweeps (output tokens/s; 'tune': goodput on the tuning seed {tune}, the highest "
            "of which chose the setting reported above; the rest: means over the report seeds)"
        )
    else:
        head = "\nsweeps (mean goodput, output tokens/s; the best setting is reported above)"
    pre = "report_" if tuned else ""
    lines = [head]
    for s in sorted(sweeps, key=lambda s: (s["workload"], s["load"], s["arm"], str(s["params"]))):
        if not s["params"]:
            continue
        setting = ",".join(f"{k}={v}" for k, v in s["params"].items())
        tune_col = f"tune {_fmt(s['tuning_goodput_tokens_per_s']):>6}  " if tuned else ""
        lines.append(
            f"  {s['workload']:<13} load {s['load']:<4g} {s['arm']:<16} {setting:<30} "
            f"{tune_col}goodput {_fmt(s[pre + 'goodput_tokens_per_s']):>6}  interactive "
            f"{_fmt(s[pre + 'interactive_goodput_tokens_per_s']):>6}  SLO "
            f"{_fmt(s[pre + 'slo_attainment'], '.1f', 100)}%"
        )
    return "\n".join(lines)
