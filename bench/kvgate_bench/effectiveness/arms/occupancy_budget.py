"""The ``occupancy-budget`` arm: hivenet_router's token-weighted occupancy rule, in front of one
engine.

HivenetOSS/hivenet_router (https://github.com/HivenetOSS/hivenet_router, 2026-08) admits a
request while the token-weighted in-flight sum stays under 0.85 of a budget:

* **Weight** of a request in flight: its input tokens plus its declared ``max_tokens``, or,
  when the client declared none, the output tokens it has streamed so far (growing live).
* **Rule**: a request is admitted when the in-flight sum plus its own weight (input plus its
  declared ``max_tokens``, or input alone) stays at or under ``0.85 x budget_tokens``.
* **Refusal**: a request that does not fit waits 250 ms and is checked once more; if it still
  does not fit it is answered 429 with ``Retry-After: 1``. A request arriving meanwhile is
  checked on its own (no queue, no order between them).

No prediction, no prefix discount, no fair queue: the closest public analogue of kvgate's
reservation core. The budget is what its users size: here a fraction of the engine's KV pool
(``budget_kv``; ``budget_tokens = budget_kv x num_gpu_blocks x block_size``).

Swept: ``budget_kv`` from half the pool to three pools (the 0.85 headroom and the output
that undeclared requests have yet to write let a budget above the pool still fit).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from kvgate_bench.effectiveness.arms.context import ArmContext
from kvgate_bench.effectiveness.model.gate import Arm
from kvgate_bench.effectiveness.model.schedule import Request

#: The share of the budget the in-flight sum may reach.
HEADROOM = 0.85
#: How long a refused request waits before its one retry, seconds.
RETRY_WAIT_S = 0.25
#: The Retry-After of the final refusal, seconds.
RETRY_AFTER_S = 1.0


class OccupancyBudgetArm(Arm):
    """Admit while the token-weighted in-flight sum stays under 0.85 of the budget; one retry
    after 250 ms, then 429 with Retry-After 1 (see the module docstring).

    ``in_flight_tokens``: the sum of the weights of the requests dispatched and not finished.
    """

    name = "occupancy-budget"

    def __init__(self, ctx: ArmContext, budget_kv: float) -> None:
        super().__init__()
        if budget_kv <= 0:
            raise ValueError("budget_kv must be > 0")
        self.budget_tokens = round(budget_kv * ctx.kv_capacity_tokens)
        self.params = {"budget_kv": budget_kv}
        self.in_flight_tokens = 0
        self._weight: dict[str, int] = {}  # request id -> its weight now
        self._live: dict[str, int] = {}  # no declared max_tokens (weight grows): id -> input
        self._held: deque[tuple[float, Request]] = deque()  # (retry at, request), in order
        self.retried = 0
        self.refused = 0

    @staticmethod
    def weight_of(req: Request) -> int:
        """A request's weight at admission: input plus declared max_tokens (or input alone)."""
        return req.prompt_tokens + (req.max_tokens or 0)

    def fits(self, req: Request) -> bool:
        """Whether ``req`` keeps the in-flight sum at or under 0.85 of the budget."""
        return self.in_flight_tokens + self.weight_of(req) <= HEADROOM * self.budget_tokens

    def _admit(self, req: Request, now: float) -> None:
        self.gate.dispatch(req, now)
        if self.gate.sequences.get(req.rid) is None:  # the engine refused it (400)
            return
        w = self.weight_of(req)
        self._weight[req.rid] = w
        self.in_flight_tokens += w
        if req.max_tokens is None:
            self._live[req.rid] = req.prompt_tokens

    def on_arrival(self, req: Request, now: float) -> None:
        if self.fits(req):
            self._admit(req, now)
            return
        self.retried += 1
        self._held.append((now + RETRY_WAIT_S, req))

    def next_wake(self) -> float | None:
        return self._held[0][0] if self._held else None

    def on_wake(self, now: float) -> None:
        while self._held and self._held[0][0] <= now:
            _, req = self._held.popleft()
            if self.fits(req):
                self._admit(req, now)
            else:
                self.refused += 1
                self.gate.reject(req, now, RETRY_AFTER_S)

    def on_tokens(self, new_tokens: dict[str, int], now: float) -> None:
        for rid, index in new_tokens.items():
            prompt = self._live.get(rid)
            if prompt is not None:  # the output so far is index + 1 tokens
                w = prompt + index + 1
                self.in_flight_tokens += w - self._weight[rid]
                self._weight[rid] = w

    def on_finish(self, req: Request, output_tokens: int, now: float) -> None:
        self.in_flight_tokens -= self._weight.pop(req.rid, 0)
        self._live.pop(req.rid, None)


#: Swept budgets, x the engine's KV pool.
SHORT_BUDGETS: tuple[float, ...] = (0.5, 1.0, 1.5, 2.0, 3.0)
FULL_BUDGETS: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0)


def candidates(short: bool) -> list[dict[str, Any]]:
    """The settings swept: the budget as a fraction of the KV pool."""
    return [{"budget_kv": b} for b in (SHORT_BUDGETS if short else FULL_BUDGETS)]
