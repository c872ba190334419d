"""Per-request time per output token against the requests in flight, learned from completions.

A TPOT SLO is met or missed by each request on its own: its TPOT is the time from its first
token to its last over the tokens after the first, prefill stalls by newcomers and all. Each
streamed request that completes is one sample, labelled with the mean number of requests in
flight while it decoded (time-weighted over its inter-token gaps), in the buckets of
:mod:`.step_table`. Per bucket the table keeps a smoothed mean of ``ln TPOT``; the spread of
``ln TPOT`` around its bucket's mean is pooled over all buckets (one standard deviation, its
prior :data:`PRIOR_SD` worth :data:`PRIOR_N` samples), so the 90th percentile at ``n`` is
``exp(mean(n) + Z90 x sd)``: :attr:`TpotTable.mean` times :attr:`TpotTable.factor`.

A bucket without a completion for :data:`~.step_table.STALE_S` seconds starts again from its
next one. A request's TPOT averages over its whole life, so a burst of newcomers' prefills that
stalls every stream for a second moves it a little, as it moves what the SLO counts; a request that
lived through a lowered limit is labelled with what it actually ran beside, not with the new
limit (no wind-up).

Invariant: pure and clock-injected; :meth:`TpotTable.observe` is O(1).
"""

from __future__ import annotations

import math
from typing import Final

from kvgate_agent.admission.step_table import BUCKETS, STALE_S, bucket_of

#: z of the 90th percentile of a normal distribution (of ``ln TPOT``).
Z90: Final = 1.2816
#: Prior of the pooled standard deviation of ``ln TPOT`` around its bucket's mean, and the
#: pseudo-samples behind it.
PRIOR_SD: Final = 0.1
PRIOR_N: Final = 4.0
#: Weight of a completion in the pooled variance once the prior is outweighed.
SPREAD_ALPHA: Final = 0.02
#: Weight of a completion in its bucket's mean once the first few are in.
MEAN_ALPHA: Final = 0.2
#: Completions a bucket needs before it counts as measured.
MIN_COMPLETIONS: Final = 3


class TpotTable:
    """Per-request TPOT by mean requests in flight (see the module docstring).

    Attributes:
        mean: per bucket, the geometric mean of its completions' TPOT, seconds (0: none).
        count: per bucket, completions behind ``mean`` (capped).
        seen: per bucket, clock seconds of its last completion.
        factor: the 90th percentile's ratio to a bucket's mean, ``exp(Z90 x sd)`` (>= 1).
        folded: buckets that got completions since the last :meth:`fold`.
    """

    __slots__ = (
        "_log",
        "_n",
        "_pending",
        "_touched",
        "_var",
        "count",
        "factor",
        "folded",
        "mean",
        "seen",
    )

    def __init__(self) -> None:
        self._log: list[float] = [0.0] * BUCKETS
        self.mean: list[float] = [0.0] * BUCKETS
        self.count: list[float] = [0.0] * BUCKETS
        self.seen: list[float] = [0.0] * BUCKETS
        self._var = PRIOR_SD * PRIOR_SD
        self._n = PRIOR_N
        self.factor = math.exp(Z90 * PRIOR_SD)
        self._touched: list[int] = []
        self._pending: list[bool] = [False] * BUCKETS
        self.folded: list[int] = []

    def observe(self, mean_in_flight: float, tpot_s: float, now: float) -> None:
        """One request completed with ``tpot_s`` seconds per output token after its first,
        having decoded beside ``mean_in_flight`` requests in flight on average (itself
        included), at clock time ``now``. Ignored unless ``tpot_s`` > 0. O(1)."""
        if tpot_s <= 0.0:
            return
        i = bucket_of(max(1, round(mean_in_flight)))
        x = math.log(tpot_s)
        k = self.count[i]
        if k > 0.0 and now - self.seen[i] > STALE_S:
            k = 0.0  # stale: what it held then says nothing now (a slowdown long over)
        if k > 0.0:
            d = x - self._log[i]
            alpha = max(SPREAD_ALPHA, 1.0 / (self._n + 1.0))
            self._n += 1.0
            self._var = (1.0 - alpha) * self._var + alpha * d * d
            self.factor = math.exp(Z90 * math.sqrt(self._var))
            self._log[i] += max(MEAN_ALPHA, 1.0 / (k + 1.0)) * d
        else:
            self._log[i] = x
        self.mean[i] = math.exp(self._log[i])
        self.count[i] = min(k + 1.0, 1.0 / MEAN_ALPHA)
        self.seen[i] = now
        if not self._pending[i]:
            self._pending[i] = True
            self._touched.append(i)

    def fold(self) -> None:
        """Close one control interval: :attr:`folded` becomes the buckets touched since."""
        self.folded.clear()
        self.folded.extend(self._touched)
        for i in self._touched:
            self._pending[i] = False
        self._touched.clear()

    def measured(self, i: int, now: float) -> bool:
        """Whether bucket ``i`` counts at clock time ``now``."""
        return self.count[i] >= MIN_COMPLETIONS and now - self.seen[i] <= STALE_S

    def any_measured(self, up_to: int, now: float) -> bool:
        """Whether any bucket up to ``up_to`` counts at clock time ``now``."""
        return any(self.measured(i, now) for i in range(1, up_to + 1))
