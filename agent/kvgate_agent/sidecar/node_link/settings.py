"""How the sidecar reaches its node agent and who it is (cluster mode): :class:`AgentSettings`,
part of :class:`~kvgate_agent.sidecar.settings.SidecarSettings`. Each field's default is written
here once, with its docstring under it; a field that is also a flag carries
:func:`~kvgate_agent.args.flag` metadata.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvgate_agent.args import flag, non_negative_seconds, positive, url
from kvgate_agent.contract.policy import FailureMode
from kvgate_agent.contract.sync import DEFAULT_SYNC_INTERVAL_SECONDS, MAX_WAIT_SECONDS

__all__ = ["DEFAULT_SYNC_TIMEOUT_SECONDS", "AgentSettings"]

#: Bound on one sync call, seconds (connect + answer).
DEFAULT_SYNC_TIMEOUT_SECONDS = 2.0


@dataclass(frozen=True, slots=True)
class AgentSettings:
    """How the sidecar reaches its node agent and who it is (cluster mode)."""

    url: str = field(
        metadata=flag(
            "node agent base URL, e.g. http://$(HOST_IP):9470: thresholds come from it "
            "(cluster mode; give this or --policy)",
            name="--agent-url",
            parse=url,
        )
    )
    """The agent's base URL, e.g. ``http://10.0.0.5:9470`` (``/v1/sync`` is appended)."""

    pod_namespace: str = field(
        metadata=flag("this pod's namespace (downward API); required with --agent-url")
    )
    """The pod's namespace (downward API); required."""

    pod_name: str = field(
        metadata=flag("this pod's name (downward API); required with --agent-url")
    )
    """The pod's name (downward API); required."""

    token_file: str = field(
        default="/var/run/secrets/kvgate/token",
        metadata=flag(
            "projected service-account token (audience kvgate-agent) sent to the node agent, "
            "re-read before every sync"
        ),
    )
    """The projected service-account token (audience ``kvgate-agent``), read before every
    call; the default is where the operator's webhook mounts it."""

    pod_uid: str | None = field(
        default=None,
        metadata=flag("this pod's uid (downward API), checked by the node agent"),
    )
    """The pod's uid (downward API), checked against the token by the agent."""

    pod_ip: str | None = field(
        default=None,
        metadata=flag(
            "this pod's IP (downward API): the node agent scrapes the engine's metrics "
            "through http://POD_IP:PORT/metrics"
        ),
    )
    """The pod's IP (downward API), from which :attr:`metrics_url` is made."""

    failure_mode: FailureMode = field(
        default=FailureMode.FAIL_OPEN,
        metadata=flag(
            "with --agent-url: what applies until the node agent's first answer (FailOpen: no "
            "limits; FailClosed: 503), and past the TTL when no policy selects the pod",
            choices=[m.value for m in FailureMode],
            to_field=FailureMode,
        ),
    )
    """What applies before the first answer (and past the TTL when the last answer carried no
    policy)."""

    expected_policy: str | None = field(
        default=None,
        metadata=flag(
            "with --agent-url: the RateLimitPolicy this pod should be governed by (the "
            "webhook sets it from the kvgate.io/policy annotation); a different or no policy "
            "is logged and shown in kvgate_policy_mismatch"
        ),
    )
    """The RateLimitPolicy name the pod should be governed by (annotation
    ``kvgate.io/policy``); informational: a mismatch is logged and exported."""

    ttl_override: float | None = field(
        default=None,
        metadata=flag(
            "with --agent-url: seconds the last thresholds stay enforced while the node "
            "agent is unreachable, then the policy's failureMode applies (default: the agent's "
            "ttlSeconds, 30 before its first answer)",
            name="--thresholds-ttl",
            parse=positive(float),
        ),
    )
    """Seconds the last thresholds stay enforced without a successful sync; None = the
    answer's ``ttlSeconds`` (30 before any answer)."""

    sync_wait: float = field(
        default=MAX_WAIT_SECONDS,
        metadata=flag(
            "with --agent-url: seconds the node agent may hold a sync until the thresholds "
            "change (long poll; capped below the TTL); 0 = poll every sync interval",
            parse=non_negative_seconds,
        ),
    )
    """Seconds the agent may hold a sync until the answer changes (long poll, ``Prefer:
    wait``); capped so a held call ends well within the TTL (see
    :meth:`~kvgate_agent.sidecar.node_link.sync_state.SyncState.wait_seconds`); 0 = plain polling
    every sync interval."""

    metrics_url: str | None = None
    """Reported so the agent can scrape the engine through the sidecar; None = do not scrape
    (see :func:`~kvgate_agent.sidecar.node_link.agent_link.sidecar_metrics_url`)."""

    gpu_uuids: tuple[str, ...] = ()
    """The pod's GPUs when known (see
    :func:`~kvgate_agent.sidecar.node_link.agent_link.gpu_uuids_from_env`,
    ``KVGATE_GPU_UUIDS``)."""

    sync_timeout: float = DEFAULT_SYNC_TIMEOUT_SECONDS
    """Bound on one sync call, seconds."""

    sync_interval: float = DEFAULT_SYNC_INTERVAL_SECONDS
    """Seconds between syncs until an answer gives its own."""
