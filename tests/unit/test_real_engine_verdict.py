"""The real-engine benchmark's verdict from a resume file: the intervals
(:mod:`kvgate_bench.real_engine.stats`), the twin's agreement
(:mod:`kvgate_bench.real_engine.agreement`) and the targets
(:mod:`kvgate_bench.real_engine.verdict`). No clock, no server."""

from __future__ import annotations

from typing import Any

import pytest

from kvgate_bench.real_engine import agreement, stats, verdict, verdict_text
from kvgate_bench.real_engine.resume import close_cell, new_doc


def test_wilson_matches_the_issues_4_of_5() -> None:
    lo, hi = stats.wilson(4, 5) or (0, 0)
    assert (lo, hi) == pytest.approx((0.3755, 0.9638), abs=1e-3)  # the issue's 38-96 %
    assert stats.wilson(0, 0) is None
    lo, hi = stats.wilson(120, 120) or (0, 0)
    assert hi == 1.0 and lo == pytest.approx(0.969, abs=1e-3)
    with pytest.raises(ValueError):
        stats.wilson(6, 5)


def test_bootstrap_interval_is_seeded_and_brackets_the_rate() -> None:
    tokens = [0.0, 50.0, 100.0, 80.0, 0.0, 120.0] * 40
    rate = sum(tokens) / 100.0
    ci = stats.rate_ci95(tokens, 100.0, seed=7)
    assert ci == stats.rate_ci95(tokens, 100.0, seed=7)  # the same seed, the same interval
    assert ci[0] < rate < ci[1]
    assert ci[1] - ci[0] < 0.4 * rate
    assert stats.rate_ci95([5.0] * 10, 10.0, seed=1) == pytest.approx((5.0, 5.0))
    assert stats.rate_ci95([], 10.0, seed=1) == (0.0, 0.0)


def test_paired_ratio_of_one_schedule_and_pooled_seeds() -> None:
    base = [10.0, 0.0, 30.0, 20.0] * 50
    same = stats.ratio_ci95([(stats.Arm(base, 100.0), stats.Arm(base, 100.0))], seed=1)
    assert same.value == 1.0 and same.ci95 == pytest.approx((1.0, 1.0))  # paired: no noise
    double = [2 * x for x in base]
    r = stats.ratio_ci95([(stats.Arm(double, 100.0), stats.Arm(base, 100.0))], seed=1)
    assert r.value == pytest.approx(2.0) and r.ci95 == pytest.approx((2.0, 2.0))
    # Pooled: sum of numerator rates over sum of denominator rates across seeds.
    pooled = stats.ratio_ci95(
        [(stats.Arm([3.0] * 10, 1.0), stats.Arm([1.0] * 10, 1.0)),
         (stats.Arm([1.0] * 10, 1.0), stats.Arm([1.0] * 10, 1.0))], seed=2
    )  # fmt: skip
    assert pooled.value == pytest.approx(2.0)
    assert stats.ratio_ci95([(stats.Arm([1.0], 1.0), stats.Arm([0.0], 1.0))], 1).value is None
    with pytest.raises(ValueError):
        stats.ratio_ci95([(stats.Arm([1.0], 1.0), stats.Arm([1.0, 2.0], 1.0))], 1)


def _row(arm: str, seed: int, good: list[float], **kw: Any) -> dict[str, Any]:
    span = 100.0
    return {
        "workload": kw.pop("workload", "multi-tenant"), "load": kw.pop("load", 2.0),
        "arm": arm, "seed": seed, "profile": "llama-server", "requests": len(good),
        "good_tokens": good, "served_tokens": kw.pop("served", good), "span_s": span,
        "goodput_tokens_per_s": sum(good) / span,
        "goodput_ci95": list(stats.rate_ci95(good, span, 1)),
        "slo_attainment": sum(1 for g in good if g) / len(good),
        "well_behaved_slo_attainment": None, "well_behaved_wilson_lo": None,
        "cached_prompt_tokens": 0, "errors_5xx": 0, **kw,
    }  # fmt: skip


