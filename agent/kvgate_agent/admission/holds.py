"""Holds: stops on every new admission, each under its own key (e.g. the engine's KV capacity
unknown, thresholds stale under FailClosed, GPU memory low).

Invariant: while any hold is active nobody is admitted, and the refusal comes from the hold
with the longest remaining wait, so a client is never told to retry before every hold ends.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgate_agent.admission.decision import Decision, Reason
from kvgate_agent.admission.retry import refusal


@dataclass(slots=True)
class Hold:
    """A stop on every new admission (see :meth:`AdmissionController.hold`).

    Attributes:
        reason: the refusal reason (``fail_closed``, ``gpu_memory_low``).
        retry_after: seconds a refused client should wait (used while ``until`` is None).
        message: the explanation put in error bodies.
        until: clock time at which the hold ends by itself; None = until lifted.
    """

    reason: Reason
    retry_after: float
    message: str
    until: float | None = None

    def wait(self, now: float) -> float:
        """Seconds a client refused at ``now`` should wait."""
        return self.retry_after if self.until is None else self.until - now

    def refusal(self, now: float, max_tokens: int) -> Decision:
        """The 503 this hold answers at ``now``, with its Retry-After."""
        return refusal(
            self.reason, self.reason.value, 503, self.wait(now), max_tokens, self.message
        )


class Holds:
    """The active holds by key. Falsy when there are none (a cheap check on the hot path)."""

    __slots__ = ("_holds",)

    def __init__(self) -> None:
        self._holds: dict[str, Hold] = {}

    def __bool__(self) -> bool:
        return bool(self._holds)

    def put(self, key: str, hold: Hold) -> None:
        """Start (or replace) the hold named ``key``.

        Raises:
            ValueError: ``hold.retry_after`` ≤ 0 seconds.
        """
        if not hold.retry_after > 0:
            raise ValueError(f"retry_after must be > 0 seconds, got {hold.retry_after}")
        self._holds[key] = hold

    def lift(self, key: str) -> bool:
        """End the hold named ``key``; returns whether one was active."""
        return self._holds.pop(key, None) is not None

    def active(self, now: float) -> Hold | None:
        """The hold that decides at ``now``: the one with the longest remaining wait; None when
        none is active. Holds past their ``until`` are forgotten."""
        best: Hold | None = None
        for key, h in list(self._holds.items()):
            if h.until is not None and now >= h.until:
                del self._holds[key]
            elif best is None or h.wait(now) > best.wait(now):
                best = h
        return best

    def next_end(self) -> float | None:
        """The earliest clock time at which a hold ends by itself; None if none does."""
        ends = [h.until for h in self._holds.values() if h.until is not None]
        return min(ends) if ends else None
