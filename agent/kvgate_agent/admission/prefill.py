"""The engine's prefill backlog as admission sees it: prompt tokens admitted whose first token
has not streamed yet, and how fast the engine clears them.

An engine serves prefills in arrival order (vLLM's waiting queue is FCFS by default; chunked
prefill spreads a step's token budget over them: https://docs.vllm.ai/en/latest/configuration/optimization.html#chunked-prefill),
so a request admitted behind a burst of long prompts waits for all of them before its first
token, however fair the queue in front was. :class:`PrefillBacklog` estimates that wait:
``pending / rate``, ``pending`` the prompt tokens admitted and not yet prefilled, ``rate`` the
prompt tokens per second the engine was seen to prefill (a decaying peak of per-interval
samples: the engine's capacity shows when it is busy, not when it idles).

A request whose first token never streams (a non-streamed response) would stay pending until
its release: entries older than :data:`HORIZON_S` seconds leave the backlog whatever happened.

Invariant: pure and clock-injected (times are passed in, seconds); O(1) amortised per call.
"""

from __future__ import annotations

from typing import Final

from kvgate_agent.admission.decision import Ticket

#: Length of one rate sample, seconds.
INTERVAL_S: Final = 0.5
#: Per-interval decay of the peak rate (so a slower engine, or a smaller one, is learned).
DECAY: Final = 0.98
#: Longest a ticket counts as pending prefill, seconds.
HORIZON_S: Final = 5.0


class PrefillBacklog:
    """The prompt tokens admitted and not yet prefilled, and the engine's prefill rate.

    Attributes:
        pending: prompt tokens admitted whose first token has not streamed (within
            :data:`HORIZON_S`), tokens.
        rate: the engine's prefill rate, prompt tokens per second (0 before any sample).
    """

    __slots__ = ("_done", "_entries", "_head", "_interval_end", "pending", "rate")

    def __init__(self) -> None:
        #: The tickets admitted, oldest first, from index ``_head`` on (those before it are
        #: gone: a list and an index rather than a deque, whose methods mypyc calls as
        #: Python methods, on every admission).
        self._entries: list[Ticket] = []
        self._head = 0
        self.pending = 0
        self.rate = 0.0
        self._done = 0
        self._interval_end: float | None = None

    def admitted(self, ticket: Ticket) -> None:
        """``ticket``'s prompt waits for its prefill from now (its ``admitted_at``).

        Entries at the front that no longer count (prefilled or released) are dropped first:
        :meth:`delay` would drop them unchanged, but it runs only under a TTFT SLO, and without
        one every ticket ever admitted stayed (unbounded memory)."""
        entries = self._entries
        head, n = self._head, len(entries)
        while head < n and not entries[head].prefill_pending:
            head += 1
        self._forget(head)
        ticket.prefill_pending = True
        self.pending += ticket.uncached_prompt_tokens
        entries.append(ticket)

    def _forget(self, head: int) -> None:
        """The entries before index ``head`` are gone: drop them once they are all the list, or
        at least half of it (amortised O(1) per entry)."""
        entries = self._entries
        if head == len(entries):
            entries.clear()
            head = 0
        elif head >= 64 and 2 * head >= len(entries):
            del entries[:head]
            head = 0
        self._head = head

    def prefilled(self, ticket: Ticket) -> None:
        """``ticket``'s first token streamed (its prompt is prefilled)."""
        if ticket.prefill_pending:
            ticket.prefill_pending = False
            self.pending -= ticket.uncached_prompt_tokens
            self._done += ticket.uncached_prompt_tokens

    def ended(self, ticket: Ticket) -> None:
        """``ticket`` was released, prefilled or not (not counted as prefill done)."""
        if ticket.prefill_pending:
            ticket.prefill_pending = False
            self.pending -= ticket.uncached_prompt_tokens

    def delay(self, now: float) -> float:
        """Seconds a prompt admitted now would wait for those ahead of it: ``pending /
        rate``, 0 before the rate is known. Closes the rate intervals that ended by clock time
        ``now`` and forgets entries past :data:`HORIZON_S`."""
        end = self._interval_end
        if end is None:
            self._interval_end = now + INTERVAL_S
        elif now >= end:
            sample = self._done / (INTERVAL_S + now - end)
            self.rate = max(self.rate * DECAY, sample)
            self._done = 0
            self._interval_end = now + INTERVAL_S
        entries = self._entries
        head, n = self._head, len(entries)
        while head < n and (
            not entries[head].prefill_pending or now - entries[head].admitted_at > HORIZON_S
        ):
            self.ended(entries[head])
            head += 1
        self._forget(head)
        return self.pending / self.rate if self.rate > 0 else 0.0