def _cell(doc: dict[str, Any], cell: str, seed: int, rows: list[dict[str, Any]]) -> None:
    close_cell(doc, {"cell": cell, "seed": seed, "rows": rows, "virtual": [], "comparison": []})


@pytest.fixture
def fast_bootstrap(monkeypatch: pytest.MonkeyPatch) -> None:
    """The verdict's ratios on 50 resamples: these tests read sizes,
    labels and intervals a bootstrap cannot widen (every pair's ratio the same), not widths."""
    monkeypatch.setattr(
        verdict, "ratio_ci95", lambda pairs, seed: stats.ratio_ci95(pairs, seed, 50)
    )


@pytest.mark.usefixtures("fast_bootstrap")
def test_verdict_names_the_seeds_and_evaluates_the_targets() -> None:
    doc = new_doc({"model": "smollm2"}, tune_seed=1)
    doc["tuned"]["multi-tenant:2"] = {"concurrency-cap": {"cap": 2, "queue_timeout_s": 1.0}}
    n = [10.0, 0.0] * 100
    for seed in (2, 3):
        _cell(doc, "multi-tenant:2", seed, [
            _row("none", seed, n),
            _row("concurrency-cap", seed, [15.0, 0.0] * 100),
            _row("token-bucket", seed, [12.0, 0.0] * 100),
            _row("kvgate", seed, [20.0, 0.0] * 100, limit_after_20_completions=3.0),
            _row("kvgate-empty", seed, [13.0, 0.0] * 100, limit_after_20_completions=2.0),
        ])  # fmt: skip
    wb = {"well_behaved_requests": 130, "well_behaved_met": 126, "noisy_served": 40,
          "workload": "isolation", "load": 3.0}  # fmt: skip
    _cell(doc, "isolation:3", 2, [_row("kvgate", 2, [5.0] * 130, **wb)])
    alone = {"workload": "isolation-alone", "load": 3.0}
    _cell(
        doc,
        "isolation-alone:3",
        2,
        [
            _row("none", 2, [5.0] * 110 + [0.0] * 10, **alone),
            _row("kvgate", 2, [5.0] * 117 + [0.0] * 3, **alone),
        ],
    )
    bad = _row("none", 4, n, cached_prompt_tokens=57)
    _cell(doc, "multi-tenant:2", 4, [bad, _row("kvgate", 4, [1.0, 0.0] * 100)])
    v = verdict.verdict(doc)
    assert v["tune_seed"] == 1 and v["report_seeds"] == [2, 3, 4]
    assert v["invalid"] == ["multi-tenant:2@4"]  # left out of the figures
    t = {x["target"]: x for x in v["targets"]}
    best = t["multi-tenant:2: kvgate / best baseline"]
    assert best["value"] == pytest.approx(20 / 15) and best["met"]
    assert best["ci95"] == pytest.approx([20 / 15, 20 / 15]) and best["clears"] is True
    assert t["multi-tenant:2: kvgate / none"]["value"] == pytest.approx(2.0)
    assert t["multi-tenant:2: kvgate / none"]["met"]
    assert t["multi-tenant:2: kvgate-empty / tuned cap"]["value"] == pytest.approx(13 / 15)
    assert t["multi-tenant:2: kvgate-empty / tuned cap"]["met"]
    limit = next(x for k, x in t.items() if "limit after 20" in k)
    assert limit["value"] == 1.0 and limit["met"]
    assert t["isolation:3: kvgate well-behaved SLO met"]["value"] == pytest.approx(126 / 130)
    # isolation finished on seed 2 alone of the report seeds 2, 3, 4: not a verdict
    iso = t["isolation:3: kvgate well-behaved SLO met"]
    assert iso["status"] == "indicative" and iso["met"] is None and iso["reached"]
    assert v["sizes"]["isolation:3"]["label"] == (
        "not a verdict (130 requests an arm, 120 required; on seed 2 only, not 3, 4)"
    )
    wilson_lo = t["isolation:3: kvgate well-behaved Wilson lower bound"]
    assert wilson_lo["value"] == pytest.approx(0.923, abs=1e-3) and wilson_lo["reached"]
    ref = t["isolation-alone:3: kvgate's SLO met with no noisy tenant (the well-behaved alone)"]
    assert ref["status"] == "reference" and ref["met"] is None and ref["note"] == "117/120"
    assert ref["value"] == pytest.approx(117 / 120) and ref["ci95"][0] < 117 / 120 < ref["ci95"][1]
    none_alone = t[
        "isolation-alone:3: none's SLO met with no noisy tenant (the well-behaved alone)"
    ]
    assert none_alone["value"] == pytest.approx(110 / 120)
    assert none_alone["note"] == "110/120"  # within what the calibration promised: no remark
    assert t["cells with cached prompt tokens (invalid)"]["value"] == 1
    lines = verdict_text.verdict_lines(v)
    assert lines[0].startswith(
        "verdict on 1 of 3 cells: baselines tuned on seed 1, reported on seeds 2, 3, 4"
    )
    assert "; 5 cells x seeds finished" in lines[0]
    best_line = next(x for x in lines if "kvgate / best baseline:" in x)
    assert best_line.lstrip().startswith("met") and "interval clears the goal" in best_line
    assert any("INVALID" in x and "multi-tenant:2@4" in x for x in lines)
    assert any(x.lstrip().startswith("reference") and "117/120" in x for x in lines)
    only2 = verdict.verdict(doc, [2])
    assert only2["report_seeds"] == [2]
    ratio = next(r for r in only2["ratios"] if r["ratio"] == "kvgate / none")
    assert ratio["seeds"] == [2] and list(ratio["per_seed"]) == ["2"]


