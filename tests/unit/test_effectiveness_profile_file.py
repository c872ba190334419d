"""``--profile FILE``: the effectiveness benchmark and kvgate-sim on a JSON engine profile."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from kvgate_bench.effectiveness.__main__ import main as effectiveness_main
from kvgate_bench.effectiveness.arms.registry import candidates
from kvgate_bench.effectiveness.model.engines import engine_of, unloaded_slo
from kvgate_bench.sim.cli import build_parser, config_from_args
from kvgate_bench.sim.cli import main as sim_main
from kvgate_bench.sim.profile_file import load_profile, write_profile
from tests.conftest import REPO

EXAMPLE = REPO / "examples" / "profiles" / "llama-server-cpu-4slot.json"


def test_the_benchmark_runs_on_a_profile_file(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    argv = ["--profile", str(EXAMPLE), "--short", "--workloads", "conversation", "--loads",
            "1", "--seeds", "1", "--arms", "none,concurrency-cap", "--jobs", "1",
            "--json", str(out)]  # fmt: skip
    assert effectiveness_main(argv) == 0
    doc: dict[str, Any] = json.loads(out.read_text())
    rows = doc["results"]
    assert {r["arm"] for r in rows} == {"none", "concurrency-cap"}
    for r in rows:
        assert r["profile"] == "cpu-4slot"
        assert math.isfinite(r["goodput_tokens_per_s"]) and r["goodput_tokens_per_s"] >= 0
        assert r["requests"] > 0
    meta = doc["meta"]
    assert meta["profile"] == "cpu-4slot" and meta["profile_file"] == str(EXAMPLE)
    assert meta["slo"] == {"ttft_s": 2.0, "tpot_s": 0.07, "source": "file"}
    assert meta["engine_profile"] == load_profile(EXAMPLE).to_json()
    # The cap is swept within the engine's four slots, not the 256-sequence engine's 32-192.
    caps = {s["params"]["cap"] for s in doc["sweeps"] if s["arm"] == "concurrency-cap"}
    assert caps == {1, 2, 3}


def test_a_file_without_slo_gets_the_unloaded_multiple(tmp_path: Path) -> None:
    prof = load_profile(EXAMPLE).model_copy(update={"slo": None})
    path = tmp_path / "no-slo.json"
    write_profile(prof, path)
    eng = engine_of(str(path))
    # The median unloaded prompt (320 tokens) prefills in one 512-token chunk at 4 ms a token,
    # then one sequence decodes at 22 ms a step: 4 x 1.28 s and 3 x 22 ms.
    assert eng.slo == pytest.approx((4 * 1.28, 3 * 0.022))
    assert eng.slo == unloaded_slo(prof.steptime(), prof.engine_config())
    assert eng.slo_source == "unloaded" and eng.config == prof.engine_config()
    # A built-in keeps the benchmark's fixed SLO and engine shape.
    h100 = engine_of("h100-llama3-8b")
    assert h100.slo is None and h100.score_slo == (0.5, 0.05)
    assert h100.config.max_num_seqs == 256 and h100.meta() == {"profile": "h100-llama3-8b"}


def test_cap_candidates_scale_with_the_engine() -> None:
    full = [c["cap"] for c in candidates("concurrency-cap", {}, False, 4)]
    assert sorted(set(full)) == [1, 2, 3, 4]
    assert {c["cap"] for c in candidates("concurrency-cap", {}, False)} == {
        16, 32, 48, 64, 96, 128, 160, 192, 256,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--profile", "nope.json"], "neither a built-in profile"),
        (["--profile", "{bad}"], "engine profile"),
        (["--profile", str(EXAMPLE), "--replicas", "2"], "--replicas takes a built-in"),
    ],
)
def test_bad_profiles_exit_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], words: str
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**load_profile(EXAMPLE).to_json(), "max_num_seqs": 0}))
    argv = [str(bad) if a == "{bad}" else a for a in argv]
    assert effectiveness_main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and "Traceback" not in err
    if "{bad}" in argv or str(bad) in argv:
        assert str(bad) in err and "max_num_seqs" in err


def test_kvgate_sim_takes_a_profile_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = config_from_args(build_parser().parse_args(["--profile", str(EXAMPLE)]))
    prof = load_profile(EXAMPLE)
    assert cfg.profile == "cpu-4slot" and cfg.steptime == prof.steptime()
    assert cfg.engine_config() == prof.engine_config()
    # An engine-shape flag overrides the file's value.
    args = build_parser().parse_args(["--profile", str(EXAMPLE), "--max-num-seqs", "2"])
    assert config_from_args(args).engine_config().max_num_seqs == 2
    help_text = " ".join(build_parser().format_help().split())
    assert "its engine shape (KV pool, block size, max model length, sequences" in help_text
    assert "wherever the matching flag below is not given" in help_text
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "x", "speed": 1}')
    assert sim_main(["--profile", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(bad) in err and "speed" in err
    assert sim_main(["--profile", str(tmp_path / "absent.json")]) == 2
    assert "neither a built-in" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text_of", "field"),
    [
        (lambda t: t.replace('"1": 22', '"1": 0'), "decode_step_ms.1"),
        (
            lambda t: t.replace('"prefill_ms_per_token": 4.0', '"prefill_ms_per_token": 0'),
            "prefill_ms_per_token",
        ),
        (lambda t: t.replace('"max_num_seqs": 4', '"max_num_seqs": "4"'), "max_num_seqs"),
        (lambda t: t.replace('"1": 22', '"1": "22"'), "decode_step_ms.1"),
        (lambda t: t.replace('"4": 78', '"4.0": 78'), "decode_step_ms"),
        (lambda t: t.replace('"2": 63', '" 2": 63'), "decode_step_ms"),
        (lambda t: t.replace('"4": 78', '"4": 78, "2": 70'), "decode_step_ms"),
    ],
)
def test_both_commands_refuse_a_bad_table_with_exit_2_and_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text_of: Any, field: str
) -> None:
    bad = tmp_path / "bad.json"
    text = text_of(EXAMPLE.read_text())
    assert text != EXAMPLE.read_text()
    bad.write_text(text)
    for main in (effectiveness_main, sim_main):
        assert main(["--profile", str(bad)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err
        assert str(bad) in err and f"{field}: " in err, err
