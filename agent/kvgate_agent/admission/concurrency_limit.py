"""The adaptive concurrency limit: the most requests in flight whose requests still meet the SLO,
read off what was learned by requests in flight (:mod:`.step_table`, :mod:`.tpot_table`).

**With a TPOT SLO** (``slo.tpotSeconds``): a level ``n`` is *good* when the 90th percentile of a
request's own TPOT there (:class:`.tpot_table.TpotTable`: completed requests' TPOT labelled
with the mean requests in flight beside them, times the pooled p90 factor) is at most the SLO,
and, under a TTFT SLO, the admission-to-first-token time there is at most :data:`TTFT_SHARE`
times it (this side binds only where a lower level meets it, i.e. where concurrency is the
cause). Until requests have completed at the levels in question, the
streams' inter-token gaps (:class:`.step_table.StepTable`) stand in for their TPOT. **Without
one** (an empty spec) a level is good while its requests' mean TPOT (the gaps' until requests
complete there) is within :data:`TOLERANCE` times the floor (the fastest decoding seen, drifting
up slowly): the knee of throughput against concurrency (for a step time ``a + c n`` each
sequence added there adds about ``1 / TOLERANCE**2`` of the first one's throughput).

Once per control interval:

* **Down** when a level at or under the limit was found not good in :data:`COMPLETED_STREAK`
  completions in a row (the gaps: :data:`BAD_STREAK` intervals), the last of them recent (the
  step time grows with the batch, so the lowest such level bounds the limit): to the largest
  measured good level below it, else in proportion from it (``n x target / predicted``, at
  least one less, at most by half: a step time that grows faster than the batch would
  overshoot). Only levels that were measured decide, so the limit cannot wind up: while the
  requests admitted under the old limit still run, their gaps and TPOT are labelled with what
  they ran beside, not with the new limit (Netflix's concurrency-limits AIMD keeps lowering on
  the aggregate latency until a service time has passed;
  https://github.com/Netflix/concurrency-limits).
* **Up** only when the limit stopped a request since the last interval (demand above it), the
  highest measured level at or under it is good, and a service time (admission to release,
  smoothed) has passed since the last raise: to the highest level up to ``limit + max(1, limit
  x RAISE_STEP)`` that is measured good or, unmeasured, predicted good by extending the
  highest measured level at or under the limit along a line through it and the highest measured
  at least :data:`SLOPE_SPAN` of it lower (never falling; with one measured level, the next level
  is tried), stopping below the first measured level that is
  not good or the first level that lowered the limit within its back-off (a minute, doubling
  each time it does so again, up to 16 minutes). A raise admits that many queued requests at
  once, whose prefills stall every stream, so it is a quarter at most: from a cold start the
  limit grows 1.25x per service time (64 to 256 in about six), while a 4-slot CPU server's
  limit moves one request at a time.

Floor 1 request; ceiling the policy's cap or the engine's slots (none: unbounded).

Invariant: pure and clock-injected; :meth:`ConcurrencyLimit.decide` runs once per control
interval (on whichever call closes it) and scans the buckets up to about the limit's: at most
225, a few microseconds compiled; every per-request call stays O(1).
"""

from __future__ import annotations

import math
from typing import Final, Protocol

from kvgate_agent.admission.step_table import (
    BUCKETS,
    STALE_S,
    StepTable,
    bucket_low,
    bucket_of,
)
from kvgate_agent.admission.tpot_table import TpotTable

#: Without a TPOT SLO, a level is good while its step time is within this many times the
#: fastest measured (Gradient2's ``rttTolerance`` in Netflix's concurrency-limits).
#: Chosen on the effectiveness benchmark, seed 1 (docs/benchmarks.md, "The claim on a real
#: engine (issue 33)").
TOLERANCE: Final = 2.5
#: Intervals in a row a level must be found not good before it lowers the limit (a burst of
#: newcomers' prefills is a transient of one or two).
BAD_STREAK: Final = 4
#: Seconds since a level's last sample within which it may still lower the limit (after that
#: it only stops raises, until stale).
FRESH_S: Final = 2.0
#: Completions in a row at a level whose TPOT says it is not good before it lowers the limit
#: (each is a whole request's TPOT: two suffice).
COMPLETED_STREAK: Final = 2
#: A level that lowered the limit is tried again by a raise only after this long at most, the
#: wait doubling from :data:`~.step_table.STALE_S` each time it lowers the limit again (a
#: probe of a level that is still too slow costs a service time of misses), seconds.
MAX_BACKOFF_S: Final = 960.0
#: The limit may rise by at most this share of itself (at least 1) per raise.
RAISE_STEP: Final = 0.25
#: Under a TTFT SLO, a level is good only while its admission-to-first-token time is at most
#: this share of the SLO (a level where even a request admitted at once misses it on average
#: serves nobody in time). Chosen on the effectiveness benchmark, seed 1 (h100 profile, load 2:
#: 0.6 and 0.8 held the limit lower for the noise of a burst's prefills: ``isolation`` 2,886
#: tokens/s at 0.8, 3,046 at 1.0; ``multi-tenant`` 2,405 and 2,446; ``conversation`` 2,981
#: and 2,973).
TTFT_SHARE: Final = 1.0
#: The slope a raise extends is taken between the highest measured level and the highest
#: measured at least this share of it lower (the lowest measured, if none is): two
#: neighbouring levels' means differ by their noise more than by their step time (on the h100
#: profile the limit sat at 63 for 45 s because 63's mean came out above 62's). Chosen on the
#: effectiveness benchmark, seed 1 (``multi-tenant`` 2,425 -> 2,459 tokens/s, ``isolation``
#: 3,163 -> 3,185; docs/benchmarks.md, "The raise's slope over a span").
SLOPE_SPAN: Final = 0.25


