"""Retry-After: how long a refused request should wait, from the real refill or drain time.

Invariant: every Retry-After given is a whole number of seconds in [1, :data:`MAX_RETRY_AFTER`];
it is the time the blocking resource needs (a bucket's refill, or in-flight work draining at
the observed decode speed), never a fixed guess.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Final

from kvgate_agent.admission.bucket import Bucket
from kvgate_agent.admission.decision import (
    AdmissionRequest,
    Blocker,
    Decision,
    Outcome,
    Reason,
    Waiter,
)
from kvgate_agent.admission.limits import Limits

#: Initial decode time per output token before any request has finished, seconds. 20 ms is a
#: typical inter-token latency of a loaded vLLM server (vLLM benchmarks report ITL of 10–50 ms);
#: it is replaced by the observed average as soon as responses complete.
DEFAULT_SECONDS_PER_TOKEN: Final = 0.02
#: Weight of each new observation in the seconds-per-token moving average.
EMA_ALPHA: Final = 0.2
#: Upper bound on a Retry-After, seconds (one day), so a tiny rate cannot produce absurd values.
MAX_RETRY_AFTER: Final = 86_400


def retry_after_seconds(wait: float) -> int:
    """An HTTP Retry-After value from a wait in seconds: integer ≥ 1, at most a day."""
    if not math.isfinite(wait):
        return MAX_RETRY_AFTER
    return min(MAX_RETRY_AFTER, max(1, math.ceil(wait)))


def refusal(
    reason: Reason, limit: str, status: int, wait: float | None, max_tokens: int, message: str
) -> Decision:
    """A rejected :class:`Decision` with HTTP ``status`` and, when ``wait`` (seconds) is given,
    its Retry-After."""
    return Decision(
        Outcome.REJECTED,
        reason,
        status=status,
        retry_after=None if wait is None else retry_after_seconds(wait),
        max_tokens=max_tokens,
        limit=limit,
        message=message,
    )


class DecodeSpeed:
    """Observed decode time per output token, seconds: a moving average over finished requests
    (weight :data:`EMA_ALPHA`), starting at :data:`DEFAULT_SECONDS_PER_TOKEN`."""

    __slots__ = ("seconds_per_token",)

    def __init__(self) -> None:
        self.seconds_per_token = DEFAULT_SECONDS_PER_TOKEN

    def observe(self, seconds: float, tokens: int) -> None:
        """Count one request that produced ``tokens`` (> 0) output tokens in ``seconds``."""
        self.seconds_per_token += EMA_ALPHA * (seconds / tokens - self.seconds_per_token)


def wait_seconds(
    req: AdmissionRequest,
    blocker: Blocker,
    now: float,
    limits: Limits,
    queue: Collection[Waiter],
    seconds_per_token: float,
) -> float:
    """Seconds until the blocking resource could admit ``req`` (not rounded): the bucket's
    refill time for a rate limit, else the expected drain of in-flight work (finishing at
    ``seconds_per_token`` per output token) and of the work already queued."""
    if blocker.bucket is not None:
        return _refill_wait(req, blocker, blocker.bucket, now, limits, queue)
    return _drain_wait(req, blocker, now, limits, queue, seconds_per_token)


def _refill_wait(
    req: AdmissionRequest,
    blocker: Blocker,
    b: Bucket,
    now: float,
    limits: Limits,
    queue: Collection[Waiter],
) -> float:
    # Waiters drawing on the same bucket are served first: count their demand too.
    per_request = blocker.reason is Reason.RATE_LIMIT_REQUESTS
    cost = limits.config.cost
    queued = 0.0
    for w in queue:
        other = w.request
        if other is req or (blocker.tenant_scoped and other.tenant != req.tenant):
            continue
        queued += 1.0 if per_request else cost(other.prompt_tokens, other.n * other.max_tokens)
    wait = b.seconds_until(blocker.amount, now)
    if queued:
        wait = max(wait, (blocker.amount + queued - b.refill(now)) / b.rate)
    return wait


def _drain_wait(
    req: AdmissionRequest,
    blocker: Blocker,
    now: float,
    limits: Limits,
    queue: Collection[Waiter],
    seconds_per_token: float,
) -> float:
    ends = sorted(
        (t.admitted_at + (t.max_tokens + 1) * seconds_per_token, t.kv_tokens)
        for t in limits.tickets.values()
    )
    if not ends:
        return seconds_per_token * max(1, req.max_tokens)
    floor = seconds_per_token
    cfg = limits.config
    if blocker.reason is Reason.KV_CAPACITY and cfg.kv_capacity_tokens is not None:
        need = (
            limits.kv_reserved_tokens
            + sum(w.kv_tokens for w in queue)
            + limits.reservation(req, req.max_tokens)
            + limits.headroom
            - cfg.kv_capacity_tokens
        )
        freed = 0
        for end, kv in ends:
            freed += kv
            if freed >= need:
                return max(floor, end - now)
        return max(floor, ends[-1][0] - now)
    # Concurrency (or "others queued ahead"): the (queued + 1)-th completion frees our slot.
    slots_needed = len(queue) + 1
    if limits.concurrency_limit is not None:
        slots_needed += max(0, limits.in_flight - limits.concurrency_limit)
    rounds, idx = divmod(slots_needed - 1, len(ends))
    span = ends[-1][0] - min(now, ends[0][0]) if rounds else 0.0
    return max(floor, ends[idx][0] - now + rounds * max(span, floor))
