"""The real-time driver's pure parts: the requests it sends count as the schedule says on both
sides of the sidecar, kvgate-sim gets the virtual driver's engine, the policy the sidecar is
given, and the agreement and kept-up rules. (The runs themselves: tests/integration.)"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvgate_agent.contract.policy import parse_policy
from kvgate_agent.sidecar.reading.tokens import PromptCounter
from kvgate_bench.effectiveness.arms.context import ArmContext
from kvgate_bench.effectiveness.model.driver import engine_config
from kvgate_bench.effectiveness.model.gate import RunResult
from kvgate_bench.effectiveness.model.schedule import Request
from kvgate_bench.effectiveness.model.workloads import generate, tenants_of
from kvgate_bench.effectiveness.realtime.agreement import preemptions_agree, well_behaved_agree
from kvgate_bench.effectiveness.realtime.client import request_body
from kvgate_bench.effectiveness.realtime.run import RealtimeRun, steptime_with_pool
from kvgate_bench.effectiveness.realtime.servers import (
    arm_policy,
    policy_manifest,
    sim_argv,
    sim_config,
    write_word_tokenizer,
)
from kvgate_bench.sim.cli import build_parser, config_from_args
from kvgate_bench.sim.server import count_chat_prompt_tokens, count_completion_prompt_tokens


def ctx(kv_tokens: int | None = 24_576) -> ArmContext:
    steptime = steptime_with_pool("h100-llama3-8b", kv_tokens)
    tenants = {t.name: t for t in tenants_of("conversation")}
    return ArmContext(engine_config(steptime), tenants, 8.0, 8.0 * 1400)


def req(prompt: int, max_tokens: int | None = 256) -> Request:
    return Request("r", 0.0, "chat-0", "interactive", prompt, max_tokens, 100)


@pytest.mark.parametrize("prompt", [7, 100, 757, 7936])
def test_prompts_count_as_scheduled_on_both_sides(prompt: int, tmp_path: Path) -> None:
    body = request_body(req(prompt))
    assert count_completion_prompt_tokens(body["prompt"]) == prompt  # kvgate-sim
    count = PromptCounter().count(body)  # the sidecar, no tokenizer needed
    assert count.tokens == prompt and count.exact
    chat = request_body(req(prompt), chat=True)
    assert count_chat_prompt_tokens(chat["messages"]) == prompt
    tok = tmp_path / "tokenizer.json"
    write_word_tokenizer(tok)
    assert PromptCounter(str(tok)).count(chat).tokens == prompt + 1  # its reply primer is 3


def test_max_tokens_is_sent_only_when_the_schedule_has_one() -> None:
    assert request_body(req(50))["max_tokens"] == 256
    body = request_body(req(50, None))
    assert "max_tokens" not in body and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}


def test_kvgate_sim_runs_the_virtual_drivers_engine() -> None:
    c = ctx()
    sc = sim_config("h100-llama3-8b", c.engine, time_scale=2.0)
    assert sc.engine_config() == c.engine and sc.time_scale == 2.0
    argv = sim_argv(sc, port=0)
    assert argv[1:3] == ["-m", "kvgate_bench.sim.cli"]
    assert config_from_args(build_parser().parse_args(argv[3:])) == sc
    with pytest.raises(ValueError, match="cannot run"):
        sim_config("h100-llama3-8b", replace(c.engine, watermark=0.0))
    with pytest.raises(ValueError, match="cannot run"):  # constant: no chunked prefill
        sim_config("constant", c.engine)


def test_the_sidecar_gets_the_arms_policy_and_baselines_have_none() -> None:
    c = ctx()
    assert arm_policy("none", c) is None
    spec = arm_policy("kvgate-maxtokens", c)
    assert spec is not None
    policy = parse_policy(policy_manifest(spec))
    assert policy.spec.capacity.kv_cache_tokens == 24_576
    with pytest.raises(ValueError, match="no real-time counterpart"):
        arm_policy("concurrency-cap", c)
    with pytest.raises(ValueError):
        arm_policy("no-such-arm", c)


def test_preemptions_agree_within_ten_percent_or_two() -> None:
    assert preemptions_agree(0, 2) and preemptions_agree(5, 3) and not preemptions_agree(5, 8)
    assert preemptions_agree(100, 110) and not preemptions_agree(100, 112)


def run(send_lags: list[float], sim_lag: float, late: float, scale: float = 1.0) -> RealtimeRun:
    sched = generate("conversation", 1.0, 1.0, 1)
    result = RunResult(sched, "none", {}, [], 0.0, 0.0, 0, 0.0, None)  # type: ignore[arg-type]
    return RealtimeRun(result, 1.0, scale, late, sim_lag, send_lags, 0)


def test_kept_up_reads_the_send_lags_p99_and_the_step_lag() -> None:
    assert run([0.005] * 99 + [0.3], 0.02, 0.0).kept_up  # one late send in 100 is the 1 %
    assert not run([0.005] * 90 + [0.3] * 10, 0.02, 0.0).kept_up
    assert not run([0.005] * 100, 0.15, 0.0).kept_up
    assert run([0.005] * 100, 0.15, 0.0, scale=2.0).kept_up  # 75 ms of modelled time
    assert not run([0.005] * 100, 0.02, 0.01).kept_up  # kvgate-sim wrote lag off
    assert run([], 0.0, 0.0).send_lag_max_s == 0.0


def test_well_behaved_attainment_agrees_within_ten_percent() -> None:
    def row(x: float | None) -> dict[str, float | None]:
        return {"well_behaved_slo_attainment": x}

    assert well_behaved_agree(row(None), row(None))  # no noisy tenant: nothing to compare
    assert well_behaved_agree(row(0.90), row(0.82)) and not well_behaved_agree(row(0.90), row(0.80))
    assert not well_behaved_agree(row(0.9), row(None))


def test_the_day_one_arms_carry_what_the_engine_would_report() -> None:
    engine = engine_config(steptime_with_pool("h100-llama3-8b", None))
    ctx = ArmContext(engine, {}, 1.0, 1.0)
    for arm in ("kvgate-slo-only", "kvgate-empty", "kvgate"):
        spec = arm_policy(arm, ctx)
        assert spec is not None
        assert spec["capacity"]["kvCacheTokens"] == engine.num_gpu_blocks * engine.block_size
        assert spec["concurrency"] == {"maxRequests": engine.max_num_seqs}
    for arm in ("oracle", "kvgate-noisy"):
        with pytest.raises(ValueError, match="no real-time counterpart"):
            arm_policy(arm, ctx)
