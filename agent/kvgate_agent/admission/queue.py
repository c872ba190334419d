"""The admission queue of one pod: who waits, in which order, and who may leave it now.

:class:`WaitQueue` owns every waiter, the per-priority counts the SLO's expected wait reads,
the ShortestFirst aging rate and the "a head waits for a shared resource" flag that stops a
newcomer from overtaking it. It admits waiters that fit now through the :class:`.Limits` it is
given (the check and the reservation in one call) and hands back the ones past their deadline
for the controller's overload actions to decide; it never decides a refusal itself.

Invariant: pure and clock-injected like the controller (times are passed in, seconds); a
waiter leaves the queue exactly once, with its ``decision`` set, collected by
:meth:`WaitQueue.take_resolved`.
"""

from __future__ import annotations

from collections.abc import Collection

from kvgate_agent.admission.config import AdmissionConfig
from kvgate_agent.admission.decision import AdmissionRequest, Decision, Outcome, Reason, Waiter
from kvgate_agent.admission.limits import Blocker, Limits
from kvgate_agent.admission.retry import refusal
from kvgate_agent.contract.policy import QueueOrder


class WaitQueue:
    """The requests waiting for admission on one pod (see the module docstring).

    Args:
        limits: the pod's counted and reserved resources; read for every admission from the
            queue and reserved from in the same call.
    """

    def __init__(self, limits: Limits) -> None:
        self._limits = limits
        self._waiters: dict[int, Waiter] = {}
        self._by_priority: dict[int, int] = {}
        self._seq = 0
        self._resolved: list[Waiter] = []
        self._aging_rate = aging_rate(limits.config)
        #: A waiter is blocked by a shared resource (the concurrency cap, KV, a pod-wide
        #: bucket): a newcomer must not take that resource first. Set by :meth:`admit_fitting`.
        self.head_blocked_shared = False

    def __len__(self) -> int:
        return len(self._waiters)

    def retune(self, config: AdmissionConfig) -> None:
        """New thresholds: the ShortestFirst aging rate follows the maximum wait."""
        self._aging_rate = aging_rate(config)

    def waiters(self) -> Collection[Waiter]:
        """Every waiter, in arrival order (read only)."""
        return self._waiters.values()

    def ahead_of(self, priority: int) -> int:
        """Waiters that would be served before a newcomer of ``priority``: under Priority order
        those of at least its priority, else all. O(distinct priorities waiting)."""
        if self._limits.config.queue_order is QueueOrder.PRIORITY:
            return sum(n for p, n in self._by_priority.items() if p >= priority)
        return len(self._waiters)

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
        self._waiters[w.seq] = w
        by = self._by_priority
        by[req.priority] = by.get(req.priority, 0) + 1
        return w

    def remove(self, w: Waiter) -> None:
        """Take ``w`` out of the queue (its decision is the caller's: :meth:`resolve`)."""
        del self._waiters[w.seq]
        by = self._by_priority
        p = w.request.priority
        left = by[p] - 1
        if left:
            by[p] = left
        else:
            del by[p]

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
        if self._waiters.get(w.seq) is w:
            self.remove(w)
            if not self._waiters:
                self.head_blocked_shared = False

    def expired(self, now: float) -> list[Waiter]:
        """The waiters past their deadline, in arrival order, still queued: the caller removes
        and decides on each in turn (the ones after it still count as waiting meanwhile)."""
        return [w for w in self._waiters.values() if now >= w.deadline]

    def reject_all(
        self, now: float, reason: Reason, status: int, retry_after: float, message: str
    ) -> None:
        """Refuse every waiter with ``status`` and ``retry_after`` seconds (e.g. shutting down)."""
        for w in list(self._waiters.values()):
            self.remove(w)
            d = refusal(reason, "queue", status, retry_after, w.request.max_tokens, message)
            d.queue_seconds = now - w.enqueued_at
            self.resolve(w, d)
        self.head_blocked_shared = False

    # ------------------------------------------------------------------ order and admission

    def ordered(self, now: float) -> list[Waiter]:
        """The waiters in service order: arrival (FIFO), priority then arrival (Priority), or
        reservation size less aging, then arrival (ShortestFirst)."""
        waiters = list(self._waiters.values())
        order = self._limits.config.queue_order
        if order is QueueOrder.PRIORITY:
            waiters.sort(key=lambda w: (-w.request.priority, w.seq))
        elif order is QueueOrder.SHORTEST_FIRST:
            rate = self._aging_rate
            waiters.sort(key=lambda w: (w.kv_tokens - (now - w.enqueued_at) * rate, w.seq))
        return waiters

    def head_blocker(self, now: float) -> Blocker | None:
        """What blocks the first waiter (in service order) held by a shared resource; None when
        no waiter is."""
        for w in self.ordered(now):
            b = self._limits.blocker(w.request, w.request.max_tokens, now)
            if b is not None and not b.tenant_scoped:
                return b
        return None

    def admit_fitting(self, now: float) -> None:
        """Admit the waiters that fit now, in service order, until one blocked by a shared
        resource (the concurrency cap, KV, a pod-wide bucket): those behind it cannot overtake
        it. One blocked only by its own tenant's bucket is skipped, its refill time noted for
        :meth:`next_wake`."""
        limits = self._limits
        self.head_blocked_shared = False
        waiters = iter(self.ordered(now))
        for w in waiters:
            b = limits.blocker(w.request, w.request.max_tokens, now)
            if b is None:
                self.remove(w)
                ticket = limits.reserve(w.request, w.request.max_tokens, now)
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
                continue
            w.retry_at = (
                None if b.bucket is None else now + max(1e-3, b.bucket.seconds_until(b.amount, now))
            )
            if not b.tenant_scoped:
                self.head_blocked_shared = True
                # Those behind it cannot go first, whatever their own bucket says: a release
                # pumps again. A refill time left from an earlier pass would be in the past and
                # make next_wake() ask for a pump at once, again and again.
                for behind in waiters:
                    behind.retry_at = None
                break

    def next_wake(self) -> float | None:
        """The earliest clock time a waiter needs looking at without a release: its deadline or
        its bucket's refill; None when nobody waits."""
        t: float | None = None
        for w in self._waiters.values():
            c = w.deadline if w.retry_at is None else min(w.deadline, w.retry_at)
            t = c if t is None else min(t, c)
        return t


def aging_rate(config: AdmissionConfig) -> float:
    """ShortestFirst aging, KV tokens per second: after half the maximum wait, a waiting
    request outranks any new one."""
    ref = config.max_model_len or config.kv_capacity_tokens or 8192
    return ref / max(1e-3, config.queue_max_wait_seconds / 2)
