"""Which policy a sidecar enforces now: its policy file's (standalone), or the node agent's
thresholds in the mode their age puts them (agent mode:
:mod:`kvgate_agent.sidecar.node_link.agent_enforcement`); and where they stand, as answers say
it (``x-kvgate-thresholds``: the mode, and with a store where shared limits stand).

Invariant: exactly one of the two sources is given, for the sidecar's lifetime.
"""

from __future__ import annotations

from collections.abc import Callable

from kvgate_agent.contract.policy import RateLimitPolicy, RateLimitPolicySpec
from kvgate_agent.sidecar.node_link.agent_enforcement import NO_LIMITS, AgentEnforcement
from kvgate_agent.sidecar.node_link.sync_state import Mode, SyncState


class EnforcedPolicy:
    """The policy a sidecar enforces now.

    Holds the standalone policy (None in agent mode) or the node agent's enforcement (None
    standalone).

    Raises ``ValueError`` unless exactly one of ``policy`` and ``enforcement`` is given.
    """

    def __init__(
        self, policy: RateLimitPolicy | None, enforcement: AgentEnforcement | None
    ) -> None:
        if (policy is None) == (enforcement is None):
            raise ValueError("give exactly one of a policy or the node agent's enforcement")
        self.standalone = policy
        self._standalone_spec = NO_LIMITS if policy is None else policy.spec
        #: Agent mode only: what the node agent's answers enforce (their sync state, the mode).
        self.enforcement = enforcement
        self._store_state: Callable[[], str] | None = None  # with a store: where it stands

    def attach_store(self, state: Callable[[], str]) -> None:
        """Shared limits are leased from a store: :meth:`header` says ``store=<state()>``
        (``state()``: ``shared``, ``local`` or ``closed``, read at each answer)."""
        self._store_state = state

    @property
    def headed(self) -> bool:
        """Whether answers to generation requests carry :meth:`header` (agent mode, or a
        store); fixed once the sidecar is built."""
        return self.enforcement is not None or self._store_state is not None

    def header(self) -> str | None:
        """``x-kvgate-thresholds``: the thresholds mode (agent mode) and, with a store, where
        shared limits stand (``store=shared|local|closed``), comma-separated; None when neither
        applies."""
        mode = self.mode
        parts = [] if mode is None else [mode.value]
        if self._store_state is not None:
            parts.append(f"store={self._store_state()}")
        return ", ".join(parts) or None

    def replace(self, policy: RateLimitPolicy) -> None:
        """Enforce ``policy`` from now on (standalone: a policy file re-read on SIGHUP).

        Raises:
            ValueError: in agent mode (the node agent's thresholds are enforced there).
        """
        if self.enforcement is not None:
            raise ValueError("the node agent's thresholds are enforced: no policy file")
        self.standalone = policy
        self._standalone_spec = policy.spec

    @property
    def spec(self) -> RateLimitPolicySpec:
        """The policy spec enforced now (the node agent's thresholds in agent mode)."""
        return self._standalone_spec if self.enforcement is None else self.enforcement.spec

    @property
    def sync_state(self) -> SyncState | None:
        """The sync's state when a node agent is used (None standalone)."""
        return None if self.enforcement is None else self.enforcement.state

    @property
    def mode(self) -> Mode | None:
        """The thresholds mode enforced now (None standalone, and in agent mode before the
        sidecar starts). Kept current by the enforcement itself: reading it changes nothing."""
        return None if self.enforcement is None else self.enforcement.mode

    def name(self) -> str:
        """``namespace/name`` of the governing policy (the store keys' hash tag)."""
        ref = None if self.enforcement is None else self.enforcement.policy_ref
        if ref is not None:
            return f"{ref.namespace}/{ref.name}"
        meta = None if self.standalone is None else self.standalone.metadata
        return "standalone" if meta is None else f"{meta.namespace or 'default'}/{meta.name}"

    def refresh_mode(self, *, force: bool = False) -> Mode | None:
        """Apply the mode the sync's state implies now (see
        :meth:`AgentEnforcement.refresh`; the enforcement does it by itself after each sync
        and at the end of the TTL once started, so this is for callers on an injected clock);
        None standalone."""
        return None if self.enforcement is None else self.enforcement.refresh(force=force)
