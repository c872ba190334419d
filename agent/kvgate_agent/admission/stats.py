"""Read-only snapshots of one pod's admission state (:meth:`AdmissionController.stats`) and of
its tenants (:meth:`AdmissionController.tenant_stats`): what the metrics, the node agent's sync
report and the tests read, built at that moment."""

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


@dataclass(frozen=True, slots=True)
class TenantStats:
    """A read-only snapshot of one pod's per-tenant state
    (:meth:`AdmissionController.tenant_stats`), for metrics and tests.

    Each field's docstring is under it.
    """

    bucket_levels: list[tuple[str, str, str, float, float]]
    """(limit name, unit, key, level, capacity) for every bucket held in memory; ``unit`` is
    ``requests`` or ``cost``, ``key`` the tenant or "" for pod-wide buckets."""
    tenants_tracked: int
    """Tenant buckets held in memory (bounded by ``max_tenants`` per limit)."""
    fair_shares: list[tuple[str, float, float]]
    """(tenant, virtual counter, attained service) of every fair-share account kept: the
    counter in weighted charge units (the fair queue serves the smallest first), the service in
    token-weighted units (``w_in x prompt + w_out x output``, settled to real usage)."""
