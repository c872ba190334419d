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
    """A stop on every new admission (see :meth:`Holds.hold`).

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

    def hold(
        self,
        reason: Reason,
        *,
        retry_after: float,
        message: str,
        key: str | None = None,
        until: float | None = None,
    ) -> None:
        """Refuse every new request with 503 and a Retry-After until lifted (or until clock
        time ``until``, when given): e.g. ``Reason.FAIL_CLOSED`` (stale thresholds or unknown
        KV capacity under FailClosed) or ``Reason.GPU_MEMORY_LOW`` (the GPU safety net closed).

        Args:
            reason: the refusal reason reported.
            retry_after: seconds a refused client should wait (> 0); with ``until`` the
                remaining time is used instead.
            message: the explanation for error bodies.
            key: names this hold for :meth:`lift` (default: the reason's value), so holds from
                different sources do not lift each other. A hold of the same key is replaced.
            until: clock time at which the hold ends by itself; None = until lifted.

        While any hold is active, the controller's ``pump`` admits nobody from the queue:
        waiters stay until their deadline (then they are refused with the hold's 503) or until
        every hold is lifted. In-flight requests are not touched.

        Raises:
            ValueError: ``retry_after`` ≤ 0 seconds.
        """
        if not retry_after > 0:
            raise ValueError(f"retry_after must be > 0 seconds, got {retry_after}")
        self._holds[key if key is not None else reason.value] = Hold(
            reason, retry_after, message, until
        )

    def lift(self, key: str | Reason) -> bool:
        """End the hold named ``key`` (a key given to :meth:`hold`, or the reason it defaulted
        to); returns whether one was active. Waiters are admitted on the controller's next
        ``pump``."""
        name = key.value if isinstance(key, Reason) else key
        return self._holds.pop(name, None) is not None

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
