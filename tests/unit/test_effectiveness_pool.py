"""The virtual-time pool: conservation, the routers, Envoy's retries, refused_while_room."""

from __future__ import annotations

from typing import Any

import pytest

from kvgate_bench.effectiveness.arms.baselines import ConcurrencyCapArm
from kvgate_bench.effectiveness.arms.context import ArmContext
from kvgate_bench.effectiveness.arms.registry import make_arm
from kvgate_bench.effectiveness.model.driver import simulate
from kvgate_bench.effectiveness.model.gate import DEGRADED, REJECTED, SERVED, Arm
from kvgate_bench.effectiveness.model.metrics import summarize
from kvgate_bench.effectiveness.model.schedule import Request, Schedule
from kvgate_bench.effectiveness.model.workloads import generate, tenants_of
from kvgate_bench.effectiveness.pool.driver import simulate_pool
from kvgate_bench.effectiveness.pool.routers import (
    EppRouter,
    LeastRequestRouter,
    RandomRouter,
    RetryPolicy,
    make_router,
)
from kvgate_bench.effectiveness.pool.runner import PoolFlowControlArm, pairs
from kvgate_bench.sim.sequences import EngineConfig
from kvgate_bench.sim.steptime import profile

STEPTIME = profile("h100-llama3-8b")
SMALL = EngineConfig(
    num_gpu_blocks=2048, max_model_len=8192, max_num_batched_tokens=8192, chunked_prefill=True
)


def context(workload: str = "conversation") -> ArmContext:
    return ArmContext(SMALL, {t.name: t for t in tenants_of(workload)}, 4.0, 4.0 * 1400)


def schedule(workload: str = "conversation", rate: float = 16.0, secs: float = 10.0) -> Schedule:
    return generate(workload, rate, secs, 7)


class RefuseAll(Arm):
    """A replica that refuses every request (429, Retry-After 0.5 s)."""

    name = "refuse-all"

    def on_arrival(self, req: Request, now: float) -> None:
        self.gate.reject(req, now, 0.5)


def run(
    sched: Schedule,
    arms: list[Arm],
    router: Any,
    retry: RetryPolicy | None,
    front: Arm | None = None,
) -> Any:
    return simulate_pool(
        sched, lambda i: arms[i], router, STEPTIME, len(arms), front=front, retry=retry,
        config=SMALL,
    )  # fmt: skip


@pytest.mark.parametrize("router", ["random", "least-request", "epp"])
@pytest.mark.parametrize("arm", ["none", "kvgate", "concurrency-cap"])
def test_each_client_request_ends_once_and_each_attempt_has_one_replica(
    router: str, arm: str
) -> None:
    sched = schedule("multi-turn" if router == "epp" else "conversation", rate=24.0)
    ctx = context()
    params: dict[str, Any] = {"cap": 8, "queue_timeout_s": 0.1} if arm == "concurrency-cap" else {}
    arms = [make_arm(arm, ctx, params) for _ in range(3)]
    r = make_router(router, 1, SMALL.block_size, arm == "kvgate")
    res, stats = run(sched, arms, r, RetryPolicy() if r.retries else None)
    ids = [rec.request.rid for rec in res.records]
    assert len(ids) == len(set(ids)) >= len(sched.requests)
    assert all(rec.outcome in (SERVED, DEGRADED, REJECTED) for rec in res.records)
    # Every attempt went to one replica: the first attempts plus the retries.
    assert sum(stats.per_replica_requests) == len(ids) + stats.retries
    assert min(stats.per_replica_requests) > 0
    if arm == "concurrency-cap":
        assert any(rec.outcome == REJECTED for rec in res.records)
    if not r.retries:
        assert stats.retries == 0


def test_a_pool_of_one_is_the_single_pod_driver() -> None:
    sched = schedule(rate=20.0)
    ctx = context()
    alone = summarize(simulate(sched, make_arm("kvgate", ctx, {}), STEPTIME, SMALL))
    res, stats = run(sched, [make_arm("kvgate", ctx, {})], make_router("random", 1, 16), None)
    pooled = summarize(res)
    assert stats.retries == 0 and stats.per_replica_requests == [len(sched.requests)]
    for key in ("requests", "rejected", "goodput_tokens_per_s", "slo_attainment"):
        assert pooled[key] == pytest.approx(alone[key], rel=1e-9), key


def test_random_never_retries_and_counts_refusals_while_another_replica_idles() -> None:
    sched = schedule(rate=4.0)
    arms: list[Arm] = [RefuseAll(), make_arm("none", context(), {})]
    res, stats = run(sched, arms, RandomRouter(3), None)
    refused = [rec for rec in res.records if rec.outcome == REJECTED]
    assert stats.retries == 0
    assert 0 < len(refused) < len(res.records)
    # At 4 requests/s the other replica is idle at most refusals (its work ended, nothing waits).
    assert 0 < stats.refused_while_room <= len(refused)
    assert stats.refused_while_room >= 0.5 * len(refused)


