"""Reject precision and Retry-After error by replay: the driver's force_dispatch and probes, the
seeded sample, the figures on hand-made schedules whose answer is known, and the runner's
replays of the reported rows."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvgate_bench.effectiveness.arms.baselines import ConcurrencyCapArm, TokenBucketArm
from kvgate_bench.effectiveness.calibration import Calibration
from kvgate_bench.effectiveness.model.driver import simulate
from kvgate_bench.effectiveness.model.gate import REJECTED, SERVED, Arm, Gate
from kvgate_bench.effectiveness.model.schedule import INTERACTIVE, Request, Schedule, Tenant
from kvgate_bench.effectiveness.replay import (
    precision,
    replay_forced,
    replay_probes,
    retry_after_error,
    sample_rejected,
)
from kvgate_bench.effectiveness.runner import Task, replay_best, replay_units, run_all
from kvgate_bench.sim.sequences import EngineConfig
from kvgate_bench.sim.steptime import constant_profile

#: 10 ms per step, 20 us per prefill token: a 100-token prompt prefills in 12 ms.
STEP = constant_profile()
WIDE = EngineConfig(num_gpu_blocks=4096, max_num_seqs=256)
#: One running sequence at a time: a second request waits in the engine for the first.
SERIAL = EngineConfig(num_gpu_blocks=4096, max_num_seqs=1)
TENANTS = {"a": Tenant("a", INTERACTIVE), "b": Tenant("b", INTERACTIVE)}


def req(rid: str, at: float, out: int, tenant: str = "a") -> Request:
    return Request(rid, at, tenant, INTERACTIVE, 100, 1000, out)


def two_requests() -> Schedule:
    """``long`` (200 tokens, about 2 s) then ``late`` 1 ms after it (20 tokens)."""
    reqs = [req("long", 0.0, 200), req("late", 0.001, 20, "b")]
    return Schedule("hand", 1.0, 5.0, 0, TENANTS, reqs)


def cap1() -> Arm:
    """A concurrency cap of 1 with a 10 ms queue timeout: ``late`` is refused at 11 ms."""
    return ConcurrencyCapArm(cap=1, queue_timeout_s=0.01)


class Seen(Arm):
    """Wraps an arm; records the ids it is offered and told finished."""

    def __init__(self, inner: Arm) -> None:
        super().__init__()
        self.inner, self.name = inner, inner.name
        self.arrived: list[str] = []
        self.finished: list[str] = []

    def start(self, gate: Gate, now: float) -> None:
        super().start(gate, now)
        self.inner.start(gate, now)

    def on_arrival(self, req: Request, now: float) -> None:
        self.arrived.append(req.rid)
        self.inner.on_arrival(req, now)

    def on_finish(self, req: Request, output_tokens: int, now: float) -> None:
        self.finished.append(req.rid)
        self.inner.on_finish(req, output_tokens, now)

    def next_wake(self) -> float | None:
        return self.inner.next_wake()

    def on_wake(self, now: float) -> None:
        self.inner.on_wake(now)


def test_cap_one_refuses_the_second_request() -> None:
    run = simulate(two_requests(), cap1(), STEP, WIDE)
    late = run.record("late")
    assert late.outcome == REJECTED and late.finished_at == pytest.approx(0.011)
    assert run.record("long").outcome == SERVED


def test_forced_request_bypasses_the_arm() -> None:
    arm = Seen(cap1())
    run = simulate(two_requests(), arm, STEP, WIDE, force_dispatch=frozenset({"late"}))
    assert arm.arrived == ["long"] and arm.finished == ["long"]  # the arm never saw "late"
    late = run.record("late")
    assert late.outcome == SERVED and late.admitted_at == pytest.approx(0.001)
    assert late.output_tokens == 20


def test_precision_zero_when_the_rejected_request_would_have_met_its_slo() -> None:
    """On a wide engine ``late`` runs beside ``long``: TTFT ~ 20 ms, TPOT 10 ms: met."""
    sched = two_requests()
    met, _ = replay_forced(sched, cap1, STEP, "late", WIDE)
    assert met
    assert precision([met]) == 0.0


def test_precision_one_when_it_would_have_missed() -> None:
    """On a one-sequence engine ``late`` would have waited ~2 s behind ``long``: TTFT > 0.5 s."""
    sched = two_requests()
    run = simulate(sched, cap1(), STEP, SERIAL)
    assert run.record("late").outcome == REJECTED
    met, _ = replay_forced(sched, cap1, STEP, "late", SERIAL)
    assert not met
    assert precision([met]) == 1.0
    full = simulate(sched, cap1(), STEP, SERIAL, force_dispatch=frozenset({"late"}))
    first = full.record("late").first_token_at
    assert first is not None and first > 1.9  # behind the 200 decode steps of "long"


def test_replay_stops_once_the_answer_is_known() -> None:
    reqs = [req("long", 0.0, 200), req("late", 0.001, 20, "b"), req("after", 0.5, 300)]
    sched = Schedule("hand", 1.0, 5.0, 0, TENANTS, reqs)
    run = simulate(
        sched, cap1(), STEP, WIDE, force_dispatch=frozenset({"late"}), stop_when_known=True
    )
    assert run.stopped_early and run.record("late").outcome == SERVED
    assert run.end_s < 0.5  # "late" finished at ~0.2 s; nothing after it was simulated


class ClosedUntil(Arm):
    """Refuses every arrival before ``until`` with Retry-After ``suggest``; admits after."""

    name = "closed-until"

    def __init__(self, until: float, suggest: float) -> None:
        super().__init__()
        self.until, self.suggest = until, suggest
        self.offered: list[tuple[str, float]] = []

    def on_arrival(self, req: Request, now: float) -> None:
        self.offered.append((req.rid, now))
        if now < self.until:
            self.gate.reject(req, now, self.suggest)
        else:
            self.gate.dispatch(req, now)


def test_probes_find_the_first_admitted_retry() -> None:
    sched = Schedule("hand", 1.0, 5.0, 0, TENANTS, [req("x", 1.0, 5)])
    arm = ClosedUntil(until=3.0, suggest=5.0)
    run = simulate(sched, arm, STEP, WIDE, probes={"x": [0.5, 1.0, 2.0, 4.0]})
    # Offered at 1 (refused), 1.5 and 2 (refused), 3 (admitted); 5 is never offered.
    assert arm.offered == [("x", 1.0), ("x~0", 1.5), ("x~1", 2.0), ("x~2", 3.0)]
    assert run.probe_waits == {"x": pytest.approx(2.0)}
    assert run.record("x").outcome == REJECTED
    served = [r for r in run.probe_records if r.outcome == SERVED]
    assert [r.request.rid for r in served] == ["x~2"] and served[0].output_tokens == 5
    waits, _ = replay_probes(sched, lambda: ClosedUntil(3.0, 5.0), STEP, {"x": 5.0}, WIDE)
    assert waits == {"x": pytest.approx(2.0)}
    err = retry_after_error({"x": 5.0}, waits)
    assert err.median_s == pytest.approx(3.0) and err.median_abs_s == pytest.approx(3.0)
    assert (err.samples, err.censored) == (1, 0)


def test_probes_give_up_after_the_last_delta() -> None:
    sched = Schedule("hand", 1.0, 5.0, 0, TENANTS, [req("x", 1.0, 5)])
    waits, _ = replay_probes(
        sched, lambda: ClosedUntil(100.0, 1.0), STEP, {"x": 1.0}, WIDE, deltas=(0.5, 2.0)
    )
    assert waits == {"x": None}
    err = retry_after_error({"x": 1.0}, waits)
    assert err.median_s is None and (err.samples, err.censored) == (0, 1)
    with pytest.raises(ValueError, match="> 0"):
        simulate(sched, ClosedUntil(0, 1), STEP, WIDE, probes={"x": [0.0]})


def test_a_queued_probe_is_one_outstanding_retry() -> None:
    """Behind a cap of 1 with a 1.5 s queue timeout, a copy offered at 0.1 s queues and is
    refused at 1.6 s: the probe times in between are skipped, the next copy goes at 2 s."""
    reqs = [req("long", 0.0, 400), req("late", 0.001, 20, "b")]
    sched = Schedule("hand", 1.0, 5.0, 0, TENANTS, reqs)
    arm = Seen(ConcurrencyCapArm(cap=1, queue_timeout_s=1.5))
    run = simulate(sched, arm, STEP, WIDE, probes={"late": [0.1, 0.5, 1.0, 2.0, 4.0]})
    # "late" refused at 1.501; copies at 1.601 (queued, "long" ends ~4 s: refused 3.101)...
    copies = [r.request for r in run.probe_records]
    assert [c.rid for c in copies] == ["late~0", "late~3"]
    assert copies[0].arrival_s == pytest.approx(1.601)
    assert copies[1].arrival_s == pytest.approx(3.501)  # first delta after 3.101: 2.0
    assert run.probe_records[0].outcome == REJECTED
    assert run.probe_waits["late"] == pytest.approx(2.0)  # admitted, once "long" ended
    assert run.probe_records[1].outcome == SERVED


def token_bucket(rate_rps: float) -> Callable[[], Arm]:
    from kvgate_bench.effectiveness.arms.context import ArmContext

    ctx = ArmContext(WIDE, {"a": Tenant("a", INTERACTIVE)}, rate_rps, 1e9)
    return lambda: TokenBucketArm(ctx, factor=1.0, burst_s=1.0)


def test_token_bucket_retry_after_against_replay() -> None:
    """A bucket of 1 request refilled at 0.4/s: ``b`` at 0.5 s finds 0.2 left and is told
    ceil(0.8 / 0.4) = 2 s; the bucket is full 2 s after the refusal, so the copy offered at
    +2 s is admitted: error 0. ``c`` at 0.6 s (told 2 s as well, ceil(1.96)) is next in the
    refilled bucket only after ``b``'s copy took it."""
    reqs = [req("a0", 0.0, 5), req("b", 0.5, 5), req("c", 0.6, 5)]
    sched = Schedule("hand", 1.0, 5.0, 0, {"a": Tenant("a", INTERACTIVE)}, reqs)
    make = token_bucket(0.4)
    run = simulate(sched, make(), STEP, WIDE)
    rej = {r.request.rid: r.retry_after_s for r in run.records if r.outcome == REJECTED}
    assert rej == {"b": 2.0, "c": 2.0}
    waits, _ = replay_probes(sched, make, STEP, {"b": 2.0}, WIDE)
    assert waits == {"b": pytest.approx(2.0)}
    both, _ = replay_probes(sched, make, STEP, {"b": 2.0, "c": 2.0}, WIDE)
    assert both["b"] == pytest.approx(2.0)
    c = both["c"]
    assert c is not None and c > 2.0  # b's admitted copy emptied the bucket again
    err = retry_after_error({"b": 2.0, "c": 2.0}, both)
    assert err.median_s is not None and err.median_s < 0  # told too short, on the median


