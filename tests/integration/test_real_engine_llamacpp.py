"""The real-engine benchmark against the real llama.cpp llama-server (built by scripts/build-llama).

* Its plumbing end to end (``python -m kvgate_bench.real_engine``'s ``main``) on SmolLM2-135M-
  Instruct, the benchmark's default model: one tiny cell (a handful of requests over 3 s,
  outputs of at most 16 tokens, 2 slots) through all five arms in the seed's rotated order,
  each on a fresh llama-server with the prompt cache off; every row counts 0 cached prompt
  tokens (and llama-server did report its count); the resume file is written, and a second
  invocation re-reads it and runs nothing; ``--report`` prints the verdict naming the seeds.
  The calibration and the tuned settings are stored in the resume file beforehand (the
  calibration alone takes minutes), as a re-invocation finds them.
* One schedule through ``none`` on Gemma 3 270M (the second profile) and through a cap of one
  on SmolLM2 (each request waits its turn), on servers with the prompt cache off: no 5xx, rows
  of the benchmark's schema, nothing cached.
* SIGTERM to an invocation (in its calibration) stops it with status 143 and stops its
  llama-server.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvgate_bench.effectiveness.arms.context import ArmContext
from kvgate_bench.effectiveness.model.workloads import generate, tenants_of
from kvgate_bench.kit.processes import Proc
from kvgate_bench.real_engine import resume
from kvgate_bench.real_engine.__main__ import main
from kvgate_bench.real_engine.calibration import Slo
from kvgate_bench.real_engine.cells import real_row
from kvgate_bench.real_engine.cli import parse_args, run_config
from kvgate_bench.real_engine.client import run_arm
from kvgate_bench.real_engine.engine import start_llama
from kvgate_bench.real_engine.plan import ARMS, CAP, KVGATE, NONE, arm_order
from kvgate_bench.real_engine.prompts import MODELS, corpus
from kvgate_bench.real_engine.virtual import engine_config
from tests.conftest import llama_paths

pytestmark = pytest.mark.llama

PARALLEL, CTX = 2, 1024
#: Loose enough for a shared 2-core machine: the tests check the plumbing, not the figures.
SLO = Slo(10.0, 1.0, 1.0, 0.1)


def _smollm2() -> tuple[str, str]:
    """(llama-server, SmolLM2's GGUF) from the environment or the cache; skips without them,
    except under CI, where it fails."""
    paths = llama_paths()
    cache = Path(os.environ.get("KVGATE_CACHE", Path.home() / ".cache" / "kvgate"))
    model = os.environ.get(MODELS["smollm2"].env) or next(
        iter(sorted(map(str, cache.glob(MODELS["smollm2"].pattern)))), None
    )
    if paths is None or model is None:
        why = "llama-server or SmolLM2 not fetched: run scripts/build-llama (or scripts/test)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return paths[0], model


def _calibration() -> dict[str, Any]:
    """A stored calibration: the loose SLO, 1.5 requests/s at load 1, a 2-slot profile."""
    profile = {
        "name": "test-2slot", "max_num_seqs": PARALLEL, "kv_capacity_tokens": CTX,
        "block_size": 16, "max_model_len": CTX // PARALLEL, "prefill_chunk_tokens": 2048,
        "prefill_ms_per_token": 0.5, "decode_step_ms": {"1": 10.0, "2": 14.0},
        "context_us_per_token": 0.0, "slo": {"ttft_s": SLO.ttft_s, "tpot_s": SLO.tpot_s},
    }  # fmt: skip
    return {"slo": SLO.__dict__, "profile": profile, "capacity_rps": 1.5,
            "mean_total_tokens": 100.0, "mean_output_tokens": 12.0}  # fmt: skip


def test_one_tiny_cell_resumes_and_reports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    server, model = _smollm2()
    monkeypatch.setenv("KVGATE_LLAMA_SERVER", server)
    monkeypatch.setenv(MODELS["smollm2"].env, model)
    path = tmp_path / "real.json"
    argv = ["--resume", str(path), "--cells", "multi-tenant:1", "--seeds", "2",
            "--tune-seed", "1", "--min-requests", "4", "--duration", "3", "--drain", "60",
            "--parallel", str(PARALLEL), "--ctx", str(CTX), "--max-tokens", "16",
            "--no-pin"]  # fmt: skip
    doc = resume.new_doc(run_config(parse_args(argv)), 1)
    doc["calibration"] = _calibration()
    doc["profile"] = doc["calibration"]["profile"]
    doc["tuned"]["multi-tenant:2"] = {CAP: {"cap": 1, "queue_timeout_s": 60.0},
                                      "token-bucket": {"factor": 1.0, "burst_s": 10.0}}  # fmt: skip
    resume.save(path, doc)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "left: 5 arm runs" in out  # the tuning was stored: the five arms of one cell
    done = json.loads(path.read_text())
    assert resume.finished(done) == {("multi-tenant:1", 2)} and done["runs"] == []
    cell = done["cells"][0]
    assert cell["arm_order"] == arm_order(2)
    rows = {r["arm"]: r for r in cell["rows"]}
    assert set(rows) == set(ARMS) and {v["arm"] for v in cell["virtual"]} == set(ARMS)
    for arm, r in rows.items():
        assert r["cached_prompt_tokens"] == 0, (arm, r["cached_prompt_tokens"])
        assert r["cached_reported"] > 0  # llama-server did report its count
        assert r["errors_5xx"] == 0 and r["timeouts"] == 0, (arm, r["statuses"])
        assert r["requests"] >= 4 and len(r["good_tokens"]) == r["requests"]
        lo, hi = r["goodput_ci95"]
        assert lo <= r["goodput_tokens_per_s"] <= hi
        assert r["profile"] == "llama-server" and r["eos_share"] is not None
        assert 1 <= r["output_tokens_max"] <= 16
    for arm in (KVGATE, "kvgate-empty"):
        assert rows[arm]["limit_samples"] >= 1, arm  # the admin port's gauge was read
    assert rows[CAP]["params"] == {"cap": 1, "queue_timeout_s": 60.0}
    assert all("agrees" in x for x in cell["comparison"])
    assert "verdict: baselines tuned on seed 1, reported on seeds 2" in out
    # Re-invoked on the same file: the finished cell is skipped, nothing runs.
    assert main(argv) == 0
    assert "left: 0 arm runs" in capsys.readouterr().out
    again = json.loads(path.read_text())
    assert again["cells"] == done["cells"] and again["invocations"][-1]["units"] == 0
    assert main(["--report", str(path)]) == 0
    report = capsys.readouterr().out
    # A few requests an arm: labelled, not called a verdict, its targets indicative.
    assert report.startswith("not a verdict: baselines tuned on seed 1, reported on seeds 2")
    assert "not a verdict (" in report and " requests an arm, 200 required)" in report
    assert "  indicative multi-tenant:1: kvgate / none (throughput)" in report
    assert "multi-tenant:1: kvgate / none (throughput)" in report
    assert "virtual twin (as each cell's run recorded it):" in report


@pytest.fixture(scope="module")
def servers(
    llama_server: Callable[..., Proc], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[str], Proc]]:
    """``get(model)``: a 2-slot llama-server of ``model`` with the prompt cache off, started
    once per module (Gemma through the shared fixture, SmolLM2 by the benchmark's own
    :func:`kvgate_bench.real_engine.engine.start_llama`)."""
    procs: dict[str, Proc] = {}

    def get(model: str) -> Proc:
        if model not in procs:
            if model == "gemma":
                procs[model] = llama_server(PARALLEL, CTX, "--cache-ram", "0")
            else:
                server, gguf = _smollm2()
                log = tmp_path_factory.mktemp("smollm2") / "llama.log"
                procs[model] = start_llama(
                    server, gguf, log, parallel=PARALLEL, ctx=CTX, threads=1,
                    alias=MODELS[model].alias, cache_ram_off=True,
                )  # fmt: skip
        return procs[model]

    yield get
    if "smollm2" in procs:
        procs["smollm2"].stop()


@pytest.mark.parametrize(("model", "arm"), [("gemma", NONE), ("smollm2", CAP)])
async def test_one_schedule_rows(
    servers: Callable[[str], Proc], model: str, arm: str, tmp_path: Path
) -> None:
    engine = servers(model)
    sched = generate("multi-tenant", 1.5, 3.0, 5, max_model_len=CTX // PARALLEL)
    assert 2 <= len(sched.requests) <= 12, len(sched.requests)
    tenants = {t.name: t for t in tenants_of("multi-tenant")}
    ctx = ArmContext(engine_config(PARALLEL, CTX), tenants, 1.0, 100.0, SLO.pair())
    params: dict[str, Any] = {"cap": 1, "queue_timeout_s": 120.0} if arm == CAP else {}
    run = await run_arm(
        engine.url, sched, arm, ctx, params, max_tokens=8, drain_s=120.0, words=corpus(),
        workdir=tmp_path, alias=MODELS[model].alias,
    )  # fmt: skip
    assert run.errors == [] and run.errors_5xx == 0 and run.timeouts == 0, run.statuses
    assert run.cached_prompt_tokens == 0 and run.cached_tokens  # counted, and 0
    args = parse_args(["--short", "--model", model])
    row = real_row(run, args, SLO.pair(), workload="multi-tenant", load=1.0, arm=arm, seed=5,
                   params=params, tuned="-", position=0)  # fmt: skip
    for key in ("goodput_tokens_per_s", "goodput_ci95", "slo_attainment", "ttft_p99_s",
                "rejected", "kept_up", "errors_5xx", "engine", "eos_share", "profile"):  # fmt: skip
        assert key in row, key
    assert row["requests"] == len(sched.requests)
    served = [r for r in run.result.records if r.outcome != "rejected"]
    assert served, run.statuses
    for rec in served:
        assert rec.first_token_at is not None and rec.finished_at is not None
        assert rec.first_token_at >= rec.request.arrival_s
        assert 1 <= rec.output_tokens <= 8
        assert run.prompt_tokens[rec.request.rid] > 10  # real text, counted by llama-server
    assert row["engine"]["samples"] >= 1
    if arm == CAP:  # every request waited its turn and was served, one at a time
        assert row["rejected"] == 0 and len(served) == len(sched.requests)
        spans = sorted((r.admitted_at or 0.0, r.finished_at or 0.0) for r in served)
        assert all(b[0] >= a[1] - 0.05 for a, b in itertools.pairwise(spans))


def _children(pid: int) -> list[int]:
    """``pid``'s child processes (Linux ``/proc``)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _cmdline(pid: int) -> str:
    """``pid``'s command line ("" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has exited)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_sigterm_stops_the_run_and_its_llama_server(tmp_path: Path) -> None:
    """A killed invocation left its llama-server running (SIGTERM skipped the ``finally`` that
    stops it): SIGTERM now cancels the run, the server is stopped, the exit status is 143."""
    server, model = _smollm2()
    env = {**os.environ, "KVGATE_LLAMA_SERVER": server, MODELS["smollm2"].env: model}
    argv = [sys.executable, "-m", "kvgate_bench.real_engine", "--short", "--no-pin",
            "--resume", str(tmp_path / "real.json"), "--parallel", str(PARALLEL),
            "--ctx", str(CTX), "--max-tokens", "16"]  # fmt: skip
    with (tmp_path / "out.log").open("wb") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        llama: list[int] = []
        deadline = time.monotonic() + 120
        while not llama and time.monotonic() < deadline and proc.poll() is None:
            llama = [c for c in _children(proc.pid) if "llama-server" in _cmdline(c)]
            time.sleep(0.2)
        assert llama, (tmp_path / "out.log").read_text()[-2000:]
        time.sleep(3.0)  # into the calibration's requests
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "stopped by SIGTERM" in (tmp_path / "out.log").read_text()
    deadline = time.monotonic() + 10
    while any(map(_alive, llama)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, llama)), "llama-server outlived the stopped run"
