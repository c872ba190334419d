"""Each tuned arm's setting is chosen on the tuning seed alone ("choose constants on one seed and
report on others"): a setting best on the report seeds but not on the tuning seed is not
chosen, single-pod (``runner.pick_best``) and pool (``pool.runner.pick_best_pool``) alike.

Rows are built by hand; nothing is simulated.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvgate_bench.effectiveness import __main__ as cli
from kvgate_bench.effectiveness.pool.report import sweeps_of
from kvgate_bench.effectiveness.pool.runner import pick_best_pool
from kvgate_bench.effectiveness.report.tables import sweep_table, table
from kvgate_bench.effectiveness.runner import pick_best, report_rows, tuning_text

A = {"cap": 64, "queue_timeout_s": 1.0}
B = {"cap": 128, "queue_timeout_s": 1.0}
#: Goodput per setting and seed: A wins on seed 1 (the tuning seed), B on seeds 2 and 3 and on
#: the mean over all three (the old rule's pick).
GOODPUT = {"A": {1: 1000.0, 2: 500.0, 3: 500.0}, "B": {1: 900.0, 2: 2000.0, 3: 2000.0}}
PARAMS = {"A": A, "B": B}


def row(setting: str, seed: int, arm: str = "concurrency-cap") -> dict[str, Any]:
    g = GOODPUT[setting][seed]
    return {
        "workload": "multi-tenant",
        "load": 2.0,
        "arm": arm,
        "seed": seed,
        "params": dict(PARAMS[setting]),
        "goodput_tokens_per_s": g,
        "interactive_goodput_tokens_per_s": g / 2,
        "slo_attainment": g / 2500,
        "preemptions_per_1k": 0.0,
    }


def rows(seeds: tuple[int, ...] = (1, 2, 3)) -> list[dict[str, Any]]:
    out = [row(s, seed) for seed in seeds for s in ("A", "B")]
    out.extend({**row("A", seed, "none"), "params": {}} for seed in seeds)
    return out


def pool_row(setting: str, seed: int, arm: str = "concurrency-cap") -> dict[str, Any]:
    return {
        "workload": "conversation",
        "load": 2.0,
        "replicas": 4,
        "router": "epp",
        "arm": arm,
        "seed": seed,
        "params": dict(PARAMS[setting]),
        "goodput_tokens_per_s": GOODPUT[setting][seed],
    }


def pool_rows(seeds: tuple[int, ...] = (1, 2, 3)) -> list[dict[str, Any]]:
    return [pool_row(s, seed) for seed in seeds for s in ("A", "B")]


def settings(chosen: list[dict[str, Any]], arm: str = "concurrency-cap") -> list[dict[str, Any]]:
    return [r["params"] for r in chosen if r["arm"] == arm]


def test_the_setting_best_on_the_report_seeds_but_not_the_tuning_seed_is_not_chosen() -> None:
    chosen, sweep = pick_best(rows())
    assert settings(chosen) == [A, A, A]  # every seed's row of A, none of B
    assert {r["seed"]: r["tuning_seed"] for r in chosen if r["arm"] == "concurrency-cap"} == {
        1: True,
        2: False,
        3: False,
    }
    assert len([r for r in chosen if r["arm"] == "none"]) == 3
    by = {s["params"]["cap"]: s for s in sweep if s["arm"] == "concurrency-cap"}
    # The sweep still holds the means over all seeds, and now the two halves apart.
    assert by[128]["goodput_tokens_per_s"] > by[64]["goodput_tokens_per_s"]
    assert by[64]["tuning_goodput_tokens_per_s"] == 1000.0
    assert by[128]["tuning_goodput_tokens_per_s"] == 900.0
    assert by[128]["report_goodput_tokens_per_s"] == 2000.0
    assert by[64]["tuning_seed"] == 1


def test_the_tuning_seed_can_be_named_and_must_have_run() -> None:
    chosen, _ = pick_best(rows(), tune_seed=2)
    assert settings(chosen) == [B, B, B]
    assert [r["seed"] for r in chosen if r["tuning_seed"]] == [2, 2]  # B's and none's
    with pytest.raises(ValueError, match="tuning seed 7"):
        pick_best(rows(), tune_seed=7)
    with pytest.raises(ValueError, match="tuning seed 7"):
        pick_best_pool(pool_rows(), tune_seed=7)


def test_the_first_seed_tunes_when_none_is_named() -> None:
    chosen, _ = pick_best(rows((2, 3)))  # seed 2 first: B wins there
    assert settings(chosen) == [B, B]
    assert [r["seed"] for r in chosen if r["arm"] == "concurrency-cap" and r["tuning_seed"]] == [2]


def test_one_seed_chooses_as_before_and_reports_every_row() -> None:
    chosen, sweep = pick_best(rows((1,)))
    assert settings(chosen) == [A]
    assert all(r["tuning_seed"] for r in chosen)
    assert report_rows(chosen) == chosen
    assert all(s["report_goodput_tokens_per_s"] is None for s in sweep)
    # Ties keep the first setting, as the mean rule did.
    tied = [row("A", 1), {**row("B", 1), "goodput_tokens_per_s": 1000.0}]
    assert settings(pick_best(tied)[0]) == [A]
    assert pick_best([]) == ([], [])


def test_the_report_averages_the_report_seeds_only() -> None:
    chosen, sweep = pick_best(rows())
    reported = report_rows(chosen)
    assert sorted({r["seed"] for r in reported}) == [2, 3]
    text, _ = table(reported, ["none", "concurrency-cap"], "report seeds 2,3")
    assert "means over report seeds 2,3" in text
    line = next(x for x in text.splitlines() if x.startswith("concurrency-cap"))
    assert line.split()[2] == "500"  # A's goodput on seeds 2 and 3, not 667 with seed 1
    swept = sweep_table(sweep)
    assert "tuning seed 1" in swept
    cap128 = next(x for x in swept.splitlines() if "cap=128" in x)
    assert "tune    900  goodput   2000" in cap128
    assert tuning_text(1, [2, 3]) == "settings chosen on seed 1; reported on seeds 2,3"


def test_one_seed_sweep_table_is_the_old_one() -> None:
    _, sweep = pick_best(rows((1,)))
    swept = sweep_table(sweep)
    assert swept.splitlines()[1] == (
        "sweeps (mean goodput, output tokens/s; the best setting is reported above)"
    )
    assert "tune" not in swept


def test_pool_a_setting_best_on_the_report_seeds_not_the_tuning_seed_is_not_chosen() -> None:
    chosen = pick_best_pool(pool_rows())
    assert settings(chosen) == [A, A, A]
    assert [r["tuning_seed"] for r in chosen] == [True, False, False]
    assert settings(pick_best_pool(pool_rows(), tune_seed=3)) == [B, B, B]
    assert settings(pick_best_pool(pool_rows((2, 3)))) == [B, B]
    one = pick_best_pool(pool_rows((1,)))
    assert settings(one) == [A] and one[0]["tuning_seed"] is True
    sweeps = {s["params"]["cap"]: s for s in sweeps_of(pool_rows())}
    assert sweeps[128]["goodput_tokens_per_s"] > sweeps[64]["goodput_tokens_per_s"]
    assert (sweeps[64]["tuning_goodput_tokens_per_s"], sweeps[64]["tuning_seed"]) == (1000.0, 1)
    assert pick_best_pool([]) == []


@pytest.mark.parametrize(
    "argv",
    [
        ["--seeds", "2", "--tune-seed", "5"],
        ["--replicas", "2", "--seeds", "2", "--tune-seed", "5"],
    ],
)
def test_a_tuning_seed_not_run_is_refused(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["--short", *argv]) == 2
    assert "--tune-seed 5 is not one of the seeds run [1, 2]" in capsys.readouterr().err


@pytest.mark.parametrize("seeds", ["0", "-1"])
@pytest.mark.parametrize("pool", [[], ["--replicas", "2"]])
def test_no_seed_to_run_is_refused_as_such(
    seeds: str, pool: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``--seeds 0`` names the option given, not the tuning seed it was never asked about."""
    assert cli.main(["--short", *pool, "--seeds", seeds]) == 2
    err = capsys.readouterr().err
    assert "--seeds wants at least 1" in err and "--tune-seed" not in err