def test_sample_is_seeded_bounded_and_arm_refusals_only() -> None:
    reqs = [req("long", 0.0, 300)] + [req(f"r{i}", 0.01 * (i + 1), 5) for i in range(30)]
    sched = Schedule("hand", 1.0, 5.0, 0, TENANTS, reqs)
    run = simulate(sched, cap1(), STEP, WIDE)
    refused = {r.request.rid for r in run.records if r.outcome == REJECTED}
    assert len(refused) == 30
    a = [r.request.rid for r in sample_rejected(run.records, 8, seed=3)]
    assert a == [r.request.rid for r in sample_rejected(run.records, 8, seed=3)]
    assert len(a) == 8 and set(a) <= refused
    assert a != [r.request.rid for r in sample_rejected(run.records, 8, seed=4)]
    assert len(sample_rejected(run.records, 100, seed=3)) == 30
    assert sample_rejected(run.records, 8, seed=3, with_retry_after=True) == []


def test_replay_best_fills_the_reported_rows() -> None:
    cal = Calibration("multi-tenant", "h100-llama3-8b", 1400.0, 5.0, 150.0, 1000.0)
    params = (("cap", 4), ("queue_timeout_s", 0.05))
    tb = (("burst_s", 2.0), ("factor", 0.2))
    tasks = [
        Task("multi-tenant", 2.0, 1, "concurrency-cap", params, "h100-llama3-8b", 8.0, cal, 4),
        Task("multi-tenant", 2.0, 1, "none", (), "h100-llama3-8b", 8.0, cal, 4),
        Task("multi-tenant", 2.0, 1, "token-bucket", tb, "h100-llama3-8b", 8.0, cal, 4),
    ]
    rows = run_all(tasks, 1)
    assert rows[0]["rejected"] > 4 and rows[1]["rejected"] == 0 and rows[2]["rejected"] > 4
    units = replay_units(tasks, rows, rows)
    # 4 forced replays per row with refusals, and 4 probe replays (one each) for the bucket's.
    assert [(u.row, u.rid is None) for u in units].count((2, True)) == 4
    assert all(len(u.suggested) == 1 for u in units if u.rid is None)
    assert len(units) == 12
    cpu = replay_best(tasks, rows, rows, 1)
    cap, none, bucket = rows
    assert bucket["retry_after_samples"] + bucket["retry_after_censored"] == 4
    assert bucket["retry_after_error_s"] is not None
    assert cap["reject_replays"] == 4 and cap["reject_precision"] is not None
    assert 0.0 <= cap["reject_precision"] <= 1.0
    assert cap["retry_after_error_s"] is None and cap["retry_after_samples"] == 0  # no hint
    assert none["reject_precision"] is None and none["reject_replays"] == 0
    assert cpu == pytest.approx(cap["replay_cpu_s"] + bucket["replay_cpu_s"]) and cpu > 0
    assert all("replay_sample" not in r for r in rows)
