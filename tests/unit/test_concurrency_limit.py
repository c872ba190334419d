"""The adaptive concurrency limit on the learned step-time table: pure, in virtual time.

A small closed-loop engine (:class:`Engine`) drives :class:`SloState` as the sidecar's streams
do: every step each request in flight gets a token after ``step(n)`` seconds, a request that
finishes is replaced at once while the limit allows (the demand never stops), and the limit is
ticked every step. Lowering the limit bites only as requests finish, as on a real server.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvgate_agent.admission.concurrency_limit import TOLERANCE, ConcurrencyLimit
from kvgate_agent.admission.slo import SloState
from kvgate_agent.admission.step_table import (
    BUCKETS,
    MAX_CONCURRENCY,
    STALE_S,
    StepTable,
    bucket_low,
    bucket_of,
)
from kvgate_agent.admission.tpot_table import TpotTable


def table_step(points: dict[int, float]) -> Callable[[int], float]:
    """Seconds per step by batch size, interpolated between ``points`` and extended flat."""
    xs = sorted(points)

    def step(n: int) -> float:
        if n <= xs[0]:
            return points[xs[0]]
        for lo, hi in itertools.pairwise(xs):
            if n <= hi:
                return points[lo] + (points[hi] - points[lo]) * (n - lo) / (hi - lo)
        return points[xs[-1]]

    return step


class Engine:
    """A closed loop of requests of ``output`` tokens each on a step time ``step(n)``."""

    def __init__(
        self,
        state: SloState,
        step: Callable[[int], float],
        output: int = 40,
        prefill_s: float = 0.0,
    ) -> None:
        self.state, self.step, self.output, self.prefill_s = state, step, output, prefill_s
        self.now = 0.0
        # Each request: [tokens so far, last token time, first token time, requests in flight x
        # seconds over its gaps, admitted at].
        self.running: list[list[float]] = []
        self.completions = 0
        self.limits: list[tuple[int, int]] = []  # (completions, limit) after every step

    def fill(self) -> None:
        while len(self.running) < self.state.limit:
            self.running.append([0, -1.0, -1.0, 0.0, self.now])
        if len(self.running) >= self.state.limit:
            self.state.reached()

    def run(self, seconds: float) -> None:
        end = self.now + seconds
        while self.now < end:
            self.fill()
            n = len(self.running)
            self.now += self.step(n) + (
                self.prefill_s if any(r[0] == 0 for r in self.running) else 0
            )
            done = []
            for r in self.running:
                if r[1] < 0:
                    self.state.observe_first_token(self.now - r[4], n, self.now)
                    r[2] = self.now
                else:
                    gap = self.now - r[1]
                    self.state.observe_gap(gap, 1.0, n)
                    r[3] += n * gap
                r[0] += 1
                r[1] = self.now
                if r[0] >= self.output:
                    done.append(r)
            for r in done:
                self.running.remove(r)
                self.completions += 1
                self.state.observe_departure(self.now - r[4])
                decode = r[1] - r[2]
                self.state.observe_completion(r[3] / decode, decode / (r[0] - 1), self.now)
            self.state.tick(self.now, len(self.running))
            self.limits.append((self.completions, self.state.limit))


LLAMA_CPU = table_step({1: 0.022, 2: 0.063, 4: 0.078})


def test_buckets_are_exact_below_64_then_at_most_a_sixteenth_wide() -> None:
    assert [bucket_of(n) for n in (1, 2, 63)] == [1, 2, 63]
    assert bucket_of(0) == 1
    assert bucket_of(MAX_CONCURRENCY * 4) == BUCKETS - 1
    for i in range(1, BUCKETS - 1):
        lo, hi = bucket_low(i), bucket_low(i + 1)
        assert lo < hi and bucket_of(lo) == i and bucket_of(hi - 1) == i
        assert hi - lo == 1 or (hi - lo) / lo <= 1 / 16


@given(st.integers(min_value=1, max_value=MAX_CONCURRENCY))
def test_a_count_falls_in_the_bucket_that_starts_at_or_below_it(n: int) -> None:
    i = bucket_of(n)
    assert bucket_low(i) <= n < (bucket_low(i + 1) if i + 1 < BUCKETS else n + 1)


def test_the_table_learns_a_mean_per_concurrency_and_forgets_stale_levels() -> None:
    t = StepTable()
    for now in (0.5, 1.0):
        for _ in range(5):
            t.observe(2, 0.06, 1.0)
            t.observe(4, 0.08, 1.0)
        t.fold(now)
    assert t.mean[2] == pytest.approx(0.06) and t.mean[4] == pytest.approx(0.08)
    assert t.measured(2, 1.0) and not t.measured(3, 1.0)
    assert t.floor_s == pytest.approx(0.07)  # the lowest interval mean over all requests
    assert not t.measured(2, 1.0 + STALE_S + 0.1)  # stale: to be measured again


def test_a_4_slot_cpu_server_settles_at_2_within_20_completions_and_stays() -> None:
    # llama-server on one CPU thread: 22 ms a step with one sequence, 63 with two, 78 with
    # four; TPOT SLO 70 ms: the right concurrency is 2. The limit starts at the slots (4).
    s = SloState(0.07, None, 4, 0.0)
    e = Engine(s, LLAMA_CPU)
    e.run(120.0)
    after = [lim for done, lim in e.limits if done >= 20]
    assert after and after[0] == 2
    # It probes 3 again only once a level's measurement went stale; it is back at 2 at once.
    share_at_2 = sum(1 for lim in after if lim == 2) / len(after)
    assert share_at_2 > 0.85
    assert min(lim for _, lim in e.limits) >= 2  # no wind-up below the right level


def test_no_wind_up_while_long_requests_still_run_at_the_old_limit() -> None:
    # Long outputs (a service time of ~200 steps): the gaps stay labelled with the old
    # concurrency until requests finish, so the limit does not fall past what was measured.
    step = table_step({1: 0.02, 2: 0.03, 3: 0.05, 8: 0.2})
    s = SloState(0.04, None, 8, 0.0)
    e = Engine(s, step, output=200)
    e.run(60.0)
    assert min(lim for _, lim in e.limits) >= 2
    assert e.limits[-1][1] == 2


def test_an_h100_batch_grows_to_hundreds_of_sequences_from_the_default_start() -> None:
    # vLLM on an H100: 7.5 ms a step plus 80 us per sequence; a TPOT SLO of 50 ms allows about
    # (50 / p90 factor - 7.5) / 0.08, several hundred.
    s = SloState(0.05, None, None, 0.0)
    assert s.limit == SloState.DEFAULT_START
    e = Engine(s, lambda n: 0.0075 + 0.00008 * n, output=200)
    e.run(120.0)
    late = [lim for _, lim in e.limits[len(e.limits) // 2 :]]
    assert min(late) >= 400  # the right level is 531 (50 ms); buckets are 32 wide up there
    within = sum(1 for lim in late if 0.0075 + 0.00008 * lim <= 0.05 * 1.07) / len(late)
    assert within > 0.8  # a stale level above is probed again now and then, and left at once


def test_without_an_slo_the_limit_is_the_knee_within_the_tolerance_of_the_fastest() -> None:
    # Step 10 ms x (1 + n / 10): within 2.5x the fastest (11 ms at n = 1) up to n = 17.
    s2 = SloState(None, None, 1, 0.0)  # one at a time first: the fastest level is measured
    e2 = Engine(s2, lambda n: 0.010 * (1 + n / 10), output=30)
    e2.run(5.0)
    s2.retune(None, None, 64)
    e2.run(120.0)
    knee = max(n for n in range(1, 65) if 0.010 * (1 + n / 10) <= TOLERANCE * 0.011)
    assert abs(e2.limits[-1][1] - knee) <= 1


def test_the_ttft_side_binds_only_where_concurrency_is_the_cause() -> None:
    t = StepTable()
    for now in (0.5, 1.0):
        for n, ttft in ((1, 0.3), (2, 0.5), (3, 2.5)):
            t.observe_first_token(n, ttft, now)
            for _ in range(5):
                t.observe(n, 0.01, 1.0)
        t.fold(now)
    c = ConcurrencyLimit(3)
    for now in (1.5, 2.0, 2.5, 3.0):  # the gaps decide (nothing completed), after 4 intervals
        t.fold(now)
        t.folded.extend([1, 2, 3])
        c.decide(t, TpotTable(), now, tpot_s=0.1, ttft_s=2.0, reached=False, hold_s=1.0, cap=None)
    assert c.limit == 2  # 2.5 s > the 2 s SLO at 3; 0.5 s at 2 is within
    c = ConcurrencyLimit(3)
    for now in (1.5, 2.0, 2.5, 3.0):
        t.folded[:] = [1, 2, 3]
        c.decide(t, TpotTable(), now, tpot_s=0.1, ttft_s=0.25, reached=False, hold_s=1.0, cap=None)
    assert c.limit == 3  # even one request alone misses 0.25 s: not the concurrency's doing


def test_a_raise_waits_a_service_time_and_needs_the_limit_reached() -> None:
    t = StepTable()
    for now in (0.5, 1.0):
        for n in (1, 2):
            for _ in range(5):
                t.observe(n, 0.01 * n, 1.0)
        t.fold(now)
    c = ConcurrencyLimit(2)
    tp = TpotTable()
    kw = {"tpot_s": 0.1, "ttft_s": None, "hold_s": 5.0, "cap": None}
    c.decide(t, tp, 1.0, reached=False, **kw)  # type: ignore[arg-type]
    assert c.limit == 2
    c.decide(t, tp, 1.0, reached=True, **kw)  # type: ignore[arg-type]
    assert c.limit == 3  # a quarter up, at least one: a line through 1 and 2 predicts 0.03 at 3
    c.decide(t, tp, 2.0, reached=True, **kw)  # type: ignore[arg-type]
    assert c.limit == 3  # 3 is not measured yet, and a service time has not passed


def test_the_cap_bounds_the_limit() -> None:
    s = SloState(0.05, None, 3, 0.0)
    e = Engine(s, lambda n: 0.001 * n, output=20)
    e.run(30.0)
    assert max(lim for _, lim in e.limits) == 3


def test_completions_learn_tpot_by_mean_concurrency_and_a_pooled_p90_factor() -> None:
    tp = TpotTable()
    prior = tp.factor
    assert 1.0 < prior < 1.2
    for i in range(200):
        tp.observe(2.4, 0.05, float(i))  # labelled 2 (the mean concurrency, rounded)
        tp.observe(4.0, 0.08, float(i))
    assert tp.mean[2] == pytest.approx(0.05) and tp.mean[4] == pytest.approx(0.08)
    assert tp.factor == pytest.approx(1.0, abs=0.02)  # no spread around the levels' means
    assert tp.measured(2, 200.0) and not tp.measured(3, 200.0)
    for i in range(400):  # half the requests 30 % slower: the p90 moves above the mean
        tp.observe(2.0, 0.05 * (1.0 + 0.3 * (i % 2)), 200.0 + i)
    assert 1.1 < tp.factor < 1.4
    before = tp.factor
    tp.observe(2.0, 0.0, 700.0)  # no TPOT: ignored
    assert tp.factor == before
    assert math.isfinite(tp.factor)


def test_a_level_that_lowered_the_limit_is_probed_again_less_and_less_often() -> None:
    # 1 and 2 in flight are fast and a line through them says 3 is too, but 3 is slow: each
    # probe of it costs a service time of misses, so the wait before the next doubles.
    s = SloState(0.05, None, 1, 0.0)
    e = Engine(s, table_step({1: 0.02, 2: 0.03, 3: 0.08}))
    e.run(30.0)  # one at a time first: level 1 measured
    s.retune(0.05, None, 4)
    start = len(e.limits)
    e.run(900.0)
    late = e.limits[start:]
    probes = [i for i, ((_, a), (_, b)) in enumerate(itertools.pairwise(late)) if a < 3 <= b]
    assert 3 <= len(probes) <= 6  # one a minute would be about 14
    assert all(lim <= 3 for _, lim in late[probes[0] :])


def test_after_a_slowdown_the_limit_climbs_back_from_1() -> None:
    # Batching nearly free (40 ms + 2 ms a sequence), TPOT SLO 60 ms, cap 8: a minute five times
    # slower drives the limit to 1; once only level 1 is measured the next level is tried (no
    # shape to extend), and stale levels start again from their next samples.
    def step(n: int) -> float:
        return 0.040 + 0.002 * (n - 1)

    s = SloState(0.06, None, 8, 0.0)
    slow = [False]
    e = Engine(s, lambda n: step(n) * (5 if slow[0] else 1), output=50)
    e.run(60.0)
    assert s.limit >= 7
    slow[0] = True
    e.run(60.0)
    assert s.limit <= 2
    slow[0] = False
    e.run(300.0)
    assert s.limit >= 7


def test_one_lucky_gap_does_not_set_the_floor() -> None:
    t = StepTable()
    for now in (0.5, 1.0):
        for _ in range(20):
            t.observe(4, 0.04, 1.0)
        t.fold(now)
    t.observe(1, 0.001, 1.0)  # a quiet interval: one token, 1 ms after the one before
    t.fold(1.5)
    assert t.floor_s == pytest.approx(0.04)


def test_a_raise_extends_the_slope_over_a_span_not_two_neighbours_noise() -> None:
    # Levels 40-63 measured on 10 ms + 0.2 ms a sequence, but 63's mean came out 4 ms high (its
    # noise): the line through 62 and 63 climbs 4 ms a level and would forbid even 64, where
    # the line through 48 and 63 (SLOPE_SPAN: a quarter lower) allows 68 under the SLO.
    t = StepTable()
    for now in (0.5, 1.0):
        for n in range(40, 64):
            mean = 0.010 + 0.0002 * n + (0.004 if n == 63 else 0.0)
            for _ in range(5):
                t.observe(n, mean, 1.0)
        t.fold(now)
    c = ConcurrencyLimit(63)
    tp = TpotTable()  # no completions: the gaps decide, with the prior p90 factor
    slo = 0.0299 * tp.factor  # the target the gaps' mean must meet: 29.9 ms
    c.decide(t, tp, 1.0, tpot_s=slo, ttft_s=None, reached=True, hold_s=5.0, cap=None)
    assert c.limit == 68
