"""Predicted reservations, live correction as tokens stream, and SLO shedding, through the
admission controller with an injected clock."""

from __future__ import annotations

from typing import Any

import pytest

from kvgate_agent.admission import (
    AdmissionConfig,
    AdmissionController,
    AdmissionRequest,
    Decision,
    Outcome,
    Reason,
    ResolvedLimit,
    Ticket,
    retry_after_seconds,
    round_up,
)
from kvgate_agent.admission.limits import ENGINE_KV_TTL_S
from kvgate_agent.admission.predictor import BIN_RATIO, MIN_SAMPLES
from kvgate_agent.admission.slo import INTERVAL_S, SHED_FACTOR
from kvgate_agent.admission.step_table import bucket_of
from kvgate_agent.contract.policy import LimitScope, OverloadAction, QueueOrder, ReservationMode
from kvgate_bench.kit.toolkit import FakeClock

BLOCK = 16
PROMPT = 50


def make(clock: FakeClock | None = None, **kw: Any) -> tuple[AdmissionController, FakeClock]:
    clock = clock or FakeClock(1000.0)
    cfg_kw: dict[str, Any] = {"kv_capacity_tokens": 100_000, "block_size": BLOCK}
    cfg_kw.update(kw)
    return AdmissionController(AdmissionConfig(**cfg_kw), clock), clock


def req(max_tokens: int = 4096, prompt: int = PROMPT, **kw: Any) -> AdmissionRequest:
    kw.setdefault("tenant", "a")
    return AdmissionRequest(prompt_tokens=prompt, max_tokens=max_tokens, **kw)


def admitted(d: Decision) -> Ticket:
    assert d.ticket is not None, d
    return d.ticket


def train(c: AdmissionController, clock: FakeClock, count: int, tokens: int, **kw: Any) -> None:
    """Admit and settle ``count`` requests (max_tokens 4096) that produced ``tokens`` each."""
    for _ in range(count):
        t = admitted(c.submit(req(**kw)))
        clock.advance(0.01)
        assert c.release(t, completion_tokens=tokens)


# ---------------------------------------------------------------- reservation size


def test_predicted_reservation_after_enough_settled_requests() -> None:
    c, clock = make()
    assert c.predicted_output_tokens("a", None, 4096) is None
    first = admitted(c.submit(req()))
    assert first.kv_tokens == round_up(PROMPT + 4096, BLOCK)  # no samples: the worst case
    c.release(first, completion_tokens=100)
    train(c, clock, MIN_SAMPLES, 100)
    pred = c.predicted_output_tokens("a", None, 4096)
    assert pred is not None and 100 <= pred < 100 * BIN_RATIO
    t = admitted(c.submit(req()))
    assert t.kv_tokens == round_up(PROMPT + pred, BLOCK)
    assert t.kv_tokens < round_up(PROMPT + 4096, BLOCK)
    assert t.kv_reserved_at_admission == t.kv_tokens
    assert t.kv_max == round_up(PROMPT + 4096, BLOCK)
    assert c.stats().kv_reserved_tokens == t.kv_tokens
    # Another tenant, same model and band: the pooled key serves it.
    u = admitted(c.submit(req(tenant="b")))
    assert u.kv_tokens == round_up(PROMPT + pred, BLOCK)


def test_prediction_is_capped_by_max_tokens() -> None:
    c, clock = make()
    train(c, clock, MIN_SAMPLES + 5, 3000)  # band 12 (max_tokens 4096), outputs ~3000
    t = admitted(c.submit(req(max_tokens=2049)))  # same band, lower cap
    assert t.kv_tokens == round_up(PROMPT + 2049, BLOCK) == t.kv_max


def test_n_choices_scale_the_prediction() -> None:
    c, _clock = make()
    for _ in range(MIN_SAMPLES):
        t = admitted(c.submit(req(n=2)))
        c.release(t, completion_tokens=200)  # 100 per choice
    pred = c.predicted_output_tokens("a", None, 4096)
    assert pred is not None and 100 <= pred < 100 * BIN_RATIO
    t = admitted(c.submit(req(n=2)))
    # Each choice is its own sequence: the prompt's full blocks once, then per choice its last
    # partial prompt block and its output, rounded up to whole blocks.
    full = PROMPT // BLOCK * BLOCK
    assert t.kv_tokens == full + 2 * round_up(PROMPT - full + pred, BLOCK)
    assert t.kv_max == full + 2 * round_up(PROMPT - full + 4096, BLOCK)


