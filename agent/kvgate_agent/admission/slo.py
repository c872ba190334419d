"""Serving the latency SLOs: an adaptive concurrency limit and the expected queue wait.

**Adaptive concurrency** (policy ``slo.tpotSeconds``): the time per output token a running
request sees is the engine's step time, and that grows with the batch (more sequences, more
context, more prefill in each step). kvgate measures it from the streamed tokens that pass
(:meth:`SloState.observe_gap`) and, once per :data:`INTERVAL_S`, moves a concurrency limit:
down by :data:`DECREASE` while the smoothed inter-token time is above ``TARGET_FRACTION x
tpotSeconds``, up by :data:`INCREASE` of itself (at least 1) while it is below
``RAISE_FRACTION x`` that and the limit was reached in the interval. That is the AIMD limit of
Netflix's concurrency-limits (https://github.com/Netflix/concurrency-limits) with the SLO as
the latency target, so the cap a platform team would otherwise hand-tune per workload follows
the load.

**Adaptive concurrency without a target** (no ``slo.tpotSeconds``): a gradient limit, after
Gradient2 of Netflix's concurrency-limits
(https://github.com/Netflix/concurrency-limits/blob/master/concurrency-limits-core/src/main/java/com/netflix/concurrency/limits/limit/Gradient2Limit.java),
with the smoothed inter-token time ``gap_s`` as the short-term latency and the lowest
inter-token time of one interval observed (:attr:`SloState.floor_s`, the mean over the interval's
tokens) as the long-term one. Once per interval
the limit is scaled by ``gradient = min(1, GRADIENT_TOLERANCE x floor_s / gap_s)`` (not below
:data:`GRADIENT_MIN`), plus ``sqrt(limit)`` of headroom when the limit was reached, and moved
:data:`GRADIENT_SMOOTHING` of the way there: the limit holds while decoding runs at most
:data:`GRADIENT_TOLERANCE` times slower than at its fastest, falls while it is slower, and
grows by about ``GRADIENT_SMOOTHING x sqrt(limit)`` per interval while the limit is what stops
requests. The floor drifts up towards ``gap_s`` by :data:`FLOOR_DRIFT` per interval, so a
floor seen once (an idle server, a since-replaced model) does not hold the limit down forever.
As in Gradient2, the limit does not move while fewer than half of it are in flight
(application-limited: the latency then says nothing about the limit).

**Expected queue wait** (policy ``slo.ttftSeconds``): requests leave the queue as admitted ones
finish. With ``N`` requests in flight that each hold their place for ``S`` seconds on average
(admission to release, smoothed), the full server frees a place every ``S / N`` seconds
(Little's law, https://doi.org/10.1287/opre.9.3.383), so a newcomer with ``k`` waiting ahead
waits about ``(k + 1) x S / N`` seconds. (The measured release rate is no substitute: below
saturation it is the arrival rate, far below how fast a full server drains.) Requests the engine
itself holds in its own queue (``vllm:num_requests_waiting``, llama.cpp's
``llamacpp:requests_deferred``: sent around kvgate, or by another sidecar) are ahead too: they
count in ``k`` while the engine's report is fresh (:meth:`SloState.observe_engine_waiting`).

The time budget for waiting is the TTFT SLO less the observed time from admission to the first
token (prefill). A request expected to wait more than :data:`SHED_FACTOR` times its budget is
refused at once, with the expected wait as its Retry-After, instead of queued to miss its SLO;
one that is queued leaves the queue at its budget.

Invariant: pure and clock-injected (times are passed in); every method is O(1).
"""

from __future__ import annotations

import math

