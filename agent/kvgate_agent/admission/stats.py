"""A read-only snapshot of one pod's admission state (:meth:`AdmissionController.stats`): what
the metrics, the node agent's sync report and the tests read, built at that moment."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AdmissionStats:
    """A read-only snapshot of one pod's admission state, for metrics, sync reports and tests.

    Each field's docstring is under it.
    """

    in_flight: int
    """Admitted requests not yet released."""
    queue_length: int
    """Requests waiting now."""
    kv_reserved_tokens: int
    """KV tokens reserved by the requests in flight (block-rounded)."""
    kv_capacity_tokens: int | None
    """KV capacity enforced, tokens (None: not enforced)."""
    kv_headroom_tokens: int
    """KV tokens kept free for the growth of predicted reservations in flight."""
    concurrency_limit: int | None
    """The concurrency cap enforced now: the lowest of the policy's cap, the engine's own and
    the adaptive limit (None: none)."""
    engine_concurrency: int | None
    """Requests the engine serves at once (llama.cpp's slots); None: unknown."""
    seconds_per_token: float
    """Observed decode time per output token, seconds (the drain estimate's speed)."""
    inter_token_seconds: float | None
    """Smoothed time between streamed output tokens (the adaptive limit's input), seconds;
    None before the first gap."""
