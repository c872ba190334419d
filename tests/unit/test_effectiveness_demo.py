"""The virtual-time demo (``python -m kvgate_bench.demo.virtual``): its tables hold the
three arms and every tenant, its takeaway's ratios agree with the goodputs it printed, and it
reports where kvgate does worse.

The calibration is replaced by a fixed one (the real search takes seconds; it has its own tests
through the benchmark's runner), everything else runs: a 10 s schedule at load 3 through the 17 arm
settings in this process.
"""

from __future__ import annotations

import io
import re
from typing import Any

import pytest

from kvgate_bench.demo import virtual as demo
from kvgate_bench.effectiveness.arms.registry import candidates
from kvgate_bench.effectiveness.calibration import Calibration
from kvgate_bench.effectiveness.model.workloads import tenants_of

NUMBER = r"([0-9]+(?:\.[0-9]+)?)"


def fixed_calibration(workload: str, prof: str, duration_s: float, seed: int) -> Calibration:
    # C = 1500 output tokens/s, E[out] = 200 tokens: load 1 = 7.5 requests/s.
    return Calibration(workload, prof, 1500.0, 8.0, 200.0, 1400.0, [(8.0, 1500.0)])


def run_demo(monkeypatch: pytest.MonkeyPatch, *args: str) -> str:
    monkeypatch.setattr(demo, "calibrate", fixed_calibration)
    out = io.StringIO()
    assert (
        demo.main(["--duration", "10", "--load", "3", "--jobs", "1", "--quiet", *args], out=out)
        == 0
    )
    return out.getvalue()


def arm_rows(text: str) -> dict[str, list[str]]:
    """The per-arm table's rows: arm label -> cells."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("arm ")) + 2
    rows: dict[str, list[str]] = {}
    for line in lines[start:]:
        if not line.strip():
            break
        cells = line.split()
        rows[cells[0]] = cells
    return rows


def tenant_sections(text: str) -> dict[str, dict[str, list[str]]]:
    """The per-tenant tables: arm label -> tenant -> cells."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("per tenant"))
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        if not line.startswith(" "):
            current = sections.setdefault(line.rstrip(":"), {})
        elif current is not None and line.split()[0] != "tenant":
            cells = line.split()
            current[cells[0]] = cells
    return sections


