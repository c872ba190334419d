"""The asyncio side of admission: awaiting a place in the queue.

:class:`AsyncAdmission` wraps an :class:`AdmissionController`. Waiting is event-driven: a release
pumps the queue at once, and a single timer (``loop.call_at``) fires at the controller's
:meth:`~AdmissionController.next_wake` (a queue deadline or a bucket refill), never a polling loop.
A waiter whose task is cancelled (client gone) leaves the queue; if it had just been admitted,
its reservation is released before the cancellation propagates.
"""

from __future__ import annotations

import asyncio

from kvgate_agent.admission.controller import AdmissionController
from kvgate_agent.admission.decision import AdmissionRequest, Decision, Reason, Ticket


class AsyncAdmission:
    """Awaitable admission over one :class:`AdmissionController` on the running event loop."""

    def __init__(self, controller: AdmissionController) -> None:
        self.core = controller
        self._futures: dict[int, asyncio.Future[Decision]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._idle: asyncio.Event | None = None

    async def admit(self, req: AdmissionRequest) -> Decision:
        """Decide on ``req``, waiting in the queue if the policy says so.

        Returns the final decision (admitted, queued-then-admitted, degraded or rejected).
        Raises ``asyncio.CancelledError`` if cancelled while waiting; nothing stays reserved.
        """
        decision = self.core.submit(req)
        waiter = decision.waiter
        if waiter is None:
            self._settle()
            return decision
        fut: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()
        self._futures[waiter.seq] = fut
        self._settle()
        try:
            return await fut
        except asyncio.CancelledError:
            self._futures.pop(waiter.seq, None)
            self.core.cancel(waiter)
            won = waiter.decision
            if won is not None and won.ticket is not None:
                self.core.release(won.ticket, completion_tokens=0, reached_upstream=False)
            self.kick()
            raise

    def release(
        self,
        ticket: Ticket,
        *,
        completion_tokens: int,
        prompt_tokens: int | None = None,
        reached_upstream: bool = True,
    ) -> None:
        """Release ``ticket`` (see :meth:`AdmissionController.release`) and wake waiters."""
        if self.core.release(
            ticket,
            completion_tokens=completion_tokens,
            prompt_tokens=prompt_tokens,
            reached_upstream=reached_upstream,
        ):
            self.kick()

    def reject_waiting(self, reason: Reason, status: int, retry_after: float, message: str) -> None:
        """Refuse every waiter now (see :meth:`AdmissionController.reject_waiting`)."""
        self.core.reject_waiting(reason, status, retry_after, message)
        self._settle()
        if self._idle is not None and self.idle:
            self._idle.set()

    def kick(self) -> None:
        """Re-run the queue now (after capacity may have freed)."""
        self.core.pump()
        self._settle()
        if self._idle is not None and self.idle:
            self._idle.set()

    @property
    def idle(self) -> bool:
        """Nothing in flight and nobody waiting."""
        return self.core.in_flight == 0 and self.core.queue_length == 0

    async def wait_idle(self, within: float) -> bool:
        """Wait until :attr:`idle` (for a graceful drain), at most ``within`` seconds; returns
        whether it became idle."""
        if self.idle:
            return True
        self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), within)
        except TimeoutError:
            return self.idle
        return True

    def _settle(self) -> None:
        for w in self.core.take_resolved():
            fut = self._futures.pop(w.seq, None)
            if fut is not None and not fut.done() and w.decision is not None:
                fut.set_result(w.decision)
        self._arm()

    def _arm(self) -> None:
        at = self.core.next_wake()
        if at == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = at
        if at is not None:
            loop = asyncio.get_running_loop()
            delay = max(0.0, at - self.core.clock())
            self._timer = loop.call_at(loop.time() + delay, self._fire)

    def _fire(self) -> None:
        self._timer = None
        self._timer_at = None
        self.kick()

    def close(self) -> None:
        """Cancel the timer (on shutdown)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
