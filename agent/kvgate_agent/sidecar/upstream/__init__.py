"""The model server's side: the upstream connection pool (``upstream``, ``upstream_conn``), the
model server's address and probe client (``model_server``), forwarding an admitted request and
relaying its answer (``forward``, ``relay``), the fallback pool and the engine-stall watch.

Other rooms import what they use from here (``__all__``); modules of this room import
each other directly.
"""

from __future__ import annotations

from kvgate_agent.sidecar.upstream.engine_stall import EngineStall
from kvgate_agent.sidecar.upstream.fallback_pool import already_degraded, degrade_to_pool
from kvgate_agent.sidecar.upstream.forward import Forwarder
from kvgate_agent.sidecar.upstream.model_server import Flag, ModelServer, base_url_problem

__all__ = [
    "EngineStall",
    "Flag",
    "Forwarder",
    "ModelServer",
    "already_degraded",
    "base_url_problem",
    "degrade_to_pool",
]
