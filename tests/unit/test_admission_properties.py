"""Random operation sequences against a controller with predicted reservations, live correction,
SLOs and a concurrency cap: the KV and in-flight accounting must add up after every step, and
nothing may leak once everything is released or gone."""

from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvgate_agent.admission import (
    AdmissionConfig,
    AdmissionController,
    AdmissionRequest,
    Outcome,
    Reason,
    ResolvedLimit,
    Ticket,
    Waiter,
)
from kvgate_agent.admission.predictor import MIN_SAMPLES
from kvgate_agent.contract.policy import LimitScope, OverloadAction, ReservationMode
from kvgate_bench.kit.toolkit import FakeClock

CAPACITY = 6144
BLOCK = 16
MAX_CONCURRENCY = 6
QUEUE_LENGTH = 6
SLO_MIN_PRIORITY = 1


def config(actions: tuple[OverloadAction, ...], **kw: Any) -> AdmissionConfig:
    cfg = AdmissionConfig(
        limits=(
            ResolvedLimit(
                name="t",
                per=LimitScope.TENANT,
                request_rate=5.0,
                request_capacity=10.0,
                cost_rate=2000.0,
                cost_capacity=20_000.0,
                warmup_seconds=0.0,
            ),
        ),
        max_concurrency=MAX_CONCURRENCY,
        kv_capacity_tokens=CAPACITY,
        block_size=BLOCK,
        queue_max_length=QUEUE_LENGTH,
        queue_max_wait_seconds=3.0,
        actions=actions,
        min_max_tokens=16,
        reservation=ReservationMode.PREDICTED,
        reservation_quantile=0.9,
        ttft_slo_seconds=1.0,
        tpot_slo_seconds=0.02,
        slo_min_priority=SLO_MIN_PRIORITY,
    )
    return dataclasses.replace(cfg, **kw)


