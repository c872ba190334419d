"""The virtual-time driver and the arms: conservation, monotone time, each arm's invariants."""

from __future__ import annotations

from typing import Any

import pytest

from kvgate_agent.admission.prefix_index import TRUST_START
from kvgate_bench.effectiveness.arms.baselines import (
    ConcurrencyCapArm,
    SaturationShedArm,
    TokenBucketArm,
)
from kvgate_bench.effectiveness.arms.context import ArmContext
from kvgate_bench.effectiveness.arms.kvgate_arms import KvgateMaxTokensArm
from kvgate_bench.effectiveness.arms.registry import ABLATIONS, ARM_NAMES, candidates, make_arm
from kvgate_bench.effectiveness.model.driver import simulate
from kvgate_bench.effectiveness.model.gate import DEGRADED, REJECTED, SERVED, Arm, Gate, RunResult
from kvgate_bench.effectiveness.model.schedule import BATCH, Request, Schedule
from kvgate_bench.effectiveness.model.workloads import generate, tenants_of
from kvgate_bench.sim.prefix_cache import SessionKeys, extend_chain
from kvgate_bench.sim.sequences import EngineConfig
from kvgate_bench.sim.steptime import profile

STEPTIME = profile("h100-llama3-8b")
#: A small pool (2048 blocks of 16 = 32,768 tokens) so that KV binds with few requests.
SMALL = EngineConfig(
    num_gpu_blocks=2048, max_model_len=8192, max_num_batched_tokens=8192, chunked_prefill=True
)


def context(workload: str, engine: EngineConfig = SMALL) -> ArmContext:
    return ArmContext(engine, {t.name: t for t in tenants_of(workload)}, 4.0, 4.0 * 1400)


def schedule(workload: str = "multi-tenant", rate: float = 12.0, secs: float = 15.0) -> Schedule:
    return generate(workload, rate, secs, 11)


class Recording(Arm):
    """Wraps an arm and records the virtual time of every call the driver makes."""

    def __init__(self, inner: Arm) -> None:
        super().__init__()
        self.inner = inner
        self.name = inner.name
        self.times: list[float] = []
        self.wakes = 0

    def start(self, gate: Gate, now: float) -> None:
        super().start(gate, now)
        self.inner.start(gate, now)
        self.times.append(now)

    def on_arrival(self, req: Request, now: float) -> None:
        assert now >= req.arrival_s
        self.times.append(now)
        self.inner.on_arrival(req, now)

    def on_finish(self, req: Request, output_tokens: int, now: float) -> None:
        self.times.append(now)
        self.inner.on_finish(req, output_tokens, now)

    def on_tokens(self, new_tokens: dict[str, int], now: float) -> None:
        self.times.append(now)
        self.inner.on_tokens(new_tokens, now)

    def next_wake(self) -> float | None:
        return self.inner.next_wake()

    def on_wake(self, now: float) -> None:
        self.times.append(now)
        self.wakes += 1
        self.inner.on_wake(now)


def check_conserved(run: RunResult) -> None:
    assert len(run.records) == len(run.schedule.requests)
    for rec in run.records:
        req = rec.request
        assert rec.outcome in (SERVED, DEGRADED, REJECTED)
        assert rec.finished_at is not None and rec.finished_at >= req.arrival_s
        if rec.outcome == REJECTED:
            assert rec.output_tokens == 0
            continue
        assert rec.admitted_at is not None and rec.first_token_at is not None
        assert req.arrival_s <= rec.admitted_at <= rec.first_token_at <= rec.finished_at
        assert rec.max_tokens_sent is not None
        assert rec.output_tokens == min(req.output_tokens, rec.max_tokens_sent)
    assert not run.engine.has_work and run.engine.used_blocks == 0


