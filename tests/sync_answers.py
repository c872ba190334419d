"""Sync answers for the sidecar's sync tests: what a node agent answers one pod."""

from __future__ import annotations

from typing import Any

from kvgate_agent.contract.sync import SyncAnswer


def answer(
    thresholds: dict[str, Any] | None = None,
    *,
    managed: bool = True,
    etag: str = "e1",
    ttl: float = 10.0,
    interval: float = 1.0,
    safety_net: dict[str, Any] | None = None,
    generation: int = 3,
) -> SyncAnswer:
    """One answer for pod ``ns/model-0`` (``managed``: a policy selects it) with these
    ``thresholds``, ETag, TTL and sync interval (seconds), and safety net."""
    pod = None
    if managed:
        pod = {
            "namespace": "ns",
            "name": "model-0",
            "uid": "u-1",
            "policy": {"namespace": "ns", "name": "pol", "generation": generation},
            "thresholds": thresholds or {},
        }
    return SyncAnswer.model_validate(
        {
            "etag": etag,
            "pod": pod,
            "safetyNet": safety_net or {"open": True},
            "ttlSeconds": ttl,
            "syncIntervalSeconds": interval,
        }
    )
