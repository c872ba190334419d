"""JSON engine profiles: validation, the step-time model and engine they give, the round trip."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvgate_bench.sim.engine import SimEngine
from kvgate_bench.sim.profile_file import EngineProfile, load_profile, write_profile
from tests.conftest import REPO

EXAMPLE = REPO / "examples" / "profiles" / "llama-server-cpu-4slot.json"


def _raw() -> dict[str, Any]:
    return {
        "name": "cpu-4slot", "max_num_seqs": 4, "kv_capacity_tokens": 16384, "block_size": 16,
        "max_model_len": 4096, "prefill_chunk_tokens": 512, "prefill_ms_per_token": 4.0,
        "decode_step_ms": {"1": 22, "2": 63, "4": 78}, "context_us_per_token": 0.0,
        "slo": {"ttft_s": 2.0, "tpot_s": 0.07},
    }  # fmt: skip


def test_the_shipped_example_loads() -> None:
    p = load_profile(EXAMPLE)
    assert p == EngineProfile.model_validate(_raw())
    assert p.name == "cpu-4slot" and p.slo == (2.0, 0.07)
    assert p.decode_step_ms == {1: 22.0, 2: 63.0, 4: 78.0}


def test_steptime_and_engine_config() -> None:
    p = EngineProfile(
        name="gpu", max_num_seqs=64, kv_capacity_tokens=100_000, block_size=16,
        max_model_len=8192, prefill_chunk_tokens=2048, prefill_ms_per_token=0.05,
        decode_step_ms={8: 12.0, 1: 8.0}, context_us_per_token=0.1,
    )  # fmt: skip
    assert list(p.decode_step_ms) == [1, 8]  # kept sorted
    st = p.steptime()
    assert st.name == "gpu" and st.chunked_prefill and st.kv_capacity_tokens == 100_000
    assert st.decode_table == ((1, 0.008), (8, 0.012))
    assert (st.a_s, st.c_s) == (0.0, 0.0)
    # table(2) = 8 + 4/7 ms; 100 prefill tokens at 50 us; 1000 context tokens at 0.1 us.
    assert st.seconds(100, 2, 1000) == pytest.approx(8e-3 + 4e-3 / 7 + 5e-3 + 1e-4)
    cfg = p.engine_config()
    assert cfg.num_gpu_blocks == 6250 and cfg.block_size == 16  # 100,000 // 16
    assert (cfg.max_num_seqs, cfg.max_model_len, cfg.max_num_batched_tokens) == (64, 8192, 2048)
    assert cfg.chunked_prefill
    assert p.slo is None and "slo" not in p.to_json()


def test_the_engine_runs_on_a_profile() -> None:
    p = load_profile(EXAMPLE)
    eng = SimEngine(p.engine_config(), p.steptime())
    for i in range(6):
        eng.submit(f"r{i}", prompt_tokens=600, max_tokens=2)
    r = eng.step()  # 512-token budget: one chunk of r0's prompt, nothing decodes
    assert (r.prefill_tokens, r.decode_seqs) == (512, 0)
    assert r.duration_s == pytest.approx(512 * 4e-3)
    assert len(eng.running) <= 4


def test_round_trip(tmp_path: Path) -> None:
    p = EngineProfile.model_validate(_raw())
    path = tmp_path / "p.json"
    write_profile(p, path)
    assert load_profile(path) == p
    assert json.loads(path.read_text()) == p.to_json()
    assert EngineProfile(**p.to_json()) == p
    assert hash(load_profile(path)) == hash(p)
    no_slo = p.model_copy(update={"slo": None})
    write_profile(no_slo, path)
    assert load_profile(path).slo is None
    with pytest.raises(ValueError):  # frozen
        p.max_num_seqs = 8  # type: ignore[misc]


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"decode_step_ms": {}}, "decode_step_ms", "at least one"),
        ({"decode_step_ms": {"0": 5}}, "decode_step_ms", "batch size '0' is not an integer"),
        ({"decode_step_ms": {"two": 5}}, "decode_step_ms", "batch size 'two' is not"),
        ({"decode_step_ms": {"1.5": 5}}, "decode_step_ms", "batch size '1.5' is not"),
        ({"decode_step_ms": {"4.0": 5}}, "decode_step_ms", "batch size '4.0' is not"),
        ({"decode_step_ms": {" 2": 5}}, "decode_step_ms", "batch size ' 2' is not"),
        ({"decode_step_ms": {"02": 5}}, "decode_step_ms", "batch size '02' is not"),
        ({"decode_step_ms": {"1": -1}}, "decode_step_ms.1", "greater than 0"),
        ({"decode_step_ms": {"1": 0}}, "decode_step_ms.1", "greater than 0"),
        ({"decode_step_ms": {"1": "22"}}, "decode_step_ms.1", "valid number, got '22'"),
        ({"prefill_ms_per_token": 0}, "prefill_ms_per_token", "greater than 0"),
        ({"prefill_ms_per_token": "4.0"}, "prefill_ms_per_token", "valid number, got '4.0'"),
        ({"prefill_ms_per_token": float("inf")}, "prefill_ms_per_token", "finite"),
        ({"context_us_per_token": -1}, "context_us_per_token", "greater than or equal to 0"),
        ({"context_us_per_token": "0"}, "context_us_per_token", "valid number, got '0'"),
        ({"max_num_seqs": 0}, "max_num_seqs", "greater than or equal to 1"),
        ({"max_num_seqs": "4"}, "max_num_seqs", "valid integer, got '4'"),
        ({"max_num_seqs": True}, "max_num_seqs", "true/false"),
        ({"block_size": 2.5}, "block_size", "valid integer, got 2.5"),
        ({"max_model_len": 4096.0}, "max_model_len", "valid integer, got 4096.0"),
        ({"name": 7}, "name", "valid string, got 7"),
        ({"kv_capacity_tokens": 8}, "profile", "must hold one block"),
        ({"name": ""}, "name", "at least 1"),
        ({"slo": {"ttft_s": 1.0}}, "slo", "missing ['tpot_s']"),
        ({"slo": {"ttft_s": 1.0, "tpot_s": 0.05, "p": 9}}, "slo", "unknown ['p']"),
        ({"slo": {"ttft_s": 1.0, "tpot_s": 0}}, "slo", "tpot_s must be"),
        ({"slo": 2.0}, "slo", "ttft_s"),
        ({"speed": "fast"}, "speed", "not permitted"),
    ],
)
def test_bad_files_name_the_file_and_the_field(
    tmp_path: Path, change: dict[str, Any], field: str, words: str
) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({**_raw(), **change}))
    with pytest.raises(ValueError) as e:
        load_profile(path)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg
    assert f"{field}: " in msg and words in msg


def test_a_zero_context_cost_is_allowed_and_python_callers_may_use_int_keys() -> None:
    p = EngineProfile.model_validate(
        {**_raw(), "context_us_per_token": 0, "prefill_ms_per_token": 1}
    )
    assert p.context_us_per_token == 0.0 and p.prefill_ms_per_token == 1.0
    assert EngineProfile.model_validate(
        {**_raw(), "decode_step_ms": {2: 5.0, 1: 3}}
    ).decode_step_ms == {1: 3.0, 2: 5.0}
    with pytest.raises(ValueError, match="batch size 2 given twice"):
        EngineProfile.model_validate({**_raw(), "decode_step_ms": {2: 5.0, "2": 6.0}})


def test_a_key_given_twice_in_the_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "twice.json"
    text = json.dumps(_raw())
    path.write_text(text.replace('"4": 78', '"4": 78, "2": 70'))
    with pytest.raises(ValueError) as e:
        load_profile(path)
    assert str(path) in str(e.value) and "decode_step_ms: batch size '2' given twice" in str(
        e.value
    )
    path.write_text(text.replace('"block_size": 16', '"block_size": 16, "block_size": 32'))
    with pytest.raises(ValueError, match="block_size: given twice"):
        load_profile(path)


def test_missing_field_unreadable_and_non_json_files(tmp_path: Path) -> None:
    raw = _raw()
    del raw["decode_step_ms"]
    path = tmp_path / "p.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"decode_step_ms: Field required"):
        load_profile(path)
    with pytest.raises(ValueError, match="cannot read"):
        load_profile(tmp_path / "absent.json")
    path.write_text("{nope")
    with pytest.raises(ValueError, match="not JSON"):
        load_profile(path)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        load_profile(path)
