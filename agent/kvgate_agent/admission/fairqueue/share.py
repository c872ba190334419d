"""Fair shares between tenants: the virtual token counters of VTC.

Each tenant has a counter of the service it received, weighted by its share (Sheng et al.,
"Fairness in Serving Large Language Models", OSDI 2024,
https://www.usenix.org/conference/osdi24/presentation/sheng): a request of ``p`` prompt tokens
and ``o`` output tokens adds ``(w_in x p + w_out x o) / weight`` to its tenant's counter
(``w_in``, ``w_out``: the policy's ``queue.fairness`` token weights, 1 and 2 by default as in
the paper; ``weight``: the tenant class's share). The wait queue (:mod:`.waitqueue`) serves the
backlogged tenant with the smallest counter first.

How the counters move (the pitfalls of earlier attempts are cited):

- **Charged at admission, trued up after.** A request is charged its prompt and its reserved
  output (the predicted length under ``capacity.reservation: Predicted``, max_tokens otherwise)
  when admitted, so a tenant cannot win a burst of admissions before its first response ends;
  output streamed beyond that is charged as it passes (:meth:`FairShare.observe_output`), and
  the final usage settles the rest (:meth:`FairShare.settle`). An estimate that is never
  corrected skews every later decision (llm-d-router PR #1222,
  https://github.com/llm-d/llm-d-inference-scheduler/pull/1222).
- **Counters never decrease.** What was charged above the real usage is the tenant's *credit*,
  which pays its next charges first; so the queue's order never has to move a tenant back.
- **Lift, never reset.** A tenant that becomes backlogged takes ``max(its counter, F)``, ``F``
  the smallest counter among backlogged tenants (or, when none is backlogged, the counter of the
  last tenant that left the backlog): an idle tenant banks no service, an over-served one is not
  forgiven (resetting idle tenants to the active minimum forgives over-service: PR #1222 above),
  and a new tenant starts at ``F``, never at zero (a newcomer at zero outranks everyone until it
  catches up, as llm-d's least-attained-service policy does).
- **A heavier tenant still served keeps its lag.** Under a TTFT budget a tenant's queue empties
  after almost every request (its waiter admitted or timed out) while its earlier requests still
  run, so the lift would put it back at ``F`` at nearly every request: the weights would act only
  within one such burst, and a class of weight 4 against one of weight 1 got 1.8x the other's
  output (docs/benchmarks.md, issue 34). So a tenant joining the backlog with requests in flight
  and heavier than the active tenants' mean weight ``m`` is lifted only to
  ``F - IN_FLIGHT_LAG x mean charge x (1 - m / weight)``: it keeps up to that much of the service
  it is behind by. An idle tenant (nothing in flight), and every tenant where the weights are
  equal, is lifted to ``F`` as before (there the lift forgives each tenant alike; keeping lags
  there cost goodput, as the order's shortest-first slack then applies less often).

**What a tenant holds.** A queue fair among waiters cannot take back what a tenant already
holds: the accounts here also count each tenant's requests in flight and the KV they hold, and
:mod:`.reserve` keeps the last of the KV capacity and of the concurrency limit from a
tenant holding far more than its fair share.

Memory is bounded by ``max_tenants`` accounts: an account neither backlogged nor in flight whose
counter is at or below ``F`` is equivalent to a new one and is forgotten first; past that, the
idle accounts nearest to ``F`` go.

Invariant: pure, no clock needed; every call is O(log tenants) amortised (the floor's heap is
lazy: entries are checked against the account when they reach the top).
"""

from __future__ import annotations

import heapq
from typing import Final

from kvgate_agent.admission.decision import Ticket
from kvgate_agent.admission.fairqueue.pool import PoolShare
from kvgate_agent.admission.prefill import PrefillBacklog