def test_max_tokens_mode_keeps_the_worst_case() -> None:
    c, clock = make(reservation=ReservationMode.MAX_TOKENS)
    train(c, clock, MIN_SAMPLES + 10, 100)
    t = admitted(c.submit(req()))
    assert t.kv_tokens == round_up(PROMPT + 4096, BLOCK) == t.kv_max
    o = admitted(c.submit(req(predicted_output_tokens=10)))  # the override is ignored too
    assert o.kv_tokens == round_up(PROMPT + 4096, BLOCK)
    c.live.observe_tokens(t, 500)
    assert t.kv_tokens == t.kv_max  # nothing to grow
    assert c.stats().kv_headroom_tokens == 0


def test_predicted_output_tokens_override_is_used() -> None:
    c, clock = make()
    t = admitted(c.submit(req(predicted_output_tokens=300)))
    assert t.kv_tokens == round_up(PROMPT + 300, BLOCK)
    # Over the trained predictor too.
    train(c, clock, MIN_SAMPLES, 100)
    u = admitted(c.submit(req(predicted_output_tokens=1000)))
    assert u.kv_tokens == round_up(PROMPT + 1000, BLOCK)
    # Never past max_tokens.
    v = admitted(c.submit(req(max_tokens=64, predicted_output_tokens=1000)))
    assert v.kv_tokens == round_up(PROMPT + 64, BLOCK) == v.kv_max
    # A zero prediction still holds one output token.
    w = admitted(c.submit(req(predicted_output_tokens=0, prompt=BLOCK)))
    assert w.kv_tokens == round_up(BLOCK + 1, BLOCK)


# ---------------------------------------------------------------- live correction


def test_observe_tokens_grows_block_by_block_up_to_the_worst_case() -> None:
    c, clock = make()
    t = admitted(c.submit(req(predicted_output_tokens=100)))
    base = t.kv_tokens
    assert base == round_up(PROMPT + 100, BLOCK)
    kv_max = t.kv_max
    prev = base
    for g in range(1, 4300):
        clock.advance(0.001)
        c.live.observe_tokens(t, g)
        kv = t.kv_tokens
        assert kv % BLOCK == 0
        assert prev <= kv <= kv_max
        assert kv - prev <= BLOCK  # one block at a time
        assert kv >= min(kv_max, PROMPT + g + 1)  # the next token always has a place
        if PROMPT + g < base:
            assert kv == base  # nothing grows before the sequence outgrows the reservation
        assert c.stats().kv_reserved_tokens == kv
        prev = kv
    assert t.kv_tokens == kv_max == round_up(PROMPT + 4096, BLOCK)
    assert t.kv_reserved_at_admission == base
    assert c.release(t, completion_tokens=4096)
    assert c.stats().kv_reserved_tokens == 0 and c.stats().in_flight == 0


def test_observe_tokens_ignores_counts_that_do_not_increase() -> None:
    c, _clock = make()
    t = admitted(c.submit(req(predicted_output_tokens=10)))
    c.live.observe_tokens(t, 200)
    kv = t.kv_tokens
    assert kv == round_up(PROMPT + 201, BLOCK)
    c.live.observe_tokens(t, 150)
    c.live.observe_tokens(t, 200)
    assert t.kv_tokens == kv and t.generated == 200
    assert c.stats().kv_reserved_tokens == kv


def test_observe_tokens_after_release_is_a_no_op() -> None:
    c, clock = make()
    t = admitted(c.submit(req(predicted_output_tokens=10)))
    c.live.observe_tokens(t, 5)
    assert c.release(t, completion_tokens=5)
    assert c.stats().kv_reserved_tokens == 0
    kv = t.kv_tokens
    clock.advance(1.0)
    c.live.observe_tokens(t, 3000)
    assert c.stats().kv_reserved_tokens == 0 and c.stats().in_flight == 0
    assert t.kv_tokens == kv and t.generated == 5
    assert not c.release(t, completion_tokens=3000)


