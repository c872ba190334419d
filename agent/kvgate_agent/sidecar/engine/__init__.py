"""Reading the engine: the probe of its capacity, load and health (``probe``, ``engine_load``,
``engine_health``, ``engine_reads``), its tokenizer (``engine_tokens``), what one request reads
of it (``probe``'s :class:`PromptReads`: the context per request, the prompt's count), what
routers read of the sidecar (``router_metrics``, ``router_signals``), and the room's own
metrics (``metrics``: :class:`EngineMetrics`, ``kvgate_engine_*``).

Other rooms import what they use from here (``__all__``); modules of this room import
each other directly.
"""

from __future__ import annotations

from kvgate_agent.sidecar.engine.engine_tokens import DEFAULT_TIMEOUT_SECONDS, EngineTokenizer
from kvgate_agent.sidecar.engine.metrics import EngineMetrics
from kvgate_agent.sidecar.engine.probe import EngineProbe, PromptReads
from kvgate_agent.sidecar.engine.router_metrics import RouterMetrics

__all__ = [
    "DEFAULT_TIMEOUT_SECONDS",
    "EngineMetrics",
    "EngineProbe",
    "EngineTokenizer",
    "PromptReads",
    "RouterMetrics",
]