#: Weight of each admission in :attr:`FairShare.mean_charge`.
MEAN_ALPHA: Final = 0.05
#: How far below the floor, in mean charges, a tenant heavier than the active tenants' mean
#: weight may stay when it joins the backlog while its requests are still in flight, times
#: ``1 - mean weight / its weight`` (an idle tenant, or one no heavier, is lifted to the floor).
#: Chosen on the effectiveness benchmark's ``tiers`` workload, seed 1: 32 against 64 (the same
#: class share for more goodput lost; docs/benchmarks.md, issue 34).
IN_FLIGHT_LAG: Final = 32.0


class Account:
    """One tenant's fair-share state.

    Attributes:
        counter: weighted service received, cost units / weight (never decreases).
        credit: units charged above real usage, paying the next charges first (>= 0).
        attained: service received, token-weighted units (``w_in x prompt + w_out x output``,
            settled to real usage; the metric ``kvgate_tenant_attained_service``).
        queued: the tenant's requests waiting in the queue now.
        in_flight: its admitted requests not yet settled.
        kv_tokens: the KV tokens those hold (as reserved at admission).
        weight: its fair-share weight (its class's, as its last request said).
    """

    __slots__ = ("attained", "counter", "credit", "in_flight", "kv_tokens", "queued", "weight")

    def __init__(self, counter: float) -> None:
        self.counter = counter
        self.credit = 0.0
        self.attained = 0.0
        self.queued = 0
        self.in_flight = 0
        self.kv_tokens = 0
        self.weight = 1.0

    @property
    def active(self) -> bool:
        """The tenant has requests waiting or in flight."""
        return self.queued != 0 or self.in_flight != 0