#: Length of one measurement interval, seconds.
INTERVAL_S = 0.5
#: Smoothing of the per-interval means across intervals (weight of the newest).
SMOOTHING = 0.1
#: The limit is lowered while the smoothed inter-token time exceeds this share of the target:
#: per-request TPOT spreads around the mean, so the mean is held below the SLO.
TARGET_FRACTION = 1.0
#: ... and raised while it is below this share of the target (a dead band between the two).
RAISE_FRACTION = 0.85
#: Multiplicative decrease of the limit per interval over target.
DECREASE = 0.95
#: Additive increase per interval under target, as a share of the limit (at least 1).
INCREASE = 0.05
#: A request under a TTFT SLO is refused at once when its expected wait exceeds this many times
#: its wait budget; between one and this many, it is queued and its deadline (the budget)
#: decides. The estimate is an upper bound (waiters ahead also leave by timing out) and a refusal
#: is final, so only the clearly hopeless are refused unqueued. Chosen on the effectiveness
#: benchmark (1, 1.5, 2 and 2.5 tried; the table is in docs/benchmarks.md, "What kvgate does").
SHED_FACTOR = 2.0
#: Weight of each release in the mean service time.
SERVICE_ALPHA = 0.05
#: Lowest adaptive limit, requests.
MIN_LIMIT = 4
#: Gradient limit (no TPOT target): the smoothed inter-token time tolerated, as a multiple of
#: the floor, before the limit falls (Gradient2's ``rttTolerance``). Chosen on the
#: effectiveness benchmark, seed 1 (docs/benchmarks.md, "Issue 22: defaults"): 1.5 and 2 hold
#: the limit too low (an empty policy's goodput at 2x load 0.49-0.74x the tuned concurrency
#: cap's), 3 too high on ``conversation`` (0.19x); 2.5 gave 0.81x.
GRADIENT_TOLERANCE = 2.5
#: Gradient limit: the lowest factor one interval's gradient may scale the limit by.
GRADIENT_MIN = 0.5
#: Gradient limit: share of the way the limit moves to its new value per interval
#: (Gradient2's ``smoothing``, 0.2).
GRADIENT_SMOOTHING = 0.2
#: Gradient limit: share of the distance to the smoothed inter-token time the floor rises by
#: per interval while above it (0.0002: a time constant of 2,500 intervals, about 21 minutes;
#: 0.0005 cost ``conversation`` 5 % of its goodput at 2x on seed 1).
FLOOR_DRIFT = 0.0002
#: The wait budget is never below this share of the TTFT SLO (prefill estimates can be high).
MIN_WAIT_SHARE = 0.2


