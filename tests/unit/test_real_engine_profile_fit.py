"""The real-engine profile fit (:mod:`kvgate_bench.real_engine.profile_fit`), pure: bursts whose
earlier sequences carry the later prompts' prefill, the stall-free decode table, the prefill
cost under load pooled with the unloaded one, and the refit of a stored calibration."""

from __future__ import annotations

import pytest

from kvgate_bench.real_engine import profile_fit as pf
from kvgate_bench.real_engine.calibration_run import calibration_text

#: A synthetic engine: table(k) ms, prefill ms/token, no context cost.
TABLE = {1: 10.0, 2: 20.0, 3: 30.0, 4: 35.0}
PREFILL = 5.0
OUT = 48


def burst(k: int, prompt: int, joined: list[int]) -> pf.Burst:
    """k equal requests of ``prompt`` tokens on the synthetic engine, admitted in groups of
    ``joined`` sizes (sum k, first group first): each group's decode carries the prefill of
    every later group's prompts, spread over its ``OUT`` tokens."""
    assert sum(joined) == k
    per: list[float] = []
    for n, size in enumerate(joined):
        later = sum(joined[n + 1 :]) * prompt * PREFILL
        per += [TABLE[k] + later / OUT] * size
    return pf.Burst(k, tuple([prompt + OUT / 2] * k), tuple(per), OUT)


def unloaded(prompt: int, out: int = 30) -> dict[str, float]:
    return {
        "prompt_n": prompt,
        "prompt_ms": PREFILL * prompt,
        "predicted_n": out,
        "predicted_per_token_ms": TABLE[1],
    }


def test_the_stall_free_group_is_the_fastest() -> None:
    b = pf.Burst(4, (195.0,) * 4, (94.46, 40.0, 40.003, 40.007))
    assert pf.groups(b) == [[1, 2, 3], [0]]
    assert pf.stall_free_ms(b) == pytest.approx(40.003, abs=1e-3)
    assert pf.stall_free_ms(pf.Burst(1, (100.0,), (12.0,))) == 12.0


def test_stall_prefill_recovers_the_later_prompts_prefill_cost() -> None:
    ms, tokens = pf.stall_prefill([burst(4, 100, [1, 3])])
    assert tokens == 300 and ms == pytest.approx(300 * PREFILL)
    # three groups: the first carries both later ones, the second the last
    ms, tokens = pf.stall_prefill([burst(3, 100, [1, 1, 1])])
    assert tokens == 100 + 100 + 100 and ms == pytest.approx(300 * PREFILL)
    assert pf.stall_prefill([burst(2, 100, [2])]) == (0.0, 0.0)


def test_the_decode_table_leaves_the_prefill_stalls_out() -> None:
    bursts = [burst(k, 150, j) for k, j in ((1, [1]), (2, [1, 1]), (3, [2, 1]), (4, [1, 3]))]
    assert pf.decode_table(bursts, 0.0) == pytest.approx(TABLE)
    # the old fit (the mean of all k) counted the stalls into the step
    assert sum(bursts[3].per_token_ms) / 4 > 1.3 * TABLE[4]


def test_the_prefill_cost_pools_unloaded_and_loaded_tokens() -> None:
    u = [unloaded(66), unloaded(300)]
    assert pf.prefill_ms_per_token(u) == pytest.approx(PREFILL)
    slow = pf.Burst(2, (124.0, 124.0), (20.0 + 2 * 100 * PREFILL / OUT, 20.0), OUT)
    # 366 unloaded tokens at 5 ms, 100 loaded at 10 ms
    want = (366 * PREFILL + 100 * 2 * PREFILL) / 466
    assert pf.prefill_ms_per_token(u, [slow]) == pytest.approx(want)
    assert pf.prefill_ms_per_token([]) == 0.0


def test_fit_profile_recovers_the_synthetic_engine() -> None:
    bursts = [burst(k, p, j) for k in range(1, 5) for p, j in
              ((120, [k]), (160, [1, k - 1] if k > 1 else [1]), (200, [k]))]  # fmt: skip
    loads = [unloaded(x) for x in (66, 156, 315)]
    p = pf.fit_profile("synthetic", parallel=4, ctx=4096, unloaded=loads, bursts=bursts, slo=None)
    assert p.decode_step_ms == pytest.approx(TABLE)
    assert p.prefill_ms_per_token == pytest.approx(PREFILL)
    assert p.max_num_seqs == 4 and p.max_model_len == 1024 and p.context_us_per_token == 0.0


def test_refit_reads_a_stored_calibration_and_old_bursts_without_outputs() -> None:
    old = {"k": 2, "contexts": [124.0, 124.0], "per_token_ms": [20.0, 20.0]}
    assert pf.burst_of(old).outputs == pf.BURST_OUTPUTS
    b = burst(4, 100, [1, 3])
    cal = {
        "profile": {"name": "llama-server-x-p4", "max_num_seqs": 4, "kv_capacity_tokens": 4096},
        "slo": {
            "ttft_s": 3.0,
            "tpot_s": 0.04,
            "unloaded_ttft_p50_s": 0.8,
            "unloaded_tpot_p50_s": 0.01,
        },
        "unloaded": [{"timings": unloaded(100)}],
        "bursts": [old, {**b.__dict__}],
    }
    p = pf.refit(cal)
    assert p.name == "llama-server-x-p4" and p.slo == (3.0, 0.04)
    assert p.decode_step_ms[4] == pytest.approx(TABLE[4])
    assert p.prefill_ms_per_token == pytest.approx(PREFILL)


def test_burst_from_timings_keeps_the_outputs() -> None:
    t = {"prompt_n": 100, "predicted_n": 48, "predicted_per_token_ms": 20.0}
    b = pf.burst_from_timings([t, {**t, "predicted_per_token_ms": 30.0}])
    assert b.outputs == 48 and b.contexts == (124.0, 124.0) and b.k == 2
    with pytest.raises(ValueError):
        pf.burst_from_timings([])


def test_the_calibration_line_shows_the_prefill_under_load() -> None:
    b = burst(4, 100, [1, 3])
    slo = {"ttft_s": 3.0, "tpot_s": 0.04, "unloaded_ttft_p50_s": 0.8, "unloaded_tpot_p50_s": 0.01}
    cal = {
        "profile": {"name": "llama-server-x-p4", "max_num_seqs": 4, "kv_capacity_tokens": 4096},
        "slo": slo,
        "unloaded": [{"timings": unloaded(100)}],
        "bursts": [b.__dict__],
        "capacity_rps": 0.15,
        "mean_output_tokens": 70.0,
    }
    cal["profile"] = pf.refit(cal).to_json()
    line = calibration_text(cal)
    assert "prefill 5.000 ms/token (5.000 under load, 300 tokens)" in line
    assert "under load" not in calibration_text({**cal, "bursts": []})
    assert "; capacity 0.150 req/s;" in line  # a file of the first definition
    peak = {"capacity_definition": "goodput-peak", "probe_mean_output_tokens": 79.4,
            "probes": [{"goodput_tokens_per_s": 7.94}, {"goodput_tokens_per_s": 5.62}]}  # fmt: skip
    line = calibration_text({**cal, **peak, "capacity_rps": 0.1})
    assert "; load 1 0.100 req/s (none's peak goodput 7.94 tokens/s over 79 tokens" in line
