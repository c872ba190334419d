"""The real-engine benchmark's run of one schedule (:func:`kvgate_bench.real_engine.client.run_arm`)
against the real llama.cpp llama-server (built by scripts/build-llama): a tiny multi-tenant
schedule (a handful of requests over 3 s, outputs of at most 8 tokens) through ``none`` (straight
to the server), ``kvgate`` (the real sidecar process on the README's recommended policy) and
``concurrency-cap`` at one request (the virtual arm's class on the real clock).
Rows are the virtual benchmark's schema plus the real-engine keys; no answer is a 5xx.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvgate_bench.effectiveness.arms import ArmContext
from kvgate_bench.effectiveness.metrics import summarize
from kvgate_bench.effectiveness.workloads import generate, tenants_of
from kvgate_bench.kit.processes import Proc
from kvgate_bench.real_engine.calibration import Slo
from kvgate_bench.real_engine.cells import cell_row
from kvgate_bench.real_engine.cli import parse_args
from kvgate_bench.real_engine.client import CAP, KVGATE, NONE, corpus, run_arm
from kvgate_bench.real_engine.virtual import engine_config

pytestmark = pytest.mark.llama

PARALLEL, CTX = 2, 1024
#: Loose enough for a shared 2-core machine: the test checks the plumbing, not the figures.
SLO = Slo(10.0, 1.0, 1.0, 0.1)


@pytest.fixture(scope="module")
def engine(llama_server: Callable[..., Proc]) -> Proc:
    return llama_server(PARALLEL, CTX)


#: The cap holds one request at a time and lets the rest wait (the virtual arm's class, driven
#: on the real clock by the client).
CAP_PARAMS: dict[str, Any] = {"cap": 1, "queue_timeout_s": 60.0}


@pytest.mark.parametrize("arm", [NONE, KVGATE, CAP])
async def test_tiny_schedule_rows(engine: Proc, arm: str, tmp_path: Path) -> None:
    sched = generate("multi-tenant", 1.5, 3.0, 5, max_model_len=CTX // PARALLEL)
    assert 2 <= len(sched.requests) <= 12, len(sched.requests)
    ctx = ArmContext(
        engine_config(PARALLEL, CTX),
        {t.name: t for t in tenants_of("multi-tenant")},
        1.0,
        100.0,
        SLO.pair(),
    )
    params = CAP_PARAMS if arm == CAP else {}
    run = await run_arm(
        engine.url, sched, arm, ctx, params, max_tokens=8, drain_s=60.0, words=corpus(),
        workdir=tmp_path,
    )  # fmt: skip
    assert run.errors == [] and run.errors_5xx == 0 and run.timeouts == 0, run.statuses
    assert not any(code.startswith("5") for code in run.statuses), run.statuses
    args = parse_args(["--short"])
    row = cell_row(run, "multi-tenant", 1.0, arm, args, SLO, "-")
    summary = summarize(run.result, SLO.pair())
    for key in summary:
        assert key in row, key
    for key in ("goodput_tokens_per_s", "slo_attainment", "ttft_p99_s", "rejected", "kept_up",
                "errors_5xx", "timeouts", "engine", "loadavg_before", "eos_share"):  # fmt: skip
        assert key in row, key
    assert row["requests"] == len(sched.requests)
    served = [r for r in run.result.records if r.outcome != "rejected"]
    assert served, run.statuses
    for rec in served:
        assert rec.first_token_at is not None and rec.finished_at is not None
        assert rec.first_token_at >= rec.request.arrival_s
        assert 1 <= rec.output_tokens <= 8
        assert run.prompt_tokens[rec.request.rid] > 10  # real text, counted by llama-server
    assert row["throughput_tokens_per_s"] > 0
    assert row["engine"]["samples"] >= 1
    if arm == CAP:  # every request waited its turn and was served, one at a time
        assert row["rejected"] == 0 and len(served) == len(sched.requests)
        spans = sorted((r.admitted_at or 0.0, r.finished_at or 0.0) for r in served)
        assert all(b[0] >= a[1] - 0.05 for a, b in itertools.pairwise(spans))