def test_a_target_met_at_its_point_estimate_only_says_its_interval_reaches_below() -> None:
    t = {"target": "multi-tenant:2: kvgate / best baseline", "value": 1.12, "goal": ">= 1",
         "met": True, "ci95": [0.99, 1.25], "cell": "multi-tenant:2", "status": "met",
         "clears": False}  # fmt: skip
    line = verdict_text._target_line(t)
    assert line.lstrip().startswith("met") and "1.12 [0.990, 1.250]" in line
    assert line.endswith("(goal >= 1; the 95 % interval reaches below the goal: not separated)")
    no_ci = verdict_text._target_line({**t, "ci95": None, "clears": None})
    assert "interval" not in no_ci


def _pair(**real_kw: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    real = {"workload": "multi-tenant", "load": 2.0, "arm": "kvgate", "seed": 2,
            "goodput_tokens_per_s": 100.0, "goodput_ci95": [80.0, 125.0], "requests": 200,
            "slo_attainment": 0.8, "ttft_p50_s": 1.0, "tpot_p50_s": 0.05,
            "queue_wait_p50_s": 0.2, "refused_share": 0.1, **real_kw}  # fmt: skip
    return real, dict(real)


def test_twin_agrees_within_15_percent_or_the_real_interval() -> None:
    real, virt = _pair()
    assert agreement.compare(real, virt)["agrees"]
    virt["goodput_tokens_per_s"] = 120.0  # 20 % over, but inside [80, 125]
    assert agreement.goodput_agrees(real, virt)
    virt["goodput_tokens_per_s"] = 130.0
    assert not agreement.goodput_agrees(real, virt)
    x = agreement.compare(real, virt)
    assert not x["agrees"] and "every median" in x["disagreement"]
    virt["tpot_p50_s"] = 0.08  # the decode step is what is off
    assert "decode step time" in agreement.compare(real, virt)["disagreement"]
    virt["refused_share"] = 0.4  # refusals come first in the diagnosis
    assert agreement.compare(real, virt)["disagreement"].startswith("the gate refuses")
    # Well-behaved attainment where counted: 126 / 130 against 110 / 130.
    r2, v2 = _pair(well_behaved_requests=130, well_behaved_met=126)
    v2["well_behaved_met"] = 110
    assert agreement.attainment_agrees(r2, v2)  # 0.846 vs 0.969: within 15 %
    v2["well_behaved_met"] = 90
    assert not agreement.attainment_agrees(r2, v2)
    zero_r, zero_v = _pair(goodput_tokens_per_s=0.0)
    zero_v["goodput_tokens_per_s"] = 0.0
    assert agreement.goodput_agrees(zero_r, zero_v)


def test_the_interval_rule_needs_a_verdict_sized_real_row() -> None:
    real, virt = _pair(requests=28)
    virt["goodput_tokens_per_s"] = 120.0  # inside [80, 125], 20 % over: not enough on 28
    assert not agreement.goodput_agrees(real, virt)
    x = agreement.compare(real, virt)
    assert not x["agrees"] and not x["interval_rule"]
    assert x["rule"] == "15 % only (28 requests, 200 needed for the interval rule)"
    virt["goodput_tokens_per_s"] = 110.0  # within 15 %: agrees on any size
    assert agreement.compare(real, virt)["agrees"]
    big, big_v = _pair(requests=200)
    assert agreement.compare(big, big_v)["interval_rule"]
    # Attainment: 3 of 5 against 4 of 5 is 25 % off but inside Wilson's [0.38, 0.96]; that
    # counts on a multi-tenant row of 200 requests, not on an isolation row of 5 well-behaved.
    wb = {"requests": 200, "well_behaved_requests": 5, "well_behaved_met": 4}
    mt, mt_v = _pair(**wb)
    mt_v["well_behaved_met"] = 3
    assert agreement.interval_rule(mt) and agreement.attainment_agrees(mt, mt_v)
    iso, iso_v = _pair(workload="isolation", **wb)
    iso_v["well_behaved_met"] = 3
    assert not agreement.interval_rule(iso) and not agreement.attainment_agrees(iso, iso_v)
    assert agreement.interval_rule({**iso, "well_behaved_requests": 120})


def test_the_report_judges_the_twin_afresh_and_says_which_rule() -> None:
    doc = new_doc({"model": "smollm2"}, tune_seed=1)
    rows = [_row(arm, 2, [10.0, 0.0] * 14) for arm in ("none", "kvgate")]
    virt = [{**r, "goodput_tokens_per_s": r["goodput_tokens_per_s"] * 1.3} for r in rows]
    close_cell(doc, {"cell": "multi-tenant:2", "seed": 2, "rows": rows, "virtual": virt,
                     "comparison": [{"agrees": True}]})  # fmt: skip
    a = verdict.verdict(doc)["agreement"]
    assert a["pairs"] == 2 and a["agree"] == 0 and a["fifteen_percent_only"] == 2
    line = next(x for x in verdict_text.verdict_lines(verdict.verdict(doc)) if "virtual twin" in x)
    assert line.startswith(
        "virtual twin (as each cell's run recorded it): 0 of 2 row pairs agree; 2 of them judged "
        "on the 15 %"
    )


def _sized_doc(n: int, *, short: bool = False, completions: int | None = None) -> dict[str, Any]:
    """multi-tenant:2 on seeds 2 and 3, every arm with ``n`` requests; the kvgate arms'
    limit after 20 completions 2 (the tuned cap), or None with ``completions`` completions."""
    doc = new_doc({"model": "smollm2", "short": short}, tune_seed=1)
    doc["tuned"]["multi-tenant:2"] = {"concurrency-cap": {"cap": 2, "queue_timeout_s": 1.0}}
    half = [10.0, 0.0] * (n // 2)
    lim: dict[str, Any] = {"limit_after_20_completions": 2.0 if completions is None else None}
    if completions is not None:
        lim["completions"] = completions
    for seed in (2, 3):
        _cell(doc, "multi-tenant:2", seed, [
            _row("none", seed, half), _row("concurrency-cap", seed, half),
            _row("kvgate", seed, [2 * x for x in half], **lim),
            _row("kvgate-empty", seed, half, **lim),
        ])  # fmt: skip
    return doc


@pytest.mark.usefixtures("fast_bootstrap")
def test_an_undersized_or_short_cell_is_not_a_verdict() -> None:
    full = verdict.verdict(_sized_doc(200))
    assert full["sizes"]["multi-tenant:2"] == {
        "requests": 200, "required": 200, "seeds": [2, 3], "verdict": True,
        "label": "200 requests an arm (200 required)"}  # fmt: skip
    best = next(t for t in full["targets"] if t["target"].endswith("kvgate / best baseline"))
    assert best["status"] == "met" and best["met"] is True
    assert verdict_text.verdict_lines(full)[0].startswith("verdict: baselines tuned on seed 1")
    for v, label in (
        (verdict.verdict(_sized_doc(198)), "not a verdict (198 requests an arm, 200 required)"),
        (verdict.verdict(_sized_doc(200, short=True)),
         "not a verdict (200 requests an arm, 200 required; a --short run)"),
    ):  # fmt: skip
        assert v["sizes"]["multi-tenant:2"]["label"] == label
        cell_targets = [t for t in v["targets"] if t["cell"] == "multi-tenant:2"]
        assert cell_targets and all(t["status"] == "indicative" for t in cell_targets)
        best = next(t for t in cell_targets if t["target"].endswith("kvgate / best baseline"))
        assert best["met"] is None and best["reached"] is True and best["value"] == 2.0
        lines = verdict_text.verdict_lines(v)
        assert lines[0].startswith("not a verdict: baselines tuned on seed 1")
        assert f"  multi-tenant:2    {label}" in lines
        assert not any(x.startswith(("  met ", "  MISSED ")) and "multi-tenant:2:" in x
                       for x in lines)  # fmt: skip
        assert any(x.startswith("  indicative multi-tenant:2: kvgate / none: 2") for x in lines)
    # Isolation counts well-behaved requests: 120 make a verdict, 119 do not.
    for wb, ok in ((120, True), (119, False)):
        doc = new_doc({}, tune_seed=1)
        extra = {"workload": "isolation", "load": 3.0, "well_behaved_requests": wb,
                 "well_behaved_met": wb, "noisy_served": 5}  # fmt: skip
        _cell(doc, "isolation:3", 2, [_row("kvgate", 2, [1.0] * 300, **extra)])
        v = verdict.verdict(doc)
        assert v["sizes"]["isolation:3"]["verdict"] is ok
        assert {t["status"] for t in v["targets"] if t["cell"]} == {"met" if ok else "indicative"}


@pytest.mark.usefixtures("fast_bootstrap")
def test_a_limit_without_20_completions_is_not_measured() -> None:
    v = verdict.verdict(_sized_doc(200, completions=11))
    t = next(t for t in v["targets"] if "limit after 20" in t["target"])
    assert t["status"] == "not measured" and t["met"] is None
    assert t["note"] == "not measured (11 completions)"
    line = next(x for x in verdict_text.verdict_lines(v) if "limit after 20" in x)
    assert line.startswith("  -          multi-tenant:2: kvgate arms' limit after 20")
    assert line.endswith(": not measured (11 completions) (goal <= 1)") and "MISSED" not in line
    # One seed measured, the other not: judged on the measured runs, the others named.
    doc = _sized_doc(200)
    for row in doc["cells"][1]["rows"][2:]:
        row.update(limit_after_20_completions=None, completions=12)
    t = next(t for t in verdict.verdict(doc)["targets"] if "limit after 20" in t["target"])
    assert t["status"] == "met" and t["value"] == 0.0
    assert t["note"] == ("not measured on s3 kvgate (12 completions), "
                         "s3 kvgate-empty (12 completions)")  # fmt: skip
    # A row written before ``completions`` was recorded: its served requests count.
    assert verdict.completions({"served_tokens": [3, 0, 5, 0]}) == 2


@pytest.mark.usefixtures("fast_bootstrap")
def test_seeds_and_cells_choose_what_is_reported() -> None:
    doc = _sized_doc(200)
    _cell(doc, "multi-tenant:3", 2, [_row("none", 2, [1.0] * 200), _row("kvgate", 2, [2.0] * 200)])
    v = verdict.verdict(doc, [3, 5])
    assert v["report_seeds"] == [3] and v["absent_seeds"] == [5]
    assert v["cells"] == ["multi-tenant:2@3"]
    lines = verdict_text.verdict_lines(v)
    assert lines[0].startswith("verdict: baselines tuned on seed 1, reported on seeds 3;")
    assert "  seeds asked but absent from the file (no finished cell), not reported: 5" in lines
    only = verdict.verdict(doc, None, ["multi-tenant:3", "isolation:3"])
    assert only["cells"] == ["multi-tenant:3@2"] and {r["cell"] for r in only["ratios"]} == {
        "multi-tenant:3"}  # fmt: skip
    assert only["absent_cells"] == ["isolation:3"] and only["report_seeds"] == [2]
    assert verdict.verdict(doc, [7])["report_seeds"] == []


@pytest.mark.usefixtures("fast_bootstrap")
def test_a_target_on_fewer_seeds_than_reported_names_its_seeds() -> None:
    """A cell finished on some of the report seeds only: its targets (pooled over those) say
    which, so 'the noisy tenant served on every seed: yes' or an isolation MISSED is not read
    as over all three (found by a new-user review: pass 5's isolation:3, seed 3 alone)."""
    doc = new_doc({"model": "smollm2"}, tune_seed=1)
    for seed in (2, 3, 4):
        _cell(doc, "multi-tenant:2", seed, [
            _row("none", seed, [10.0, 0.0] * 100),
            _row("kvgate", seed, [20.0, 0.0] * 100),
        ])  # fmt: skip
    wb = {"well_behaved_requests": 130, "well_behaved_met": 52, "noisy_served": 40,
          "workload": "isolation", "load": 3.0}  # fmt: skip
    _cell(doc, "isolation:3", 3, [_row("kvgate", 3, [5.0] * 130, **wb)])
    v = verdict.verdict(doc, [2, 3, 4])
    lines = verdict_text.verdict_lines(v)
    served = next(x for x in lines if "noisy tenant served" in x)
    assert served.endswith("(goal true; on seed 3 only, of report seeds 2, 3, 4)")
    missed = next(x for x in lines if "well-behaved SLO met" in x)
    # not a verdict on one seed of three: indicative, neither met nor missed
    assert missed.lstrip().startswith("indicative") and "on seed 3 only, of report seeds" in missed
    whole = next(x for x in lines if "multi-tenant:2: kvgate / none:" in x)
    assert "only" not in whole  # on every report seed: nothing to say


def test_the_alone_reference_says_when_the_engine_alone_misses_the_slo() -> None:
    doc = new_doc({}, 1)
    alone = {"workload": "isolation-alone", "load": 3.0}
    _cell(doc, "isolation-alone:3", 3, [
        _row("none", 3, [5.0] * 87 + [0.0] * 35, **alone),
        _row("kvgate", 3, [5.0] * 89 + [0.0] * 33, **alone),
    ])  # fmt: skip
    t = {x["target"]: x for x in verdict.verdict(doc, [3])["targets"]}
    none = t["isolation-alone:3: none's SLO met with no noisy tenant (the well-behaved alone)"]
    assert none["note"].startswith("87/122; none misses the SLO for more than 10% of the")
    assert "falls short of the isolation target with no noisy tenant" in none["note"]
    kv = t["isolation-alone:3: kvgate's SLO met with no noisy tenant (the well-behaved alone)"]
    assert kv["note"] == "89/122"  # the remark is about the calibration, said once
    line = next(x for x in verdict_text.verdict_lines(verdict.verdict(doc, [3])) if "87/122" in x)
    assert "well-behaved requests alone, at 0.6x load 1" in line


def test_the_report_names_the_capacity_and_its_thin_probes() -> None:
    doc = new_doc({}, 1)
    probe = {"timeouts": 0, "send_lag_p99_s": 0.002, "cached_prompt_tokens": 0}
    doc["calibration"] = {
        "capacity_rps": 0.145,
        "probes": [  # the first verdict's: 11, 5 and 10 requests, in the order run
            {"rate_rps": 0.199, "slo_attainment": 0.636, "requests": 11, **probe},
            {"rate_rps": 0.1395, "slo_attainment": 1.0, "requests": 5, **probe},
            {"rate_rps": 0.169, "slo_attainment": 0.5, "requests": 10, **probe},
        ],
    }
    _cell(doc, "multi-tenant:2", 3, [_row("none", 3, [5.0] * 10)])
    v = verdict.verdict(doc, [3])
    assert v["capacity"] == {
        "capacity_rps": 0.145,
        "definition": "attainment-90",  # a file written before the goodput peak
        "probes": [[0.1395, 1.0, 5, None], [0.169, 0.5, 10, None], [0.199, 0.636, 11, None]],
        "thin": 3,
        "none_met": False,
        "still_climbing": False,
    }
    lines = verdict_text.verdict_lines(v)
    assert lines[1].startswith(
        "capacity 0.145 req/s, where none met the SLO for 90% (probes, req/s: 0.140 met 1.00 of 5"
    )
    assert lines[2].startswith("  3 of 3 probes held fewer than 40 requests")
    # Probes of the size a calibration now runs: no warning; no probes kept: no line.
    for p in doc["calibration"]["probes"]:
        p["requests"] = 40
    assert verdict.verdict(doc, [3])["capacity"]["thin"] == 0
    assert not any("fewer than" in x for x in verdict_text.verdict_lines(verdict.verdict(doc, [3])))
    # This session's: no probe of 42-51 requests met 90 %, from 0.047 to 0.096 requests/s.
    for p, (rate, att) in zip(
        doc["calibration"]["probes"], [(0.096, 0.86), (0.068, 0.89), (0.047, 0.81)], strict=True
    ):
        p.update(rate_rps=rate, slo_attainment=att)
    doc["calibration"]["capacity_rps"] = 0.047 * 0.81 / 0.9
    v = verdict.verdict(doc, [3])
    assert v["capacity"]["none_met"]
    assert any("no probe met the SLO for 90%" in x for x in verdict_text.verdict_lines(v))
    # The goodput peak: load 1 from the best probe; a climb cut short is named.
    doc["calibration"]["capacity_definition"] = "goodput-peak"
    for p, g in zip(doc["calibration"]["probes"], [9.0, 10.0, 6.0], strict=True):
        p["goodput_tokens_per_s"] = g
    doc["calibration"]["capacity_rps"] = 10.0 / 80.0
    v = verdict.verdict(doc, [3])
    assert not v["capacity"]["none_met"] and not v["capacity"]["still_climbing"]
    lines = verdict_text.verdict_lines(v)
    assert lines[1].startswith(
        "load 1 0.125 req/s, none's peak goodput (probes, req/s: 0.047: goodput 6.00 tokens/s,"
    )
    assert not any("no probe met" in x for x in lines)
    doc["calibration"]["probes"][0]["goodput_tokens_per_s"] = 12.0  # best at the highest rate
    v = verdict.verdict(doc, [3])
    assert v["capacity"]["still_climbing"]
    lines = verdict_text.verdict_lines(v)
    assert any("stopped while none's goodput still grew" in x for x in lines)
    doc["calibration"] = {}
    assert verdict.verdict(doc, [3])["capacity"] is None
    assert not any(
        x.startswith("capacity") for x in verdict_text.verdict_lines(verdict.verdict(doc, [3]))
    )
