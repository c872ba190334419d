"""The waiting requests of one pod in service order: priority bands, tenants by fair share,
each tenant's own order.

:class:`FairOrder` holds the waiters (no decisions: :class:`.waitqueue.WaitQueue` decides who
leaves). Three levels:

1. **Priority bands**, strictly: a higher priority is always looked at first (as Kubernetes
   API Priority and Fairness, https://kubernetes.io/docs/concepts/cluster-administration/flow-control/,
   and llm-d's flow control do).
2. **Tenants by virtual counter** within a band (VTC, :mod:`.share`): the backlogged tenant
   that received the least weighted service first.
3. **Within a tenant** in the policy's ``queue.order``: arrival (FIFO, Priority), or reservation
   size less aging (ShortestFirst: after half the maximum wait a request outranks any new one).

Invariant: pure; each band keeps exactly one heap entry per tenant flow at rest, and heaps
delete lazily (an entry whose waiter left, whose flow emptied, or whose tenant's counter moved
on is dropped or re-pushed when it reaches the top), so adding, removing and taking the next
tenant are O(log n).
"""

from __future__ import annotations

import heapq
import math
from typing import Final

from kvgate_agent.admission.config import AdmissionConfig
from kvgate_agent.admission.decision import AdmissionRequest, Waiter
from kvgate_agent.admission.fairqueue.share import FairShare
from kvgate_agent.contract.policy import QueueOrder

#: Tenants whose counters are within this many mean charges of the smallest are taken in the
#: within-tenant order (shortest first) rather than strictly by counter: the bound on how far
#: a tenant may fall behind another for the sake of serving short requests first. Chosen on
#: the effectiveness benchmark, seed 1 (docs/benchmarks.md, issue 22).
SLACK: Final = 4.0
#: Tenants looked at within the slack for one choice (bounds its cost).
MAX_SLACK_SCAN: Final = 16


class Flow:
    """One tenant's waiters in one priority band: a heap of (key, seq, waiter)."""

    __slots__ = ("count", "heap", "retry_at")

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, Waiter]] = []
        self.count = 0
        #: Clock time the tenant's own bucket (or a pod-wide one, for the blocked head) lets
        #: its head in (None: nothing to wake up for).
        self.retry_at: float | None = None


#: A band's entry for one flow: (tenant's counter when pushed, its waiters then, its head's
#: arrival order then, tenant, flow).
Entry = tuple[float, int, int, str, Flow]


class _Band:
    __slots__ = ("count", "flows", "heap")

    def __init__(self) -> None:
        self.flows: dict[str, Flow] = {}
        self.heap: list[Entry] = []
        self.count = 0