ARM_PARAMS: list[tuple[str, dict[str, Any]]] = [
    ("none", {}),
    ("concurrency-cap", {"cap": 8, "queue_timeout_s": 1.0}),
    ("token-bucket", {"factor": 0.5, "burst_s": 10.0}),
    ("saturation-shed", {"shed": "all"}),
    ("kvgate-maxtokens", {}),
    ("kvgate", {}),
    ("kvgate-noisy", {}),
    ("oracle", {}),
    ("kvgate-no-kv", {}),
    ("kvgate-no-degrade", {}),
    ("kvgate-fifo", {}),
    ("kvgate-tenant-budgets", {}),
    ("flow-control", {"ttl_s": 2.0, "queue_threshold": 5, "kv_threshold": 0.8}),
    ("vllm-queue-limit", {"max_num_queued_reqs": 16, "max_num_queued_tokens": 8192}),
    ("codel-gate", {"cap": 8, "target_s": 0.25}),
    ("dynamo-drr", {"classes": "tenant", "quantum": 512, "queue_limit": 8, "busy_frac": 1.0}),
    ("occupancy-budget", {"budget_kv": 0.5}),
    ("kvgate-slo-only", {}),
    ("kvgate-empty", {}),
    ("kvgate-bench-policy", {}),
    ("kvgate-prefix-blind", {}),
]


@pytest.mark.parametrize(("arm", "params"), ARM_PARAMS, ids=[a for a, _ in ARM_PARAMS])
def test_every_request_ends_and_time_is_monotone(arm: str, params: dict[str, Any]) -> None:
    rec = Recording(make_arm(arm, context("multi-tenant"), params))
    run = simulate(schedule(), rec, STEPTIME, SMALL, max_virtual_s=3600)
    check_conserved(run)
    assert rec.times == sorted(rec.times)
    assert run.end_s >= max(r.finished_at or 0.0 for r in run.records)
    # Timers are bounded: no arm (nor the driver) spins on a timer in the past.
    assert rec.wakes <= 20 * len(run.records) + 1000


def test_all_built_arms_are_covered() -> None:
    assert {a for a, _ in ARM_PARAMS} == set(ARM_NAMES) | set(ABLATIONS)
    for name in ARM_NAMES:
        assert candidates(name, context("multi-tenant").tenants, short=True)
    with pytest.raises(ValueError, match="unknown arm"):
        make_arm("kvgate-nope", context("conversation"), {})


def test_none_serves_everything() -> None:
    run = simulate(schedule(), make_arm("none", context("multi-tenant"), {}), STEPTIME, SMALL)
    assert all(r.outcome == SERVED for r in run.records)
    assert run.engine.preemptions_total > 0  # the small pool overflows: preemption happens


def test_concurrency_cap_never_exceeds_the_cap() -> None:
    arm = ConcurrencyCapArm(cap=6, queue_timeout_s=2.0)

    class Checked(Recording):
        def on_finish(self, req: Request, output_tokens: int, now: float) -> None:
            eng = self.gate.engine
            assert eng.num_running + eng.num_waiting <= 6
            super().on_finish(req, output_tokens, now)

    run = simulate(schedule(), Checked(arm), STEPTIME, SMALL)
    check_conserved(run)
    assert arm.max_in_flight == 6 and arm.in_flight == 0
    assert any(r.outcome == REJECTED for r in run.records)  # the queue timed some out


def test_kvgate_maxtokens_stays_within_capacity_and_leaks_nothing() -> None:
    arm = KvgateMaxTokensArm(context("multi-tenant"))
    run = simulate(schedule(rate=20.0), arm, STEPTIME, SMALL)
    check_conserved(run)
    ctl = arm.controller
    cap = SMALL.num_gpu_blocks * SMALL.block_size
    assert ctl.stats().kv_capacity_tokens == cap
    assert cap // 2 < arm.max_kv_reserved <= cap  # KV bound, and was never overbooked
    assert (
        ctl.stats().in_flight == 0
        and ctl.stats().kv_reserved_tokens == 0
        and ctl.stats().queue_length == 0
    )
    outcomes = {r.outcome for r in run.records}
    assert REJECTED in outcomes and SERVED in outcomes
    # What the engine got: the policy's default for unset max_tokens, never above the client's.
    for r in run.records:
        if r.max_tokens_sent is not None:
            client = r.request.max_tokens
            assert r.max_tokens_sent <= (client if client is not None else 1024)


