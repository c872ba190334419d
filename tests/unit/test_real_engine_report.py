"""``python -m kvgate_bench.real_engine --report FILE`` on resume files (no clock, no server):
its refusals, what it says is left, what it will not call a verdict, and ``--seeds`` /
``--cells``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvgate_bench.real_engine import plan, progress, resume
from kvgate_bench.real_engine.__main__ import main

PREFIX = "python -m kvgate_bench.real_engine: error: "


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("", "empty file"),
        ("  \n", "empty file"),
        ("[1", "not JSON"),
        ('{"kind": "other"}', "not a kvgate-real-engine resume file"),
        ('{"kind": "kvgate-real-engine", "version": 1}', "'config' is missing or not an object"),
        ('{"kind": "kvgate-real-engine", "version": 7}', "version 7, not 1"),
        (
            json.dumps({**resume.new_doc({}, 1), "cells": [{"cell": "multi-tenant:2"}]}),
            "cells[0] lacks its cell, seed or rows",
        ),
        (
            json.dumps(
                {
                    **resume.new_doc({}, 1),
                    "cells": [
                        {
                            "cell": "multi-tenant:2",
                            "seed": 2,
                            "rows": [{"arm": a, "good_tokens": [1.0]} for a in ("none", "kvgate")],
                        }
                    ],
                }
            ),
            "malformed resume file (KeyError: 'span_s')",
        ),
    ],
)
def test_a_bad_file_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, words: str
) -> None:
    path = tmp_path / "real.json"
    path.write_text(text)
    assert main(["--report", str(path)]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith(f"{PREFIX}--report {path}: ")
    assert out.err.count("\n") == 1 and words in out.err, out.err


def test_a_missing_file_is_refused_the_same_way(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--report", str(tmp_path / "absent.json")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == f"{PREFIX}--report {tmp_path / 'absent.json'}: no such file\n"


CONFIG = {"model": "smollm2", "parallel": 4, "ctx": 4096, "threads": 1, "max_tokens": 256,
          "short": False, "min_requests": 200, "duration_s": 60.0, "drain_s": 20.0}  # fmt: skip
SLO = {"ttft_s": 3.0, "tpot_s": 0.04, "unloaded_ttft_p50_s": 0.8, "unloaded_tpot_p50_s": 0.013}


def _doc(**config: object) -> dict[str, Any]:
    doc = resume.new_doc({**CONFIG, **config}, 1)
    doc["calibration"] = {"slo": SLO, "capacity_rps": 0.16}
    return doc


def _unit_s(workload: str, load: float, seed: int) -> float:
    sched = plan.sized_schedule(workload, load, 0.16, seed, min_duration_s=60.0,
                                min_requests=200, max_model_len=1024)  # fmt: skip
    return plan.unit_estimate_s(sched.duration_s, 20.0)


def test_work_left_counts_sweeps_cells_and_hours() -> None:
    doc = _doc()
    settings = plan.sweeps(False, 4, SLO["ttft_s"])
    cap = settings[plan.CAP]
    for p in cap[:3]:  # three of the cap sweep's settings ran on the tune seed
        resume.add_sweep(doc, "multi-tenant:2", plan.CAP, p, {"goodput_tokens_per_s": 1.0})
    resume.add_run(doc, "multi-tenant:2", 2, plan.NONE, {"requests": 200})  # one arm of a cell
    cells = [("multi-tenant", 2.0), ("isolation", 3.0)]
    left = progress.work_left(doc, cells, [2, 3], CONFIG)
    n_sweeps = sum(len(x) for x in settings.values())
    assert left["planned"] == 4 and left["missing"] == [
        "multi-tenant:2@2", "isolation:3@2", "multi-tenant:2@3", "isolation:3@3"]  # fmt: skip
    # isolation:3 is tuned by multi-tenant:2's sweep: one tuning cell.
    assert left["sweeps"] == {"multi-tenant:2": {"done": 3, "left": n_sweeps - 3, "tuned": False}}
    assert left["arm_runs"] == (n_sweeps - 3) + 4 + 5 + 5 + 5
    want = (n_sweeps - 3) * _unit_s("multi-tenant", 2.0, 1) + 4 * _unit_s("multi-tenant", 2.0, 2)
    want += 5 * (_unit_s("isolation", 3.0, 2) + _unit_s("multi-tenant", 2.0, 3)
                 + _unit_s("isolation", 3.0, 3))  # fmt: skip
    assert left["seconds"] == pytest.approx(want)
    text = progress.lines(left, 1)
    assert text[0].startswith("to do: 4 of 4 cells x seeds planned not finished (multi-tenant:2@2")
    assert text[1] == f"  tune seed 1, multi-tenant:2: 3 sweep runs done, {n_sweeps - 3} left"
    assert text[2].startswith(f"  left: {left['arm_runs']} arm runs, about {want / 3600:.1f} h")
    # Tuned: no sweep left; not calibrated: the runs counted, the hours unknown.
    doc["tuned"]["multi-tenant:2"] = {plan.CAP: cap[0]}
    assert progress.work_left(doc, cells[:1], [2], CONFIG)["arm_runs"] == 4
    doc["calibration"] = None
    bare = progress.work_left(doc, cells[:1], [2], CONFIG)
    assert bare["arm_runs"] == 4 and bare["seconds"] is None
    assert progress.left_text(4, None) == "left: 4 arm runs, about unknown until calibrated"


def test_planned_cells_and_seeds() -> None:
    doc = _doc()
    cells, seeds = progress.planned(doc)
    assert cells == plan.parse_cells(plan.DEFAULT_CELLS) and seeds == [2, 3, 4]
    assert progress.planned(_doc(short=True)) == ([("multi-tenant", 2.0)], [2])
    resume.add_run(doc, "isolation:2", 7, plan.NONE, {})  # a cell and seed outside the defaults
    cells, seeds = progress.planned(doc)
    assert cells[-1] == ("isolation", 2.0) and seeds == [2, 3, 4, 7]
    # What a run asked adds to the verdict's plan, never shrinks it.
    doc["invocations"].append({"cells": ["multi-tenant:3", "isolation-alone:3"], "seeds": [5]})
    cells, seeds = progress.planned(doc)
    default = plan.parse_cells(plan.DEFAULT_CELLS)
    assert cells == [*default, ("isolation-alone", 3.0), ("isolation", 2.0)]
    assert seeds == [2, 3, 4, 5, 7]
    assert progress.planned(doc, [("multi-tenant", 1.0)], [9]) == ([("multi-tenant", 1.0)], [9])


def test_the_report_says_what_is_left(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = _doc()
    path = tmp_path / "real.json"
    resume.save(path, doc)
    assert main(["--report", str(path), "--cells", "multi-tenant:2", "--seeds", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    n = sum(len(x) for x in plan.sweeps(False, 4, SLO["ttft_s"]).values())
    assert "to do: 1 of 1 cells x seeds planned not finished (multi-tenant:2@2)" in out
    assert f"  tune seed 1, multi-tenant:2: 0 sweep runs done, {n} left" in out
    hours = (n * _unit_s("multi-tenant", 2.0, 1) + 5 * _unit_s("multi-tenant", 2.0, 2)) / 3600
    assert any(x.startswith(f"  left: {n + 5} arm runs, about {hours:.1f} h") for x in out)
    # Nothing finished: not a verdict; the seed and cell asked are absent, and said so.
    assert out[0].startswith("not a verdict: baselines tuned on seed 1, reported on seeds -;")
    assert "  seeds asked but absent from the file (no finished cell), not reported: 2" in out
    assert "  cells asked but not finished on the report seeds, not reported: multi-tenant:2" in out
