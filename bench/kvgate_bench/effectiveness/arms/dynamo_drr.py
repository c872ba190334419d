"""The ``dynamo-drr`` arm: NVIDIA Dynamo's policy-class queues, in front of one engine.

Dynamo's router holds requests in policy-class queues (ai-dynamo/dynamo PR #10744,
https://github.com/ai-dynamo/dynamo/pull/10744, merged 2026-06; the design is DEP #9755,
https://github.com/ai-dynamo/dynamo/issues/9755) and dispatches them while a worker has room:

* **Classes**: each request resolves to one policy class (``x-dynamo-meta-policy-class``).
  The operator maps the workload's tenants to classes in one of three ways, which the sweep
  tries (``classes``): ``default``, one class for all (Dynamo's synthetic ``default`` queue
  when no policy config is given); ``tier``, one class per (tier, weight), the classes kvgate's
  recommended policy declares (``interactive``, ``batch``; where the workload declares its
  classes, ``tiers``' ``premium`` and ``regular``, those); ``tenant``, one class per tenant
  (the flows ``flow-control`` sees). A class's weight is its tenants' weight (1 in every
  workload but those that say otherwise; ``default``: 1).
* **Across classes**: work-conserving weighted deficit round robin. Each active class (one
  with queued requests) has a deficit counter; when its turn comes it gains ``quantum x
  weight`` and dispatches its head while the deficit pays the head's cost, then the turn
  passes. The cost is the request's **uncached** input tokens (``max(1, prompt - cached)``,
  the cached part the engine's prefix cache holds for it now, as Dynamo's router sees it from
  the worker's KV events). A class that empties loses its deficit. When no head is affordable
  in a whole round the rounds are added in bulk (Dynamo's "bounded bulk virtual rounds"; the
  same order as adding them one by one).
* **Within a class**: earliest deadline first, the deadline ``arrival + the request's TTFT
  SLO`` as the client states it in ``x-dynamo-slo-ttft-ms`` (interactive: the TTFT SLO, 0.5 s;
  batch: its completion bound, 600 s), ties by arrival.
* **Queue limit**: a class holding ``queue_limit`` requests refuses the next one at once
  (429, no Retry-After). Dynamo's limit is per worker; here there is one.
* **Room**: Dynamo's busy threshold. A worker is busy while its active prefill tokens (the
  uncached prompt tokens of the requests dispatched to it that have produced no output token
  yet; a request in vLLM's own waiting queue counts) exceed ``busy_frac x
  max_num_batched_tokens`` (``prefill_busy_threshold_frac``; the router's
  ``--router-queue-threshold`` defaults to 4.0, the sample policy config has 16.0). The
  scheduler dispatches while the worker is not busy, so one dispatch may pass the threshold
  (the busy test ``active_prefill_tokens > threshold x max_num_batched_tokens``:
  https://github.com/ai-dynamo/dynamo/pull/8163, the default 4.0 there; 16.0:
  https://github.com/ai-dynamo/dynamo/pull/12420). With ``kv_frac`` set the worker is also
  busy while its KV usage, as the engine reports it each forward pass, exceeds that fraction
  (Dynamo's optional ``--active-decode-blocks-threshold``,
  https://github.com/ai-dynamo/dynamo/pull/4837): the only check on decode load, since the
  prefill one lets a server full of long decodes take more.

Not modelled: the router's queues in front of several replicas (DEP #15187); in pool mode the
arm stands in front of each replica, each with its own state (the per-replica queues of the
DEP's skewed-ingress case: ``--arms dynamo-drr`` with ``--replicas``, classes ``tier``), and
WSPT ordering (FCFS/EDF is the class default).

Swept (what a user tunes): ``classes`` (default, tier, tenant), ``queue_limit`` (requests per
class: 1, 4; full 1 to 256), ``busy_frac`` (0.125, 0.25; full 0.125 to 16), ``kv_frac`` (0.3,
0.5; full unset, 0.2 to 0.8) and, in the full sweep, ``quantum`` (uncached tokens per round and
unit weight, 256 to 16384; ``--short`` keeps 1024: 512 and 4096 moved goodput by at most 7
output tokens/s in the first tuning run). The short grid is where a 0.5 s TTFT lives on the
``h100-llama3-8b`` profile at 2x: in the tuning runs on seed 1 (docs/benchmarks.md, issue 34)
queue limits of 32 and 256, busy thresholds of 1 and 4 and no KV threshold left every workload
at <= 1,058 output tokens/s, and limits of 1-4, thresholds of 0.125-0.25 and a KV threshold of
0.3 (over 0.2 and unset) won.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kvgate_bench.effectiveness.arms.context import ArmContext
from kvgate_bench.effectiveness.model.gate import Arm
from kvgate_bench.effectiveness.model.metrics import BATCH_SLO_S, TTFT_SLO_S
from kvgate_bench.effectiveness.model.schedule import BATCH, Request, Tenant, content_keys
from kvgate_bench.sim.prefix_cache import extend_chain

#: How tenants map to policy classes.
CLASS_MODES: tuple[str, ...] = ("default", "tier", "tenant")


@dataclass
class PolicyClass:
    """One policy-class queue: its weight, deficit (tokens) and EDF heap of (deadline, arrival
    order, request)."""

    name: str
    weight: float
    deficit: float = 0.0
    heap: list[tuple[float, int, Request]] = field(default_factory=list)


class DynamoDrrArm(Arm):
    """Weighted DRR across policy classes, EDF within one, per-class queue limits, dispatch
    while the worker is not prefill-busy (see the module docstring)."""

    name = "dynamo-drr"

    def __init__(
        self,
        ctx: ArmContext,
        classes: str = "tier",
        quantum: int = 1024,
        queue_limit: int = 64,
        busy_frac: float = 4.0,
        kv_frac: float | None = None,
    ) -> None:
        super().__init__()
        if classes not in CLASS_MODES:
            raise ValueError(f"classes must be one of {', '.join(CLASS_MODES)}")
        if quantum < 1 or queue_limit < 1 or busy_frac <= 0:
            raise ValueError("need quantum >= 1, queue_limit >= 1, busy_frac > 0")
        if kv_frac is not None and not 0 < kv_frac <= 1:
            raise ValueError("kv_frac must be in (0, 1] or None")
        self.kv_frac = kv_frac
        self.quantum, self.queue_limit = quantum, queue_limit
        self.busy_tokens = busy_frac * ctx.engine.max_num_batched_tokens
        self.block_size = ctx.engine.block_size
        self.params = {
            "classes": classes,
            "quantum": quantum,
            "queue_limit": queue_limit,
            "busy_frac": busy_frac,
            "kv_frac": kv_frac,
        }
        self.ttft_slo_s = ctx.slo[0] if ctx.slo is not None else TTFT_SLO_S
        self._class_of: dict[str, PolicyClass] = {}
        by_name: dict[str, PolicyClass] = {}
        for t in ctx.tenants.values():
            if classes == "default":
                key, weight = "default", 1.0
            else:
                key = t.name if classes == "tenant" else _tier_class(t)
                weight = t.weight
            self._class_of[t.name] = by_name.setdefault(key, PolicyClass(key, weight))
        self._active: deque[PolicyClass] = deque()  # classes with queued requests, in turn
        self._granted = False  # whether the head of _active had its quantum this turn
        self._order = itertools.count()
        self.active_prefill = 0  # uncached prompt tokens dispatched, no output token yet
        self._in_prefill: dict[str, int] = {}
        self.refused = 0

    def uncached_tokens(self, req: Request) -> int:
        """The request's cost: its prompt less what the engine's prefix cache holds of it now
        (at least 1)."""
        cached = 0
        keys = content_keys(req, self.block_size)
        if keys is not None:
            blocks = req.prompt_tokens // self.block_size
            chain = extend_chain([], keys, blocks)
            cached = self.gate.engine.pool.lookup(chain) * self.block_size
        return max(1, req.prompt_tokens - cached)

    def deadline(self, req: Request, now: float) -> float:
        """The request's EDF key: ``now`` (its arrival here) plus its stated TTFT SLO."""
        return now + (BATCH_SLO_S if req.tier == BATCH else self.ttft_slo_s)

    def busy(self) -> bool:
        """Whether the worker's active prefill tokens exceed the busy threshold, or its KV
        usage ``kv_frac``."""
        if self.active_prefill > self.busy_tokens:
            return True
        return self.kv_frac is not None and self.gate.engine.kv_usage > self.kv_frac

    def queued(self) -> int:
        return sum(len(c.heap) for c in self._active)

    def on_arrival(self, req: Request, now: float) -> None:
        cls = self._class_of[req.tenant]
        if len(cls.heap) >= self.queue_limit:
            self.refused += 1
            self.gate.reject(req, now, None)
            return
        if not cls.heap:
            self._active.append(cls)
        heapq.heappush(cls.heap, (self.deadline(req, now), next(self._order), req))
        self._dispatch(now)

    def pop_next(self) -> Request | None:
        """The next request by weighted DRR across classes, EDF within; None when empty."""
        misses = 0
        while self._active:
            cls = self._active[0]
            if not self._granted:
                cls.deficit += self.quantum * cls.weight
                self._granted = True
            req = cls.heap[0][2]
            cost = self.uncached_tokens(req)
            if cost <= cls.deficit:
                heapq.heappop(cls.heap)
                cls.deficit -= cost
                if not cls.heap:  # an emptied class leaves the round and loses its deficit
                    cls.deficit = 0.0
                    self._active.popleft()
                    self._granted = False
                return req
            self._active.rotate(-1)
            self._granted = False
            misses += 1
            if misses == len(self._active):  # a whole round paid nobody: add rounds in bulk
                self._bulk_rounds()
                misses = 0
        return None

    def _bulk_rounds(self) -> None:
        """Add, to every active class, all but the last of the rounds until the first head
        becomes affordable (each class got its quantum this round already)."""
        rounds = min(
            math.ceil((self.uncached_tokens(c.heap[0][2]) - c.deficit) / (self.quantum * c.weight))
            for c in self._active
        )
        for c in self._active:
            c.deficit += (rounds - 1) * self.quantum * c.weight

    def _dispatch(self, now: float) -> None:
        while self._active and not self.busy():
            req = self.pop_next()
            if req is None:
                break
            cost = self.uncached_tokens(req)
            self.gate.dispatch(req, now)
            if self.gate.sequences.get(req.rid) is not None:  # not refused by the engine
                self._in_prefill[req.rid] = cost
                self.active_prefill += cost

    def _left_prefill(self, rid: str) -> None:
        self.active_prefill -= self._in_prefill.pop(rid, 0)

    def on_tokens(self, new_tokens: dict[str, int], now: float) -> None:
        for rid, index in new_tokens.items():
            if index == 0:
                self._left_prefill(rid)
        self._dispatch(now)

    def on_finish(self, req: Request, output_tokens: int, now: float) -> None:
        self._left_prefill(req.rid)
        self._dispatch(now)