def test_token_bucket_refuses_a_tenant_over_its_rate() -> None:
    arm = TokenBucketArm(context("multi-tenant"), factor=0.2, burst_s=2.0)
    run = simulate(schedule(), arm, STEPTIME, SMALL)
    check_conserved(run)
    refused = [r for r in run.records if r.outcome == REJECTED]
    assert refused and all(r.retry_after_s is not None and r.retry_after_s >= 1 for r in refused)
    noisy = sum(1 for r in refused if r.request.tenant == "noisy")
    assert noisy > len(refused) / 2  # the tenant sending 5x its share is the one refused


def test_saturation_shed_sheds_only_batch_in_sheddable_mode() -> None:
    arm = SaturationShedArm(shed="sheddable")
    run = simulate(schedule(rate=20.0), arm, STEPTIME, SMALL)
    check_conserved(run)
    refused = [r for r in run.records if r.outcome == REJECTED]
    assert refused and all(r.request.tier == BATCH for r in refused)
    arm_all = SaturationShedArm(shed="all")
    run_all = simulate(schedule(rate=20.0), arm_all, STEPTIME, SMALL)
    assert {r.request.tier for r in run_all.records if r.outcome == REJECTED} > {BATCH}


def test_saturation_detector_thresholds_and_staleness() -> None:
    arm = SaturationShedArm()
    run = simulate(schedule(rate=2.0, secs=2.0), arm, STEPTIME, SMALL)
    check_conserved(run)
    arm._scraped_at, arm._waiting, arm._kv = 10.0, 4, 0.79
    assert not arm.saturated(10.2)
    assert arm.saturated(10.2001)  # the scrape is older than 200 ms
    arm._waiting = 5
    assert arm.saturated(10.0)
    arm._waiting, arm._kv = 0, 0.8
    assert arm.saturated(10.0)


def test_kvgate_arm_never_asks_to_be_woken_in_the_past() -> None:
    """A waiter blocked by its own tenant's bucket behind a head blocked by KV: the controller
    must not leave the refill time of an earlier pump for ``next_wake`` (it used to, and the
    driver then woke at that past time again and again)."""
    from kvgate_agent.admission import (
        AdmissionConfig,
        AdmissionController,
        AdmissionRequest,
        ResolvedLimit,
    )
    from kvgate_agent.contract.policy import LimitScope, QueueOrder

    arm = KvgateMaxTokensArm(context("multi-tenant"))
    per_tenant = ResolvedLimit("t", LimitScope.TENANT, None, None, 10.0, 1000.0, 0.0)
    cfg = AdmissionConfig(
        limits=(per_tenant,),
        cost_per_request=500.0,
        kv_capacity_tokens=1000,
        queue_order=QueueOrder.PRIORITY,
    )
    ctl = arm.controller = AdmissionController(cfg, arm.clock)
    assert ctl.submit(AdmissionRequest("x", 10, 390)).admitted  # KV 400, x's bucket 100 left
    assert ctl.submit(AdmissionRequest("y", 10, 90)).admitted  # KV 512, y's bucket 400 left
    waiter = ctl.submit(AdmissionRequest("y", 10, 40)).waiter  # y's bucket: 550 > 400
    assert waiter is not None and ctl.next_wake() == pytest.approx(15.0)
    head = ctl.submit(AdmissionRequest("z", 10, 480, priority=1)).waiter  # KV: 512 + 496 > 1000
    assert head is not None and ctl.take_resolved() == []
    arm.clock.now = 15.0
    ctl.pump()
    # y's refilled head fits the KV left: admitted past z (a bounded backfill); z still waits.
    assert ctl.take_resolved() == [waiter] and ctl.stats().queue_length == 1
    at = arm.next_wake()
    assert at is not None and at > 15.0


