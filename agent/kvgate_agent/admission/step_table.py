"""The engine's step time against the requests in flight, learned from the streams that pass.

A continuous-batching engine (vLLM, SGLang, TGI, llama.cpp's server) produces one token per
running sequence per step, so the time between two tokens of one stream (its inter-token gap)
is the engine's step time while that stream ran, prefill stalls of newcomers included. kvgate
labels every gap with the number of requests in flight here when the token passed (``n``) and
keeps, per ``n``, a smoothed mean seconds per output token: the table the concurrency limit
(:mod:`.concurrency_limit`) reads to find the largest ``n`` whose requests still meet the TPOT
SLO. Nothing is assumed about the shape (llama.cpp's server on one CPU thread measured 22 ms
per step with one sequence, 63 with two and 78 with four: no straight line fits it).

It also keeps, per ``n``, the smoothed time from admission to the first token (the request's
own prefill behind the others' work), for the TTFT side of the limit.

**Buckets.** ``n`` from 1 to 63 has a bucket each; above that, 16 buckets per doubling (64-67,
68-71, ..., 128-135, ...: at most 6 % of ``n`` wide) up to :data:`MAX_CONCURRENCY`, so the
hundreds of sequences an H100 batch holds cost about a hundred buckets, not thousands.

The lowest one-interval mean over all requests is kept as the table's *floor*
(:attr:`StepTable.floor_s`), which drifts up slowly: without an SLO the limit keeps the step
time within a tolerance of it.

**Smoothing.** A gap is added to its bucket's interval sums in O(1); once per control interval
(:meth:`StepTable.fold`) each touched bucket moves towards the interval's mean by the interval's
share of the tokens seen (a running mean at first, then at least ``1 / WEIGHT_CAP`` per token,
never more than :data:`ALPHA_MAX` in one interval). A bucket is *measured* once
it holds :data:`MIN_TOKENS` tokens over :data:`MIN_FOLDS` intervals and was updated within the
last :data:`STALE_S` seconds: a stale bucket is forgotten (its next samples start it again), so
a level found too slow once is tried again later (the workload's prompts or the model may have
changed).

Invariant: pure and clock-injected (times are passed in); :meth:`StepTable.observe` and
:meth:`StepTable.observe_first_token` are O(1); :meth:`StepTable.fold` is O(buckets touched).
"""

from __future__ import annotations

from typing import Final

#: Concurrency values below this each have their own bucket.
EXACT: Final = 64
#: Buckets per doubling of the concurrency above :data:`EXACT`.
PER_OCTAVE: Final = 16
#: The highest concurrency the table tells apart (higher counts share its last bucket).
MAX_CONCURRENCY: Final = 1 << 16
#: A bucket's smoothed mean takes at most this share of one interval's mean.
ALPHA_MAX: Final = 0.5
#: Tokens after which a bucket's mean is an exponential average over about this many tokens.
WEIGHT_CAP: Final = 200.0
#: Tokens a bucket needs before it counts as measured.
MIN_TOKENS: Final = 8.0
#: Intervals a bucket needs before it counts as measured (one interval can be a transient: a
#: burst of newcomers' prefills).
MIN_FOLDS: Final = 2
#: Seconds without a new sample after which a bucket is no longer measured.
STALE_S: Final = 60.0
#: Share of the distance to the interval's mean inter-token time the floor rises by per
#: interval while above it (a time constant of 2,500 intervals, about 21 minutes; chosen on the
#: effectiveness benchmark, seed 1, for the gradient limit this table replaced).
FLOOR_DRIFT: Final = 0.0002
#: Weight of each first token in a bucket's admission-to-first-token mean (after the first few).
TTFT_ALPHA: Final = 0.2


def bucket_of(n: int) -> int:
    """The bucket index of concurrency ``n`` (requests; < 1 counts as 1). O(1): integer bits."""
    if n < EXACT:
        return n if n > 0 else 1
    if n > MAX_CONCURRENCY:
        n = MAX_CONCURRENCY
    bits = n.bit_length()
    return EXACT + PER_OCTAVE * (bits - 7) + (n >> (bits - 5)) - 16


def bucket_low(i: int) -> int:
    """The lowest concurrency (requests) in bucket ``i`` (the inverse of :func:`bucket_of`)."""
    if i < EXACT:
        return i
    octave, sub = divmod(i - EXACT, PER_OCTAVE)
    return (PER_OCTAVE + sub) << (octave + 2)


#: Number of buckets (index 0 is never used).
BUCKETS: Final = bucket_of(MAX_CONCURRENCY) + 1


