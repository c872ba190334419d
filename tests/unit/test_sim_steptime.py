"""The step-time model t = a + b*P + c*D + d*K, its profiles, and how kvgate-sim picks them."""

from __future__ import annotations

import pytest

from kvgate_bench.sim.cli import build_parser, config_from_args
from kvgate_bench.sim.config import SimConfig
from kvgate_bench.sim.engine import SimEngine
from kvgate_bench.sim.sequences import EngineConfig
from kvgate_bench.sim.steptime import (
    LLAMA3_8B_KV_TOKENS,
    PROFILE_NAMES,
    PROFILES,
    StepTimeModel,
    constant_profile,
    profile,
)


@pytest.mark.parametrize(
    ("name", "a", "b", "c", "d"),
    [
        ("h100-llama3-8b", 7.5e-3, 33e-6, 4.4e-6, 0.076e-6),
        ("a100-llama3-8b", 12e-3, 100e-6, 20e-6, 0.125e-6),
    ],
)
def test_realistic_profiles_follow_the_formula(
    name: str, a: float, b: float, c: float, d: float
) -> None:
    model = profile(name)
    assert model.name == name and model.chunked_prefill
    assert model.kv_capacity_tokens == LLAMA3_8B_KV_TOKENS == 467_280
    assert model.seconds(0, 0, 0) == pytest.approx(a)
    assert model.seconds(1000, 0, 0) == pytest.approx(a + 1000 * b)
    assert model.seconds(0, 64, 0) == pytest.approx(a + 64 * c)
    assert model.seconds(0, 0, 100_000) == pytest.approx(a + 100_000 * d)
    assert model.seconds(512, 200, 300_000) == pytest.approx(a + 512 * b + 200 * c + 300_000 * d)


def test_h100_magnitudes() -> None:
    h100 = PROFILES["h100-llama3-8b"]
    # A 2048-token prefill alone: 7.5 ms + 2048 x 33 us = 75.08 ms.
    assert h100.seconds(2048, 0, 0) == pytest.approx(0.075084, abs=1e-9)
    # 256 decodes at 1000 tokens of context: 7.5 + 1.13 + 19.5 ms = 28.1 ms per step.
    assert h100.seconds(0, 256, 256_000) == pytest.approx(0.028082, abs=1e-6)


def test_constant_profile_is_the_old_step_time() -> None:
    model = constant_profile(decode_ms=4.0, prefill_us_per_token=20.0)
    assert not model.chunked_prefill and model.kv_capacity_tokens == 65536
    for prefill in (0, 1, 100, 8192):
        # The old SimConfig.step_duration_s: decode_ms / 1e3 + prefill * us / 1e6.
        assert model.seconds(prefill, 17, 5000) == pytest.approx(4e-3 + prefill * 20e-6)
    assert profile("constant", 2.0, 0.0).seconds(999, 5, 5) == pytest.approx(2e-3)


def test_unknown_profile_and_negative_coefficients_raise() -> None:
    with pytest.raises(ValueError, match="unknown profile"):
        profile("tpu-v5")
    with pytest.raises(ValueError, match=">= 0"):
        StepTimeModel("bad", a_s=-1.0)
    with pytest.raises(ValueError):
        StepTimeModel("bad", a_s=0.0, kv_capacity_tokens=0)
    assert PROFILE_NAMES[0] == "constant" and set(PROFILE_NAMES[1:]) == set(PROFILES)


def test_engine_reports_the_modelled_duration() -> None:
    h100 = PROFILES["h100-llama3-8b"]
    cfg = EngineConfig(num_gpu_blocks=1000, block_size=16, max_model_len=4096,
                       max_num_batched_tokens=512, chunked_prefill=True)  # fmt: skip
    eng = SimEngine(cfg, h100)
    eng.submit("a", prompt_tokens=100, max_tokens=3)
    r = eng.step()  # whole 100-token prefill, first token
    assert r.prefill_tokens == 100 and r.decode_seqs == 0
    assert r.duration_s == pytest.approx(h100.seconds(100, 0, 0))
    r = eng.step()  # one decode with 101 tokens of context
    assert (r.prefill_tokens, r.decode_seqs, r.context_tokens) == (0, 1, 101)
    assert r.duration_s == pytest.approx(7.5e-3 + 4.4e-6 + 101 * 0.076e-6)
    assert SimEngine(cfg).steptime.name == "constant"  # the default model


def test_sim_config_resolves_the_profile() -> None:
    old = SimConfig()
    assert old.steptime == constant_profile(10.0, 20.0)
    assert old.kv_tokens == 65536 and old.num_gpu_blocks == 4096
    ec = old.engine_config()
    assert not ec.chunked_prefill and ec.max_num_batched_tokens == 8192

    h100 = SimConfig(profile="h100-llama3-8b")
    assert h100.steptime is PROFILES["h100-llama3-8b"]
    assert h100.num_gpu_blocks == 29205
    ec = h100.engine_config()
    assert ec.chunked_prefill and ec.max_num_batched_tokens == 8192
    assert SimConfig(profile="h100-llama3-8b", kv_capacity_tokens=1600).num_gpu_blocks == 100
    # Chunked prefill lets the budget be smaller than max_model_len.
    small = SimConfig(profile="a100-llama3-8b", max_model_len=32768, max_num_batched_tokens=2048)
    assert small.engine_config().max_num_batched_tokens == 2048
    with pytest.raises(ValueError):
        SimConfig(max_model_len=32768, max_num_batched_tokens=2048).engine_config()