class FairShare:
    """The tenants' virtual counters of one pod (see the module docstring).

    Args:
        prompt_weight: ``w_in``, units per prompt token (>= 0).
        output_weight: ``w_out``, units per output token (>= 0).
        max_tenants: accounts kept in memory before idle ones are forgotten (>= 1).
    """

    __slots__ = (
        "_accounts",
        "_backlogged",
        "_floor_heap",
        "_last_departed",
        "active_tenants",
        "active_weight",
        "congested",
        "max_tenants",
        "mean_charge",
        "output_weight",
        "pool",
        "prefill",
        "prompt_weight",
    )

    def __init__(self, prompt_weight: float, output_weight: float, max_tenants: int) -> None:
        self.prompt_weight = prompt_weight
        self.output_weight = output_weight
        self.max_tenants = max(1, max_tenants)
        self._accounts: dict[str, Account] = {}
        #: (counter, tenant) of backlogged tenants; lazy: checked against the account on top.
        self._floor_heap: list[tuple[float, str]] = []
        self._backlogged = 0
        self._last_departed = 0.0
        #: Mean cost units charged per admission (weight 1), for queue-wait estimates.
        self.mean_charge = 0.0
        #: Sum of the weights of the active tenants (requests waiting or in flight).
        self.active_weight = 0.0
        #: How many tenants are active.
        self.active_tenants = 0
        #: The engine's prefill is congested (``reserve.PREFILL_SHARE``; set by the
        #: concurrency ceiling): tenants above their share of the concurrency limit wait.
        self.congested = False
        #: The prompt tokens admitted and not yet prefilled (charged here at every admission).
        self.prefill = PrefillBacklog()
        #: The pool's view of the same tenants' service on other replicas (:mod:`.pool`):
        #: None (the default) for a pod on its own.
        self.pool: PoolShare | None = None

    def retune(self, prompt_weight: float, output_weight: float) -> None:
        """New token weights for charges from now on (what is charged stays)."""
        self.prompt_weight, self.output_weight = prompt_weight, output_weight

    # ------------------------------------------------------------------ reading

    def floor(self) -> float:
        """``F``: the smallest counter among backlogged tenants, or the last departed tenant's
        counter when none is backlogged (0 before any)."""
        if not self._backlogged:
            return self._last_departed
        heap, accounts = self._floor_heap, self._accounts
        while heap:
            c, tenant = heap[0]
            a = accounts.get(tenant)
            if a is not None and a.queued and a.counter == c:
                return c
            heapq.heappop(heap)
            if a is not None and a.queued:
                heapq.heappush(heap, (a.counter, tenant))
        return self._last_departed  # unreachable while the counts agree

    def counter(self, tenant: str) -> float:
        """``tenant``'s counter, or where it would start (:meth:`floor`) when it has none;
        a tenant not backlogged reads as lifted (:meth:`lift_to`)."""
        a = self._accounts.get(tenant)
        if a is None:
            return self.floor()
        if a.queued:
            return a.counter
        return max(a.counter, self.lift_to(a))

    def lift_to(self, a: Account) -> float:
        """Where ``a``'s tenant is lifted to when it joins the backlog: the floor, or while its
        requests are in flight and it is heavier than the active tenants' mean weight ``m``,
        :data:`IN_FLIGHT_LAG` mean charges x ``(1 - m / its weight)`` below it. O(1) past
        :meth:`floor`."""
        floor = self.floor()
        if a.in_flight and self.active_tenants:
            mean = self.active_weight / self.active_tenants
            if a.weight > mean * (1.0 + 1e-9):  # (not for equal weights' rounding)
                floor -= IN_FLIGHT_LAG * max(1.0, self.mean_charge) * (1.0 - mean / a.weight)
        return floor

    def account(self, tenant: str) -> Account | None:
        """``tenant``'s account, if one is kept (read only)."""
        return self._accounts.get(tenant)

    def accounts(self) -> list[tuple[str, Account]]:
        """Every account kept, (tenant, account) (read only)."""
        return list(self._accounts.items())

    def shares(self) -> list[tuple[str, float, float]]:
        """(tenant, counter, attained service) of every account kept (for metrics)."""
        return [(t, a.counter, a.attained) for t, a in self._accounts.items()]

    # ------------------------------------------------------------------ the backlog

    def join(self, tenant: str, weight: float = 1.0) -> None:
        """One more of ``tenant``'s requests waits in the queue; on its first, the tenant is
        lifted to ``max(counter, floor)`` (a new tenant starts at the floor)."""
        a = self._accounts.get(tenant)
        if a is None:
            a = self._new(tenant)
        if not a.active:
            a.weight = weight
            self.active_weight += weight
            self.active_tenants += 1
        if not a.queued:
            floor = self.lift_to(a)
            if a.counter < floor:
                a.counter = floor
                a.credit = 0.0  # lifted past it: an over-charge then is moot
            self._backlogged += 1
            heapq.heappush(self._floor_heap, (a.counter, tenant))
        a.queued += 1

    def leave(self, tenant: str) -> None:
        """One of ``tenant``'s requests left the queue (admitted, refused or cancelled)."""
        a = self._accounts[tenant]
        a.queued -= 1
        if not a.queued:
            self._backlogged -= 1
            self._last_departed = a.counter
            if not a.in_flight:
                self.active_weight -= a.weight
                self.active_tenants -= 1
            self._prune()

    # ------------------------------------------------------------------ charges

    def admit(self, ticket: Ticket) -> None:
        """Charge ``ticket``'s tenant at admission: its uncached prompt (the prompt less the
        cached prefix expected, ``ticket.cached_tokens``: :mod:`.prefix_index`) and its reserved
        output (``kv_tokens`` less that, at most ``n x max_tokens``). Sets ``ticket.fair_*``."""
        a = self._accounts.get(ticket.tenant)
        if a is None:
            a = self._new(ticket.tenant)
        prompt = ticket.uncached_prompt_tokens
        out = max(0, min(ticket.n * ticket.max_tokens, ticket.kv_tokens - prompt))
        raw = self.prompt_weight * prompt + self.output_weight * out
        ticket.fair_output = out
        ticket.fair_charged = raw
        if not a.active:
            a.weight = ticket.weight
            self.active_weight += a.weight
            self.active_tenants += 1
        a.in_flight += 1
        a.kv_tokens += ticket.kv_tokens
        self.prefill.admitted(ticket)
        self._charge(ticket.tenant, a, raw, ticket.weight)
        self.mean_charge += MEAN_ALPHA * (raw - self.mean_charge)

    def observe_output(self, ticket: Ticket, generated: int) -> None:
        """``ticket``'s request has streamed ``generated`` output tokens (all choices): what
        passed beyond the charged output is charged now, and its prompt is prefilled. O(1)."""
        if ticket.prefill_pending:
            self.prefill.prefilled(ticket)
        extra = generated - ticket.fair_output
        if extra <= 0 or ticket.released:
            return
        a = self._accounts.get(ticket.tenant)
        if a is None:
            return
        raw = self.output_weight * extra
        ticket.fair_output = generated
        ticket.fair_charged += raw
        self._charge(ticket.tenant, a, raw, ticket.weight)

    def settle(self, ticket: Ticket, prompt_tokens: int, completion_tokens: int) -> None:
        """``ticket``'s request ended having used ``prompt_tokens`` (uncached: the engine's
        cached prefix is not charged) and ``completion_tokens`` (both 0 when it never reached
        the model server): charge what it used beyond its charge,
        or credit what it was charged beyond its use."""
        self.prefill.ended(ticket)
        a = self._accounts.get(ticket.tenant)
        if a is None:
            return
        a.in_flight -= 1
        a.kv_tokens -= ticket.kv_reserved_at_admission
        if not a.active:
            self.active_weight -= a.weight
            self.active_tenants -= 1
        used = self.prompt_weight * prompt_tokens + self.output_weight * completion_tokens
        delta = used - ticket.fair_charged
        ticket.fair_charged = used
        if delta > 0:
            self._charge(ticket.tenant, a, delta, ticket.weight)
        else:
            a.credit += -delta / ticket.weight
            a.attained += delta
        if not a.queued and not a.in_flight:
            self._prune()

    def _charge(self, tenant: str, a: Account, raw: float, weight: float) -> None:
        a.attained += raw
        units = raw / weight
        if a.credit:
            paid = min(a.credit, units)
            a.credit -= paid
            units -= paid
        a.counter += units
        if self.pool is not None and units > 0:
            self.pool.charged(tenant, units, units * weight)
        # (A backlogged tenant's entry in the floor heap is now stale: fixed when on top.)

    def pool_synced(self, remote: dict[str, float]) -> None:
        """Add the weighted service each tenant got on the other replicas since the last read
        (:meth:`.pool.PoolShare.update`, units) to its counter here, for the tenants kept: the
        order among this pod's waiters is then the pool's (counters only grow; stale heap
        entries are fixed when they reach the top). O(tenants in ``remote``)."""
        accounts = self._accounts
        for tenant, units in remote.items():
            a = accounts.get(tenant)
            if a is not None:
                a.counter += units

    # ------------------------------------------------------------------ memory

    def _new(self, tenant: str) -> Account:
        a = Account(self.floor())
        self._accounts[tenant] = a
        return a

    def _prune(self) -> None:
        """Forget idle accounts past ``max_tenants``: those at or below the floor first (they
        equal a new one), then the idle ones nearest to it."""
        accounts = self._accounts
        if len(accounts) <= self.max_tenants:
            return
        floor = self.floor()
        idle = [(a.counter, t) for t, a in accounts.items() if not a.queued and not a.in_flight]
        idle.sort()
        # Keep a tenth of the bound free so this runs once per tenth, not on every call.
        excess = len(accounts) - self.max_tenants + self.max_tenants // 10
        for c, t in idle:
            if excess <= 0 and c > floor:
                break
            del accounts[t]
            excess -= 1