def test_demo_tables_hold_the_arms_and_tenants_and_the_takeaway_agrees(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    text = run_demo(monkeypatch)
    flat = " ".join(text.split())  # the setup text and the takeaway are wrapped
    n_requests = int(re.search(r"seed 1, ([0-9]+) requests", flat).group(1))  # type: ignore[union-attr]
    assert n_requests > 50
    rows = arm_rows(text)
    assert list(rows) == ["none", "concurrency-cap*", "kvgate"]
    goodput = {arm: float(cells[-7]) for arm, cells in rows.items()}

    tenants = [t.name for t in tenants_of("multi-tenant")]
    sections = tenant_sections(text)
    assert list(sections) == ["none", "concurrency-cap*", "kvgate"]
    for arm, by_tenant in sections.items():
        assert list(by_tenant) == tenants, arm
        # One schedule: every arm saw the same requests, tenant by tenant.
        assert sum(int(c[2]) for c in by_tenant.values()) == n_requests
        assert [c[2] for c in by_tenant.values()] == [c[2] for c in sections["none"].values()]
        # The tenants' goodputs add up to the arm's (each rounded to 0.1 tokens/s).
        total = sum(float(c[4]) for c in by_tenant.values())
        assert total == pytest.approx(goodput[arm], abs=0.05 * (len(tenants) + 1))

    m = re.search(
        rf"goodput: kvgate {NUMBER} tokens/s = {NUMBER}x none \({NUMBER}\) and {NUMBER}x the "
        rf"tuned concurrency cap \({NUMBER}, cap=([0-9]+),queue_timeout_s=",
        flat,
    )
    assert m is not None, text
    gk, r_none, gn, r_cap, gc = (float(m.group(i)) for i in range(1, 6))
    assert (gk, gn, gc) == (goodput["kvgate"], goodput["none"], goodput["concurrency-cap*"])
    # Each goodput is rounded to 0.1 and each ratio to 0.01.
    for ratio, base in ((r_none, gn), (r_cap, gc)):
        assert base > 0
        slack = 0.005 + 0.05 * (gk + base) / base**2
        assert ratio == pytest.approx(gk / base, abs=slack)

    # The tuned cap is the sweep's best setting on this schedule.
    settings = candidates("concurrency-cap", {}, short=True)
    caps = sorted({int(p["cap"]) for p in settings})
    grid = text[text.index("concurrency-cap sweep") :].splitlines()[2 : 2 + len(caps)]
    cells = [c.rstrip("*") for line in grid for c in line.split()[1:]]
    assert len(cells) == len(settings)
    assert max(float(c) for c in cells) == pytest.approx(goodput["concurrency-cap*"], abs=0.5)
    assert f"cap={m.group(6)}, queue timeout" in text
    assert sum(line.count("*") for line in grid) == 1


def figures(arm: str, goodput: float, rejected: int, ttft_p99: float) -> demo.ArmRun:
    summary: dict[str, Any] = {
        "requests": 100,
        "goodput_tokens_per_s": goodput,
        "interactive_goodput_tokens_per_s": goodput / 2,
        "throughput_tokens_per_s": goodput + 10,
        "slo_attainment": goodput / 1000,
        "preemptions_per_1k": 0.0,
        "rejected": rejected,
        "ttft_p99_s": ttft_p99,
        "tpot_p99_s": 0.04,
    }
    tenant = demo.TenantFigures("chat", "interactive", 1.0, 100, int(goodput / 10), goodput, 0, 0.3)
    return demo.ArmRun(arm, {"cap": 8, "queue_timeout_s": 1.0}, summary, [tenant], rejected)


def test_takeaway_says_where_kvgate_does_worse() -> None:
    none = figures("none", 200.0, 0, 9.0)
    cap = figures("concurrency-cap", 600.0, 30, 0.4)
    kvgate = figures("kvgate", 500.0, 20, 0.45)
    lines = demo.takeaway([none, cap, kvgate])
    assert lines[0].startswith("goodput: kvgate 500.0 tokens/s = 2.50x none (200.0) and 0.83x")
    worse = "\n".join(lines)
    assert "goodput: 500.0 tokens/s vs concurrency-cap* 600.0 tokens/s" in worse
    assert "rejections: 20 vs none 0" in worse
    assert "interactive TTFT p99: 0.450 s vs concurrency-cap* 0.400 s" in worse
    assert "chat's SLO met: 50.0% vs concurrency-cap* 60.0%" in worse

    best = figures("kvgate", 700.0, 0, 0.3)
    lines = demo.takeaway([none, cap, best])
    assert "kvgate does no worse than none or the tuned cap on any figure above." in lines


def test_the_kvgate_arm_is_described_from_its_own_policy() -> None:
    """The setup text names what the ``kvgate`` arm enforces (the recommended policy, read
    through the contract with its defaults), not a fixed sentence that can drift from it."""
    from kvgate_bench.demo.virtual_report import describe_policy
    from kvgate_bench.effectiveness.arms.context import ArmContext
    from kvgate_bench.effectiveness.arms.registry import make_arm
    from kvgate_bench.sim.sequences import EngineConfig

    ctx = ArmContext(
        EngineConfig(num_gpu_blocks=1000),
        {t.name: t for t in tenants_of("multi-tenant")},
        4.0,
        5600,
    )
    text = describe_policy(make_arm("kvgate", ctx, {}))
    assert "Predicted (prompt + the 0.9 quantile" in text
    assert "ShortestFirst fair queue of 100, waits up to 10 s" in text
    assert "Degrade to 128 tokens" in text and "no rate limit" in text
    assert "interactive-w100 (weight 1, the SLO)" in text


def test_the_setup_text_describes_every_workload_the_demo_offers() -> None:
    """Every ``--workload`` choice has its arrivals described (``isolation`` crashed the demo
    after its runs with a KeyError before this)."""
    from kvgate_bench.demo.virtual_report import ARRIVALS
    from kvgate_bench.effectiveness.model.workloads import WORKLOADS

    for workload in WORKLOADS:
        assert demo.parse_args(["--workload", workload]).workload in ARRIVALS
