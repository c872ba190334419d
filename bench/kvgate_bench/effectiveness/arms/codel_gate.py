"""The ``codel-gate`` arm: NVIDIA Dynamo's per-backend admission gate, in front of one engine.

Dynamo's Backend Admission Gate (ai-dynamo/dynamo PR #14369,
https://github.com/ai-dynamo/dynamo/pull/14369, on the boundary of PR #14158) sits after the
request plane and before the engine:

* a cap on concurrent requests in the backend (``DYN_ENGINE_REQUEST_LIMIT``; by default
  ``ceil(1.5 x max_num_seqs)`` = 384 for this engine), held until the response stream ends;
* a bounded FIFO overflow queue (``DYN_DYNAMO_REQUEST_QUEUE_LIMIT``, default 40,000); a request
  that finds it full is refused (503);
* Controlled Delay, on by default, and Adaptive LIFO, on by default, as Facebook runs them
  ("Fail at Scale", Maurer, ACM Queue 13(8), 2015, https://queue.acm.org/detail.cfm?id=2839461;
  after CoDel, Nichols and Jacobson, "Controlling Queue Delay", ACM Queue 10(5), 2012,
  https://queue.acm.org/detail.cfm?id=2209336). The queue is *congested* when it has not been
  empty during the last ``interval_s`` (a standing queue: its minimum sojourn over the
  interval is above zero). While congested, a queued request is refused (503) once it has
  waited ``target_s`` (the expired prefix is dropped from the head), and free slots go to the
  newest request first (LIFO); otherwise a request may wait ``interval_s`` and the queue is
  served FIFO.

Facebook's figures are 5 ms and 100 ms for RPCs; an LLM's service time is seconds, so the
benchmark sweeps the target (50 ms to 1 s) with ``interval_s = max(100 ms, 2 x target)`` (the
interval stays the longer of the two, as in the original), and the cap. Times in seconds.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from kvgate_bench.effectiveness.model.gate import Arm
from kvgate_bench.effectiveness.model.schedule import Request

#: Dynamo's default queue bound, requests.
DEFAULT_QUEUE_LIMIT = 40_000


class CodelGateArm(Arm):
    """A concurrency cap with a CoDel-managed, adaptive-LIFO queue (see the module docstring).

    ``max_in_flight`` records the largest number in flight seen (never above ``cap``);
    ``dropped`` counts the requests refused for their queue delay.
    """

    name = "codel-gate"

    def __init__(
        self,
        cap: int,
        target_s: float,
        interval_s: float | None = None,
        queue_limit: int = DEFAULT_QUEUE_LIMIT,
    ) -> None:
        super().__init__()
        interval = max(0.1, 2 * target_s) if interval_s is None else interval_s
        if cap < 1 or target_s <= 0 or interval < target_s or queue_limit < 0:
            raise ValueError(
                "need cap >= 1, target_s > 0, interval_s >= target_s, queue_limit >= 0"
            )
        self.cap, self.target_s, self.interval_s = cap, target_s, interval
        self.queue_limit = queue_limit
        self.params = {"cap": cap, "target_s": target_s, "interval_s": interval}
        self.in_flight = 0
        self.max_in_flight = 0
        self.dropped = 0
        self._queue: deque[tuple[Request, float]] = deque()  # (request, enqueued at), oldest first
        self._nonempty_since = math.inf  # when the queue last went from empty to non-empty

    def congested(self, now: float) -> bool:
        """Whether the queue has not been empty during the last ``interval_s`` at ``now``."""
        return bool(self._queue) and now - self._nonempty_since >= self.interval_s

    def _limit(self, now: float) -> float:
        return self.target_s if self.congested(now) else self.interval_s

    def on_arrival(self, req: Request, now: float) -> None:
        self._service(now)
        if self.in_flight < self.cap and not self._queue:
            self._send(req, now)
        elif len(self._queue) >= self.queue_limit:
            self.gate.reject(req, now, None)
        else:
            if not self._queue:
                self._nonempty_since = now
            self._queue.append((req, now))

    def _send(self, req: Request, now: float) -> None:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.gate.dispatch(req, now)
        if self.gate.sequences.get(req.rid) is None:  # the engine refused it (400)
            self.in_flight -= 1

    def _service(self, now: float) -> None:
        """Drop the expired prefix, then fill free slots (LIFO while congested)."""
        q = self._queue
        limit = self._limit(now)
        while q and now - q[0][1] >= limit:
            self.dropped += 1
            self.gate.reject(q.popleft()[0], now, None)
        while q and self.in_flight < self.cap:
            lifo = self.congested(now)
            self._send((q.pop() if lifo else q.popleft())[0], now)
        if not q:
            self._nonempty_since = math.inf

    def on_finish(self, req: Request, output_tokens: int, now: float) -> None:
        self.in_flight -= 1
        self._service(now)

    def next_wake(self) -> float | None:
        """The head's deadline under the current state, or when the queue turns congested
        (which shortens the head's deadline to ``target_s``)."""
        if not self._queue:
            return None
        head = self._queue[0][1]
        turns = self._nonempty_since + self.interval_s
        return min(head + self.interval_s, max(turns, head + self.target_s))

    def on_wake(self, now: float) -> None:
        self._service(now)


#: Swept caps (requests) and CoDel targets (seconds).
SHORT_CAPS: tuple[int, ...] = (64, 96, 128, 192, 384)
SHORT_TARGETS: tuple[float, ...] = (0.1, 0.25, 1.0)
FULL_CAPS: tuple[int, ...] = (32, 48, 64, 96, 128, 192, 256, 384)
FULL_TARGETS: tuple[float, ...] = (0.05, 0.1, 0.25, 0.5, 1.0)


def candidates(short: bool) -> list[dict[str, Any]]:
    """The settings swept: cap x target (the interval follows the target)."""
    caps, targets = (SHORT_CAPS, SHORT_TARGETS) if short else (FULL_CAPS, FULL_TARGETS)
    return [{"cap": c, "target_s": t} for c in caps for t in targets]
