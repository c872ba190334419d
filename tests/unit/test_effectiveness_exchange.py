"""Issue 34's class shares across the pool, the exchange's benchmark side: the pool arm
``kvgate-exchange`` (kvgate with the replicas' exchange of service counters in virtual time) and
its in-memory exchange (no real clock)."""

from __future__ import annotations

import pytest

from kvgate_bench.effectiveness.arms.context import ArmContext
from kvgate_bench.effectiveness.model.workloads import generate, tenants_of
from kvgate_bench.effectiveness.pool.driver import simulate_pool
from kvgate_bench.effectiveness.pool.exchange import (
    EXCHANGE_ARM,
    KvgateExchangeArm,
    MemoryExchange,
)
from kvgate_bench.effectiveness.pool.routers import make_router
from kvgate_bench.effectiveness.pool.runner import ALL_POOL_ARMS, POOL_ARMS, pool_candidates
from kvgate_bench.sim.sequences import EngineConfig
from kvgate_bench.sim.steptime import profile

STEPTIME = profile("h100-llama3-8b")
SMALL = EngineConfig(
    num_gpu_blocks=2048, max_model_len=8192, max_num_batched_tokens=8192, chunked_prefill=True
)


def context() -> ArmContext:
    return ArmContext(SMALL, {t.name: t for t in tenants_of("tiers")}, 4.0, 4.0 * 1400)


def test_the_exchange_sums_every_replicas_deltas() -> None:
    ex = MemoryExchange()
    assert ex.sync({"a": (1.0, 4.0)}) == {"a": (1.0, 4.0)}
    assert ex.sync({"a": (2.0, 8.0), "b": (1.0, 1.0)}) == {"a": (3.0, 12.0), "b": (1.0, 1.0)}
    assert ex.sync({}) == {"a": (3.0, 12.0), "b": (1.0, 1.0)} and ex.syncs == 3


def test_the_exchange_arm_runs_when_named_only_and_refuses_unknown_settings() -> None:
    assert EXCHANGE_ARM in ALL_POOL_ARMS and EXCHANGE_ARM not in POOL_ARMS
    assert pool_candidates(EXCHANGE_ARM, True) == [{}]
    with pytest.raises(ValueError, match="nope"):
        KvgateExchangeArm(context(), MemoryExchange(), {"nope": 1})


def test_replicas_share_their_counters_through_one_exchange() -> None:
    sched = generate("tiers", 30.0, 20.0, 1)
    ctx = context()
    ex = MemoryExchange()
    arms: list[KvgateExchangeArm] = []

    def arm_of(i: int) -> KvgateExchangeArm:
        arms.append(KvgateExchangeArm(ctx, ex, {"sync_s": 0.5}))
        return arms[-1]

    run, _ = simulate_pool(sched, arm_of, make_router("epp-affinity", 1, 16, True), STEPTIME, 4)
    assert all(r.outcome != "pending" for r in run.records)
    # every replica synced about every half second while it had requests
    assert ex.syncs >= 4 * 20
    tenants = {r.tenant for r in sched.requests}
    assert set(ex.totals) == tenants
    for arm in arms:
        assert arm.pool.syncs > 0
        assert set(arm.pool.rates()) <= tenants and arm.pool.level > 0
    # the sums are every replica's service: premium's raw is its weighted x 4
    for t, (u, r) in ex.totals.items():
        w = 4.0 if t.startswith("premium") else 1.0
        assert r == pytest.approx(u * w)
