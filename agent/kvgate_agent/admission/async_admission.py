"""The asyncio side of admission: the one admission API the sidecar drives.

:class:`AsyncAdmission` wraps an :class:`AdmissionController`. Every call that can let a waiter
in (a release, new thresholds, a hold lifted, a new KV capacity or engine ceiling, the engine's
usage, slices granted by the store) re-runs the queue itself: no caller has to remember to.
Waiting is event-driven: a single timer (``loop.call_at``) fires at the controller's
:attr:`~AdmissionController.next_wake` (the queue side's own :meth:`Waiting.next_wake`: a queue
deadline, a bucket refill or a hold's end), never a polling loop. A waiter whose task is
cancelled (client gone) leaves the queue; if it had just been admitted, its reservation is
released before the cancellation propagates.

The virtual-time benchmark drives the pure controller itself (no event loop), pumping where
this wrapper wakes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvgate_agent.admission.config import AdmissionConfig
from kvgate_agent.admission.controller import AdmissionController
from kvgate_agent.admission.decision import AdmissionRequest, Decision, Reason, Ticket
from kvgate_agent.admission.fairqueue import PoolShare
from kvgate_agent.admission.lease import LeaseBook
from kvgate_agent.admission.stats import AdmissionStats, TenantStats
from kvgate_agent.contract.policy import FailureMode


class AsyncAdmission:
    """Awaitable admission over one :class:`AdmissionController` on the running event loop.

    Args:
        controller: the pure decisions, kept as :attr:`core` for admission's own package and
            tests: the sidecar reads admission through this wrapper (:meth:`stats`,
            :meth:`tenant_stats`, :meth:`engine_waiting`, :meth:`lease_book`), and changes it
            through it too (the controller's own mutators do not wake the queue).
    """

    def __init__(self, controller: AdmissionController) -> None:
        self.core = controller
        #: The controller's clock (monotonic seconds).
        self.clock: Callable[[], float] = controller.clock
        #: ``ticket``'s request has produced this many output tokens so far (all choices), as
        #: its stream passes (:meth:`LiveCorrection.observe_tokens`). Called per streamed
        #: event, so bound once; it never wakes the queue (a growing stream frees nothing).
        self.observe_tokens = controller.live.observe_tokens
        self._futures: dict[int, asyncio.Future[Decision]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._idle: asyncio.Event | None = None

    # ------------------------------------------------------------------ reads

    @property
    def config(self) -> AdmissionConfig:
        """The thresholds enforced now."""
        return self.core.config

    def stats(self) -> AdmissionStats:
        """The admission state now (:meth:`AdmissionController.stats`)."""
        return self.core.stats()

    def tenant_stats(self) -> TenantStats:
        """The per-tenant state now (:meth:`AdmissionController.tenant_stats`: bucket levels,
        tenants tracked, fair shares)."""
        return self.core.tenant_stats()

    def engine_waiting(self) -> int:
        """Requests the engine reported waiting in its own queue now, 0 once that report is
        older than its lifetime (:meth:`~kvgate_agent.admission.slo.SloState.engine_waiting`)."""
        core = self.core
        return core.slo.engine_waiting(core.clock())

    def lease_book(self, now: float) -> LeaseBook:
        """Hold ``shared`` limits as slices of fleet-wide budgets from now on (across new
        thresholds: :meth:`AdmissionController.attach_store`), and the book of their leases the
        store link keeps (:class:`~kvgate_agent.admission.lease.LeaseBook`, created at clock
        time ``now``, seconds; it reads the shared limits' buckets, the retired slices, the
        ``failureMode`` and this pod's fleet share as they are when asked)."""
        core = self.core
        core.attach_store()
        return LeaseBook(
            core.shared_maps,
            lambda: core.config.failure_mode is FailureMode.FAIL_CLOSED,
            now,
            retired=core.take_retired_slices,
            share=lambda: core.config.fleet_share,
        )

    def refused_whatever_the_prompt(self, req: AdmissionRequest) -> bool:
        """Whether :meth:`admit` would refuse ``req`` now whatever its prompt's count (see
        :meth:`AdmissionController.refused_whatever_the_prompt`); decides nothing."""
        return self.core.refused_whatever_the_prompt(req)

    # ------------------------------------------------------------------ a request

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
            self._wake()
            raise

    def release(
        self,
        ticket: Ticket,
        *,
        completion_tokens: int,
        prompt_tokens: int | None = None,
        reached_upstream: bool = True,
        cached_tokens: int | None = None,
    ) -> None:
        """Release ``ticket`` (see :meth:`AdmissionController.release`: ``cached_tokens`` are
        the prompt tokens the engine reported found in its prefix cache) and wake waiters."""
        if self.core.release(
            ticket,
            completion_tokens=completion_tokens,
            prompt_tokens=prompt_tokens,
            reached_upstream=reached_upstream,
            cached_tokens=cached_tokens,
        ):
            self._wake()

    def reject_waiting(self, reason: Reason, status: int, retry_after: float, message: str) -> None:
        """Refuse every waiter now (see :meth:`AdmissionController.reject_waiting`)."""
        self.core.reject_waiting(reason, status, retry_after, message)
        self._settle()
        if self._idle is not None and self.idle:
            self._idle.set()

    # ------------------------------------------------------------------ state that wakes

    def reconfigure(self, config: AdmissionConfig) -> None:
        """Enforce new thresholds (:meth:`AdmissionController.reconfigure`); waiters are
        re-examined at once."""
        self.core.reconfigure(config)
        self._wake()

    def hold(
        self,
        reason: Reason,
        *,
        retry_after: float,
        message: str,
        key: str | None = None,
        until: float | None = None,
    ) -> None:
        """Refuse every new request until lifted (:meth:`Holds.hold`; raises ``ValueError`` if
        ``retry_after`` ≤ 0); the queue's timer follows the hold's end."""
        self.core.holds.hold(reason, retry_after=retry_after, message=message, key=key, until=until)
        self._wake()

    def lift(self, key: str | Reason) -> bool:
        """End the hold named ``key`` (:meth:`Holds.lift`); returns whether one was active, and
        lets waiters in at once when it was."""
        lifted = self.core.holds.lift(key)
        if lifted:
            self._wake()
        return lifted

    def set_kv_capacity(self, tokens: int | None) -> None:
        """Enforce a new KV capacity, tokens (None: not enforced); waiters are re-examined."""
        self.core.live.set_kv_capacity(tokens)
        self._wake()

    def set_engine_concurrency(self, slots: int | None) -> None:
        """The engine serves at most ``slots`` requests at once
        (:meth:`LiveCorrection.set_engine_concurrency`); waiters are re-examined."""
        self.core.live.set_engine_concurrency(slots)
        self._wake()

    def observe_engine_usage(
        self, kv_used_tokens: int | None, waiting: int | None, running: int | None
    ) -> None:
        """The engine's own report: KV tokens in use, requests waiting in its queue and running
        in its batch (None: unknown); see :meth:`LiveCorrection.observe_engine_kv` and
        :meth:`~LiveCorrection.observe_engine_waiting`. Waiters are re-examined."""
        live = self.core.live
        live.observe_engine_kv(kv_used_tokens)
        live.observe_engine_waiting(waiting, running)
        self._wake()

    def attach_pool(self, pool: PoolShare) -> None:
        """Decide with the pool's view of the tenants' service on other replicas from now on
        (:meth:`AdmissionController.attach_pool`; the store's share exchange keeps it)."""
        self.core.attach_pool(pool)

    def pool_synced(self, remote: dict[str, float]) -> None:
        """The pool's sums were read (:meth:`AdmissionController.pool_synced`): who is over its
        pool-wide share may have changed, so waiters may fit now."""
        self.core.pool_synced(remote)
        self._wake()

    def slices_granted(self) -> None:
        """The store topped up slices of shared limits: waiters for them may fit now."""
        self._wake()

    # ------------------------------------------------------------------ drain

    @property
    def idle(self) -> bool:
        """Nothing in flight and nobody waiting."""
        return self.core.idle

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

    def close(self) -> None:
        """Cancel the timer (on shutdown)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # ------------------------------------------------------------------ the queue's timer

    def _wake(self) -> None:
        """Re-run the queue now (capacity may have freed) and hand out its decisions."""
        self.core.pump()
        self._settle()
        if self._idle is not None and self.idle:
            self._idle.set()

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
        self._wake()
