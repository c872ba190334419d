"""SloState: the measurements, the service time, the wait budget (the adaptive limit itself:
tests/unit/test_concurrency_limit.py)."""

from __future__ import annotations

import pytest

from kvgate_agent.admission.slo import (
    INTERVAL_S,
    MIN_WAIT_SHARE,
    RESIDUAL_FLOOR,
    UNLOADED_WAIT_FACTOR,
    SloState,
)
from kvgate_agent.admission.step_table import bucket_of
from kvgate_agent.contract.queue import DEFAULT_WAIT_SECONDS


class Driver:
    """Closes one measurement interval per :meth:`interval`, with a given inter-token time."""

    def __init__(self, state: SloState, now: float = 0.0) -> None:
        self.state = state
        self.now = now

    def interval(
        self, gap_s: float | None, in_flight: int = 0, departures: int = 0, reached: bool = False
    ) -> int | None:
        if gap_s is not None:
            self.state.observe_gap(gap_s * 10, 10, in_flight)
        for _ in range(departures):
            self.state.observe_departure(0.5)
        if reached:
            self.state.reached()
        self.now += INTERVAL_S
        self.state.tick(self.now, in_flight)
        return self.state.limit


def test_limit_starts_at_the_cap_or_the_default() -> None:
    assert SloState(0.05, None, 100, 0.0).limit == 100
    assert SloState(0.05, None, None, 0.0).limit == SloState.DEFAULT_START


def test_no_tick_before_the_interval_ends() -> None:
    s = SloState(0.05, None, 100, 0.0)
    s.observe_gap(1.0, 1, 100)
    s.tick(INTERVAL_S / 2, 0)
    assert s.gap_s is None and s.limit == 100 and s.service_s is None


def test_gaps_are_learned_per_concurrency_and_the_overall_mean_is_smoothed() -> None:
    s = SloState(0.05, None, 100, 0.0)
    d = Driver(s)
    d.interval(0.02, in_flight=3)
    assert s.gap_s == pytest.approx(0.02)
    assert s.table.mean[bucket_of(3)] == pytest.approx(0.02)
    assert s.table.mean[bucket_of(4)] == 0.0


def test_expected_wait_none_without_departures() -> None:
    s = SloState(None, 1.0, None, 0.0)
    assert s.expected_wait(0, 4) is None  # no release seen yet
    d = Driver(s)
    d.interval(None, departures=0)
    assert s.service_s is None
    assert s.expected_wait(3, 4) is None
    s.observe_departure(0.5)
    assert s.expected_wait(3, 0) is None  # nothing in flight: nothing to drain


def test_expected_wait_is_k_plus_one_times_service_over_in_flight() -> None:
    s = SloState(None, 1.0, None, 0.0)
    d = Driver(s)
    d.interval(None, departures=5)  # each held its place 0.5 s
    assert s.service_s == pytest.approx(0.5)
    # 5 in flight of 0.5 s each: a place frees every 0.1 s.
    assert s.expected_wait(0, 5) == pytest.approx(0.1)
    assert s.expected_wait(3, 5) == pytest.approx(0.4)
    assert s.expected_wait(3, 10) == pytest.approx(0.2)
    # Not the release rate: a full server after light load still drains at N / S.
    s.observe_departure(1.5)  # smoothed 0.5 + 0.05 x (1.5 - 0.5)
    assert s.service_s == pytest.approx(0.55)
    assert s.expected_wait(1, 5) == pytest.approx(2 * 0.55 / 5)


