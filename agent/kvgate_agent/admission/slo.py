"""Serving the latency SLOs: the measurements, the adaptive concurrency limit and the expected
queue wait.

**Adaptive concurrency**: every streamed token's inter-token gap is labelled with the requests
in flight when it passed and learned per concurrency (:mod:`.step_table`); once per
:data:`INTERVAL_S` the limit moves to the largest concurrency whose requests meet the SLO there
(:mod:`.concurrency_limit`: the p90 of per-request TPOT under ``slo.tpotSeconds``, the knee of
throughput against concurrency without it), lowered at once where measured too slow, raised at
most one step per service time where the limit stopped requests. Each completed request's own
TPOT, labelled with the mean requests in flight beside it, is learned too
(:mod:`.tpot_table`): under a TPOT SLO it is what decides once requests complete.

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

Invariant: pure and clock-injected (times are passed in); every method is O(1) but
:meth:`SloState.tick`, which moves the limit once per interval in O(buckets).
"""

from __future__ import annotations

from typing import Final

from kvgate_agent.admission.concurrency_limit import ConcurrencyLimit
from kvgate_agent.admission.step_table import StepTable
from kvgate_agent.admission.tpot_table import TpotTable

#: Length of one measurement interval, seconds.
INTERVAL_S: Final = 0.5
#: Smoothing of the per-interval mean inter-token time across intervals (weight of the newest;
#: the overall figure reported as ``inter_token_seconds``).
SMOOTHING: Final = 0.1
#: A request under a TTFT SLO is refused at once when its expected wait exceeds this many times
#: its wait budget; between one and this many, it is queued and its deadline (the budget)
#: decides. The estimate is an upper bound (waiters ahead also leave by timing out) and a refusal
#: is final, so only the clearly hopeless are refused unqueued. Chosen on the effectiveness
#: benchmark (1, 1.5, 2 and 2.5 tried; the table is in docs/benchmarks.md, "What kvgate does").
SHED_FACTOR: Final = 2.0
#: Without a TTFT SLO or a stated wait bound, a request may wait in the queue the default bound
#: or this many times the lowest admission-to-first-token time measured, whichever is longer:
#: on an engine whose own first token takes seconds (a CPU server's prefill) a fixed 0.5 s
#: refuses every request that would have to wait behind one other, while on a GPU (tens of
#: milliseconds) the default stays. The same tolerance as the empty spec's TPOT knee
#: (:data:`~.concurrency_limit.TOLERANCE`).
UNLOADED_WAIT_FACTOR: Final = 2.5
#: The mean residual service time of the requests in flight is never taken below this share of
#: the service time: one that ran past the mean is a long one, not one about to end.
RESIDUAL_FLOOR: Final = 0.25
#: Weight of each release in the mean service time.
SERVICE_ALPHA: Final = 0.05
#: Seconds between two raises of the limit before any service time is known.
DEFAULT_HOLD_S: Final = 1.0
#: The wait budget is never below this share of the TTFT SLO (prefill estimates can be high).
MIN_WAIT_SHARE: Final = 0.2


