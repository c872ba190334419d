"""The adaptive concurrency limit: the most requests in flight whose requests still meet the SLO,
read off the engine's learned step-time table (:mod:`.step_table`).

**With a TPOT SLO** (``slo.tpotSeconds``): a level ``n`` is *good* when the predicted p90 of a
request's time per output token there, ``factor x step(n)``, is at most the SLO (``factor``: the
learned ratio of a request's own TPOT to the table's mean at its concurrency, its 90th
percentile: :class:`TpotSpread`), and, under a TTFT SLO, the admission-to-first-token time
there is at most :data:`TTFT_SHARE` of it (the rest is the queue's; this side binds only where a
lower level meets it, i.e. where concurrency is the cause). **Without one** (an empty spec) a
level is good while its step time is within :data:`TOLERANCE` times the table's floor (the
fastest measured, drifting up slowly): the
knee of throughput against concurrency (for a step time ``a + c n`` each sequence added there
adds about ``1 / TOLERANCE**2`` of the first one's throughput).

Once per control interval:

* **Down** at once when the limit's own level is measured and not good: to the largest measured
  good level below it, else in proportion (``limit x target / predicted``, at least one less,
  at most by half: a step time that grows faster than the batch would overshoot).
  Only levels that were measured decide, so the limit cannot wind up: while the requests
  admitted under the old limit still run, the gaps are labelled with their count, not with the
  new limit's (Netflix's concurrency-limits AIMD keeps lowering on the aggregate latency until a
  service time has passed; https://github.com/Netflix/concurrency-limits).
* **Up** only when the limit stopped a request since the last interval (demand above it), its
  own level is measured good, and a service time (admission to release, smoothed) has passed
  since the last raise: to the highest level up to ``limit + max(1, limit x RAISE_STEP)`` that is
  measured good or, unmeasured, predicted good by extending the two highest measured levels at
  or under the limit (a line through them, never falling; one level: in proportion to ``n``),
  stopping below the first measured level that is not good. From a cold start the limit doubles
  at most once per service time, so it reaches the hundreds of sequences an H100 batch holds in
  a few, and a 4-slot CPU server's 2 within a few completions.

Floor 1 request; ceiling the policy's cap or the engine's slots (none: unbounded).

Invariant: pure and clock-injected; :meth:`ConcurrencyLimit.decide` is O(buckets), run once per
control interval, never on a request's path.
"""

from __future__ import annotations

import math

from kvgate_agent.admission.step_table import BUCKETS, StepTable, bucket_low, bucket_of

#: Without a TPOT SLO, a level is good while its step time is within this many times the
#: fastest measured (Gradient2's ``rttTolerance`` in Netflix's concurrency-limits).
#: Chosen on the effectiveness benchmark, seed 1 (docs/benchmarks.md, "The claim on a real
#: engine (issue 33)").
TOLERANCE = 2.5
#: The limit may rise by at most this share of itself (at least 1) per raise.
RAISE_STEP = 1.0
#: Under a TTFT SLO, a level is good only while its admission-to-first-token time is at most
#: this share of the SLO (the rest is left to waiting in the queue).
TTFT_SHARE = 0.6
#: z of the 90th percentile of a normal distribution (of the log TPOT ratio).
Z90 = 1.2816
#: Prior of the log ratio's standard deviation, and the pseudo-samples behind it.
PRIOR_SD = 0.1
PRIOR_N = 4.0
#: Weight of a completion in the ratio's mean and variance, once the prior is outweighed.
SPREAD_ALPHA = 0.05


class TpotSpread:
    """The spread of a request's own TPOT around the table's mean at its concurrency.

    Each completed request gives ``x = ln(its TPOT / the table's mean over its gaps)``; a
    running mean and variance of ``x`` (the prior :data:`PRIOR_SD` worth :data:`PRIOR_N`
    samples, then an exponential average) give the 90th percentile factor
    ``exp(mean + Z90 x sd)``, clamped to [1, 4]: what the table's mean is multiplied by to
    predict the p90 of per-request TPOT.
    """

    __slots__ = ("_mean", "_n", "_var", "factor")

    def __init__(self) -> None:
        self._mean = 0.0
        self._var = PRIOR_SD * PRIOR_SD
        self._n = PRIOR_N
        self.factor = math.exp(Z90 * PRIOR_SD)

    def observe(self, tpot_s: float, predicted_s: float) -> None:
        """One request's TPOT (seconds per token after its first) against the table's mean
        over its gaps (seconds per token); ignored unless both are > 0."""
        if tpot_s <= 0.0 or predicted_s <= 0.0:
            return
        x = math.log(tpot_s / predicted_s)
        alpha = max(SPREAD_ALPHA, 1.0 / (self._n + 1.0))
        self._n += 1.0
        d = x - self._mean
        self._mean += alpha * d
        self._var = (1.0 - alpha) * (self._var + alpha * d * d)
        f = math.exp(self._mean + Z90 * math.sqrt(self._var))
        self.factor = min(4.0, max(1.0, f))