def test_expected_wait_from_the_age_of_the_requests_in_flight() -> None:
    s = SloState(None, 1.0, None, 0.0)
    for _ in range(3):
        s.observe_departure(4.0)
    assert s.service_s == pytest.approx(4.0)
    # One llama.cpp slot, its request 3 s into a 4 s service time: it ends in about 1 s, not 4.
    assert s.expected_wait(0, 1, age_s=3.0) == pytest.approx(1.0)
    assert s.expected_wait(0, 1) == pytest.approx(4.0)  # without the age: a whole service time
    # Past the mean service time it is a long one, not one about to end.
    assert s.expected_wait(0, 1, age_s=10.0) == pytest.approx(RESIDUAL_FLOOR * 4.0)
    # Steady state (mean age S / 2): residuals spread over [0, S], the k-th of n ends at
    # S k / (n + 1), about the drain k S / n.
    assert s.expected_wait(1, 7, age_s=2.0) == pytest.approx(4.0 * 2 / 8)
    # Beyond the n-th request in flight, one more per S / n.
    assert s.expected_wait(4, 2, age_s=0.0) == pytest.approx(2 * 4.0 * 2 / 3 + 3 * 4.0 / 2)
    # The engine's own waiting requests are ahead of all.
    s.observe_engine_waiting(2, until=10.0)
    assert s.expected_wait(0, 4, now=5.0, age_s=2.0) == pytest.approx(4.0 * 3 / 5)


def test_default_wait_follows_a_slow_first_token() -> None:
    s = SloState(None, None, None, 0.0)
    assert s.default_wait(DEFAULT_WAIT_SECONDS) == DEFAULT_WAIT_SECONDS  # nothing measured
    d = Driver(s)
    for _ in range(3):  # a GPU: first tokens in 40 ms; the default bound stays
        s.observe_first_token(0.04, 1, d.now)
        d.interval(0.01, in_flight=1)
    assert s.lowest_ttft_s == pytest.approx(0.04)
    assert s.default_wait(DEFAULT_WAIT_SECONDS) == DEFAULT_WAIT_SECONDS
    s2 = SloState(None, None, None, 0.0)
    d2 = Driver(s2)
    for _ in range(3):  # a CPU server: 0.8 s of prefill before the first token
        s2.observe_first_token(0.8, 1, d2.now)
        d2.interval(0.02, in_flight=1)
    assert s2.default_wait(DEFAULT_WAIT_SECONDS) == pytest.approx(UNLOADED_WAIT_FACTOR * 0.8)


def test_wait_budget_is_ttft_less_prefill_floored() -> None:
    s = SloState(None, 2.0, None, 0.0)
    assert s.wait_budget() == pytest.approx(2.0)
    s.observe_first_token(1.0, 1, 0.0)  # smoothed prefill 0.1
    assert s.prefill_s == pytest.approx(0.1)
    assert s.wait_budget() == pytest.approx(1.9)
    for _ in range(200):
        s.observe_first_token(10.0, 1, 0.0)
    assert s.prefill_s > 2.0
    assert s.wait_budget() == pytest.approx(MIN_WAIT_SHARE * 2.0)


def test_wait_budget_none_without_ttft() -> None:
    s = SloState(0.05, None, None, 0.0)
    s.observe_first_token(0.5, 1, 0.0)
    assert s.wait_budget() is None


def test_retune_keeps_and_clamps_the_limit() -> None:
    s = SloState(None, None, 50, 0.0)
    assert s.limit == 50  # the limit starts at the cap
    s.retune(0.05, None, 50)
    assert s.limit == 50
    s.retune(0.05, None, 20)
    assert s.limit == 20
    s.retune(None, None, 20)
    assert s.limit == 20
    s.retune(0.05, 1.0, None)  # the cap lifted: where an uncapped limit starts
    assert s.limit == SloState.DEFAULT_START
    assert s.ttft_seconds == 1.0


def test_a_cap_that_comes_and_goes_gives_back_the_limit_held_before_it() -> None:
    # An engine stall caps admission at 1 for its length (the sidecar's engine concurrency),
    # then lifts the cap: the limit held before comes back, not 1.
    s = SloState(0.05, None, None, 0.0)
    s.retune(0.05, None, 100)
    s.retune(0.05, None, None)
    assert s.limit == 100
    s.retune(0.05, None, 1)
    assert s.limit == 1
    s.retune(0.05, None, None)
    assert s.limit == 100