def test_steptime_of_replaces_the_kv_pool() -> None:
    from kvgate_bench.effectiveness.model.engines import steptime_of
    from kvgate_bench.sim.steptime import profile

    base = profile("h100-llama3-8b")
    assert steptime_of("h100-llama3-8b") == base
    small = steptime_of("h100-llama3-8b@65536")
    assert small.kv_capacity_tokens == 65536 != base.kv_capacity_tokens
    assert small.chunked_prefill == base.chunked_prefill
    for bad in ("h100-llama3-8b@0", "h100-llama3-8b@x", "h100-llama3-8b@-5"):
        with pytest.raises(ValueError, match="positive"):
            steptime_of(bad)


def test_kvgate_is_prefix_aware_on_multi_turn_and_leaks_nothing() -> None:
    """``kvgate`` names a multi-turn prompt's blocks as the engine does and settles with the
    engine's cached tokens (which move the index's trust); its prefix-blind ablation passes
    none; both give every reservation back."""
    sched = schedule("multi-turn", rate=6.0, secs=120.0)
    ctx = context("multi-turn")
    aware = make_arm("kvgate", ctx, {})
    blind = make_arm("kvgate-prefix-blind", ctx, {})
    assert isinstance(aware, KvgateMaxTokensArm) and isinstance(blind, KvgateMaxTokensArm)
    later = next(r for r in sched.requests if r.session is not None)
    blocks = aware.admission_request(later).prefix_blocks
    bs = SMALL.block_size
    assert blocks == extend_chain([], SessionKeys(later.session or ""), later.prompt_tokens // bs)
    assert blind.admission_request(later).prefix_blocks is None
    runs = {a.name: simulate(sched, a, STEPTIME, SMALL) for a in (aware, blind)}
    for arm in (aware, blind):
        run = runs[arm.name]
        assert len(run.records) > len(sched.requests)  # later turns were sent
        assert not run.engine.has_work and run.engine.used_blocks == 0
        st = arm.controller.stats()
        assert st.in_flight == 0 and st.kv_reserved_tokens == 0 and st.queue_length == 0
    cached = sum(r.cached_tokens for r in runs["kvgate"].records)
    assert cached > 0
    prefixes = aware.controller._limits.prefixes
    assert len(prefixes) > 0 and prefixes.trust != TRUST_START  # confirmed by the engine
    assert len(blind.controller._limits.prefixes) == 0


def test_kvgate_reserves_a_shared_prefix_once_on_a_kv_bound_engine() -> None:
    """``shared-prefix`` on the small pool: the engine shares each application's prefix
    between running requests, prefix-aware ``kvgate`` names those blocks and so admits more
    than its prefix-blind ablation, which reserves every prompt whole; both leak nothing."""
    sched = generate("shared-prefix", 6.0, 60.0, 11)
    ctx = context("shared-prefix")
    aware = make_arm("kvgate", ctx, {})
    blind = make_arm("kvgate-prefix-blind", ctx, {})
    assert isinstance(aware, KvgateMaxTokensArm) and isinstance(blind, KvgateMaxTokensArm)
    first = sched.requests[0]
    assert len(aware.admission_request(first).prefix_blocks or []) == first.prefix_tokens // 16
    assert blind.admission_request(first).prefix_blocks is None
    runs = {a.name: simulate(sched, a, STEPTIME, SMALL) for a in (aware, blind)}
    for arm in (aware, blind):
        run = runs[arm.name]
        assert not run.engine.has_work and run.engine.used_blocks == 0
        st = arm.controller.stats()
        assert st.in_flight == 0 and st.kv_reserved_tokens == 0 and st.queue_length == 0
    served = {n: sum(1 for r in run.records if r.outcome != REJECTED) for n, run in runs.items()}
    assert sum(r.cached_tokens for r in runs["kvgate"].records) > 0
    assert served["kvgate"] > served["kvgate-prefix-blind"]
