"""The ``flow-control`` arm: llm-d's flow control as its users run it, in front of one engine.

llm-d's endpoint picker holds requests in its flow-control layer (llm-d-router
``pkg/epp/flowcontrol/``, https://github.com/llm-d/llm-d-inference-scheduler/tree/main/pkg/epp/flowcontrol;
GA, opt-in) and dispatches them while the pool is not saturated:

* **Priority bands**, served strictly in priority order (the benchmark's ``interactive`` tier
  above ``batch``, as an InferenceObjective's priority would put them).
* **Flows** within a band: one per fairness id (``x-llm-d-inference-fairness-id``; the tenant
  here); the inter-flow policy is round-robin between the band's non-empty flows, the
  intra-flow policy FCFS.
* **Saturation gate**: the same detector as the ``saturation-shed`` arm (scraped every 50 ms;
  saturated at >= ``queue_threshold`` waiting requests or >= ``kv_threshold`` KV usage, or
  when the last scrape is older than 200 ms); the dispatch loop hands the chosen head to the
  engine only while the pool is not saturated, and stops at the first saturated check (head of
  line). Between two scrapes the requests dispatched since the last one are counted as
  waiting (otherwise one stale reading would release the whole queue at once).
* **TTL**: a queued request that has waited ``ttl_s`` (default 60 s, the controller's
  ``DefaultRequestTTL``) is evicted and answered 429.

Swept: the TTL and the two thresholds around their defaults. Times in seconds.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from typing import Any

from kvgate_bench.effectiveness.model.gate import Arm, Gate
from kvgate_bench.effectiveness.model.schedule import BATCH, Request

#: The detector's scrape period and staleness bound, seconds (those of ``saturation-shed``).
SCRAPE_S = 0.05
STALENESS_S = 0.2


class FlowControlArm(Arm):
    """Priority bands, round-robin flows, FCFS within a flow, a saturation-gated dispatch
    loop and a TTL (see the module docstring)."""

    name = "flow-control"

    def __init__(
        self,
        ttl_s: float = 60.0,
        queue_threshold: int = 5,
        kv_threshold: float = 0.8,
        scrape_s: float = SCRAPE_S,
        staleness_s: float = STALENESS_S,
    ) -> None:
        super().__init__()
        if ttl_s <= 0 or queue_threshold < 1 or not 0 < kv_threshold <= 1:
            raise ValueError("need ttl_s > 0, queue_threshold >= 1, 0 < kv_threshold <= 1")
        self.ttl_s = ttl_s
        self.queue_threshold, self.kv_threshold = queue_threshold, kv_threshold
        self.scrape_s, self.staleness_s = scrape_s, staleness_s
        self.params = {
            "ttl_s": ttl_s,
            "queue_threshold": queue_threshold,
            "kv_threshold": kv_threshold,
        }
        # band (higher first) -> flow -> FCFS queue of (request, enqueued at); a flow's place in
        # its OrderedDict is its turn (round-robin: the served flow moves to the end).
        self._bands: dict[int, OrderedDict[str, deque[tuple[Request, float]]]] = {}
        self._expiry: deque[tuple[float, Request]] = deque()  # (deadline, request), in order
        self._queued: set[str] = set()
        self._scraped_at = -math.inf
        self._waiting = 0
        self._kv = 0.0
        self._since_scrape = 0
        self._next_scrape = 0.0
        self.evicted = 0

    def start(self, gate: Gate, now: float) -> None:
        super().start(gate, now)
        self._next_scrape = now

    @staticmethod
    def band_of(req: Request) -> int:
        """The request's priority band: 0 for the batch tier, 1 otherwise."""
        return 0 if req.tier == BATCH else 1

    def saturated(self, now: float) -> bool:
        """The detector's answer at ``now``: the last scrape plus what was sent since."""
        return (
            now - self._scraped_at > self.staleness_s
            or self._waiting + self._since_scrape >= self.queue_threshold
            or self._kv >= self.kv_threshold
        )

    def scrape(self, now: float) -> None:
        """Read the engine's gauges at ``now`` (the detector's periodic scrape)."""
        eng = self.gate.engine
        self._waiting, self._kv, self._scraped_at = eng.num_waiting, eng.kv_usage, now
        self._since_scrape = 0
        self._next_scrape = now + self.scrape_s

    def _catch_up(self, now: float) -> None:
        if now >= self._next_scrape:
            # No timer ran while the engine idled: the scrapes since read the same idle state.
            self.scrape(now - (now - self._next_scrape) % self.scrape_s)

    def on_arrival(self, req: Request, now: float) -> None:
        self._catch_up(now)
        flows = self._bands.setdefault(self.band_of(req), OrderedDict())
        flows.setdefault(req.tenant, deque()).append((req, now))
        self._queued.add(req.rid)
        self._expiry.append((now + self.ttl_s, req))
        self._dispatch(now)

    def _pop_next(self) -> Request | None:
        """The next request by band, then round-robin flow, then FCFS; None when empty."""
        for band in sorted(self._bands, reverse=True):
            flows = self._bands[band]
            while flows:
                tenant, q = next(iter(flows.items()))
                while q and q[0][0].rid not in self._queued:
                    q.popleft()  # evicted at its TTL
                if not q:
                    del flows[tenant]
                    continue
                req = q.popleft()[0]
                flows.move_to_end(tenant)
                if not q:
                    del flows[tenant]
                return req
        return None

    def _evict(self, now: float) -> None:
        exp = self._expiry
        while exp and (exp[0][0] <= now or exp[0][1].rid not in self._queued):
            _, req = exp.popleft()
            if req.rid in self._queued:
                self._queued.discard(req.rid)
                self.evicted += 1
                self.gate.reject(req, now, None)

    def _dispatch(self, now: float) -> None:
        self._evict(now)
        while self._queued and not self.saturated(now):
            req = self._pop_next()
            if req is None:
                break
            self._queued.discard(req.rid)
            self._since_scrape += 1
            self.gate.dispatch(req, now)

    def busy(self) -> bool:
        """Whether the detector keeps scraping: requests queued here or the engine at work."""
        return bool(self._queued) or self.gate.engine.has_work

    def next_wake(self) -> float | None:
        # Scrape while there is something to dispatch or the engine is busy; the next TTL.
        scrape = self._next_scrape if self.busy() else math.inf
        while self._expiry and self._expiry[0][1].rid not in self._queued:
            self._expiry.popleft()
        ttl = self._expiry[0][0] if self._expiry else math.inf
        t = min(scrape, ttl)
        return None if t == math.inf else t

    def on_wake(self, now: float) -> None:
        if now >= self._next_scrape:
            self.scrape(now)
        self._dispatch(now)

    def on_finish(self, req: Request, output_tokens: int, now: float) -> None:
        self._catch_up(now)
        self._dispatch(now)


