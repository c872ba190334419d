"""SloState without a TPOT target: the gradient limit against the lowest smoothed inter-token
time (Gradient2 of https://github.com/Netflix/concurrency-limits), on a fake clock."""

from __future__ import annotations

import pytest

from kvgate_agent.admission import slo
from kvgate_agent.admission.slo import (
    FLOOR_DRIFT,
    GRADIENT_TOLERANCE,
    INTERVAL_S,
    MIN_LIMIT,
    SloState,
)


class FakeClock:
    """Closes one measurement interval per :meth:`interval` with a given inter-token time."""

    def __init__(self, state: SloState) -> None:
        self.state = state
        self.now = 0.0

    def interval(self, gap_s: float, in_flight: int | None = None) -> int:
        s = self.state
        s.observe_gap(gap_s * 20, 20)
        self.now += INTERVAL_S
        s.tick(self.now, s.limit if in_flight is None else in_flight)  # the limit is reached
        return s.limit


def settle(clock: FakeClock, gap_s: float, n: int = 100) -> None:
    for _ in range(n):
        clock.interval(gap_s)


def test_holds_at_the_cap_while_decoding_is_at_its_fastest() -> None:
    s = SloState(None, None, 200, 0.0)
    c = FakeClock(s)
    settle(c, 0.010)
    assert s.limit == 200
    assert s.floor_s is not None and abs(s.floor_s - 0.010) < 1e-9


@pytest.mark.parametrize("tolerance", [1.25, GRADIENT_TOLERANCE])
def test_lowers_the_limit_when_the_inter_token_time_doubles_and_recovers(
    tolerance: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(slo, "GRADIENT_TOLERANCE", tolerance)
    s = SloState(None, None, 200, 0.0)
    c = FakeClock(s)
    settle(c, 0.010)
    # The engine slows to twice what the tolerance allows: the limit falls, each interval by
    # at most smoothing x (1 - GRADIENT_MIN) of itself, never below MIN_LIMIT.
    prev = s.limit
    for _ in range(60):
        lim = c.interval(0.010 * tolerance * 2)
        assert MIN_LIMIT <= lim <= prev
        prev = lim
    low = s.limit
    assert low < 100
    # Back to its fastest: once the smoothed inter-token time is within the tolerance again,
    # the limit grows (about smoothing x sqrt(limit) per interval) up to the cap, never above.
    for _ in range(40):
        c.interval(0.010)
    assert s.gap_s is not None and s.gap_s < tolerance * 0.010
    prev = s.limit
    for _ in range(400):
        lim = c.interval(0.010)
        assert prev <= lim <= 200
        prev = lim
    assert s.limit == 200


def test_within_the_tolerance_the_limit_does_not_fall() -> None:
    s = SloState(None, None, 100, 0.0)
    c = FakeClock(s)
    settle(c, 0.010)
    settle(c, 0.010 * GRADIENT_TOLERANCE * 0.95)
    assert s.limit == 100


def test_never_below_min_limit() -> None:
    s = SloState(None, None, 100, 0.0)
    c = FakeClock(s)
    settle(c, 0.001)
    settle(c, 1.0, 500)
    assert s.limit == MIN_LIMIT


def test_application_limited_leaves_the_limit_alone() -> None:
    s = SloState(None, None, 100, 0.0)
    c = FakeClock(s)
    settle(c, 0.010)
    # Fewer than half the limit in flight and nothing stopped: a slow engine says nothing
    # about the limit.
    for _ in range(50):
        assert c.interval(0.050, in_flight=10) == 100


def test_no_cap_starts_at_the_default_and_grows_when_reached() -> None:
    s = SloState(None, None, None, 0.0)
    assert s.limit == SloState.DEFAULT_START
    c = FakeClock(s)
    settle(c, 0.010, 50)
    assert s.limit > SloState.DEFAULT_START


def test_the_floor_drifts_up_slowly_so_a_lower_one_seen_once_lets_go() -> None:
    s = SloState(None, None, 100, 0.0)
    c = FakeClock(s)
    settle(c, 0.005, 20)  # e.g. an idle server once
    assert s.floor_s is not None and s.floor_s < 0.0051
    settle(c, 0.020, 2000)
    assert s.floor_s is not None
    # ... rises towards the sustained inter-token time, by at most FLOOR_DRIFT of the distance
    # per interval.
    assert 0.005 < s.floor_s < 0.020
    assert s.floor_s <= 0.020 - (0.020 - 0.005) * (1 - FLOOR_DRIFT) ** 2000 + 1e-6
    settle(c, 0.020, 20000)
    assert s.limit == 100  # the floor caught up: the limit recovered to the cap


def test_the_tpot_target_keeps_its_aimd_limit() -> None:
    s = SloState(0.05, None, 100, 0.0)
    c = FakeClock(s)
    settle(c, 0.001, 10)
    # 2x the floor but under the TPOT target: the AIMD limit, not the gradient, decides.
    settle(c, 0.002 * GRADIENT_TOLERANCE, 100)
    assert s.limit == 100