class PredictedAdmissionMachine(RuleBasedStateMachine):
    ACTIONS: tuple[OverloadAction, ...] = (OverloadAction.QUEUE, OverloadAction.REJECT)

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock(1000.0)
        self.c = AdmissionController(config(self.ACTIONS), self.clock)
        self.tickets: list[Ticket] = []
        self.waiters: list[Waiter] = []
        # Enough settled requests that the length predictor answers (the pooled keys of model
        # m, band 12, and model None, band 10), each from a tenant of its own (fresh buckets).
        for model, max_tokens, produced in (("m", 4096, 100), (None, 1000, 50)):
            for i in range(MIN_SAMPLES):
                r = AdmissionRequest(f"warm{i}", 10, max_tokens, model=model)
                d = self.c.submit(r)
                assert d.ticket is not None, d
                self.c.release(d.ticket, completion_tokens=produced)
        assert self.c.predicted_output_tokens("c", None, 1000) is not None
        # Those 40 departures spread over the next interval give a departure rate of about 4
        # per second: a queue of a few waiters already exceeds the 1 s TTFT budget.
        self.clock.advance(10.0)

    def _collect(self) -> None:
        for w in self.c.take_resolved():
            self.waiters.remove(w)
            d = w.decision
            assert d is not None
            if d.ticket is not None:
                self.tickets.append(d.ticket)
            else:
                assert d.status in (400, 429, 503), d

    # ------------------------------------------------------------------ rules

    @rule(
        tenant=st.sampled_from("abc"),
        model=st.sampled_from(["m", None]),
        prompt=st.integers(1, 800),
        max_tokens=st.sampled_from([1, 16, 100, 256, 1000, 2000, 3000, 4096]),
        priority=st.integers(-1, 2),
        n=st.sampled_from([1, 1, 1, 2]),
        predicted=st.one_of(st.none(), st.integers(0, 3000)),
    )
    def submit(
        self,
        tenant: str,
        model: str | None,
        prompt: int,
        max_tokens: int,
        priority: int,
        n: int,
        predicted: int | None,
    ) -> None:
        r = AdmissionRequest(
            tenant,
            prompt,
            max_tokens,
            priority=priority,
            n=n,
            model=model,
            predicted_output_tokens=predicted,
        )
        d = self.c.submit(r)
        if d.waiter is not None:
            assert d.outcome is Outcome.QUEUED
            self.waiters.append(d.waiter)
        elif d.ticket is not None:
            self.tickets.append(d.ticket)
        else:
            assert d.status in (400, 429), d
            assert d.status == 400 or (d.retry_after is not None and d.retry_after >= 1)
            if d.reason is Reason.SLO:
                assert priority >= SLO_MIN_PRIORITY
        self._collect()

    @precondition(lambda self: self.tickets)
    @rule(i=st.integers(0, 100), delta=st.integers(1, 400), dt=st.floats(0, 0.2))
    def observe_tokens(self, i: int, delta: int, dt: float) -> None:
        t = self.tickets[i % len(self.tickets)]
        self.clock.advance(dt)
        self.c.live.observe_tokens(t, min(t.n * t.max_tokens, t.generated + delta))
        self._collect()

    @precondition(lambda self: self.tickets)
    @rule(delta=st.integers(1, 200), dt=st.floats(0, 0.2))
    def stream_all(self, delta: int, dt: float) -> None:
        self.clock.advance(dt)
        for t in list(self.tickets):
            self.c.live.observe_tokens(t, min(t.n * t.max_tokens, t.generated + delta))
        self._collect()

    @precondition(lambda self: self.tickets)
    @rule(i=st.integers(0, 100), extra=st.integers(0, 500), reached=st.booleans())
    def release(self, i: int, extra: int, reached: bool) -> None:
        t = self.tickets.pop(i % len(self.tickets))
        used = min(t.n * t.max_tokens, t.generated + extra)
        assert self.c.release(t, completion_tokens=used, reached_upstream=reached)
        self.c.live.observe_tokens(t, used + 10)  # after release: a no-op
        self.c.pump()
        self._collect()

    @precondition(lambda self: self.waiters)
    @rule(i=st.integers(0, 100))
    def cancel(self, i: int) -> None:
        w = self.waiters.pop(i % len(self.waiters))
        self.c.cancel(w)

    @rule(dt=st.floats(0, 4))
    def advance(self, dt: float) -> None:
        self.clock.advance(dt)
        self.c.pump()
        self._collect()

    @rule()
    def pump(self) -> None:
        self.c.pump()
        self._collect()

    @rule(
        reservation=st.sampled_from(ReservationMode),
        quantile=st.sampled_from([0.5, 0.9, 0.99]),
        tpot=st.sampled_from([None, 0.001, 0.02, 1.0]),
        ttft=st.sampled_from([None, 0.1, 1.0, 10.0]),
        max_concurrency=st.integers(1, MAX_CONCURRENCY),
    )
    def reconfigure(
        self,
        reservation: ReservationMode,
        quantile: float,
        tpot: float | None,
        ttft: float | None,
        max_concurrency: int,
    ) -> None:
        """A changed policy (same KV capacity): tickets and waiters stay."""
        self.c.reconfigure(
            config(
                self.ACTIONS,
                reservation=reservation,
                reservation_quantile=quantile,
                tpot_slo_seconds=tpot,
                ttft_slo_seconds=ttft,
                max_concurrency=max_concurrency,
            )
        )
        self.c.pump()
        self._collect()

    @rule(used=st.one_of(st.none(), st.integers(0, 2 * CAPACITY)))
    def engine_kv(self, used: int | None) -> None:
        self.c.live.observe_engine_kv(used)

    # ------------------------------------------------------------------ invariants

    @invariant()
    def accounting_adds_up(self) -> None:
        c = self.c
        live = self.tickets
        assert c.stats().in_flight == len(live) <= MAX_CONCURRENCY
        assert c.stats().kv_reserved_tokens == sum(t.kv_tokens for t in live)
        growth = 0
        for t in live:
            assert not t.released
            assert t.kv_reserved_at_admission <= t.kv_tokens <= t.kv_max
            assert t.kv_tokens % BLOCK == 0
            growth += t.kv_tokens - t.kv_reserved_at_admission
        assert c.stats().kv_reserved_tokens <= CAPACITY + growth  # only growth may overflow
        assert c.stats().queue_length == len(self.waiters) <= QUEUE_LENGTH
        limit = c.stats().concurrency_limit
        assert limit is not None and limit <= MAX_CONCURRENCY
        if not any(t.kv_reserved_at_admission < t.kv_max for t in live):
            assert c.stats().kv_headroom_tokens == 0

    @invariant()
    def fair_counters_never_decrease(self) -> None:
        seen: dict[str, float] = getattr(self, "_counters", {})
        for tenant, counter, _ in self.c.tenant_stats().fair_shares:
            assert counter >= seen.get(tenant, 0.0) - 1e-9, tenant
            seen[tenant] = counter
        self._counters = seen

    def teardown(self) -> None:
        c = self.c
        # Every waiter expires (maxWait 3 s): refused, or admitted degraded.
        self.clock.advance(100.0)
        c.pump()
        self._collect()
        assert not self.waiters and c.stats().queue_length == 0
        for t in self.tickets:
            assert c.release(t, completion_tokens=t.generated)
        self.tickets = []
        c.pump()
        self._collect()
        assert not self.tickets
        assert c.stats().in_flight == 0 and c.stats().kv_reserved_tokens == 0
        assert c.stats().kv_headroom_tokens == 0
        assert c.stats().queue_length == 0


TestPredictedAdmissionMachine = PredictedAdmissionMachine.TestCase
TestPredictedAdmissionMachine.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None
)


class CancellingMachine(PredictedAdmissionMachine):
    """The same with Degrade first, ended by cancelling every waiter instead of letting them
    expire."""

    ACTIONS: tuple[OverloadAction, ...] = (
        OverloadAction.DEGRADE,
        OverloadAction.QUEUE,
        OverloadAction.REJECT,
    )

    def teardown(self) -> None:
        c = self.c
        for w in self.waiters:
            c.cancel(w)
        self.waiters = []
        assert c.stats().queue_length == 0
        for t in self.tickets:
            assert c.release(t, completion_tokens=0, reached_upstream=False)
        self.tickets = []
        c.pump()
        assert not c.take_resolved()
        assert c.stats().in_flight == 0 and c.stats().kv_reserved_tokens == 0
        assert c.stats().kv_headroom_tokens == 0


TestCancellingMachine = CancellingMachine.TestCase
TestCancellingMachine.settings = settings(max_examples=50, stateful_step_count=40, deadline=None)
