"""The real-engine benchmark's plan (:mod:`kvgate_bench.real_engine.plan`), options
(:mod:`~kvgate_bench.real_engine.cli`), resume file (:mod:`~kvgate_bench.real_engine.resume`),
limit trace (:mod:`~kvgate_bench.real_engine.limit_trace`), fitted profile
(:mod:`~kvgate_bench.real_engine.profile_fit`) and rows (:mod:`~kvgate_bench.real_engine.rows`).
No clock, no server."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvgate_bench.effectiveness.model.gate import REJECTED, SERVED, RequestRecord, RunResult
from kvgate_bench.effectiveness.model.metrics import NOISY_TENANT
from kvgate_bench.effectiveness.model.workloads import generate
from kvgate_bench.real_engine import limit_trace, plan, profile_fit, resume
from kvgate_bench.real_engine.__main__ import main
from kvgate_bench.real_engine.calibration import Slo
from kvgate_bench.real_engine.cli import parse_args
from kvgate_bench.real_engine.rows import build_row
from kvgate_bench.real_engine.virtual import engine_config
from kvgate_bench.sim.engine import SimEngine
from kvgate_bench.sim.steptime import constant_profile


def test_cells_seeds_and_the_rotated_arm_order() -> None:
    assert plan.parse_cells("multi-tenant:2, isolation:3") == [
        ("multi-tenant", 2.0), ("isolation", 3.0)]  # fmt: skip
    for bad in ("", "chat:2", "multi-tenant", "multi-tenant:x", "isolation:0",
                "multi-tenant:2,multi-tenant:2"):  # fmt: skip
        with pytest.raises(ValueError):
            plan.parse_cells(bad)
    assert plan.parse_seeds("2,3,4") == [2, 3, 4]
    with pytest.raises(ValueError):
        plan.parse_seeds("2,2")
    assert plan.arm_order(0) == list(plan.ARMS)
    assert plan.arm_order(2)[0] == plan.ARMS[2] and plan.arm_order(7) == plan.arm_order(2)
    firsts = {plan.arm_order(s)[0] for s in range(len(plan.ARMS))}
    assert firsts == set(plan.ARMS)  # every arm runs first on some seed
    assert plan.cell_key("multi-tenant", 2.0) == "multi-tenant:2"


def test_schedules_hold_enough_requests() -> None:
    s = plan.sized_schedule("multi-tenant", 2.0, 0.5, 3, min_duration_s=20.0, min_requests=200,
                            max_model_len=1024)  # fmt: skip
    assert len(s.requests) >= 200 and s.rate_rps == pytest.approx(1.0)
    assert s.duration_s >= 200 / 1.0 * 0.9
    iso = plan.sized_schedule("isolation", 3.0, 0.5, 3, min_duration_s=20.0, min_requests=200,
                              max_model_len=1024)  # fmt: skip
    assert plan.counted("isolation", iso) >= 120  # well-behaved requests
    assert iso.rate_rps == pytest.approx(3.6 * 0.5)
    again = plan.sized_schedule("isolation", 3.0, 0.5, 3, min_duration_s=20.0,
                                min_requests=200, max_model_len=1024)  # fmt: skip
    assert [r.rid for r in again.requests] == [r.rid for r in iso.requests]  # seeded
    with pytest.raises(ValueError):
        plan.sized_schedule("multi-tenant", 1.0, 0.0, 1, min_duration_s=1, min_requests=1,
                            max_model_len=1024)  # fmt: skip


def test_sweeps_and_the_budget() -> None:
    sw = plan.sweeps(False, 4, 1.2345)
    assert [p["cap"] for p in sw[plan.CAP]] == [1, 2, 3, 4, 8]
    assert all(p["queue_timeout_s"] == 1.234 for p in sw[plan.CAP])
    assert [p["factor"] for p in sw[plan.BUCKET]] == [1.0, 1.5, 2.0]
    assert [p["cap"] for p in plan.sweeps(True, 4, 1.0)[plan.CAP]] == [2, 4]
    assert plan.tuned_on("multi-tenant", 3.0) == ("multi-tenant", 3.0)
    assert plan.tuned_on("multi-tenant", 1.0) == ("multi-tenant", 2.0)
    assert plan.tuned_on("isolation", 3.0) == ("multi-tenant", 2.0)
    est = plan.unit_estimate_s(200.0, 20.0)
    assert est == 200.0 + 20.0 + plan.RESTART_S
    assert plan.fits(est, 3000.0, 3600.0) and not plan.fits(est, 3400.0, 3600.0)
    assert plan.cell_fits(600.0, 5, 0.0, 3600.0)  # 50 min of arms in a fresh hour
    assert not plan.cell_fits(600.0, 5, 1000.0, 3600.0)  # not after 17 min: the next one
    assert plan.cell_fits(900.0, 5, 1000.0, 3600.0)  # 75 min never fits: arm by arm


def test_options_refuse_bad_values_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    a = parse_args([])
    assert a.model == "smollm2" and a.max_tokens == 256 and a.min_requests == 200
    assert a.seed_list == [2, 3, 4] and a.tune_seed == 1 and len(a.cell_list) == 4
    assert parse_args(["--model", "gemma"]).max_tokens == 96
    assert parse_args(["--short"]).seed_list == [2]
    for bad in (["--seeds", "1,2"], ["--cells", "chat:1"], ["--parallel", "0"],
                ["--duration", "nan"], ["--report", "/nonexistent/x.json"],
                ["--resume", "/nonexistent/dir/x.json"], ["--min-requests", "0"]):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            parse_args(bad)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "error:" in err[0], err  # one line
    with pytest.raises(SystemExit) as e:  # argparse's own refusal: exit 2 too
        parse_args(["--model", "llama"])
    assert e.value.code == 2


def test_help_names_the_short_defaults_and_duration(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default 20 s; --short 8 s)" in text
    assert "a plumbing run, not a verdict" in text and "about 12 min on 2 cores" in text


def test_resume_document_merges_and_saves_atomically(tmp_path: Path) -> None:
    doc = resume.new_doc({"model": "smollm2", "parallel": 4}, 1)
    resume.add_run(doc, "multi-tenant:2", 2, "none", {"goodput_ci95": (1.0, 2.0)})
    resume.add_sweep(doc, "multi-tenant:2", "concurrency-cap", {"cap": 2}, {"g": 1})
    assert resume.run_row(doc, "multi-tenant:2", 2, "none") == {"goodput_ci95": [1.0, 2.0]}
    assert resume.sweep_row(doc, "multi-tenant:2", "concurrency-cap", {"cap": 2}) == {"g": 1}
    assert resume.sweep_row(doc, "multi-tenant:2", "concurrency-cap", {"cap": 3}) is None
    path = tmp_path / "real.json"
    resume.save(path, doc)
    other = resume.new_doc({"model": "smollm2", "parallel": 4}, 1)
    resume.add_run(other, "multi-tenant:2", 2, "kvgate", {"x": 1})
    resume.close_cell(other, {"cell": "isolation:3", "seed": 2, "rows": []})
    merged = resume.save(path, other)  # the file's runs kept, the new ones added
    assert {r["arm"] for r in merged["runs"]} == {"none", "kvgate"}
    assert resume.finished(merged) == {("isolation:3", 2)}
    assert merged["sweeps"]["multi-tenant:2"][0]["params"] == {"cap": 2}
    assert json.loads(path.read_text()) == merged
    assert [p.name for p in tmp_path.iterdir()] == ["real.json"]  # no temporary left
    resume.close_cell(merged, {"cell": "multi-tenant:2", "seed": 2, "rows": []})
    assert merged["runs"] == []  # a closed cell's runs leave
    with pytest.raises(ValueError, match="parallel=4, not 8"):
        resume.check(merged, {"parallel": 8}, 1)
    with pytest.raises(ValueError, match="tuned on seed 1"):
        resume.check(merged, {}, 5)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        resume.load(tmp_path / "bad.json")
    assert resume.load(tmp_path / "none.json") is None
    a = resume.new_doc({}, 1)
    a["calibration"] = {"capacity_rps": 1.0}
    b = resume.new_doc({}, 1)
    b["calibration"] = {"capacity_rps": 2.0}
    with pytest.raises(ValueError, match="calibrations"):
        resume.merge(a, b)


def test_rerun_reopens_a_finished_cell_for_the_named_arms(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = resume.new_doc({"model": "smollm2"}, 1)
    rows = [{"arm": a, "g": i} for i, a in enumerate(plan.ARMS)]
    resume.close_cell(doc, {"cell": "multi-tenant:2", "seed": 2, "rows": rows})
    resume.close_cell(doc, {"cell": "multi-tenant:2", "seed": 3, "rows": rows})
    assert resume.reopen(doc, "multi-tenant:2", 4, ("kvgate",), "why") == []  # not finished
    got = resume.reopen(doc, "multi-tenant:2", 2, ("kvgate", "kvgate-empty"), "admission changed")
    assert got == ["kvgate", "kvgate-empty"]
    assert resume.finished(doc) == {("multi-tenant:2", 3)}  # the other seed untouched
    assert {r["arm"] for r in doc["runs"]} == {"none", "concurrency-cap", "token-bucket"}
    assert resume.run_row(doc, "multi-tenant:2", 2, "kvgate") is None  # to run again
    assert [(x["arm"], x["row"]["g"], x["why"]) for x in doc["replaced"]] == [
        ("kvgate", 3, "admission changed"), ("kvgate-empty", 4, "admission changed")]  # fmt: skip
    path = tmp_path / "real.json"
    resume.write(path, doc)  # over the file, not merged
    assert resume.load(path) == resume.jsonable(doc)
    later = resume.new_doc({"model": "smollm2"}, 1)
    resume.add_run(later, "multi-tenant:2", 2, "kvgate", {"arm": "kvgate", "g": 9})
    merged = resume.save(path, later)  # the replaced rows and the kept runs survive a merge
    assert len(merged["replaced"]) == 2 and len(merged["runs"]) == 4
    # the command line: --rerun names arms, needs a resume file, and a finished cell in it
    for bad, says in ((["--rerun", "kvgate,cap"], "not an arm"),
                      (["--rerun", ","], "at least one arm"),
                      (["--rerun", "kvgate"], "needs the --resume file"),
                      (["--rerun", "kvgate", "--resume", str(path), "--report", str(path)],
                       "give one of them")):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            parse_args(bad)
        assert e.value.code == 2 and says in capsys.readouterr().err
    assert parse_args(["--rerun", "kvgate", "--resume", str(path)]).rerun_arms == ("kvgate",)
    assert parse_args([]).rerun_arms == () and parse_args([]).commit is None
    assert main(["--rerun", "kvgate", "--resume", str(path), "--cells", "isolation:3"]) == 2
    assert "no finished cell of --cells/--seeds has kvgate" in capsys.readouterr().err
    assert resume.load(path) == merged  # refused: the file untouched


def test_limit_after_20_completions_and_the_trace_summary() -> None:
    trace = [(0.0, 4.0), (0.5, 4.0), (1.0, 3.0), (6.0, 2.0), (9.0, 2.0)]
    done = [7.0 + 0.1 * i for i in range(19)] + [5.0]  # the 20th to finish at 8.8 s
    s = limit_trace.summary(trace, done)
    assert s["limit_after_20_completions"] == 2.0 and s["completions"] == len(done)
    assert limit_trace.summary(trace, [1.0] * 20)["limit_after_20_completions"] == 3.0
    assert limit_trace.summary(trace, [1.0] * 19)["limit_after_20_completions"] is None
    assert (s["limit_first"], s["limit_last"], s["limit_min"], s["limit_max"]) == (4, 2, 2, 4)
    assert s["limit_changes"] == 2
    assert s["limit_mean"] == pytest.approx((4 * 1.0 + 3 * 5.0 + 2 * 3.0) / 9.0)
    assert s["limit_trace"][0] == [0.0, 4.0] and s["limit_trace"][-1] == [9.0, 2.0]
    long = [(i * 0.5, float(i % 3)) for i in range(1000)]
    thin = limit_trace.summary(long, [])["limit_trace"]
    assert len(thin) <= limit_trace.TRACE_POINTS + 1 and thin[-1] == [499.5, 0.0]
    assert limit_trace.summary([], [1.0] * 30)["limit_after_20_completions"] is None


def test_decode_table_from_bursts_and_the_profile() -> None:
    unloaded = [
        {"prompt_n": 100, "prompt_ms": 50.0, "predicted_n": 41, "predicted_per_token_ms": 20.1},
        {"prompt_n": 500, "prompt_ms": 250.0, "predicted_n": 41, "predicted_per_token_ms": 20.5},
    ]
    d_us = profile_fit.context_us_per_token(unloaded)
    assert d_us == pytest.approx(1.0)  # 0.4 ms over 400 tokens of context
    assert profile_fit.prefill_ms_per_token(unloaded) == pytest.approx(0.5)
    timing = {"prompt_n": 80, "predicted_n": 40}
    bursts = [
        profile_fit.burst_from_timings([{**timing, "predicted_per_token_ms": ms}] * k)
        for k, ms in ((1, 22.1), (1, 22.2), (1, 30.0), (2, 63.2), (2, 63.2), (2, 63.2),
                      (4, 78.4), (4, 78.4), (4, 78.4))
    ]  # fmt: skip
    table = profile_fit.decode_table(bursts, d_us)
    assert table[1] == pytest.approx(22.2 - 0.1)  # the median burst, less 100 tokens x 1 us
    assert table[2] == pytest.approx(63.0) and table[4] == pytest.approx(78.0)
    p = profile_fit.fit_profile("cpu", parallel=4, ctx=4096, unloaded=unloaded, bursts=bursts,
                                slo=Slo(2.0, 0.07, 0.5, 0.023))  # fmt: skip
    assert p.max_num_seqs == 4 and p.max_model_len == 1024 and p.slo == (2.0, 0.07)
    st = p.steptime()
    assert st.seconds(0, 2, 0) == pytest.approx(0.063)
    assert st.seconds(0, 3, 0) == pytest.approx((0.063 + 0.078) / 2)
    with pytest.raises(ValueError):
        profile_fit.decode_table([], 0.0)
    # A step the context correction drives to 0 or below, and no prefill measured: floored,
    # so the fitted profile is a valid one (its step times must be > 0).
    fast = [profile_fit.burst_from_timings([{**timing, "predicted_per_token_ms": 0.05}])]
    assert profile_fit.decode_table(fast, d_us) == {1: profile_fit.MIN_STEP_MS}
    q = profile_fit.fit_profile("cpu", parallel=1, ctx=256, unloaded=[], bursts=fast, slo=None)
    assert q.prefill_ms_per_token == profile_fit.MIN_STEP_MS


def test_rows_carry_intervals_and_per_request_vectors() -> None:
    sched = generate("isolation", 3.6, 20.0, 1, max_model_len=1024)
    records = []
    for i, req in enumerate(sched.requests):
        if i % 4 == 3:
            records.append(RequestRecord(req, REJECTED, None, None, req.arrival_s))
            continue
        fast = req.arrival_s + (0.5 if i % 4 else 5.0)  # one in four misses its TTFT
        records.append(RequestRecord(req, SERVED, req.arrival_s + (0.2 if i % 2 else 0.0),
                                     fast, fast + 1.0, 11))  # fmt: skip
    cfg = engine_config(4, 4096)
    run = RunResult(sched, "x", {}, records, 30.0, 0.0, 0, 0.0, SimEngine(cfg, constant_profile()))
    row = build_row(run, (2.0, 0.2), workload="isolation", load=3.0, arm="kvgate", seed=2,
                    profile="llama-server", extra={"cached_prompt_tokens": 0},
                    queue_waits_s={sched.requests[0].rid: 9.0})  # fmt: skip
    n = len(sched.requests)
    assert row["requests"] == n == len(row["good_tokens"]) == len(row["served_tokens"])
    assert sum(row["good_tokens"]) / row["span_s"] == pytest.approx(row["goodput_tokens_per_s"])
    lo, hi = row["goodput_ci95"]
    assert lo <= row["goodput_tokens_per_s"] <= hi
    assert row["well_behaved_requests"] == sum(1 for r in sched.requests if r.tenant != "noisy")
    assert 0 < row["well_behaved_wilson_lo"] < row["well_behaved_slo_attainment"]
    assert row["refused_share"] == pytest.approx(sum(1 for i in range(n) if i % 4 == 3) / n)
    assert row["queue_wait_p50_s"] in (0.0, 0.2)
    assert row["profile"] == "llama-server" and row["cached_prompt_tokens"] == 0


def test_an_isolation_alone_cell_is_isolation_without_the_noisy_tenant() -> None:
    """``isolation-alone``: the same seed's ``isolation`` schedule, the noisy tenant's requests
    taken out, run by the engine ungated and kvgate only, its baselines from multi-tenant:2."""
    assert plan.parse_cells("isolation-alone:3") == [("isolation-alone", 3.0)]
    kw = {"min_duration_s": 20.0, "min_requests": 200, "max_model_len": 1024}
    iso = plan.sized_schedule("isolation", 3.0, 0.5, 3, **kw)  # type: ignore[arg-type]
    alone = plan.sized_schedule("isolation-alone", 3.0, 0.5, 3, **kw)  # type: ignore[arg-type]
    quiet = [r.rid for r in iso.requests if r.tenant != NOISY_TENANT]
    assert [r.rid for r in alone.requests] == quiet and len(quiet) < len(iso.requests)
    assert alone.duration_s == iso.duration_s and plan.counted("isolation-alone", alone) >= 120
    assert plan.arms_of("isolation-alone") == (plan.NONE, plan.KVGATE)
    assert plan.arms_of("isolation") == plan.ARMS and plan.arms_of("multi-tenant") == plan.ARMS
    assert sorted(plan.arm_order(1, plan.arms_of("isolation-alone"))) == ["kvgate", "none"]
    assert plan.tuned_on("isolation-alone", 3.0) == ("multi-tenant", 2.0)
    assert plan.required("isolation-alone") == plan.required("isolation") == 120
    assert plan.base_workload("isolation-alone") == "isolation"


def test_a_rerun_holds_its_resume_file_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "real.json"
    doc = resume.new_doc({"model": "smollm2"}, 1)
    rows = [{"arm": a} for a in plan.ARMS]
    resume.close_cell(doc, {"cell": "multi-tenant:2", "seed": 2, "rows": rows})
    resume.write(path, doc)
    runs = [resume.hold(path, exclusive=False), resume.hold(path, exclusive=False)]  # runs share
    with pytest.raises(ValueError, match="another invocation runs on it"):
        resume.hold(path, exclusive=True)
    # --rerun refused while a run holds the file: nothing reopened, the file as it was
    assert main(["--rerun", "kvgate", "--resume", str(path), "--cells", "multi-tenant:2"]) == 2
    assert "another invocation runs on it" in capsys.readouterr().err
    assert resume.load(path) == resume.jsonable(doc)
    for fd in runs:
        os.close(fd)
    rerun = resume.hold(path, exclusive=True)
    with pytest.raises(ValueError, match="a --rerun invocation holds it"):
        resume.hold(path, exclusive=False)
    os.close(rerun)
    os.close(resume.hold(path, exclusive=True))  # released: free again


def test_llama_server_gets_one_thread_count() -> None:
    """The real-engine run asked for ``-t 1`` after the kit's ``-t 2`` (the last won): one
    ``-t``, the one asked for."""
    from kvgate_bench.kit.llamaserver import llama_args

    argv = llama_args("llama-server", "m.gguf", 8080, 4, 4096, "--cache-ram", "0", threads=1)
    assert argv.count("-t") == 1 and argv[argv.index("-t") + 1] == "1"
    assert argv[-2:] == ["--cache-ram", "0"] and argv[argv.index("--parallel") + 1] == "4"
    default = llama_args("llama-server", "m.gguf", 8080)
    assert default[default.index("-t") + 1] == "2"
