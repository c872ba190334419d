"""Live correction: what the streams and the engine tell admission while requests run.

The streams' output tokens (:meth:`LiveCorrection.observe_tokens`) move the SLO measurements,
the fair counters and a predicted reservation; the engine's reports (its KV in use, its own
queue, its KV capacity, its slots) correct what admission counts against. None of these calls
decides on a request or wakes the queue: :class:`~kvgate_agent.admission.AsyncAdmission` re-runs
the queue after those that may let a waiter in.

Invariant: pure and clock-injected like the controller (clock seconds); every call is O(1).
"""

from __future__ import annotations

from collections.abc import Callable

from kvgate_agent.admission.ceiling import ConcurrencyCeiling
from kvgate_agent.admission.decision import Ticket
from kvgate_agent.admission.limits import ENGINE_KV_TTL_S, Limits
from kvgate_agent.admission.slo import SloState


class LiveCorrection:
    """The live corrections of one pod's admission state (see the module docstring).

    Args:
        limits: the pod's counted and reserved resources.
        slo: its SLO measurements and adaptive limit.
        ceiling: its concurrency ceiling.
        clock: monotonic seconds (the controller's).
    """

    __slots__ = ("_ceiling", "_clock", "_limits", "_slo")

    def __init__(
        self,
        limits: Limits,
        slo: SloState,
        ceiling: ConcurrencyCeiling,
        clock: Callable[[], float],
    ) -> None:
        self._limits = limits
        self._slo = slo
        self._ceiling = ceiling
        self._clock = clock

    def observe_tokens(self, ticket: Ticket, generated: int) -> None:
        """``ticket``'s request has produced ``generated`` output tokens so far (all choices), as
        its stream passes. Measures the time to first token and between tokens, labelled with
        the requests in flight (the adaptive limit's input, :mod:`.slo`), and grows a predicted
        reservation block by block once the sequence outgrows it (never past prompt + n x
        max_tokens). O(1); a no-op after release or when ``generated`` did not increase."""
        prev = ticket.generated
        if ticket.released or generated <= prev:
            return
        now = self._clock()
        last = ticket.last_token_at
        slo = self._slo
        in_flight = self._limits.in_flight
        if last is None:
            ticket.first_token_at = now
            slo.observe_first_token(now - ticket.admitted_at, in_flight, now)
        else:
            tokens = (generated - prev) / ticket.n
            seconds = now - last
            slo.observe_gap(seconds, tokens, in_flight)
            ticket.inflight_seconds += in_flight * seconds
        ticket.generated = generated
        ticket.last_token_at = now
        self._limits.fair.observe_output(ticket, generated)
        if ticket.uncached_prompt_tokens + generated >= ticket.kv_tokens:
            self._limits.grow(ticket, generated)
        self._ceiling.tick(now)

    def observe_engine_kv(self, used_tokens: int | None) -> None:
        """The engine reports ``used_tokens`` KV tokens in use (None: unknown). Where that is
        more than kvgate has reserved (plus headroom), admission counts the engine's figure,
        for :data:`~kvgate_agent.admission.limits.ENGINE_KV_TTL_S` seconds from now."""
        self._limits.engine_kv_used = used_tokens
        self._limits.engine_kv_until = self._clock() + ENGINE_KV_TTL_S

    def observe_engine_waiting(self, waiting: int | None, running: int | None = None) -> None:
        """The engine reports ``waiting`` requests in its own queue, ``running`` in its batch
        (None: unknown). kvgate's own requests not running may be among the waiting (a cap above
        vLLM's ``max_num_seqs``), so only ``waiting - (in_flight - running)`` count ahead of a
        newcomer, for :data:`~kvgate_agent.admission.limits.ENGINE_KV_TTL_S` seconds."""
        ours = max(0, self._limits.in_flight - (running or 0))
        others = None if waiting is None else max(0, waiting - ours)
        self._slo.observe_engine_waiting(others, self._clock() + ENGINE_KV_TTL_S)

    def set_kv_capacity(self, tokens: int | None) -> None:
        """Enforce a new KV capacity (tokens; None = not enforced), e.g. the engine's own report.
        Reservations already held stay; waiters are re-examined on the next pump."""
        self._limits.set_kv_capacity(tokens)

    def set_engine_concurrency(self, slots: int | None) -> None:
        """The engine serves at most ``slots`` requests at once (llama.cpp's ``total_slots``;
        None: no such limit): see :meth:`ConcurrencyCeiling.set_engine_slots`."""
        self._ceiling.set_engine_slots(slots)
