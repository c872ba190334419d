"""The baselines written for the effectiveness benchmark: ``none``, ``concurrency-cap``,
``token-bucket`` and ``saturation-shed`` (what each stands for, and its swept knobs:
:mod:`kvgate_bench.effectiveness.arms.registry`). The other baselines have a module each
(:mod:`~kvgate_bench.effectiveness.arms.flow_control`,
:mod:`~kvgate_bench.effectiveness.arms.vllm_queue_limit`,
:mod:`~kvgate_bench.effectiveness.arms.codel_gate`). Times are virtual seconds, rates per second.
"""

from __future__ import annotations

import math
from collections import deque

from kvgate_bench.effectiveness.arms.context import ArmContext
from kvgate_bench.effectiveness.model.gate import Arm, Gate
from kvgate_bench.effectiveness.model.schedule import BATCH, Request


class NoneArm(Arm):
    """No admission: every request goes to the engine at once (its FCFS queue decides)."""

    name = "none"

    def on_arrival(self, req: Request, now: float) -> None:
        self.gate.dispatch(req, now)


class ConcurrencyCapArm(Arm):
    """At most ``cap`` requests in the engine; the rest wait FIFO, refused (503) after waiting
    ``queue_timeout_s`` seconds.

    ``max_in_flight`` records the largest number in flight seen (never above ``cap``).
    """

    name = "concurrency-cap"

    def __init__(self, cap: int, queue_timeout_s: float) -> None:
        super().__init__()
        if cap < 1 or queue_timeout_s <= 0:
            raise ValueError("cap must be >= 1 and queue_timeout_s > 0")
        self.cap = cap
        self.queue_timeout_s = queue_timeout_s
        self.params = {"cap": cap, "queue_timeout_s": queue_timeout_s}
        self.in_flight = 0
        self.max_in_flight = 0
        self._queue: deque[tuple[Request, float]] = deque()  # (request, deadline), FIFO

    def _send(self, req: Request, now: float) -> None:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.gate.dispatch(req, now)

    def on_arrival(self, req: Request, now: float) -> None:
        if self.in_flight < self.cap and not self._queue:
            self._send(req, now)
        else:
            self._queue.append((req, now + self.queue_timeout_s))

    def _drain(self, now: float) -> None:
        q = self._queue
        while q and q[0][1] <= now:
            self.gate.reject(q.popleft()[0], now, None)
        while q and self.in_flight < self.cap:
            self._send(q.popleft()[0], now)

    def on_finish(self, req: Request, output_tokens: int, now: float) -> None:
        self.in_flight -= 1
        self._drain(now)

    def queued(self) -> int:
        return len(self._queue)

    def next_wake(self) -> float | None:
        return self._queue[0][1] if self._queue else None  # FIFO: deadlines are in order

    def on_wake(self, now: float) -> None:
        self._drain(now)


class _DebtBucket:
    """A bucket of ``capacity`` units refilled at ``rate`` units/s that may go into debt
    (usage charged after the response can exceed what was left)."""

    __slots__ = ("capacity", "last", "level", "rate")

    def __init__(self, capacity: float, rate: float, now: float) -> None:
        self.capacity, self.rate, self.level, self.last = capacity, rate, capacity, now

    def refill(self, now: float) -> float:
        if now > self.last:
            self.level = min(self.capacity, self.level + (now - self.last) * self.rate)
            self.last = now
        return self.level

    def seconds_until(self, level: float, now: float) -> float:
        return max(0.0, (level - self.refill(now)) / self.rate)


