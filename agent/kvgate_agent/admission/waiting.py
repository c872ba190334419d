"""The controller's queue side: a request the overload actions queue, the passes that move
waiters out of the queue, and when the next pass is due.

:class:`Waiting` puts a request in the fair queue's
:class:`~kvgate_agent.admission.fairqueue.WaitQueue` when
:func:`~kvgate_agent.admission.overload.act` answers Queue (refusing the waiter it evicts in its
place), and on each :meth:`Waiting.pump` decides on the waiters past their deadline (their
remaining overload actions, or an active hold's 503) before admitting those that fit.

Invariant: pure and clock-injected like the controller (clock seconds); a waiter is decided
exactly once, through the queue's ``resolve``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from kvgate_agent.admission.ceiling import ConcurrencyCeiling
from kvgate_agent.admission.decision import AdmissionRequest, Blocker, Decision, Outcome, Reason
from kvgate_agent.admission.fairqueue import what_blocks
from kvgate_agent.admission.holds import Hold, Holds
from kvgate_agent.admission.overload import Enqueue, Resources, act, evicted
from kvgate_agent.contract.policy import OverloadAction

_DEGRADE: Final = OverloadAction.DEGRADE.value
_REJECT: Final = OverloadAction.REJECT.value


class Waiting:
    """The queue side of one pod's admission (see the module docstring).

    Args:
        r: the pod's limits, wait queue, SLO state and decode speed.
        holds: its holds (while one is active, nobody leaves the queue admitted).
        ceiling: its concurrency ceiling (ticked at every pass).
        clock: monotonic seconds (the controller's).
    """

    __slots__ = ("_ceiling", "_clock", "_holds", "_r")

    def __init__(
        self, r: Resources, holds: Holds, ceiling: ConcurrencyCeiling, clock: Callable[[], float]
    ) -> None:
        self._r = r
        self._holds = holds
        self._ceiling = ceiling
        self._clock = clock

    def act(
        self,
        req: AdmissionRequest,
        blocker: Blocker | None,
        actions: tuple[str, ...],
        now: float,
        clamped: bool,
        waited: float,
    ) -> Decision:
        """The overload actions' decision for ``req`` (:func:`.overload.act`; ``clamped``: its
        max_tokens was lowered; ``waited``: seconds it spent in the queue, 0 for a newcomer),
        queueing it when that is their answer."""
        r = self._r
        d = act(r, req, blocker, actions, now, clamped, waited)
        if isinstance(d, Enqueue):
            if d.evict is not None:
                r.queue.evict(d.evict, evicted(r, d.evict, d.evict_reason, now))
            return self._enqueue(req, d.remaining, now, clamped, d.budget)
        return d

    def _enqueue(
        self,
        req: AdmissionRequest,
        remaining: tuple[str, ...],
        now: float,
        clamped: bool,
        budget: float | None,
    ) -> Decision:
        """Queue ``req`` until the policy's maximum wait, or its SLO's wait ``budget`` (seconds)
        when that is shorter."""
        q = self._r.queue
        max_wait = self._r.limits.config.queue_max_wait_seconds
        deadline = now + (max_wait if budget is None else min(max_wait, budget))
        w = q.add(req, now, deadline, remaining or (_REJECT,), clamped)
        self.pump()
        if w.decision is not None:  # admitted at once: the caller gets it directly
            q.unresolve(w)
            if w.decision.outcome is Outcome.QUEUED:
                w.decision.outcome = Outcome.ADMITTED  # it never waited
            return w.decision
        return Decision(Outcome.QUEUED, Reason.OK, waiter=w, max_tokens=req.max_tokens)

    def pump(self) -> None:
        """Move waiters out of the queue: expire those past their deadline (their remaining
        overload actions decide), admit those that fit now in queue order. Waiters whose
        ``decision`` got set are collected for the queue's ``take_resolved``. A waiter blocked
        by a shared resource (the concurrency cap, KV, a pod-wide bucket) stops the scan so
        later ones cannot overtake it; one blocked only by its own tenant's bucket is skipped.
        While a hold is active nobody is admitted."""
        q = self._r.queue
        if not q:
            return  # (no blocked head either: it leaves with its waiter)
        now = self._clock()
        self._ceiling.tick(now)
        held = self._holds.active(now) if self._holds else None
        self._expire(now, held)
        if held is None:
            q.admit_fitting(now)  # (the head blocked at the last pass first)
        else:
            q.unblock()

    def _expire(self, now: float, held: Hold | None) -> None:
        """Decide on every waiter past its deadline: refused with ``held``'s 503 while a hold
        is active (no admission of any kind, not even degraded), else by its remaining overload
        actions (Degrade first, if the policy has it: having waited its turn, it may)."""
        q, limits = self._r.queue, self._r.limits
        actions_cfg = limits.config.actions
        for w in q.expired(now):
            q.remove(w)
            waited = now - w.enqueued_at
            if held is not None:
                d = held.refusal(now, w.request.max_tokens)
                d.message = f"timed out after {waited:.1f}s in the admission queue: {d.message}"
                d.queue_seconds = waited
                q.resolve(w, d)
                continue
            blocker = what_blocks(limits, w.request, w.request.max_tokens, now)
            actions = w.remaining_actions
            if _DEGRADE in actions_cfg and _DEGRADE not in actions:
                actions = (_DEGRADE, *actions)
            q.resolve(w, self.act(w.request, blocker, actions, now, w.clamped, max(waited, 1e-9)))

    def next_wake(self) -> float | None:
        """Clock time at which :meth:`pump` should next run even if nothing is released: the
        earliest queue deadline or bucket refill a waiter needs, or the end of a hold that ends
        by itself (it lets waiters in); None when nobody waits."""
        t = self._r.queue.next_wake()
        if t is not None:
            end = self._holds.next_end()
            if end is not None:
                t = min(t, end)
        return t
