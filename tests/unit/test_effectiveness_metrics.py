"""Goodput, SLO and fairness figures on hand-made traces; the ``--json`` schema of a tiny run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvgate_bench.effectiveness.__main__ import RESULT_KEYS, main
from kvgate_bench.effectiveness.model.driver import engine_config
from kvgate_bench.effectiveness.model.gate import (
    DEGRADED,
    REJECTED,
    SERVED,
    RequestRecord,
    RunResult,
)
from kvgate_bench.effectiveness.model.metrics import jain, met_slo, summarize, windowed_jain
from kvgate_bench.effectiveness.model.schedule import BATCH, INTERACTIVE, Request, Schedule, Tenant
from kvgate_bench.sim.engine import SimEngine
from kvgate_bench.sim.steptime import profile

TENANTS = {"a": Tenant("a", INTERACTIVE), "b": Tenant("b", BATCH, weight=2.0)}


def rec(
    rid: str,
    arrival: float,
    *,
    tenant: str = "a",
    first: float | None = None,
    finish: float | None = None,
    out: int = 0,
    outcome: str = SERVED,
    true_out: int = 100,
    max_tokens: int | None = None,
    sent: int | None = 1000,
) -> RequestRecord:
    tier = TENANTS[tenant].tier
    req = Request(rid, arrival, tenant, tier, 10, max_tokens, true_out)
    admitted = None if outcome == REJECTED else arrival
    return RequestRecord(req, outcome, admitted, first, finish, out, sent)


def run_of(records: list[RequestRecord], duration: float = 10.0) -> RunResult:
    sched = Schedule("hand", 1.0, duration, 0, TENANTS, [r.request for r in records])
    st = profile("h100-llama3-8b")
    eng = SimEngine(engine_config(st), st)
    end = max(r.finished_at or 0.0 for r in records)
    return RunResult(sched, "hand", {}, records, end, 2.5, 0, 0.0, eng)


def test_goodput_counts_only_requests_that_met_their_slo() -> None:
    records = [
        # interactive: TTFT 0.2 s, TPOT (2.2 - 0.2) / 10 = 0.2 s > 50 ms: misses.
        rec("slow-tpot", 0.0, first=0.2, finish=2.2, out=11),
        # interactive: TTFT 0.3 s, TPOT 0.02 s: meets; 11 tokens.
        rec("good", 1.0, first=1.3, finish=1.5, out=11),
        # interactive: TTFT 0.8 s: misses.
        rec("late", 2.0, first=2.8, finish=2.9, out=5),
        # batch: done 9 s after arrival (within 10 min): meets; 40 tokens.
        rec("batch", 1.0, tenant="b", first=5.0, finish=10.0, out=40),
        # rejected: a miss.
        rec("refused", 3.0, finish=3.0, outcome=REJECTED, sent=None),
        # degraded and cut below its true length (100 > 20): a miss even though fast.
        rec("cut", 4.0, first=4.1, finish=4.2, out=20, outcome=DEGRADED, sent=20),
        # degraded but its true length fit: meets; 1 token (TPOT 0).
        rec("clamped-ok", 5.0, first=5.1, finish=5.1, out=1, outcome=DEGRADED, true_out=1),
    ]
    assert [met_slo(r) for r in records] == [False, True, False, True, False, False, True]
    m = summarize(run_of(records))
    span = 10.0
    assert m["goodput_tokens_per_s"] == pytest.approx((11 + 40 + 1) / span)
    assert m["interactive_goodput_tokens_per_s"] == pytest.approx((11 + 1) / span)
    assert m["throughput_tokens_per_s"] == pytest.approx((11 + 11 + 5 + 40 + 20 + 1) / span)
    assert m["slo_attainment"] == pytest.approx(3 / 7)
    assert m["rejected"] == 1 and m["degraded"] == 2
    assert m["kv_utilisation"] == pytest.approx(0.25)
    assert m["reject_precision"] is None
    assert m["tiers"][BATCH]["requests"] == 1 and m["tiers"][INTERACTIVE]["requests"] == 6
    # TTFTs of the served interactive requests: 0.2, 0.3, 0.8, 0.1, 0.1 (linear percentile).
    assert m["ttft_p50_s"] == pytest.approx(0.2)


def test_jain_on_known_inputs() -> None:
    assert jain([1.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert jain([1.0, 0.0, 0.0]) == pytest.approx(1 / 3)
    assert jain([1.0, 2.0, 3.0]) == pytest.approx(36 / 42)
    assert jain([]) is None and jain([0.0, 0.0]) is None


def test_windowed_jain_weights_service_and_counts_only_backlogged_tenants() -> None:
    # Both tenants wait for their first token through the whole 60 s window (backlogged);
    # "a" gets 600 tokens, "b" (weight 2) 1200: equal weighted service.
    records = [
        rec("a1", 0.0, first=59.0, finish=60.0, out=1),
        rec("a2", 0.0, first=0.0, finish=60.0, out=599),
        rec("b1", 0.0, tenant="b", first=59.0, finish=60.0, out=1200),
    ]
    assert windowed_jain(records, TENANTS, 60.0) == pytest.approx(1.0, abs=1e-3)
    # "b" gets 4x the weighted service of "a": Jain (1 + 4)^2 / (2 (1 + 16)) = 25/34.
    records[2] = rec("b1", 0.0, tenant="b", first=59.0, finish=60.0, out=4800)
    assert windowed_jain(records, TENANTS, 60.0) == pytest.approx(25 / 34, rel=1e-3)
    # "b" served at once (never waiting, nothing refused): not backlogged, only "a" is: None.
    records[2] = rec("b1", 0.0, tenant="b", first=0.0, finish=60.0, out=4800)
    assert windowed_jain(records, TENANTS, 60.0) is None
    # A refusal makes "b" backlogged again, with no service: Jain 1/2.
    records[2] = rec("b1", 1.0, tenant="b", finish=1.0, outcome=REJECTED, sent=None)
    assert windowed_jain(records, TENANTS, 60.0) == pytest.approx(0.5)
    assert windowed_jain(records, TENANTS, 59.0) is None  # no whole window


def test_json_of_a_tiny_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "eff.json"
    rc = main(
        ["--short", "--workloads", "conversation", "--loads", "1", "--duration", "4",
         "--arms", "none,saturation-shed,kvgate-maxtokens", "--jobs", "1", "--json", str(out),
         "--plots", str(tmp_path / "plots")]
    )  # fmt: skip
    assert rc == 0
    doc = json.loads(out.read_text())
    rows = doc["results"]
    assert {r["arm"] for r in rows} == {"none", "saturation-shed", "kvgate-maxtokens"}
    for r in rows:
        assert list(r)[: len(RESULT_KEYS)] == list(RESULT_KEYS)
        assert r["workload"] == "conversation" and r["load"] == 1.0 and r["seed"] == 1
        for k in RESULT_KEYS[4:]:
            assert r[k] is None or isinstance(r[k], (int, float)), k
        if r["rejected"] == 0:
            assert r["reject_precision"] is None and r["reject_replays"] == 0
        if r["reject_precision"] is not None:
            assert 0.0 <= r["reject_precision"] <= 1.0 and r["reject_replays"] >= 1
        assert r["goodput_tokens_per_s"] <= r["throughput_tokens_per_s"] + 1e-9
    assert doc["calibration"]["conversation"]["capacity_goodput_tokens_per_s"] > 0
    assert doc["meta"]["profile"] == "h100-llama3-8b"
    assert doc["meta"]["replays"] == 3 and doc["meta"]["replay_cpu_s"] >= 0
    pngs = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert pngs == [f"effectiveness-conversation-{f}.png" for f in
                    ("goodput", "preemptions", "ttft-p99")]  # fmt: skip
    captured = capsys.readouterr()
    text = captured.out
    assert "conversation at load 1" in text and "kvgate-maxtokens goodput" in text
    assert "runs 1/" not in text  # progress never on stdout


def test_unknown_arm_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--arms", "kvgate-nope"]) == 2
    assert "unknown arm 'kvgate-nope'" in capsys.readouterr().err