class Levels(Protocol):
    """What the limit reads of a table by requests in flight (:class:`.step_table.StepTable`,
    :class:`.tpot_table.TpotTable`): per bucket a mean (seconds per token), when it was last
    updated, whether it counts, and the buckets updated in the last interval."""

    mean: list[float]
    seen: list[float]
    folded: list[int]

    def measured(self, i: int, now: float) -> bool: ...


class ConcurrencyLimit:
    """The adaptive limit of one pod (see the module docstring).

    Args:
        start: the limit before anything is measured, requests (>= 1).

    Attributes:
        limit: requests allowed in flight now (>= 1).
        raise_after: clock seconds before which the limit is not raised again.
    """

    __slots__ = ("_backoff", "_blocked_until", "_streak", "limit", "raise_after")

    def __init__(self, start: int) -> None:
        self.limit = max(1, start)
        self.raise_after = 0.0
        #: Per table (gaps, completions) and bucket, the updates in a row that found it not good.
        self._streak: tuple[list[int], list[int]] = ([0] * BUCKETS, [0] * BUCKETS)
        #: Per bucket, clock seconds before which a raise does not try it again after it
        #: lowered the limit, and the wait the next time it does (doubled each time).
        self._blocked_until: list[float] = [0.0] * BUCKETS
        self._backoff: list[float] = [0.0] * BUCKETS

    def decide(
        self,
        table: StepTable,
        tpot: TpotTable,
        now: float,
        *,
        tpot_s: float | None,
        ttft_s: float | None,
        reached: bool,
        hold_s: float,
        cap: int | None,
    ) -> None:
        """Move :attr:`limit` once (clock seconds ``now``): ``tpot_s``/``ttft_s`` the SLOs
        (None: not set), ``reached`` whether the limit stopped a request since the last call,
        ``hold_s`` the seconds between two raises (a service time), ``cap`` the ceiling (None:
        none)."""
        ttft_bound = self._ttft_bound(table, now, ttft_s)
        limit = self.limit
        here = bucket_of(limit)
        if tpot_s is None:
            if table.floor_s <= 0.0:
                return
            target, factor = TOLERANCE * table.floor_s, 1.0
        else:
            target, factor = tpot_s, tpot.factor
        self._count(tpot, self._streak[1], now, target, factor, ttft_bound, table)
        view: Levels
        if tpot.any_measured(here, now):
            view, streak, need, fresh = tpot, self._streak[1], COMPLETED_STREAK, hold_s
        else:  # no request completed at these levels yet: the gaps decide
            view, streak, need, fresh = table, self._streak[0], BAD_STREAK, FRESH_S
        self._count(table, self._streak[0], now, target, factor, ttft_bound, table)
        bad = self._lowest_bad(view, streak, now, here, need, max(FRESH_S, fresh))
        if bad:
            lower = self._lower(view, table, now, bad, target, factor, ttft_bound)
            if lower < limit:  # (the same level still slow while its requests run: no news)
                self.limit = lower
                wait = min(MAX_BACKOFF_S, max(STALE_S, 2.0 * self._backoff[bad]))
                self._backoff[bad] = wait
                self._blocked_until[bad] = now + wait
        elif reached and now >= self.raise_after:
            up = self._higher(view, table, now, here, target, factor, ttft_bound)
            if cap is not None:
                up = min(up, cap)
            if up > limit:
                self.limit = up
                self.raise_after = now + hold_s
        if cap is not None and self.limit > cap:
            self.limit = max(1, cap)

    def _count(
        self,
        view: Levels,
        streak: list[int],
        now: float,
        target: float,
        factor: float,
        ttft_bound: float,
        table: StepTable,
    ) -> None:
        """Count, for each bucket of ``view`` updated in the last interval, the updates in a
        row that found it not good."""
        for i in view.folded:
            ok = self._good(view, table, i, now, target, factor, ttft_bound)
            streak[i] = 0 if ok else streak[i] + 1
            if ok and view.measured(i, now):
                self._backoff[i] = 0.0  # found good again: the next probe waits the least

    @staticmethod
    def _ttft_bound(table: StepTable, now: float, ttft_s: float | None) -> float:
        """The admission-to-first-token bound a level must meet, seconds (inf: none binds)."""
        if ttft_s is None:
            return math.inf
        bound = TTFT_SHARE * ttft_s
        lowest = table.lowest_ttft(now)
        return bound if 0.0 < lowest <= bound else math.inf

    @staticmethod
    def _good(
        view: Levels,
        table: StepTable,
        i: int,
        now: float,
        target: float,
        factor: float,
        ttft_bound: float,
    ) -> bool:
        """Whether bucket ``i`` of ``view`` meets the targets (the TTFT side: ``table``'s)."""
        if factor * view.mean[i] > target:
            return False
        return not (table.ttft_measured(i, now) and table.ttft[i] > ttft_bound)

    @staticmethod
    def _lowest_bad(
        view: Levels, streak: list[int], now: float, here: int, need: int, fresh_s: float
    ) -> int:
        """The lowest bucket up to ``here`` (the limit's) found not good in its last ``need``
        updates, the last within ``fresh_s`` seconds (0: none): the step time grows with the
        batch, so no level above it is good either."""
        seen = view.seen
        for i in range(1, here + 1):
            if streak[i] >= need and now - seen[i] <= fresh_s:
                return i
        return 0

    def _lower(
        self,
        view: Levels,
        table: StepTable,
        now: float,
        bad: int,
        target: float,
        factor: float,
        ttft_bound: float,
    ) -> int:
        """The limit once bucket ``bad`` (at or below the limit) was found not good: the largest
        measured good level below it, else in proportion from it."""
        for i in range(bad - 1, 0, -1):
            if view.measured(i, now) and self._good(
                view, table, i, now, target, factor, ttft_bound
            ):
                return bucket_low(i)
        n = bucket_low(bad)
        predicted = factor * view.mean[bad]
        scaled = math.floor(n * target / predicted) if predicted > target else n - 1
        return max(1, n // 2, min(n - 1, scaled))

    def _higher(
        self,
        view: Levels,
        table: StepTable,
        now: float,
        here: int,
        target: float,
        factor: float,
        ttft_bound: float,
    ) -> int:
        """The highest level a raise may reach from the limit's bucket ``here``: extended from
        the highest measured level at or under it (the limit's own may never fill while a fair
        share is held back for other tenants), which must be good; the limit itself if none."""
        limit = self.limit
        top = limit + max(1, math.floor(limit * RAISE_STEP))
        ref = here
        while ref > 0 and not view.measured(ref, now):
            ref -= 1  # the limit's own level may never fill (a fair share held back for others)
        if ref == 0 or not self._good(view, table, ref, now, target, factor, ttft_bound):
            return limit
        n2, m2, n1, m1 = bucket_low(ref), view.mean[ref], 0, 0.0
        span = n2 - max(1, math.floor(n2 * SLOPE_SPAN))
        for i in range(ref - 1, 0, -1):
            if view.measured(i, now):
                n1, m1 = bucket_low(i), view.mean[i]
                if n1 <= span:
                    break
        blocked = self._blocked_until
        best = limit
        i = ref + 1
        if n1 == 0:
            # One level measured: no shape to extend, so try the next one (its back-off
            # permitting) rather than predict it (in proportion to n would never leave 1 where
            # the SLO is under about twice the lone request's TPOT).
            open_ = i < BUCKETS and blocked[i] <= now and bucket_low(i) <= top
            if open_ and (
                not view.measured(i, now)
                or self._good(view, table, i, now, target, factor, ttft_bound)
            ):
                best = max(best, bucket_low(i))
            return best
        slope = max(0.0, (m2 - m1) / (n2 - n1))
        while i < BUCKETS and bucket_low(i) <= top:
            n = bucket_low(i)
            if blocked[i] > now:
                break
            if view.measured(i, now):
                if not self._good(view, table, i, now, target, factor, ttft_bound):
                    break
            elif factor * (m2 + slope * (n - n2)) > target:
                break
            best = max(best, n)
            i += 1
        return best
