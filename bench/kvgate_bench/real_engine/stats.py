"""Intervals of the real-engine benchmark (pure): bootstrap over requests and Wilson's score.

**Per-request vectors.** A row keeps, in its schedule's order, each request's *good tokens*
(its output tokens when it met its SLO, else 0) and *served tokens* (its output tokens when it
was served, met or not). A row's goodput is sum(good) / span and its throughput sum(served) /
span (tokens/s; the span as :func:`kvgate_bench.effectiveness.model.metrics.summarize` defines it,
seconds, held fixed under resampling).

**Bootstrap** (Efron, "Bootstrap methods: another look at the jackknife", 1979,
https://doi.org/10.1214/aos/1176344552; the percentile interval of Efron and Tibshirani, "An
Introduction to the Bootstrap", 1993, ch. 13): :data:`RESAMPLES` resamples of the requests
with replacement, from a ``random.Random`` seeded by the caller; the 95 % interval is the
2.5th and 97.5th percentiles of the resampled statistic. Two arms of one cell ran the same
schedule, so their ratio is bootstrapped *paired*: one draw of request indices serves both
arms. Pooled over seeds, the draw is *stratified*: each seed's requests are resampled within
that seed, and the pooled ratio is the sum over seeds of the numerators' rates over the sum of
the denominators'.

**Wilson score interval** (Wilson, "Probable inference, the law of succession, and statistical
inference", JASA 1927, https://doi.org/10.1080/01621459.1927.10502953) of k successes in n
trials at z = 1.96: ``(p + z²/2n ± z sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n)``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

#: Bootstrap resamples per interval.
RESAMPLES = 1000
#: The normal quantile of a two-sided 95 % interval.
Z95 = 1.959963984540054


def _quantile(sorted_xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of sorted values, linearly interpolated."""
    pos = q * (len(sorted_xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def _interval(values: list[float]) -> tuple[float, float]:
    values.sort()
    return (_quantile(values, 0.025), _quantile(values, 0.975))


def rate_ci95(
    tokens: Sequence[float], span_s: float, seed: int, resamples: int = RESAMPLES
) -> tuple[float, float]:
    """The bootstrap 95 % interval of ``sum(tokens) / span_s`` (tokens/s) over the requests.
    (0, 0) for no request or a span <= 0."""
    n = len(tokens)
    if n == 0 or span_s <= 0:
        return (0.0, 0.0)
    rng = random.Random(seed)
    idx = range(n)
    stats = [sum(tokens[i] for i in rng.choices(idx, k=n)) / span_s for _ in range(resamples)]
    return _interval(stats)


@dataclass(frozen=True)
class Arm:
    """One arm's per-request tokens (module docstring) in its schedule's order and its span,
    seconds: the ratio bootstrap's input."""

    tokens: Sequence[float]
    span_s: float

    @property
    def rate(self) -> float:
        """sum(tokens) / span, tokens/s (0 for a span <= 0)."""
        return sum(self.tokens) / self.span_s if self.span_s > 0 else 0.0


@dataclass(frozen=True)
class Ratio:
    """A ratio of two arms' rates and its bootstrap 95 % interval (None where undefined: a
    denominator of 0)."""

    value: float | None
    ci95: tuple[float, float] | None

    def as_json(self) -> dict[str, object]:
        return {"value": self.value, "ci95": list(self.ci95) if self.ci95 else None}


def ratio_ci95(pairs: Sequence[tuple[Arm, Arm]], seed: int, resamples: int = RESAMPLES) -> Ratio:
    """The ratio sum(num rates) / sum(den rates) over ``pairs`` (one (numerator, denominator)
    pair per seed, both of the same schedule: equal lengths) and its paired, stratified
    bootstrap 95 % interval (module docstring). Resamples whose denominator is 0 are left out;
    the interval is None when more than half are. Raises ``ValueError`` when a pair's vectors
    differ in length."""
    for num, den in pairs:
        if len(num.tokens) != len(den.tokens):
            raise ValueError("a ratio's two arms must have the same requests")
    den0 = sum(d.rate for _, d in pairs)
    value = sum(n.rate for n, _ in pairs) / den0 if den0 > 0 else None
    if value is None:
        return Ratio(None, None)
    rng = random.Random(seed)
    stats: list[float] = []
    for _ in range(resamples):
        num_sum = den_sum = 0.0
        for num, den in pairs:
            n = len(num.tokens)
            if n == 0:
                continue
            pick = rng.choices(range(n), k=n)
            if num.span_s > 0:
                num_sum += sum(num.tokens[i] for i in pick) / num.span_s
            if den.span_s > 0:
                den_sum += sum(den.tokens[i] for i in pick) / den.span_s
        if den_sum > 0:
            stats.append(num_sum / den_sum)
    if len(stats) * 2 < resamples:
        return Ratio(value, None)
    return Ratio(value, _interval(stats))


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float] | None:
    """Wilson's score interval (module docstring) of ``k`` successes in ``n`` trials; None for
    no trial. Raises ``ValueError`` for ``k`` outside 0..n."""
    if not 0 <= k <= max(n, 0):
        raise ValueError(f"k={k} successes out of n={n}")
    if n <= 0:
        return None
    p = k / n
    z2 = z * z
    centre = p + z2 / (2 * n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    den = 1 + z2 / n
    return (max(0.0, (centre - half) / den), min(1.0, (centre + half) / den))