class StepTable:
    """Seconds per output token and admission-to-first-token seconds, by requests in flight.

    Attributes:
        mean: per bucket, the smoothed seconds per output token (0 before any sample).
        weight: per bucket, the tokens behind ``mean`` (capped at :data:`WEIGHT_CAP`).
        folds: per bucket, the intervals behind ``mean`` (capped at :data:`MIN_FOLDS`).
        seen: per bucket, clock seconds of its last update.
        ttft: per bucket, the smoothed seconds from admission to first token (0: no sample).
        ttft_n: per bucket, first tokens seen (capped).
        ttft_seen: per bucket, clock seconds of its last first token.
        floor_s: the lowest one-interval mean seconds per token over all requests (intervals of
            at least :data:`MIN_TOKENS` tokens), drifting up
            towards each interval's mean by :data:`FLOOR_DRIFT` while nothing faster is seen (0:
            none yet): the fastest decoding seen stays known while the load keeps the low
            levels unmeasured (a run that starts under load sees it only in its first
            intervals).
        folded: the buckets the last :meth:`fold` updated.
    """

    __slots__ = (
        "_acc_s",
        "_acc_tokens",
        "_touched",
        "floor_s",
        "folded",
        "folds",
        "mean",
        "seen",
        "ttft",
        "ttft_n",
        "ttft_seen",
        "weight",
    )

    def __init__(self) -> None:
        self.mean: list[float] = [0.0] * BUCKETS
        self.weight: list[float] = [0.0] * BUCKETS
        self.seen: list[float] = [0.0] * BUCKETS
        self.ttft: list[float] = [0.0] * BUCKETS
        self.ttft_n: list[float] = [0.0] * BUCKETS
        self.ttft_seen: list[float] = [0.0] * BUCKETS
        self._acc_s: list[float] = [0.0] * BUCKETS
        self._acc_tokens: list[float] = [0.0] * BUCKETS
        self._touched: list[int] = []
        self.floor_s = 0.0
        self.folds: list[int] = [0] * BUCKETS
        self.folded: list[int] = []

    def observe(self, in_flight: int, seconds: float, tokens: float) -> None:
        """``tokens`` (> 0) output tokens of one request arrived over ``seconds`` while
        ``in_flight`` requests were in flight (a newcomer's prefill that stalls every stream
        counts: it is what running beside ``n - 1`` others costs while they arrive). O(1)."""
        i = bucket_of(in_flight)
        if self._acc_tokens[i] == 0.0:
            self._touched.append(i)
        self._acc_s[i] += seconds
        self._acc_tokens[i] += tokens

    def observe_first_token(self, in_flight: int, seconds: float, now: float) -> None:
        """One request's first token came ``seconds`` after its admission, ``in_flight``
        requests in flight, at clock time ``now``. O(1)."""
        i = bucket_of(in_flight)
        k = self.ttft_n[i]
        alpha = max(TTFT_ALPHA, 1.0 / (k + 1.0))
        self.ttft[i] += alpha * (seconds - self.ttft[i])
        self.ttft_n[i] = min(k + 1.0, 1.0 / TTFT_ALPHA)
        self.ttft_seen[i] = now

    def fold(self, now: float) -> None:
        """Close one control interval at clock time ``now``: each bucket that got samples
        moves towards their mean (see the module docstring), and the floor follows."""
        self.folded.clear()
        if not self._touched:
            return
        total_s = total_tokens = 0.0
        for i in self._touched:
            tokens = self._acc_tokens[i]
            total_s += self._acc_s[i]
            total_tokens += tokens
            x = self._acc_s[i] / tokens
            w = self.weight[i]
            if w > 0.0 and now - self.seen[i] > STALE_S:
                w = 0.0  # stale: start again from this interval
                self.folds[i] = 0
            alpha = min(ALPHA_MAX, tokens / (w + tokens)) if w > 0 else 1.0
            m = self.mean[i] + alpha * (x - self.mean[i])
            self.mean[i] = m
            self.weight[i] = min(WEIGHT_CAP, w + tokens)
            self.seen[i] = now
            self.folds[i] = min(self.folds[i] + 1, MIN_FOLDS)
            self._acc_s[i] = 0.0
            self._acc_tokens[i] = 0.0
        self.folded.extend(self._touched)
        self._touched.clear()
        floor = self.floor_s
        interval = total_s / total_tokens
        if total_tokens < MIN_TOKENS:
            pass  # too few tokens to say how fast decoding can be (one lucky gap)
        elif floor == 0.0 or interval < floor:
            self.floor_s = interval
        else:
            self.floor_s = floor + FLOOR_DRIFT * (interval - floor)

    def measured(self, i: int, now: float) -> bool:
        """Whether bucket ``i``'s step time counts at clock time ``now``."""
        return (
            self.weight[i] >= MIN_TOKENS
            and self.folds[i] >= MIN_FOLDS
            and now - self.seen[i] <= STALE_S
        )

    def ttft_measured(self, i: int, now: float) -> bool:
        """Whether bucket ``i``'s admission-to-first-token time counts at clock time ``now``."""
        return self.ttft_n[i] >= 2.0 and now - self.ttft_seen[i] <= STALE_S

    def lowest_ttft(self, now: float) -> float:
        """The lowest measured admission-to-first-token seconds of any bucket (0: none)."""
        best = 0.0
        for i in range(1, BUCKETS):
            if self.ttft_measured(i, now):
                m = self.ttft[i]
                if best == 0.0 or m < best:
                    best = m
        return best