class FairOrder:
    """The waiters of one pod, ordered (see the module docstring).

    Args:
        fair: the tenants' counters (the queue joins and leaves their backlog here).
        config: the thresholds (``queue_order`` and the ShortestFirst aging rate).
    """

    def __init__(self, fair: FairShare, config: AdmissionConfig) -> None:
        self._fair = fair
        self.waiters: dict[int, Waiter] = {}
        self._bands: dict[int, _Band] = {}
        #: Priorities with a band, highest first.
        self.priorities: list[int] = []
        self._order = config.queue_order
        self._aging_rate = aging_rate(config)

    def __len__(self) -> int:
        return len(self.waiters)

    def live(self, w: Waiter) -> bool:
        """Whether ``w`` still waits."""
        return self.waiters.get(w.seq) is w

    def retune(self, config: AdmissionConfig) -> None:
        """New thresholds: every tenant's waiters are re-keyed in the new order and aging."""
        self._order = config.queue_order
        self._aging_rate = aging_rate(config)
        for band in self._bands.values():
            for flow in band.flows.values():
                flow.heap = [(self._key(w), w.seq, w) for _, _, w in flow.heap if self.live(w)]
                heapq.heapify(flow.heap)

    def flows(self, below: int | None = None) -> list[Flow]:
        """Every tenant flow, or those of priorities at or below ``below``."""
        return [
            f
            for p, band in self._bands.items()
            if below is None or p <= below
            for f in band.flows.values()
        ]

    def next_retry(self) -> float:
        """The earliest clock time a tenant flow's head may be let in by a bucket's refill
        (:attr:`Flow.retry_at`, set by the wait queue's passes); ``math.inf`` when no flow
        waits for one. O(tenant flows)."""
        t = math.inf
        for band in self._bands.values():
            for flow in band.flows.values():
                at = flow.retry_at
                if at is not None and at < t:
                    t = at
        return t

    # ------------------------------------------------------------------ in and out

    def add(self, w: Waiter) -> None:
        """``w`` starts waiting; its tenant joins the backlog."""
        req = w.request
        self.waiters[w.seq] = w
        self._fair.join(req.tenant, req.weight)
        band = self._bands.get(req.priority)
        if band is None:
            band = self._bands[req.priority] = _Band()
            self.priorities = sorted(self._bands, reverse=True)
        flow = band.flows.get(req.tenant)
        new = flow is None
        if flow is None:
            flow = band.flows[req.tenant] = Flow()
        heapq.heappush(flow.heap, (self._key(w), w.seq, w))
        flow.count += 1
        band.count += 1
        if new:
            self.push(req.priority, req.tenant, flow)

    def remove(self, w: Waiter) -> None:
        """``w`` stops waiting (it must be waiting); its tenant leaves the backlog once no
        other of its requests waits."""
        del self.waiters[w.seq]
        req = w.request
        self._fair.leave(req.tenant)
        band = self._bands[req.priority]
        flow = band.flows[req.tenant]
        flow.count -= 1
        band.count -= 1
        if not flow.count:
            del band.flows[req.tenant]  # its band entry goes stale
        if not band.count:
            del self._bands[req.priority]
            self.priorities.remove(req.priority)

    # ------------------------------------------------------------------ taking tenants in turn

    def pop(self, priority: int) -> Entry | None:
        """The next flow of the band ``priority``, taken off the band's heap (hand it back
        with :meth:`push`); None when the band has none left. Of the tenants whose counters
        are within :data:`SLACK` mean charges of the smallest, the one whose head comes first
        in the within-tenant order (under ShortestFirst: the smallest request): fairness
        within a bounded slack, the shortest-first order's goodput across tenants whose
        service is about even. O((tenants in the slack + 1) x log tenants)."""
        first = self._pop(priority)
        if first is None or self._order is not QueueOrder.SHORTEST_FIRST:
            return first
        band = self._bands[priority]
        bound = first[0] + SLACK * max(1.0, self._fair.mean_charge)
        best, best_key = first, self._key(self.head(first[4]))
        others: list[Entry] = []
        while band.heap and band.heap[0][0] <= bound and len(others) < MAX_SLACK_SCAN:
            e = self._pop(priority)
            if e is None:
                break
            key = self._key(self.head(e[4]))
            if key < best_key:
                others.append(best)
                best, best_key = e, key
            else:
                others.append(e)
        for e in others:
            heapq.heappush(band.heap, e)
        return best

    def _pop(self, priority: int) -> Entry | None:
        """The flow of the band whose tenant has the smallest counter (see :meth:`pop`)."""
        band = self._bands.get(priority)
        if band is None:
            return None
        heap = band.heap
        counter = self._fair.counter
        while heap:
            e = heapq.heappop(heap)
            tenant, flow = e[3], e[4]
            if band.flows.get(tenant) is not flow:
                continue  # the flow emptied (and maybe came back as a new one)
            if counter(tenant) != e[0]:
                self.push(priority, tenant, flow)  # charged since: back in its place
                continue
            return e
        return None

    def push(self, priority: int, tenant: str, flow: Flow) -> None:
        """Put ``tenant``'s flow back in its band's turn at its counter now (nothing when the
        flow emptied meanwhile)."""
        band = self._bands.get(priority)
        if band is None or band.flows.get(tenant) is not flow:
            return
        # Equal counters (a tenant joining the backlog is lifted to the smallest): the tenant
        # with fewer waiting goes first, then the one whose head came first.
        c = self._fair.counter(tenant)
        heapq.heappush(band.heap, (c, flow.count, self.head(flow).seq, tenant, flow))

    def head(self, flow: Flow) -> Waiter:
        """The first of a (non-empty) flow's waiters in its tenant's order."""
        heap = flow.heap
        while not self.live(heap[0][2]):
            heapq.heappop(heap)
        return heap[0][2]

    def sorted(self) -> list[Waiter]:
        """Every waiter roughly in service order (band, the tenant's counter, the order within
        the tenant); O(n log n), for refusals' Retry-After."""
        counter = self._fair.counter
        return sorted(
            self.waiters.values(),
            key=lambda w: (-w.request.priority, counter(w.request.tenant), self._key(w), w.seq),
        )

    # ------------------------------------------------------------------ fair estimates

    def ahead_of(self, req: AdmissionRequest) -> int:
        """Waiters the fair order would serve before a newcomer ``req``: every waiter of a
        higher priority, and in its own band, its tenant's waiters plus, of each other tenant
        B, those whose virtual start comes before the newcomer's virtual finish (VTC, each
        request charged the mean charge). O(tenants in the band)."""
        n = 0
        for p in self.priorities:
            if p > req.priority:
                n += self._bands[p].count
        band = self._bands.get(req.priority)
        if band is None:
            return n
        own, unit, finish = self._newcomer(band, req)
        n += 0 if own is None else own.count
        for tenant, flow in band.flows.items():
            if flow is own:
                continue
            lead = finish - self._fair.counter(tenant)
            if lead > 0:
                weight = self.head(flow).request.weight
                n += min(flow.count, math.ceil(lead * weight / unit))
        return n

    def _newcomer(self, band: _Band, req: AdmissionRequest) -> tuple[Flow | None, float, float]:
        """(``req``'s tenant's flow in ``band`` or None, the mean charge (>= 1), the virtual
        finish of a newcomer ``req``: its tenant's counter plus its queued requests and itself
        at the mean charge, divided by its weight)."""
        unit = max(1.0, self._fair.mean_charge)
        own = band.flows.get(req.tenant)
        mine = 0 if own is None else own.count
        return own, unit, self._fair.counter(req.tenant) + (mine + 1) * unit / req.weight

    def over_share(self, req: AdmissionRequest) -> Waiter | None:
        """The newest waiter of the tenant furthest above its share in ``req``'s band, when that
        tenant's virtual finish (its counter plus its queued requests at the mean charge,
        weighted) is beyond the newcomer's own: a refusal for lack of room should fall on it,
        not on ``req``; None otherwise. O(tenants in the band + that tenant's waiters)."""
        band = self._bands.get(req.priority)
        if band is None:
            return None
        fair = self._fair
        own, unit, top = self._newcomer(band, req)
        worst: Flow | None = None
        for tenant, flow in band.flows.items():
            if flow is own:
                continue
            finish = fair.counter(tenant) + flow.count * unit / self.head(flow).request.weight
            if finish > top:
                worst, top = flow, finish
        if worst is None:
            return None
        return max((w for _, _, w in worst.heap if self.live(w)), key=lambda w: w.seq)

    def _key(self, w: Waiter) -> float:
        """``w``'s place within its tenant: arrival, or under ShortestFirst its reservation
        less aging (``kv - (now - enqueued) x rate`` orders as ``kv + enqueued x rate``)."""
        if self._order is QueueOrder.SHORTEST_FIRST:
            return w.kv_tokens + w.enqueued_at * self._aging_rate
        return float(w.seq)


#: The context length aging assumes when the policy states none (``model.maxModelLen``),
#: tokens. Not the KV pool: a pool of 500,000 tokens would age requests so fast that
#: ShortestFirst became arrival order.
DEFAULT_CONTEXT: Final = 8192


def aging_rate(config: AdmissionConfig) -> float:
    """ShortestFirst aging, KV tokens per second: after half the maximum wait, a waiting
    request outranks any new one up to the context length."""
    ref = config.max_model_len or DEFAULT_CONTEXT
    return ref / max(1e-3, config.queue_max_wait_seconds / 2)