def test_cli_flags() -> None:
    args = build_parser().parse_args([])
    cfg = config_from_args(args)
    assert (cfg.profile, cfg.kv_capacity_tokens, cfg.output_lengths, cfg.output_seed) == (
        "constant", None, "max", 0,
    )  # fmt: skip
    assert cfg.kv_tokens == 65536
    args = build_parser().parse_args(
        ["--profile", "h100-llama3-8b", "--output-lengths", "lognormal", "--output-seed", "7",
         "--max-num-batched-tokens", "4096"]
    )  # fmt: skip
    cfg = config_from_args(args)
    assert cfg.profile == "h100-llama3-8b" and cfg.kv_tokens == 467_280
    assert cfg.output_lengths == "lognormal" and cfg.output_seed == 7
    assert cfg.engine_config().max_num_batched_tokens == 4096
    with pytest.raises(ValueError, match="neither a built-in"):
        config_from_args(build_parser().parse_args(["--profile", "nope"]))


# The decode table: llama-server on CPU, 22 ms with one sequence, 63 with two, 78 with four.
CPU = StepTimeModel(
    "cpu", a_s=0.0, b_s=4e-3, d_s=1e-7, decode_table=((1, 0.022), (2, 0.063), (4, 0.078))
)


@pytest.mark.parametrize(
    ("decodes", "seconds"),
    [
        (1, 0.022),  # on a point
        (2, 0.063),
        (3, 0.0705),  # halfway between 2 and 4
        (4, 0.078),
        (6, 0.093),  # past the last point: the line through (2, 63) and (4, 78), 7.5 ms a sequence
        (12, 0.138),
    ],
)
def test_decode_table_interpolates_and_extends_from_the_last_two_points(
    decodes: int, seconds: float
) -> None:
    assert CPU.decode_seconds(decodes) == pytest.approx(seconds)
    assert CPU.seconds(0, decodes, 0) == pytest.approx(seconds)
    # Prefill and context costs add to the table's value.
    assert CPU.seconds(100, decodes, 5000) == pytest.approx(seconds + 0.4 + 5e-4)


def test_decode_table_edges() -> None:
    # A prefill-only step costs b*P with no fixed part; an empty step costs nothing.
    assert CPU.seconds(100, 0, 0) == pytest.approx(0.4)
    assert CPU.seconds(0, 0, 0) == 0.0
    # Below the first point: the first point's value.
    late = StepTimeModel("late", a_s=0.0, decode_table=((4, 0.05), (8, 0.07)))
    assert late.decode_seconds(1) == late.decode_seconds(4) == pytest.approx(0.05)
    # One point: constant at every batch size.
    one = StepTimeModel("one", a_s=0.0, decode_table=((2, 0.03),))
    assert [one.decode_seconds(n) for n in (1, 2, 50)] == [0.03, 0.03, 0.03]
    # A table that falls at its end is held at its last value, never extended downwards.
    falling = StepTimeModel("falling", a_s=0.0, decode_table=((1, 0.04), (2, 0.03)))
    assert falling.decode_seconds(2) == falling.decode_seconds(10) == pytest.approx(0.03)
    assert falling.decode_seconds(1) == pytest.approx(0.04)


@pytest.mark.parametrize(
    ("table", "match"),
    [
        (((2, 0.01), (1, 0.02)), "sorted"),
        (((1, 0.01), (1, 0.02)), "sorted"),
        (((0, 0.01),), ">= 1"),
        (((1, -0.01),), "finite"),
        (((1, float("nan")),), "finite"),
    ],
)
def test_bad_decode_tables_raise(table: tuple[tuple[int, float], ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StepTimeModel("bad", a_s=0.0, decode_table=table)


def test_a_decode_table_replaces_a_and_c() -> None:
    with pytest.raises(ValueError, match="must be 0"):
        StepTimeModel("bad", a_s=0.01, decode_table=((1, 0.02),))
    with pytest.raises(ValueError, match="must be 0"):
        StepTimeModel("bad", a_s=0.0, c_s=1e-6, decode_table=((1, 0.02),))
    with pytest.raises(ValueError, match="no decode table"):
        PROFILES["h100-llama3-8b"].decode_seconds(1)
    # Without a table the built-in profiles keep their linear formula exactly.
    h100 = PROFILES["h100-llama3-8b"]
    assert h100.decode_table == ()
    assert (
        h100.seconds(512, 200, 300_000) == 7.5e-3 + 33e-6 * 512 + 4.4e-6 * 200 + 0.076e-6 * 300_000
    )
