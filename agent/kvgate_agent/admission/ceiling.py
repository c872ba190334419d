"""The concurrency limit one pod enforces now: the lowest of the policy's cap, the engine's own
concurrency (llama.cpp's slots) and the adaptive limit (:mod:`.concurrency_limit`: the most
requests in flight whose requests meet the TPOT SLO, or the knee of throughput against
concurrency when none is stated), always in force.

Invariant: :attr:`Limits.concurrency_limit` always holds that lowest figure: it is written here,
and only here, whenever one of the three moves.
"""

from __future__ import annotations

from kvgate_agent.admission.config import AdmissionConfig
from kvgate_agent.admission.fairqueue import PREFILL_SHARE
from kvgate_agent.admission.limits import Limits
from kvgate_agent.admission.slo import SloState


class ConcurrencyCeiling:
    """Keeps ``limits.concurrency_limit`` at the lowest of the policy's cap, the engine's slots
    and ``slo``'s adaptive limit (requests)."""

    __slots__ = ("_limits", "_slo", "engine_slots")

    def __init__(self, limits: Limits, slo: SloState) -> None:
        self._limits = limits
        self._slo = slo
        #: Requests the engine serves at once (llama.cpp's ``total_slots``); None: no such limit.
        self.engine_slots: int | None = None
        self._sync()

    def set_engine_slots(self, slots: int | None) -> None:
        """The engine serves at most ``slots`` requests at once (None: no such limit): a ceiling
        on the concurrency cap, as a request above it would wait in the engine's own queue,
        outside kvgate's order, TTFT budget and Retry-After."""
        self.engine_slots = slots  # the same figure again changes nothing
        self.retune(self._limits.config)

    def retune(self, config: AdmissionConfig) -> None:
        """New thresholds (already in ``limits``) or a new engine ceiling: the adaptive limit
        starts from the new cap."""
        self._slo.retune(config.tpot_slo_seconds, config.ttft_slo_seconds, self._cap())
        self._sync()

    def tick(self, now: float) -> None:
        """Let the adaptive limit move (clock seconds ``now``), following it when it did."""
        slo = self._slo
        before = slo.limit
        slo.tick(now, self._limits.in_flight)
        if slo.limit != before:
            self._sync()
        ttft = slo.ttft_seconds
        fair = self._limits.fair
        fair.congested = ttft is not None and fair.prefill.delay(now) > PREFILL_SHARE * ttft

    def _cap(self) -> int | None:
        """The policy's concurrency cap, lowered to the engine's own (None: neither)."""
        cap, engine = self._limits.config.max_concurrency, self.engine_slots
        return engine if cap is None else cap if engine is None else min(cap, engine)

    def _sync(self) -> None:
        cap = self._cap()
        adaptive = self._slo.limit
        self._limits.concurrency_cap = cap
        self._limits.concurrency_limit = adaptive if cap is None else min(cap, adaptive)