class TokenBucketArm(Arm):
    """Per-tenant request and token buckets, charged after the response (see the module
    docstring). Tenant ``t`` gets ``factor x share(t) x capacity`` requests and tokens per
    second, with bursts of ``burst_s`` seconds' worth."""

    name = "token-bucket"

    def __init__(self, ctx: ArmContext, factor: float, burst_s: float = 60.0) -> None:
        super().__init__()
        if factor <= 0 or burst_s <= 0:
            raise ValueError("factor and burst_s must be > 0")
        self.ctx = ctx
        self.factor = factor
        self.burst_s = burst_s
        self.params = {"factor": factor, "burst_s": burst_s}
        self._req: dict[str, _DebtBucket] = {}
        self._tok: dict[str, _DebtBucket] = {}

    def _buckets(self, tenant: str, now: float) -> tuple[_DebtBucket, _DebtBucket]:
        rb = self._req.get(tenant)
        if rb is None:
            share = self.ctx.share(tenant) * self.factor
            rr = share * self.ctx.capacity_rps
            tr = share * self.ctx.capacity_tokens_per_s
            rb = self._req[tenant] = _DebtBucket(max(1.0, rr * self.burst_s), rr, now)
            self._tok[tenant] = _DebtBucket(max(1.0, tr * self.burst_s), tr, now)
        return rb, self._tok[tenant]

    def on_arrival(self, req: Request, now: float) -> None:
        rb, tb = self._buckets(req.tenant, now)
        if rb.refill(now) < 1.0:
            self.gate.reject(req, now, math.ceil(max(1.0, rb.seconds_until(1.0, now))))
        elif tb.refill(now) <= 0.0:
            self.gate.reject(req, now, math.ceil(max(1.0, tb.seconds_until(1e-9, now))))
        else:
            rb.level -= 1.0
            self.gate.dispatch(req, now)

    def on_finish(self, req: Request, output_tokens: int, now: float) -> None:
        _, tb = self._buckets(req.tenant, now)
        tb.refill(now)
        tb.level -= req.prompt_tokens + output_tokens


class SaturationShedArm(Arm):
    """llm-d's saturation detector (see the module docstring): scrape every ``scrape_s``,
    saturated at ``queue_threshold`` waiting or ``kv_threshold`` KV usage or metrics older
    than ``staleness_s``; shed the arriving request (``shed=all``) or only sheddable (batch)
    ones (``shed=sheddable``) while saturated."""

    name = "saturation-shed"

    def __init__(
        self,
        shed: str = "all",
        queue_threshold: int = 5,
        kv_threshold: float = 0.8,
        scrape_s: float = 0.05,
        staleness_s: float = 0.2,
    ) -> None:
        super().__init__()
        if shed not in ("all", "sheddable"):
            raise ValueError("shed must be 'all' or 'sheddable'")
        self.shed = shed
        self.queue_threshold, self.kv_threshold = queue_threshold, kv_threshold
        self.scrape_s, self.staleness_s = scrape_s, staleness_s
        self.params = {"shed": shed}
        self._scraped_at = -math.inf
        self._waiting = 0
        self._kv = 0.0
        self._next_scrape = 0.0

    def start(self, gate: Gate, now: float) -> None:
        super().start(gate, now)
        self._next_scrape = now

    def saturated(self, now: float) -> bool:
        """Whether the detector says saturated at ``now`` (from the last scrape)."""
        return (
            now - self._scraped_at > self.staleness_s
            or self._waiting >= self.queue_threshold
            or self._kv >= self.kv_threshold
        )

    def on_arrival(self, req: Request, now: float) -> None:
        if now >= self._next_scrape:
            # The engine sat idle (no timer ran): every scrape since read the same idle state.
            self.on_wake(now - (now - self._next_scrape) % self.scrape_s)
        sheddable = self.shed == "all" or req.tier == BATCH
        if sheddable and self.saturated(now):
            self.gate.reject(req, now, None)
        else:
            self.gate.dispatch(req, now)

    def next_wake(self) -> float | None:
        # While the engine is idle its gauges cannot change: no timer (so a drained run ends);
        # on_arrival catches the scrapes up.
        return self._next_scrape if self.gate.engine.has_work else None

    def on_wake(self, now: float) -> None:
        eng = self.gate.engine
        self._waiting, self._kv, self._scraped_at = eng.num_waiting, eng.kv_usage, now
        self._next_scrape = now + self.scrape_s