def test_two_tickets_grow_independently_and_release_to_zero() -> None:
    c, clock = make()
    a = admitted(c.submit(req(predicted_output_tokens=10)))
    b = admitted(c.submit(req(predicted_output_tokens=10, n=2)))
    for g in range(1, 600):
        clock.advance(0.001)
        c.live.observe_tokens(a, g)
        c.live.observe_tokens(b, 2 * g)
        assert c.stats().kv_reserved_tokens == a.kv_tokens + b.kv_tokens
    assert a.kv_tokens <= a.kv_max and b.kv_tokens <= b.kv_max
    c.release(a, completion_tokens=599)
    assert c.stats().kv_reserved_tokens == b.kv_tokens
    c.release(b, completion_tokens=1198)
    assert c.stats().kv_reserved_tokens == 0 and c.stats().in_flight == 0


def test_headroom_kept_for_predicted_reservations_after_overruns() -> None:
    c, _clock = make()
    for _ in range(10):  # predicted 10, produced 500: each grew
        t = admitted(c.submit(req(predicted_output_tokens=10)))
        c.live.observe_tokens(t, 500)
        c.release(t, completion_tokens=500)
    assert c.stats().kv_headroom_tokens == 0  # nothing predicted in flight
    t = admitted(c.submit(req(predicted_output_tokens=10)))
    assert c.stats().kv_headroom_tokens > 0
    c.release(t, completion_tokens=10)
    assert c.stats().kv_headroom_tokens == 0


# ---------------------------------------------------------------- engine's KV figure


def test_observe_engine_kv_blocks_admission() -> None:
    c, _ = make(kv_capacity_tokens=10_000, actions=(OverloadAction.REJECT,))
    c.live.observe_engine_kv(9_990)
    d = c.submit(req(max_tokens=100))
    assert d.outcome is Outcome.REJECTED and d.reason is Reason.KV_CAPACITY
    assert d.status == 429 and d.retry_after is not None and d.retry_after >= 1
    c.live.observe_engine_kv(100)  # the engine's figure counts only where it is the larger
    admitted(c.submit(req(max_tokens=100)))
    c.live.observe_engine_kv(None)
    admitted(c.submit(req(max_tokens=100)))


# ---------------------------------------------------------------- SLO shedding


def slo_controller(**kw: Any) -> tuple[AdmissionController, FakeClock]:
    """Concurrency 2, TTFT SLO 1.8 s for priority >= 1, requests holding their place 0.5 s: a
    full server frees a place every 0.25 s."""
    c, clock = make(
        kv_capacity_tokens=None,
        max_concurrency=2,
        ttft_slo_seconds=1.8,
        slo_min_priority=1,
        queue_max_wait_seconds=30.0,
        **kw,
    )
    for _ in range(4):  # each holds its place 0.5 s
        t = admitted(c.submit(req(max_tokens=10, priority=1)))
        clock.advance(INTERVAL_S)
        c.release(t, completion_tokens=10)
    assert c.slo.service_s == pytest.approx(0.5)
    for _ in range(2):  # fill the concurrency cap
        admitted(c.submit(req(max_tokens=10, priority=1)))
    return c, clock


def test_slo_request_queued_while_the_expected_wait_fits() -> None:
    c, clock = slo_controller()
    budget = c.slo.wait_budget()
    assert budget == pytest.approx(1.8)
    for k in range(3):  # expected waits 0.25, 0.5, 0.75 s
        d = c.submit(req(max_tokens=10, priority=1))
        assert d.outcome is Outcome.QUEUED and d.waiter is not None, (k, d)
        assert d.waiter.deadline - d.waiter.enqueued_at == pytest.approx(1.8)
        assert d.waiter.deadline <= clock() + 1.8 + 1e-9
    assert c.stats().queue_length == 3