class ConcurrencyLimit:
    """The adaptive limit of one pod (see the module docstring).

    Args:
        start: the limit before anything is measured, requests (>= 1).

    Attributes:
        limit: requests allowed in flight now (>= 1).
        raise_after: clock seconds before which the limit is not raised again.
    """

    __slots__ = ("limit", "raise_after")

    def __init__(self, start: int) -> None:
        self.limit = max(1, start)
        self.raise_after = 0.0

    def decide(
        self,
        table: StepTable,
        now: float,
        *,
        tpot_s: float | None,
        ttft_s: float | None,
        factor: float,
        reached: bool,
        hold_s: float,
        cap: int | None,
    ) -> None:
        """Move :attr:`limit` once (clock seconds ``now``): ``tpot_s``/``ttft_s`` the SLOs
        (None: not set), ``factor`` the p90 factor (:class:`TpotSpread`), ``reached`` whether
        the limit stopped a request since the last call, ``hold_s`` the seconds between two
        raises (a service time), ``cap`` the ceiling (None: none)."""
        if tpot_s is None:
            fastest = table.floor_s
            if fastest <= 0.0:
                return
            target, factor = TOLERANCE * fastest, 1.0
        else:
            target = tpot_s
        ttft_bound = self._ttft_bound(table, now, ttft_s)
        limit = self.limit
        here = bucket_of(limit)
        measured = table.measured(here, now)
        if measured and not self._good(table, here, now, target, factor, ttft_bound):
            self.limit = self._lower(table, now, here, target, factor, ttft_bound)
        elif measured and reached and now >= self.raise_after:
            up = self._higher(table, now, here, target, factor, ttft_bound)
            if cap is not None:
                up = min(up, cap)
            if up > limit:
                self.limit = up
                self.raise_after = now + hold_s
        if cap is not None and self.limit > cap:
            self.limit = max(1, cap)

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
        table: StepTable, i: int, now: float, target: float, factor: float, ttft_bound: float
    ) -> bool:
        """Whether measured bucket ``i`` meets the targets."""
        if factor * table.mean[i] > target:
            return False
        return not (table.ttft_measured(i, now) and table.ttft[i] > ttft_bound)

    def _lower(
        self,
        table: StepTable,
        now: float,
        here: int,
        target: float,
        factor: float,
        ttft_bound: float,
    ) -> int:
        """The limit after the level ``here`` was found not good."""
        for i in range(here - 1, 0, -1):
            if table.measured(i, now) and self._good(table, i, now, target, factor, ttft_bound):
                return bucket_low(i)
        limit = self.limit
        predicted = factor * table.mean[here]
        scaled = math.floor(limit * target / predicted) if predicted > target else limit - 1
        return max(1, limit // 2, min(limit - 1, scaled))

    def _higher(
        self,
        table: StepTable,
        now: float,
        here: int,
        target: float,
        factor: float,
        ttft_bound: float,
    ) -> int:
        """The highest level a raise may reach from a good measured level ``here``."""
        limit = self.limit
        top = limit + max(1, math.floor(limit * RAISE_STEP))
        n2, m2, n1, m1 = bucket_low(here), table.mean[here], 0, 0.0
        for i in range(here - 1, 0, -1):
            if table.measured(i, now):
                n1, m1 = bucket_low(i), table.mean[i]
                break
        slope = (m2 - m1) / (n2 - n1) if n1 > 0 and n2 > n1 else m2 / n2
        slope = max(0.0, slope)
        best = limit
        i = here + 1
        while i < BUCKETS and bucket_low(i) <= top:
            n = bucket_low(i)
            if table.measured(i, now):
                if not self._good(table, i, now, target, factor, ttft_bound):
                    break
                best = n
            elif factor * (m2 + slope * (n - n2)) <= target:
                best = n
            else:
                break
            i += 1
        return best
