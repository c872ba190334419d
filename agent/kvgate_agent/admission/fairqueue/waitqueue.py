"""The admission queue of one pod: who waits, and who may leave it now.

:class:`WaitQueue` owns the waiters' lifecycle: their deadlines, the pass that admits those
that fit now, and the decisions collected for the asyncio side. The order it serves them in is
:class:`.order.FairOrder`'s: priority bands strictly, then tenants by fair share (VTC),
then each tenant's own order.

Work-conserving: when the head the order chooses is blocked by a shared resource (KV, the
concurrency cap, a pod-wide bucket), the next heads that fit are admitted past it, at most
:data:`MAX_SKIPS` times per blocked head, so a large request is not starved by small ones
(bounded backfill: a queue that only blocks on its head idles the server while anything else
would fit; Kubernetes API Priority and Fairness and the VTC artifact block on the head).

It admits through the :class:`.Limits` it is given (the check,
:func:`.reserve.what_blocks`, and the reservation in one call) and hands back the ones past
their deadline for the overload actions to decide (:mod:`.waiting`); it never decides a refusal
itself.

Invariant: pure and clock-injected like the controller (times are passed in, seconds); a
waiter leaves the queue exactly once, with its ``decision`` set, collected by
:meth:`WaitQueue.take_resolved`. Each admission from the queue costs O(log n); a pass that
finds nothing to admit looks at no more than :data:`MAX_SCAN` heads after the first blocked
one.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Collection
from typing import Final

from kvgate_agent.admission.config import AdmissionConfig
from kvgate_agent.admission.decision import (
    AdmissionRequest,
    Blocker,
    Decision,
    Outcome,
    Reason,
    Waiter,
)
from kvgate_agent.admission.fairqueue.order import Entry, FairOrder
from kvgate_agent.admission.fairqueue.reserve import what_blocks
from kvgate_agent.admission.limits import Limits
from kvgate_agent.admission.retry import refusal

#: Requests admitted past a head blocked by a shared resource before the queue holds still
#: for it (the backfill bound).
MAX_SKIPS: Final = 8
#: Heads looked at after the first blocked one in one pass (bounds a pass's work when many
#: tenants wait and nothing fits).
MAX_SCAN: Final = 32


class WaitQueue:
    """The requests waiting for admission on one pod (see the module docstring).

    Args:
        limits: the pod's counted and reserved resources; read for every admission from the
            queue and reserved from in the same call. Its ``fair`` counters order the tenants.

    Attributes:
        order: the waiters in service order (read only outside this class).
        blocked_head: the waiter at the head blocked by a shared resource, or None (set by
            :meth:`admit_fitting`).
    """

    def __init__(self, limits: Limits) -> None:
        self._limits = limits
        self.order = FairOrder(limits.fair, limits.config)
        self._deadlines: list[tuple[float, int, Waiter]] = []
        self._seq = 0
        self._resolved: list[Waiter] = []
        self.blocked_head: Waiter | None = None

    def __len__(self) -> int:
        return len(self.order)

    @property
    def head_blocked_shared(self) -> bool:
        """A waiter is blocked by a shared resource: a newcomer may take that resource first
        only as a bounded backfill (:meth:`may_backfill`)."""
        return self.blocked_head is not None

    def unblock(self) -> None:
        """Forget the blocked head (the next :meth:`admit_fitting` finds it again)."""
        self.blocked_head = None

    def may_backfill(self) -> bool:
        """Whether a request that fits now may be admitted past the blocked head (its skips
        are not used up); True when no head is blocked."""
        b = self.blocked_head
        return b is None or b.skips < MAX_SKIPS

    def backfilled(self) -> None:
        """A request that fits was admitted past the blocked head: one skip used."""
        if self.blocked_head is not None:
            self.blocked_head.skips += 1

    def retune(self, config: AdmissionConfig) -> None:
        """New thresholds: the order within tenants and the aging follow."""
        self.order.retune(config)

    def waiters(self) -> Collection[Waiter]:
        """Every waiter, in arrival order (read only)."""
        return self.order.waiters.values()

    def ahead_of(self, req: AdmissionRequest) -> int:
        """Waiters served before a newcomer ``req``: :meth:`.FairOrder.ahead_of`."""
        return self.order.ahead_of(req)

    def over_share(self, req: AdmissionRequest) -> Waiter | None:
        """A waiter to refuse in ``req``'s place: :meth:`.FairOrder.over_share`."""
        return self.order.over_share(req)

    # ------------------------------------------------------------------ in and out

    def add(
        self,
        req: AdmissionRequest,
        now: float,
        deadline: float,
        remaining: tuple[str, ...],
        clamped: bool,
    ) -> Waiter:
        """Queue ``req`` until clock time ``deadline``; ``remaining``: the overload actions
        tried when it times out."""
        self._seq += 1
        w = Waiter(
            req,
            self._seq,
            now,
            deadline,
            self._limits.reservation(req, req.max_tokens),
            remaining,
            clamped,
        )
        self.order.add(w)
        heapq.heappush(self._deadlines, (deadline, w.seq, w))
        return w

    def remove(self, w: Waiter) -> None:
        """Take ``w`` out of the queue (its decision is the caller's: :meth:`resolve`)."""
        self.order.remove(w)
        if w is self.blocked_head:
            self.blocked_head = None

    def evict(self, w: Waiter, decision: Decision) -> None:
        """Take ``w`` out of the queue with ``decision`` (a refusal in a newcomer's place)."""
        self.remove(w)
        self.resolve(w, decision)

    def resolve(self, w: Waiter, decision: Decision) -> None:
        """``w`` left the queue with ``decision`` (already removed)."""
        w.decision = decision
        self._resolved.append(w)

    def take_resolved(self) -> list[Waiter]:
        """Waiters that left the queue (``decision`` set) since the last call, in order."""
        done, self._resolved = self._resolved, []
        return done

    def unresolve(self, w: Waiter) -> None:
        """Take back ``w``'s resolution (a waiter admitted in the call that queued it: its
        caller gets the decision directly)."""
        self._resolved.remove(w)

    def cancel(self, w: Waiter) -> None:
        """Remove a waiter whose client went away (nothing when it already left)."""
        if self.order.live(w):
            self.remove(w)

    def expired(self, now: float) -> list[Waiter]:
        """The waiters past their deadline, in arrival order, still queued: the caller removes
        and decides on each in turn (the ones after it still count as waiting meanwhile)."""
        out: list[Waiter] = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            w = heapq.heappop(heap)[2]
            if self.order.live(w):
                out.append(w)
        out.sort(key=lambda w: w.seq)
        return out

    def reject_all(
        self, now: float, reason: Reason, status: int, retry_after: float, message: str
    ) -> None:
        """Refuse every waiter with ``status`` and ``retry_after`` seconds (e.g. shutting down)."""
        for w in list(self.order.waiters.values()):
            self.remove(w)
            d = refusal(reason, "queue", status, retry_after, w.request.max_tokens, message)
            d.queue_seconds = now - w.enqueued_at
            self.resolve(w, d)
        self.blocked_head = None

    # ------------------------------------------------------------------ admission

    def head_blocker(self, now: float) -> Blocker | None:
        """What blocks the first waiter (in service order) held by a shared resource; None when
        no waiter is."""
        heads = [self.blocked_head] if self.blocked_head is not None else self.order.sorted()
        for w in heads:
            b = what_blocks(self._limits, w.request, w.request.max_tokens, now)
            if b is not None and not b.tenant_scoped:
                return b
        return None

    def admit_fitting(self, now: float) -> None:
        """Admit the waiters that fit now, in the fair order. A head blocked only by its own
        tenant's bucket is skipped (its refill time noted for :meth:`next_wake`); the first head
        blocked by a shared resource becomes :attr:`blocked_head`, and heads after it that fit
        are admitted past it while its skips last (:data:`MAX_SKIPS`)."""
        if self._head_first(now):
            return
        scanned = [0]
        for p in list(self.order.priorities):
            examined: list[Entry] = []
            stop = self._admit_band(p, now, examined, scanned)
            for e in examined:
                self.order.push(p, e[3], e[4])
            if self.blocked_head is not None and (stop or not self.may_backfill()):
                self._hold_behind(p)
                return

    def _head_first(self, now: float) -> bool:
        """The head blocked at the last pass, when requests went past it, goes first: admitted
        if it fits now; if a shared
        resource still blocks it, it stays the blocked head (so what the pass admits past it
        counts against its skips) and, its skips used up, holds the queue (True: the pass
        stops). Whatever order the pass would take, a blocked head is never overtaken more than
        :data:`MAX_SKIPS` times."""
        prev = self.blocked_head
        self.unblock()
        if prev is None or not prev.skips or not self.order.live(prev):
            return False  # (nobody went past it: the order decides afresh)
        b = what_blocks(self._limits, prev.request, prev.request.max_tokens, now)
        if b is None:
            self._admit(prev, now)
            return False
        if b.tenant_scoped:
            return False
        self.blocked_head = prev
        if prev.skips < MAX_SKIPS:
            return False
        self._hold_behind(prev.request.priority)
        return True

    def _admit_band(self, p: int, now: float, examined: list[Entry], scanned: list[int]) -> bool:
        """The pass over band ``p``; True when the pass must stop here. Flows looked at and not
        admitted from are left in ``examined`` for the caller to put back."""
        order, limits = self.order, self._limits
        while (e := order.pop(p)) is not None:
            flow = e[4]
            w = order.head(flow)
            b = what_blocks(limits, w.request, w.request.max_tokens, now)
            if b is None:
                head = self.blocked_head
                if head is not None:
                    if head.skips >= MAX_SKIPS:
                        examined.append(e)
                        return True
                    head.skips += 1
                self._admit(w, now)
                flow.retry_at = None
                order.push(p, e[3], flow)
                continue
            examined.append(e)
            flow.retry_at = (
                None if b.bucket is None else now + max(1e-3, b.bucket.seconds_until(b.amount, now))
            )
            if b.tenant_scoped:
                continue
            if self.blocked_head is None:
                self.blocked_head = w
                if w.skips >= MAX_SKIPS or b.reason is Reason.CONCURRENCY:
                    return True
                continue
            flow.retry_at = None
            scanned[0] += 1
            if scanned[0] >= MAX_SCAN or b.reason is Reason.CONCURRENCY:
                return True
        return False

    def _hold_behind(self, priority: int) -> None:
        """A blocked head holds everyone from ``priority`` down: no refill wake-ups for them
        but its own (a release pumps again; a refill time left from an earlier pass would be in
        the past and make :meth:`next_wake` ask for a pump at once, again and again)."""
        blocked = self.blocked_head
        for flow in self.order.flows(below=priority):
            if blocked is None or self.order.head(flow) is not blocked:
                flow.retry_at = None

    def _admit(self, w: Waiter, now: float) -> None:
        ticket = self._limits.reserve(w.request, w.request.max_tokens, now)
        self.remove(w)  # after the charge: the counter it leaves the backlog with counts it
        outcome = Outcome.DEGRADED if w.clamped else Outcome.QUEUED
        reason = Reason.MAX_TOKENS_CLAMPED if w.clamped else Reason.OK
        self.resolve(
            w,
            Decision(
                outcome,
                reason,
                ticket=ticket,
                max_tokens=w.request.max_tokens,
                queue_seconds=now - w.enqueued_at,
            ),
        )

    def next_wake(self) -> float | None:
        """The earliest clock time a waiter needs looking at without a release: a deadline or
        a bucket's refill; None when nobody waits."""
        if not self.order:
            return None
        heap = self._deadlines
        while heap and not self.order.live(heap[0][2]):
            heapq.heappop(heap)
        t = heap[0][0] if heap else math.inf
        retry = self.order.next_retry()
        if retry < t:
            t = retry
        return None if t == math.inf else t