class SloState:
    """The measurements and the adaptive limit of one pod.

    Args:
        tpot_seconds: the TPOT SLO, seconds per output token (None: the limit finds the knee of
            throughput against concurrency instead).
        ttft_seconds: TTFT SLO, seconds (None: no shedding by expected wait).
        max_limit: the policy's concurrency cap, lowered to the engine's slots (None: neither;
            the adaptive limit then starts at :data:`DEFAULT_START`).
        now: clock seconds at creation.

    Attributes:
        limit: the adaptive concurrency limit now, requests (>= 1).
        table: the learned step time by requests in flight (:class:`.step_table.StepTable`).
        tpot: completed requests' TPOT by requests in flight (:class:`.tpot_table.TpotTable`).
        gap_s: smoothed inter-token time over all requests, seconds (None before any sample).
        prefill_s: smoothed admission-to-first-token time, seconds (0 before any sample).
        service_s: smoothed admission-to-release time, seconds (None before any sample).
        lowest_ttft_s: the lowest measured admission-to-first-token time of any concurrency,
            seconds, as of the last control interval (0: none).
    """

    DEFAULT_START = 64

    __slots__ = (
        "_control",
        "_engine_waiting",
        "_engine_waiting_until",
        "_gap_n",
        "_gap_sum",
        "_held",
        "_interval_end",
        "_reached",
        "gap_s",
        "lowest_ttft_s",
        "max_limit",
        "prefill_s",
        "service_s",
        "table",
        "tpot",
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
        self._control = ConcurrencyLimit(max_limit if max_limit is not None else self.DEFAULT_START)
        #: The limit when a cap last came over an uncapped one (given back when it is lifted).
        self._held = self.DEFAULT_START
        self.table = StepTable()
        self.tpot = TpotTable()
        self.gap_s: float | None = None
        self.prefill_s = 0.0
        self.service_s: float | None = None
        self.lowest_ttft_s = 0.0
        self._gap_sum = 0.0
        self._gap_n = 0.0
        self._reached = False
        self._interval_end = now + INTERVAL_S
        self._engine_waiting = 0
        self._engine_waiting_until = 0.0

    @property
    def limit(self) -> int:
        """The adaptive concurrency limit now, requests (>= 1)."""
        return self._control.limit

    def retune(
        self, tpot_seconds: float | None, ttft_seconds: float | None, max_limit: int | None
    ) -> None:
        """Take a changed policy's SLOs and cap; the measurements stay. A new cap is also where
        the limit starts again (it falls within an interval where the table says so); the same
        cap again changes nothing; a cap lifted (None) gives back the limit held before the cap
        came (an engine stall caps admission at 1 for its length, then lifts the cap)."""
        control = self._control
        old = self.max_limit
        if max_limit is not None and max_limit != old:
            if old is None:
                self._held = control.limit
            control.limit = max_limit
        elif max_limit is None and old is not None:
            control.limit = max(control.limit, self._held)
        self.tpot_seconds, self.ttft_seconds, self.max_limit = tpot_seconds, ttft_seconds, max_limit
        if max_limit is not None:
            control.limit = max(1, min(control.limit, max_limit))

    # ------------------------------------------------------------------ measurements

    def observe_gap(self, seconds: float, tokens: float, in_flight: int) -> None:
        """``tokens`` (> 0) output tokens of one request arrived over ``seconds`` while
        ``in_flight`` requests were in flight here."""
        self._gap_sum += seconds
        self._gap_n += tokens
        self.table.observe(in_flight, seconds, tokens)

    def observe_first_token(self, seconds: float, in_flight: int, now: float) -> None:
        """One request's first token came ``seconds`` after its admission, ``in_flight``
        requests in flight, at clock time ``now``."""
        self.prefill_s += 0.1 * (seconds - self.prefill_s)
        self.table.observe_first_token(in_flight, seconds, now)

    def observe_completion(self, mean_in_flight: float, tpot_s: float, now: float) -> None:
        """A streamed request completed at clock time ``now`` with ``tpot_s`` seconds per output
        token after its first, having decoded beside ``mean_in_flight`` requests in flight on
        average (:class:`.tpot_table.TpotTable`)."""
        self.tpot.observe(mean_in_flight, tpot_s, now)

    def observe_departure(self, seconds: float) -> None:
        """One admitted request was released ``seconds`` after its admission."""
        sv = self.service_s
        self.service_s = seconds if sv is None else sv + SERVICE_ALPHA * (seconds - sv)

    def reached(self) -> None:
        """The adaptive limit stopped a request (so raising it could admit more)."""
        self._reached = True

    # ------------------------------------------------------------------ control

    def tick(self, now: float, in_flight: int) -> None:
        """Close the measurement interval if it ended by ``now`` and move the limit."""
        if now < self._interval_end:
            return
        self._interval_end = now + INTERVAL_S
        if self._gap_n > 0:
            mean = self._gap_sum / self._gap_n
            gap = self.gap_s
            self.gap_s = mean if gap is None else gap + SMOOTHING * (mean - gap)
        self._gap_sum, self._gap_n = 0.0, 0.0
        self.table.fold(now)
        self.tpot.fold()
        self.lowest_ttft_s = self.table.lowest_ttft(now)
        reached, self._reached = self._reached or in_flight >= self.limit, False
        sv = self.service_s
        self._control.decide(
            self.table,
            self.tpot,
            now,
            tpot_s=self.tpot_seconds,
            ttft_s=self.ttft_seconds,
            reached=reached,
            hold_s=DEFAULT_HOLD_S if sv is None else max(INTERVAL_S, sv),
            cap=self.max_limit,
        )

    def observe_engine_waiting(self, waiting: int | None, until: float) -> None:
        """The engine reports ``waiting`` requests in its own queue (None: unknown); they count
        ahead of every newcomer in :meth:`expected_wait` until clock time ``until``."""
        self._engine_waiting = max(0, waiting or 0)
        self._engine_waiting_until = until

    def engine_waiting(self, now: float) -> int:
        """Requests the engine reported waiting in its own queue, 0 once that report is older
        than its lifetime."""
        return self._engine_waiting if now <= self._engine_waiting_until else 0

    def expected_wait(
        self, ahead: int, in_flight: int, now: float | None = None, age_s: float | None = None
    ) -> float | None:
        """Seconds a newcomer with ``ahead`` requests waiting before it would wait while
        ``in_flight`` requests hold the server, ``w`` of the engine's own waiting requests at
        clock time ``now`` ahead of all (:meth:`engine_waiting`; 0 when ``now`` is None); None
        before any request was released or with nothing in flight.

        With ``k = ahead + w + 1`` and ``S`` the service time: without ``age_s`` (the mean
        seconds the requests in flight have run), ``k x S / in_flight``, the drain of a server
        that frees ``in_flight`` slots per ``S``. With it, the requests in flight end first:
        their mean residual is ``R = max(RESIDUAL_FLOOR x S, S - age_s)`` and, taken as spread
        evenly over ``[0, 2R]``, the ``k``-th of ``n`` ends after ``2R x k / (n + 1)``; beyond
        the ``n``-th, one more per ``S / n``. In the steady state (``age_s`` about ``S / 2``)
        this is the drain above; where few requests hold a slow server (one llama.cpp slot
        busy for seconds), a newcomer arriving near the end of the running request is not
        told to wait a whole service time."""
        sv = self.service_s
        if sv is None or in_flight <= 0:
            return None
        if now is not None:
            ahead += self.engine_waiting(now)
        k = ahead + 1
        if age_s is None:
            return k * sv / in_flight
        residual = max(RESIDUAL_FLOOR * sv, sv - age_s)
        if k <= in_flight:
            return 2.0 * residual * k / (in_flight + 1)
        return 2.0 * residual * in_flight / (in_flight + 1) + (k - in_flight) * sv / in_flight

    def default_wait(self, default_s: float) -> float:
        """The queue wait bound of a request under no TTFT SLO, seconds: ``default_s`` or
        :data:`UNLOADED_WAIT_FACTOR` times the lowest measured admission-to-first-token time
        (as of the last control interval), whichever is longer."""
        return max(default_s, UNLOADED_WAIT_FACTOR * self.lowest_ttft_s)

    def wait_budget(self, ttft_seconds: float | None = None) -> float | None:
        """Seconds a request under a TTFT SLO (``ttft_seconds``, its class's; default the
        policy's) may wait in the queue: the SLO less the observed prefill time, at least
        :data:`MIN_WAIT_SHARE` of the SLO; None without a TTFT SLO."""
        ttft = self.ttft_seconds if ttft_seconds is None else ttft_seconds
        if ttft is None:
            return None
        return max(MIN_WAIT_SHARE * ttft, ttft - self.prefill_s)