def test_slo_request_refused_when_the_queue_is_long() -> None:
    c, _clock = slo_controller()
    # The two in flight were just admitted (mean age 0, so a residual of the whole 0.5 s
    # service time): the k-th newcomer waits 2 x 0.5 x min(k, 2) / 3 s for the first two
    # slots, then 0.5 / 2 s for each one more.
    for k in range(13):  # expected waits up to 3.42 s: within SHED_FACTOR x the 1.8 s budget
        assert c.submit(req(max_tokens=10, priority=1)).outcome is Outcome.QUEUED, k
    expected = c.slo.expected_wait(c.stats().queue_length, c.stats().in_flight, age_s=0.0)
    assert expected is not None
    assert expected == pytest.approx(2.0 / 3.0 + 12 * 0.25)  # 3.67 s > 2 x 1.8 s
    assert expected > SHED_FACTOR * 1.8
    d = c.submit(req(max_tokens=10, priority=1))
    assert d.outcome is Outcome.REJECTED and d.reason is Reason.SLO, d
    assert d.status == 429
    assert d.retry_after == retry_after_seconds(expected)
    assert c.stats().queue_length == 13  # not queued


def test_below_min_priority_never_slo_shed() -> None:
    c, _clock = slo_controller()
    for _ in range(3):
        assert c.submit(req(max_tokens=10, priority=1)).outcome is Outcome.QUEUED
    for _ in range(20):
        d = c.submit(req(max_tokens=10, priority=0))
        assert d.outcome is Outcome.QUEUED and d.waiter is not None, d
        assert d.waiter.deadline - d.waiter.enqueued_at == pytest.approx(30.0)  # maxWait
    # An SLO request still is, once enough of its own band waits ahead of it (bands are
    # served strictly by priority, so the 20 below do not count against it).
    reasons = [c.submit(req(max_tokens=10, priority=1)).reason for _ in range(30)]
    assert Reason.SLO in reasons and reasons[0] is Reason.OK


def test_wait_budget_shrinks_with_observed_prefill() -> None:
    c, clock = make(ttft_slo_seconds=2.0, max_concurrency=1)
    t = admitted(c.submit(req(max_tokens=10)))
    clock.advance(1.0)
    c.live.observe_tokens(t, 1)  # first token 1 s after admission: smoothed prefill 0.1 s
    assert c.slo.prefill_s == pytest.approx(0.1)
    d = c.submit(req(max_tokens=10))
    assert d.outcome is Outcome.QUEUED and d.waiter is not None
    assert d.waiter.deadline - d.waiter.enqueued_at == pytest.approx(1.9)


def test_no_slo_no_shedding() -> None:
    c, clock = make(kv_capacity_tokens=None, max_concurrency=1, queue_max_wait_seconds=30.0)
    for _ in range(4):
        t = admitted(c.submit(req(max_tokens=10, priority=1)))
        clock.advance(INTERVAL_S)
        c.release(t, completion_tokens=10)
    admitted(c.submit(req(max_tokens=10)))
    for _ in range(50):
        d = c.submit(req(max_tokens=10, priority=5))
        assert d.outcome is Outcome.QUEUED, d


# ---------------------------------------------------------------- what the expected wait counts


def test_slo_shedding_ignores_departures_for_a_tenant_rate_limit() -> None:
    limit = ResolvedLimit(
        name="t",
        per=LimitScope.TENANT,
        request_rate=2.0,  # one request per 0.5 s
        request_capacity=1.0,
        cost_rate=None,
        cost_capacity=None,
        warmup_seconds=0.0,
    )
    # A 0.9 s TTFT SLO: the other tenant's drain estimate (2 s) is past SHED_FACTOR x 0.9 s.
    c, clock = make(kv_capacity_tokens=None, limits=(limit,), ttft_slo_seconds=0.9)
    for _ in range(3):  # another tenant: each request holds its place 2 s
        t = admitted(c.submit(req(max_tokens=10, tenant="bg")))
        clock.advance(2.0)
        c.release(t, completion_tokens=10)
    assert c.slo.service_s == pytest.approx(2.0)
    admitted(c.submit(req(max_tokens=10)))
    d = c.submit(req(max_tokens=10))  # tenant a's bucket is empty: it refills in 0.5 s
    assert d.reason is not Reason.SLO, (d, d.message)
    assert d.outcome is Outcome.QUEUED  # 0.5 s of refill fits the 0.9 s budget