def test_least_request_retries_the_other_host_after_retry_after() -> None:
    sched = schedule(rate=4.0)
    arms: list[Arm] = [RefuseAll(), make_arm("none", context(), {})]
    res, stats = run(sched, arms, LeastRequestRouter(3), RetryPolicy(max_interval_s=10.0))
    assert all(rec.outcome == SERVED for rec in res.records)
    assert stats.refused_while_room == 0
    assert stats.retries == stats.per_replica_requests[0] > 0
    # A retried request waited the refusal's Retry-After (0.5 s, a 1 s header) before its
    # retry, counted in its TTFT from the client's arrival; the others did not.
    waits = sorted(rec.first_token_at - rec.request.arrival_s for rec in res.records
                   if rec.first_token_at is not None)  # fmt: skip
    assert len(waits) == len(res.records)
    assert sum(w >= 1.0 for w in waits) == stats.retries
    assert waits[0] < 0.5


def test_retries_stop_after_every_host_refused() -> None:
    sched = schedule(rate=2.0, secs=5.0)
    arms: list[Arm] = [RefuseAll(), RefuseAll(), RefuseAll()]
    res, stats = run(sched, arms, LeastRequestRouter(1), RetryPolicy())
    n = len(res.records)
    assert all(rec.outcome == REJECTED for rec in res.records)
    assert stats.retries == 2 * n  # N - 1 retries each, every host tried once
    assert stats.per_replica_requests == [n, n, n]
    # The engines sat idle: every refusal came while another replica had room (room is the
    # engine's, whatever its arm would decide).
    assert stats.refused_while_room == n


def test_the_retry_policy_is_envoys() -> None:
    p = RetryPolicy()
    assert p.max_retries(4) == 3 and p.max_retries(1) == 0
    # The header carries whole seconds: past the 0.5 s cap, Envoy's exponential back-off (the
    # mean of its full jitter), 25 ms doubling up to 250 ms.
    assert p.backoff_s(1, 0.3) == pytest.approx(0.0125)
    assert p.backoff_s(3, None) == pytest.approx(0.05)
    assert p.backoff_s(10, None) == pytest.approx(0.125)
    patient = RetryPolicy(max_interval_s=10.0)
    assert patient.backoff_s(1, 1.2) == 2.0  # honoured as the header says it: rounded up
    assert patient.backoff_s(1, 60.0) == pytest.approx(0.0125)  # past the cap: ignored


def test_routers_pick_only_hosts_not_tried() -> None:
    sched = schedule(rate=8.0, secs=2.0)
    arms = [make_arm("none", context(), {}) for _ in range(3)]
    for r in (RandomRouter(1), LeastRequestRouter(1), EppRouter(1, 16)):
        run(sched, arms, r, None)  # binds the replicas
        req = sched.requests[0]
        for _ in range(20):
            assert r.pick(req, 100.0, frozenset({0, 2})) == 1
        assert r.pick(req, 100.0, frozenset({0, 1, 2})) is None
        arms = [make_arm("none", context(), {}) for _ in range(3)]


def test_epp_prefers_the_replica_holding_the_sessions_prefix() -> None:
    sched = schedule("multi-turn", rate=2.0, secs=5.0)
    arms = [make_arm("none", context("multi-turn"), {}) for _ in range(4)]
    r = EppRouter(1, 16)
    res, _ = run(sched, arms, r, None)
    later = [rec.request for rec in res.records if rec.request.turn > 0]
    assert later, "the schedule has no second turns"
    # A later turn's session was sent to one replica before: the prefix scorer favours it.
    scores = r.scores(later[0], [0, 1, 2, 3])
    assert max(scores.values()) > min(scores.values())


def test_flow_control_stands_only_in_front_of_epp_and_needs_a_pool() -> None:
    assert ("epp", "flow-control") in pairs(["random", "epp"], ["none", "flow-control"])
    assert ("random", "flow-control") not in pairs(["random", "epp"], ["none", "flow-control"])
    sched = schedule(rate=30.0, secs=5.0)
    arms = [make_arm("none", context(), {}) for _ in range(2)]
    front = PoolFlowControlArm(0.25, 3, 0.3)
    res, _ = run(sched, arms, make_router("epp", 1, 16), None, front=front)
    assert all(rec.outcome in (SERVED, DEGRADED, REJECTED) for rec in res.records)
    with pytest.raises(TypeError):
        simulate(sched, PoolFlowControlArm(0.25, 3, 0.3), STEPTIME, SMALL)


def test_a_bad_pool_is_refused() -> None:
    with pytest.raises(ValueError):
        simulate_pool(schedule(), lambda i: ConcurrencyCapArm(4, 0.1), RandomRouter(1), STEPTIME, 0)
    with pytest.raises(ValueError):
        make_router("round-robin", 1, 16)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--replicas", ""], "--replicas wants"),
        (["--replicas", "0"], "--replicas wants"),
        (["--replicas", "2", "--loads", "nan"], "--loads wants"),
        (["--replicas", "2", "--seeds", "0"], "--seeds wants"),
        (["--replicas", "2", "--retry-after-cap", "-1"], "--retry-after-cap wants"),
        (["--retry-after-cap", "1"], "--retry-after-cap needs --replicas"),
        (["--routers", "epp"], "--routers needs --replicas"),
        (["--replicas", "2", "--routers", "foo"], "choose from random,least-request,epp"),
        (["--replicas", "2", "--json", "/nonexistent-kvgate/x.json"], "does not exist"),
        (["--json", "/"], "is a directory"),
    ],
)
def test_bad_options_are_refused_before_anything_runs(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvgate_bench.effectiveness.__main__ import main

    assert main(argv) == 2
    assert says in capsys.readouterr().err
