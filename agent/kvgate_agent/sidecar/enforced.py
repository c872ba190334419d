"""Which policy a sidecar enforces now: its policy file's (standalone), or the node agent's
thresholds in the mode their age puts them (agent mode: :mod:`kvgate_agent.sidecar.thresholds`).

Invariant: exactly one of the two sources is given, for the sidecar's lifetime.
"""

from __future__ import annotations

from kvgate_agent.contract.policy import RateLimitPolicy, RateLimitPolicySpec
from kvgate_agent.sidecar.agent_link import Mode, ThresholdsLink
from kvgate_agent.sidecar.thresholds import NO_LIMITS, AgentThresholds


class EnforcedPolicy:
    """The policy a sidecar enforces now.

    Holds the standalone policy (None in agent mode) or the node agent's thresholds (None
    standalone).

    Raises ``ValueError`` unless exactly one of ``policy`` and ``thresholds`` is given.
    """

    def __init__(self, policy: RateLimitPolicy | None, thresholds: AgentThresholds | None) -> None:
        if (policy is None) == (thresholds is None):
            raise ValueError("give exactly one of a policy or the node agent's thresholds")
        self.standalone = policy
        self._standalone_spec = NO_LIMITS if policy is None else policy.spec
        #: Agent mode only: the node agent's thresholds (their link, their mode).
        self.thresholds = thresholds

    @property
    def spec(self) -> RateLimitPolicySpec:
        """The policy spec enforced now (the node agent's thresholds in agent mode)."""
        return self._standalone_spec if self.thresholds is None else self.thresholds.spec

    @property
    def link(self) -> ThresholdsLink | None:
        """The thresholds' state when a node agent is used (None standalone)."""
        return None if self.thresholds is None else self.thresholds.link

    @property
    def mode(self) -> Mode | None:
        """The thresholds mode last enforced (None standalone)."""
        return None if self.thresholds is None else self.thresholds.mode

    def name(self) -> str:
        """``namespace/name`` of the governing policy (the store keys' hash tag)."""
        ref = None if self.thresholds is None else self.thresholds.policy_ref
        if ref is not None:
            return f"{ref.namespace}/{ref.name}"
        meta = None if self.standalone is None else self.standalone.metadata
        return "standalone" if meta is None else f"{meta.namespace or 'default'}/{meta.name}"

    def refresh_mode(self, *, force: bool = False) -> Mode | None:
        """Enforce the thresholds mode now (see :meth:`AgentThresholds.refresh`); None
        standalone."""
        return None if self.thresholds is None else self.thresholds.refresh(force=force)

    def current_mode(self) -> Mode:
        """The thresholds mode now (enforcing it if time moved it on). Agent mode only."""
        mode = self.refresh_mode()
        assert mode is not None, "no node agent configured"
        return mode
