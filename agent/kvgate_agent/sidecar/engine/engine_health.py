"""Whether the model server answers its ``/health`` (vLLM, SGLang and TGI serve it), asked at
most once a second whoever asks (``/readyz``, the probes of a router)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import aiohttp

from kvgate_agent.sidecar.upstream import Flag as Flag  # re-exported
from kvgate_agent.sidecar.upstream import ModelServer

#: How long a ``/health`` answer is reused, seconds.
HEALTH_CACHE_SECONDS = 1.0


@dataclass(frozen=True, slots=True)
class _HealthCheck:
    at: float  # time.monotonic() of the check, seconds
    ok: bool


class EngineHealth:
    """The model server's ``/health`` through ``server``'s probe client; each answer sets
    ``upstream_ok`` (``kvgate_upstream_up``)."""

    def __init__(self, server: ModelServer, upstream_ok: Flag) -> None:
        self.server = server
        self.upstream_ok = upstream_ok
        self._health: _HealthCheck | None = None

    async def healthy(self) -> bool:
        """GET the model server's ``/health``, cached for :data:`HEALTH_CACHE_SECONDS` so
        probes cannot hammer it (1 s timeout). Any answer below 500 counts as up."""
        now = time.monotonic()
        if self._health is not None and now - self._health.at < HEALTH_CACHE_SECONDS:
            return self._health.ok
        try:
            async with self.server.probe().get(
                self.server.url + "/health", timeout=aiohttp.ClientTimeout(total=1.0)
            ) as resp:
                ok = resp.status < 500
        except (TimeoutError, aiohttp.ClientError):
            ok = False
        self._health = _HealthCheck(now, ok)
        self.upstream_ok.value = ok
        return ok