class SloState:
    """The measurements and the adaptive limit of one pod.

    Args:
        tpot_seconds: target time per output token, seconds (None: the gradient limit, which
            needs no target).
        ttft_seconds: TTFT SLO, seconds (None: no shedding by expected wait).
        max_limit: the policy's concurrency cap (None: unbounded; the adaptive limit then starts
            at :data:`DEFAULT_START`).
        now: clock seconds at creation.

    Attributes:
        limit: the adaptive concurrency limit now, requests (AIMD on ``tpot_seconds`` when set,
            else the gradient limit).
        gap_s: smoothed inter-token time, seconds (None before any sample).
        floor_s: the lowest one-interval mean inter-token time observed, drifting up towards
            ``gap_s`` (the gradient limit's baseline), seconds (None before any sample).
        prefill_s: smoothed admission-to-first-token time, seconds (0 before any sample).
        service_s: smoothed admission-to-release time, seconds (None before any sample).
    """

    DEFAULT_START = 64

    __slots__ = (
        "_engine_waiting",
        "_engine_waiting_until",
        "_estimate",
        "_gap_n",
        "_gap_sum",
        "_interval_end",
        "_reached",
        "floor_s",
        "gap_s",
        "limit",
        "max_limit",
        "prefill_s",
        "service_s",
        "tpot_seconds",
        "ttft_seconds",
    )

    def __init__(
        self,
        tpot_seconds: float | None,
        ttft_seconds: float | None,
        max_limit: int | None,
        now: float,
    ) -> None:
        self.tpot_seconds = tpot_seconds
        self.ttft_seconds = ttft_seconds
        self.max_limit = max_limit
        self.limit: int = max_limit if max_limit is not None else self.DEFAULT_START
        self._estimate = float(self.limit)
        self.gap_s: float | None = None
        self.floor_s: float | None = None
        self.prefill_s = 0.0
        self.service_s: float | None = None
        self._gap_sum = 0.0
        self._gap_n = 0.0
        self._reached = False
        self._interval_end = now + INTERVAL_S
        self._engine_waiting = 0
        self._engine_waiting_until = 0.0

    def retune(
        self, tpot_seconds: float | None, ttft_seconds: float | None, max_limit: int | None
    ) -> None:
        """Take a changed policy's SLOs and cap; the measurements stay. The AIMD limit is
        clamped to the new cap; the gradient limit (no TPOT target) starts from a changed cap,
        as it falls again within a few intervals where the inter-token time says so."""
        if tpot_seconds is None and max_limit is not None and max_limit != self.max_limit:
            self.limit = max_limit
        self.tpot_seconds, self.ttft_seconds, self.max_limit = tpot_seconds, ttft_seconds, max_limit
        if max_limit is not None:
            self.limit = min(self.limit, max_limit)
        self._estimate = float(self.limit)

    # ------------------------------------------------------------------ measurements

    def observe_gap(self, seconds: float, tokens: float) -> None:
        """``tokens`` (> 0) output tokens of one request arrived over ``seconds``."""
        self._gap_sum += seconds
        self._gap_n += tokens

    def observe_first_token(self, seconds: float) -> None:
        """One request's first token came ``seconds`` after its admission."""
        self.prefill_s += 0.1 * (seconds - self.prefill_s)

    def observe_departure(self, seconds: float) -> None:
        """One admitted request was released ``seconds`` after its admission."""
        sv = self.service_s
        self.service_s = seconds if sv is None else sv + SERVICE_ALPHA * (seconds - sv)

    def reached(self) -> None:
        """The adaptive limit stopped a request (so raising it could admit more)."""
        self._reached = True

    # ------------------------------------------------------------------ control

    def tick(self, now: float, in_flight: int) -> None:
        """Close every measurement interval that ended by ``now`` and move the limit."""
        if now < self._interval_end:
            return
        self._interval_end = now + INTERVAL_S
        sampled = self._gap_n > 0
        if sampled:
            mean = self._gap_sum / self._gap_n
            gap = mean if self.gap_s is None else self.gap_s + SMOOTHING * (mean - self.gap_s)
            self.gap_s = gap
            floor = self.floor_s
            self.floor_s = (
                mean if floor is None or mean < floor else floor + FLOOR_DRIFT * (gap - floor)
            )
        self._gap_sum, self._gap_n = 0.0, 0.0
        reached, self._reached = self._reached or in_flight >= self.limit, False
        if self.gap_s is None:
            return
        if self.tpot_seconds is None:
            if sampled:
                self._gradient(reached, in_flight)
        elif self.gap_s > TARGET_FRACTION * self.tpot_seconds:
            self.limit = max(MIN_LIMIT, math.floor(self.limit * DECREASE))
        elif reached and self.gap_s < RAISE_FRACTION * self.tpot_seconds:
            up = self.limit + max(1, math.floor(self.limit * INCREASE))
            self.limit = up if self.max_limit is None else min(self.max_limit, up)
        self._estimate = float(self.limit) if self.tpot_seconds is not None else self._estimate

    def _gradient(self, reached: bool, in_flight: int) -> None:
        """One interval of the gradient limit (no TPOT target; see the module docstring)."""
        gap, floor, est = self.gap_s, self.floor_s, self._estimate
        assert gap is not None and floor is not None
        if not reached and in_flight < est / 2:
            return  # application-limited: the latency says nothing about the limit
        gradient = max(GRADIENT_MIN, min(1.0, GRADIENT_TOLERANCE * floor / gap)) if gap > 0 else 1.0
        # Headroom only while decoding is within the tolerance (Gradient2 adds its queue size
        # always; the limit here also waits for it to be reached).
        target = est * gradient if gradient < 1 else est + (math.sqrt(est) if reached else 0.0)
        est += GRADIENT_SMOOTHING * (target - est)
        cap = math.inf if self.max_limit is None else self.max_limit
        self._estimate = est = min(cap, max(float(MIN_LIMIT), est))
        self.limit = max(MIN_LIMIT, math.floor(est))

    def observe_engine_waiting(self, waiting: int | None, until: float) -> None:
        """The engine reports ``waiting`` requests in its own queue (None: unknown); they count
        ahead of every newcomer in :meth:`expected_wait` until clock time ``until``."""
        self._engine_waiting = max(0, waiting or 0)
        self._engine_waiting_until = until

    def engine_waiting(self, now: float) -> int:
        """Requests the engine reported waiting in its own queue, 0 once that report is older
        than its lifetime."""
        return self._engine_waiting if now <= self._engine_waiting_until else 0

    def expected_wait(self, ahead: int, in_flight: int, now: float | None = None) -> float | None:
        """Seconds a newcomer with ``ahead`` requests waiting before it would wait while
        ``in_flight`` requests hold the server: ``(ahead + w + 1) x service_s / in_flight``, with
        ``w`` the engine's own waiting requests at clock time ``now`` (:meth:`engine_waiting`;
        0 when ``now`` is None); None before any request was released or with nothing in
        flight."""
        if self.service_s is None or in_flight <= 0:
            return None
        if now is not None:
            ahead += self.engine_waiting(now)
        return (ahead + 1) * self.service_s / in_flight

    def wait_budget(self, ttft_seconds: float | None = None) -> float | None:
        """Seconds a request under a TTFT SLO (``ttft_seconds``, its class's; default the
        policy's) may wait in the queue: the SLO less the observed prefill time, at least
        :data:`MIN_WAIT_SHARE` of the SLO; None without a TTFT SLO."""
        ttft = self.ttft_seconds if ttft_seconds is None else ttft_seconds
        if ttft is None:
            return None
        return max(MIN_WAIT_SHARE * ttft, ttft - self.prefill_s)
