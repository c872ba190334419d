"""The ``isolation`` workload, its figures and its CLI: seeded, shaped by --noisy-load only."""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path

import pytest

from kvgate_bench.effectiveness.__main__ import main
from kvgate_bench.effectiveness.calibration import Calibration
from kvgate_bench.effectiveness.model.gate import REJECTED, SERVED, RequestRecord
from kvgate_bench.effectiveness.model.metrics import isolation_figures
from kvgate_bench.effectiveness.model.schedule import INTERACTIVE, Request
from kvgate_bench.effectiveness.model.workloads import (
    NOISY_MAX_TOKENS,
    calibration_workload,
    generate,
    isolation_load,
    tenants_of,
)
from kvgate_bench.effectiveness.runner import build_tasks

MML = 8192


def test_seeded_tenants_and_counts() -> None:
    a = generate("isolation", 10.0 * isolation_load(3), 200.0, 2, noisy_load=3)
    assert a == generate("isolation", 10.0 * isolation_load(3), 200.0, 2, noisy_load=3)
    assert a.requests != generate("isolation", 10.0 * isolation_load(3), 200.0, 3).requests
    assert sorted(a.tenants) == sorted([f"chat-{i}" for i in range(8)] + ["noisy"])
    assert all(t.tier == INTERACTIVE and t.weight == 1.0 for t in a.tenants.values())
    by = {n: [r for r in a.requests if r.tenant == n] for n in a.tenants}
    # At the rate of load 3.6 = 36 requests/s: noisy sends 3 x 10, each chat 0.6 / 8 x 10.
    assert len(by["noisy"]) == pytest.approx(3 * 10 * 200, rel=0.05)
    chats = sum(len(by[f"chat-{i}"]) for i in range(8))
    assert chats == pytest.approx(0.6 * 10 * 200, rel=0.08)
    for i in range(8):
        assert len(by[f"chat-{i}"]) == pytest.approx(0.075 * 10 * 200, rel=0.3)
    # Poisson: exponential gaps (CV 1) for the noisy tenant.
    times = [r.arrival_s for r in by["noisy"]]
    gaps = [b - t for t, b in itertools.pairwise(times)]
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, abs=0.08)


def test_noisy_max_tokens_and_the_chats_choices() -> None:
    s = generate("isolation", 50.0, 100.0, 1, noisy_load=1)
    noisy = [r for r in s.requests if r.tenant == "noisy"]
    assert noisy and all(
        r.max_tokens == min(NOISY_MAX_TOKENS, MML - r.prompt_tokens) for r in noisy
    )
    assert sum(r.max_tokens == NOISY_MAX_TOKENS for r in noisy) / len(noisy) > 0.95
    chats = [r for r in s.requests if r.tenant != "noisy"]
    assert any(r.max_tokens is None for r in chats) and any(r.max_tokens == 256 for r in chats)


@pytest.mark.parametrize("k", [1.0, 3.0, 10.0])
def test_noisy_load_shapes_the_demand_and_the_load(k: float) -> None:
    assert isolation_load(k) == pytest.approx(0.6 + k)
    ten = {t.name: t for t in tenants_of("isolation", k)}
    total = sum(t.demand for t in ten.values())
    assert ten["noisy"].demand / total == pytest.approx(k / (0.6 + k))
    assert calibration_workload("isolation") == "conversation"
    with pytest.raises(ValueError, match="noisy_load"):
        tenants_of("isolation", 0.0)


def test_build_tasks_runs_isolation_at_its_noisy_loads_only() -> None:
    cal = Calibration("conversation", "h100-llama3-8b", 2000.0, 10.0, 200.0, 1000.0)
    tasks = build_tasks(
        ["isolation", "conversation"],
        [2.0],
        [1],
        {"isolation": cal, "conversation": cal},
        "h100-llama3-8b",
        10.0,
        True,
        ["none"],
        [1.0, 10.0],
    )
    iso = sorted((t.load, t.noisy_load) for t in tasks if t.workload == "isolation")
    assert iso == [(1.6, 1.0), (10.6, 10.0)]
    assert [t.load for t in tasks if t.workload == "conversation"] == [2.0]


def rec(tenant: str, met: bool, tokens: int = 10) -> RequestRecord:
    req = Request(f"r-{tenant}-{met}-{tokens}", 0.0, tenant, INTERACTIVE, 10, 100, tokens)
    if not met:
        return RequestRecord(req, REJECTED, finished_at=0.0)
    # TTFT 0.1 s, TPOT 10 ms: within the interactive SLO.
    return RequestRecord(req, SERVED, 0.0, 0.1, 0.1 + 0.01 * (tokens - 1), tokens, 100)


def test_isolation_figures() -> None:
    records = [
        rec("chat-0", True),
        rec("chat-0", False),
        rec("chat-1", True),
        rec("noisy", True, 100),
        rec("noisy", False, 50),
    ]
    got = isolation_figures(records, 10.0)
    assert got["well_behaved_slo_attainment"] == pytest.approx(2 / 3)
    assert got["well_behaved_min_tenant_slo_attainment"] == pytest.approx(0.5)
    assert got["noisy_goodput_tokens_per_s"] == pytest.approx(10.0)
    assert set(isolation_figures(records[:3], 10.0).values()) == {None}


def test_cli_isolation_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "iso.json"
    rc = main(
        ["--short", "--workloads", "isolation", "--noisy-load", "1,3", "--duration", "4",
         "--arms", "none,vllm-queue-limit", "--jobs", "1", "--replays", "0", "--json", str(out)]
    )  # fmt: skip
    assert rc == 0
    rows = json.loads(out.read_text())["results"]
    assert sorted({r["load"] for r in rows}) == [1.6, 3.6]
    for r in rows:
        assert r["noisy_load"] == pytest.approx(r["load"] - 0.6)
        for key in (
            "well_behaved_slo_attainment",
            "well_behaved_min_tenant_slo_attainment",
            "noisy_goodput_tokens_per_s",
        ):
            assert isinstance(r[key], (int, float)), key
    assert "well-behaved SLO%" in capsys.readouterr().out
    assert main(["--noisy-load", "0"]) == 2
