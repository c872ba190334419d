"""The model server's side: the upstream connection pool (``upstream``, ``upstream_conn``), the
model server's address and probe client (``model_server``), forwarding an admitted request and
relaying its answer (``forward``, ``relay``), the fallback pool and the engine-stall watch;
the room's own metrics (``metrics``: :class:`UpstreamMetrics`, ``kvgate_upstream_*``, and the
0/1 :class:`FlagGauge` other rooms export their flags with); the room's own errors (``errors``:
``UpstreamError`` and its kinds, subclassing no HTTP library's, and ``UPSTREAM_FAILURES``, what
a trip on either client may fail with).

Other rooms import what they use from here (``__all__``); modules of this room import
each other directly.
"""

from __future__ import annotations

from kvgate_agent.sidecar.upstream.engine_stall import EngineStall
from kvgate_agent.sidecar.upstream.errors import (
    UPSTREAM_FAILURES,
    MalformedStream,
    UpstreamBroken,
    UpstreamConnectError,
    UpstreamError,
)
from kvgate_agent.sidecar.upstream.fallback_pool import already_degraded, degrade_to_pool
from kvgate_agent.sidecar.upstream.forward import Forwarder
from kvgate_agent.sidecar.upstream.metrics import UPSTREAM_ERROR_KINDS, FlagGauge, UpstreamMetrics
from kvgate_agent.sidecar.upstream.model_server import Flag, ModelServer, base_url_problem

__all__ = [
    "UPSTREAM_ERROR_KINDS",
    "UPSTREAM_FAILURES",
    "EngineStall",
    "Flag",
    "FlagGauge",
    "Forwarder",
    "MalformedStream",
    "ModelServer",
    "UpstreamBroken",
    "UpstreamConnectError",
    "UpstreamError",
    "UpstreamMetrics",
    "already_degraded",
    "base_url_problem",
    "degrade_to_pool",
]