#: Swept TTLs (seconds) and (queue depth, KV usage) thresholds: the defaults (60 s; 5, 0.8) and
#: tighter ones (on this engine the waiting queue stays empty until max_num_seqs are running, so
#: only a lower KV threshold holds the batch back).
SHORT_TTLS: tuple[float, ...] = (0.1, 0.25, 0.5, 60.0)
SHORT_THRESHOLDS: tuple[tuple[int, float], ...] = ((5, 0.8), (3, 0.4), (3, 0.3), (3, 0.2))
FULL_TTLS: tuple[float, ...] = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 60.0)
FULL_THRESHOLDS: tuple[tuple[int, float], ...] = (
    (2, 0.2),
    (3, 0.2),
    (3, 0.3),
    (5, 0.3),
    (3, 0.4),
    (5, 0.5),
    (5, 0.8),
    (10, 0.8),
    (10, 0.9),
)


def candidates(short: bool) -> list[dict[str, Any]]:
    """The settings swept: TTL x thresholds."""
    ttls, ths = (SHORT_TTLS, SHORT_THRESHOLDS) if short else (FULL_TTLS, FULL_THRESHOLDS)
    return [{"ttl_s": t, "queue_threshold": q, "kv_threshold": k} for t in ttls for (q, k) in ths]
