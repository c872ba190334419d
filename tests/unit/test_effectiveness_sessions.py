"""The ``multi-turn`` workload: sessions resend the growing conversation in a closed loop, and
the engine's prefix cache finds the previous turns' blocks (pure, virtual time)."""

from __future__ import annotations

import itertools
from collections import defaultdict

from kvgate_bench.effectiveness.arms.registry import make_arm
from kvgate_bench.effectiveness.calibration import _dummy, mean_lengths
from kvgate_bench.effectiveness.model.driver import MAX_MODEL_LEN, simulate
from kvgate_bench.effectiveness.model.gate import (
    REJECTED,
    Arm,
    RequestRecord,
    RunResult,
    engine_default_max_tokens,
)
from kvgate_bench.effectiveness.model.metrics import summarize
from kvgate_bench.effectiveness.model.schedule import PROMPT_HEADROOM, Request
from kvgate_bench.effectiveness.model.sessions import MULTI_TURN, planned_reuse_share, planned_turns
from kvgate_bench.effectiveness.model.workloads import WORKLOADS, generate, tenants_of
from kvgate_bench.sim.steptime import profile

H100 = profile("h100-llama3-8b")


def run(rate: float, duration: float, seed: int, arm: Arm | None = None) -> RunResult:
    sched = generate(MULTI_TURN, rate, duration, seed)
    return simulate(sched, arm or make_arm("none", _dummy(), {}), H100)


def by_session(records: list[RequestRecord]) -> dict[str, list[RequestRecord]]:
    out: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in records:
        assert r.request.session is not None
        out[r.request.session].append(r)
    return out


def test_the_schedule_holds_first_turns_and_is_seeded() -> None:
    assert MULTI_TURN in WORKLOADS and tenants_of(MULTI_TURN)[0].name == "chat-0"
    a = generate(MULTI_TURN, 4.0, 100.0, 1)
    assert a == generate(MULTI_TURN, 4.0, 100.0, 1) and a != generate(MULTI_TURN, 4.0, 100.0, 2)
    assert a.sessions is not None and len(a.sessions.plans) == len(a.requests)
    assert all(r.turn == 0 and r.rid == r.session for r in a.requests)
    # Sessions start at rate / MEAN_TURNS: about 200 in 100 s at 4 turns/s.
    assert 150 < len(a.requests) < 250
    assert [r.arrival_s for r in a.requests] == sorted(r.arrival_s for r in a.requests)


def test_turns_resend_the_conversation_after_the_answer_and_a_think_time() -> None:
    result = run(2.0, 300.0, 3)
    sched = result.schedule
    assert sched.sessions is not None
    sessions = by_session(result.records)
    assert len(result.records) > len(sched.requests)  # later turns were made
    longest = max(len(v) for v in sessions.values())
    assert longest >= 3
    for name, recs in sessions.items():
        plan = sched.sessions.plans[name]
        for prev, cur in itertools.pairwise(recs):
            assert cur.request.turn == prev.request.turn + 1
            message = plan.turns[cur.request.turn].message_tokens
            assert cur.request.prompt_tokens == (
                prev.request.prompt_tokens + prev.output_tokens + message
            )
            assert prev.finished_at is not None
            think = plan.turns[prev.request.turn].think_s
            assert abs(cur.request.arrival_s - (prev.finished_at + think)) < 1e-9
            assert cur.request.prompt_tokens <= 8192 - PROMPT_HEADROOM
        assert all(r.request.arrival_s < sched.duration_s for r in recs)


def test_the_cache_finds_every_previous_turn_at_light_load() -> None:
    result = run(1.0, 300.0, 2)
    assert result.engine.preemptions_total == 0
    sent = [(r.request, r.output_tokens) for r in result.records]
    share = summarize(result)["prefix_reuse_share"]
    # Nothing the next turn needs was evicted: the measured share is the structural one.
    assert share == planned_reuse_share(sent)
    previous: dict[str, int] = {}
    for r in result.records:
        q = r.request
        assert q.session is not None
        if q.turn > 0:
            expected = min(q.prompt_tokens - 1, previous[q.session]) // 16 * 16
            assert r.cached_tokens == expected > 0
        else:
            assert r.cached_tokens == 0
        previous[q.session] = q.prompt_tokens + r.output_tokens - 1


def test_the_reuse_share_lands_near_the_target() -> None:
    """Mooncake's chat traffic reuses 40 % of its prompt tokens; the workload's structure gives
    about 57 % when every turn is served and nothing evicted, a little less as the run cuts
    sessions at its end and evicts under load."""
    sched = generate(MULTI_TURN, 20.0, 200.0, 8)
    planned = planned_reuse_share(
        planned_turns(sched, lambda r: engine_default_max_tokens(r, MAX_MODEL_LEN))
    )
    assert 0.52 < planned < 0.62
    share = summarize(run(6.0, 200.0, 1))["prefix_reuse_share"]
    assert 0.40 < share < 0.55


class RefuseSecondTurns(Arm):
    name = "refuse-second-turns"

    def on_arrival(self, req: Request, now: float) -> None:
        if req.turn == 1:
            self.gate.reject(req, now, 1.0)
        else:
            self.gate.dispatch(req, now)


def test_a_refused_turn_ends_its_session() -> None:
    result = run(2.0, 200.0, 4, RefuseSecondTurns())
    turns = [r.request.turn for r in result.records]
    assert 1 in turns and max(turns) == 1
    assert all(r.outcome == REJECTED for r in result.records if r.request.turn == 1)
    assert summarize(result)["rejected"] == turns.count(1)


def test_other_workloads_report_no_reuse_share_and_mean_lengths_count_every_turn() -> None:
    conv = simulate(generate("conversation", 2.0, 30.0, 1), make_arm("none", _dummy(), {}), H100)
    assert "prefix_reuse_share" not in summarize(conv)
    assert all(r.cached_tokens == 0 for r in conv.records)
    mean_out, mean_total = mean_lengths(MULTI_TURN, 1)
    assert 150 < mean_out < 300 and mean_total > 1000  # later turns carry the conversation