def test_slo_shedding_at_the_onset_of_a_burst() -> None:
    c, clock = make(kv_capacity_tokens=None, max_concurrency=8, ttft_slo_seconds=1.0)
    for _ in range(60):  # light load: one request per second, each lasting 0.2 s
        t = admitted(c.submit(req(max_tokens=10)))
        clock.advance(0.2)
        c.release(t, completion_tokens=10)
        clock.advance(0.8)
    for _ in range(8):  # a burst fills the 8 slots
        admitted(c.submit(req(max_tokens=10)))
    first = c.submit(req(max_tokens=10))
    assert first.outcome is Outcome.QUEUED
    second = c.submit(req(max_tokens=10))  # one ahead: the 8 in flight end within 0.2 s
    assert second.outcome is Outcome.QUEUED, second


def test_slo_wait_counts_only_waiters_ahead_in_priority_order() -> None:
    c, _clock = slo_controller(queue_order=QueueOrder.PRIORITY)
    for _ in range(20):  # no SLO (priority below slo_min_priority): queued behind the cap
        assert c.submit(req(max_tokens=10, priority=0)).outcome is Outcome.QUEUED
    d = c.submit(req(max_tokens=10, priority=2))  # first in priority order
    assert d.outcome is Outcome.QUEUED, (d, d.message)


# ---------------------------------------------------------------- the SLO loop, through the core


def stream_one_interval(
    c: AdmissionController, clock: FakeClock, tickets: list[Ticket], gap_s: float
) -> None:
    """Every ticket streams one token per ``gap_s`` for one measurement interval."""
    steps = max(1, round(INTERVAL_S / gap_s))
    for _ in range(steps):
        clock.advance(gap_s)
        for t in tickets:
            c.live.observe_tokens(t, t.generated + 1)


def test_streamed_gaps_over_target_lower_the_limit_and_under_it_raise_it() -> None:
    c, clock = make(kv_capacity_tokens=None, max_concurrency=8, tpot_slo_seconds=0.05)
    assert c.stats().concurrency_limit == 8
    tickets = [admitted(c.submit(req(max_tokens=4096))) for _ in range(8)]
    for t in tickets:
        c.live.observe_tokens(t, 1)  # first tokens: no gap yet
    for _ in range(6):  # 80 ms between tokens at 8 in flight, over the 50 ms target: nothing
        stream_one_interval(c, clock, tickets, 0.08)  # completed, so the gaps decide
    assert c.slo.table.mean[bucket_of(8)] == pytest.approx(0.08, rel=0.05)
    low = c.stats().concurrency_limit
    assert low == 4  # after 4 intervals in a row: in proportion (8 x 50 / 80 / 1.14), by half
    # The 8 still run (nothing finished): their gaps say nothing of 4 in flight, so the limit
    # does not wind further down.
    for _ in range(20):
        stream_one_interval(c, clock, tickets, 0.08)
    assert c.stats().concurrency_limit == 4
    # Half of them finish; 4 in flight stream fast, at the limit: it rises, one request per
    # service time (about 13 s here).
    for t in tickets[4:]:
        c.release(t, completion_tokens=t.generated)
    tickets = tickets[:4]
    assert c.submit(req(max_tokens=4096, priority=-1)).limit == "concurrency"
    for _ in range(100):
        stream_one_interval(c, clock, tickets, 0.01)
        while (lim := c.stats().concurrency_limit) is not None and c.stats().in_flight < lim:
            tickets.append(admitted(c.submit(req(max_tokens=4096))))
    # Up to 7: 8 was measured too slow within the last minute (it is tried again once stale).
    assert c.stats().concurrency_limit == 7


def test_non_streamed_responses_do_not_move_the_limit() -> None:
    c, clock = make(kv_capacity_tokens=None, max_concurrency=64, tpot_slo_seconds=0.05)
    for _ in range(200):  # 20 tokens in 2 s each (prefill included): not a TPOT measurement
        t = admitted(c.submit(req(max_tokens=100)))
        clock.advance(2.0)
        c.release(t, completion_tokens=20)
    assert c.slo.gap_s is None
    assert c.stats().concurrency_limit == 64


def test_an_engine_report_stops_counting_after_its_ttl() -> None:
    c, clock = make(kv_capacity_tokens=10_000, max_concurrency=None)
    c.live.observe_engine_kv(9_990)
    assert c.submit(req(max_tokens=100, priority=-1)).limit == "kv"  # sheddable: not queued
    clock.advance(ENGINE_KV_TTL_S + 0.1)  # no newer report: the old one no longer counts
    admitted(c.submit(req(max_tokens=100)))
