"""The link to the node agent (cluster mode): the sync loop (``agent_link``), its state
(``sync_state``), what the agent's answer enforces (``agent_enforcement``, ``enforced``) and
how the sidecar reaches the agent (``settings``).

Other rooms import what they use from here (``__all__``); modules of this room import
each other directly.
"""

from __future__ import annotations

from kvgate_agent.sidecar.node_link.agent_enforcement import NO_LIMITS, AgentEnforcement
from kvgate_agent.sidecar.node_link.agent_link import (
    AgentLink,
    gpu_uuids_from_env,
    sidecar_metrics_url,
)
from kvgate_agent.sidecar.node_link.enforced import EnforcedPolicy
from kvgate_agent.sidecar.node_link.settings import AgentSettings
from kvgate_agent.sidecar.node_link.sync_state import Mode, SyncResult, SyncState

__all__ = [
    "NO_LIMITS",
    "AgentEnforcement",
    "AgentLink",
    "AgentSettings",
    "EnforcedPolicy",
    "Mode",
    "SyncResult",
    "SyncState",
    "gpu_uuids_from_env",
    "sidecar_metrics_url",
]