def _tier_class(t: Tenant) -> str:
    """The policy class of ``t`` in the ``tier`` mapping: the class the workload declares for
    it (``tiers``: ``premium``, ``regular``), else its (tier, weight)."""
    return t.class_name or f"{t.tier}-w{round(t.weight * 100)}"


#: Swept settings. Queue limits in requests per class, busy thresholds x max_num_batched_tokens
#: (to the router's default 4 and the sample config's 16), KV fractions (None: unset), quanta
#: in uncached prompt tokens (a short prompt to several long ones).
SHORT_LIMITS: tuple[int, ...] = (1, 4)
SHORT_BUSY: tuple[float, ...] = (0.125, 0.25)
SHORT_KV: tuple[float | None, ...] = (0.3, 0.5)
SHORT_QUANTA: tuple[int, ...] = (1024,)
FULL_LIMITS: tuple[int, ...] = (1, 2, 4, 8, 32, 256)
FULL_BUSY: tuple[float, ...] = (0.125, 0.25, 0.5, 1.0, 4.0, 16.0)
FULL_KV: tuple[float | None, ...] = (None, 0.2, 0.3, 0.5, 0.8)
FULL_QUANTA: tuple[int, ...] = (256, 1024, 4096, 16384)


def candidates(short: bool) -> list[dict[str, Any]]:
    """The settings swept: classes x quantum x queue limit x busy threshold x KV threshold."""
    if short:
        quanta, limits, busy, kv = SHORT_QUANTA, SHORT_LIMITS, SHORT_BUSY, SHORT_KV
    else:
        quanta, limits, busy, kv = FULL_QUANTA, FULL_LIMITS, FULL_BUSY, FULL_KV
    return [
        {"classes": m, "quantum": q, "queue_limit": n, "busy_frac": b, "kv_frac": k}
        for m in CLASS_MODES
        for q in (quanta[:1] if m == "default" else quanta)  # one class: the quantum is moot
        for n in limits
        for b in busy
        for k in kv
    ]
