"""The node agent's settings: :class:`NodeSettings`.

Each field's default is written here once, with its docstring under it. A field that is also a
``kvgate-agent node`` flag carries :func:`~kvgate_agent.args.flag` metadata, from which
:mod:`kvgate_agent.node.cli` derives the flag, its ``KVGATE_*`` variable and its default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvgate_agent.args import Flag, flag, hostport, hostport_text, positive
from kvgate_agent.contract.sync import MAX_WAIT_SECONDS

_SECONDS = positive(float)


def _seconds(help: str, name: str | None = None) -> Mapping[str, Flag]:
    """The metadata of a seconds flag: a finite number > 0, ``seconds`` in its help."""
    return flag(f"{help}, seconds", name=name, parse=_SECONDS)


@dataclass(slots=True)
class NodeSettings:
    """Settings of one node agent (seconds unless named otherwise)."""

    node_name: str = field(
        metadata=flag("this node's name (downward API spec.nodeName)", required=True)
    )
    """The node, and its NodeAdmission's name."""

    listen: tuple[str, int] = field(
        default=("0.0.0.0", 9470),
        metadata=flag(
            "HOST:PORT for the sidecars' sync API, /metrics, /healthz, /readyz",
            parse=hostport,
            text=hostport_text,
        ),
    )
    """Where the sync API, ``/metrics``, ``/healthz`` and ``/readyz`` are served."""

    gpu_backend: str = field(
        default="nvml", metadata=flag("'nvml', or 'fake:<scenario.json>' for tests")
    )
    """Where GPU figures come from (:func:`kvgate_agent.gpu.select.backend_from_spec`)."""

    kubeconfig: str | None = field(
        default=None,
        metadata=flag(
            "kubeconfig for running outside a pod (default: in-cluster, then $KUBECONFIG)",
            env="KUBECONFIG_FILE",
        ),
    )
    """A kubeconfig file (None: in-cluster, then ``$KUBECONFIG``)."""

    gpu_poll_seconds: float = field(default=2.0, metadata=_seconds("how often NVML is read"))
    """How often NVML is read."""

    gpu_call_timeout: float = field(
        default=2.0, metadata=_seconds("bound on each NVML read of one GPU")
    )
    """Bound on each NVML read of one GPU (a hung driver call is abandoned)."""

    scrape_seconds: float = field(
        default=5.0, metadata=_seconds("how often engine metrics are scraped")
    )
    """How often each engine's metrics are scraped."""

    status_min_interval: float = field(
        default=5.0, metadata=_seconds("NodeAdmission status writes at most this often")
    )
    """The NodeAdmission status is written at most this often..."""

    heartbeat_seconds: float = field(default=30.0, metadata=_seconds("...and at least this often"))
    """...and at least this often."""

    ttl_seconds: float = field(
        default=30.0,
        metadata=_seconds("how long sidecars enforce without a sync", name="--thresholds-ttl"),
    )
    """How long sidecars keep enforcing without a sync (sent to them)."""

    sync_interval_seconds: float = field(
        default=1.0, metadata=_seconds("how often sidecars sync", name="--sync-interval")
    )
    """How often sidecars sync (sent to them)."""

    max_wait_seconds: float = field(
        default=MAX_WAIT_SECONDS,
        metadata=_seconds(
            "longest hold of a sidecar's sync until its answer changes (long poll)",
            name="--max-sync-wait",
        ),
    )
    """Longest hold of a sync that asks for one (long poll); 0 = answer every sync at once."""

    token_cache_seconds: float = field(
        default=60.0, metadata=_seconds("how long an accepted token is trusted")
    )
    """How long an accepted token is trusted (TokenReview answers are cached)."""

    api_liveness_seconds: float = field(
        default=120.0,
        metadata=_seconds(
            "liveness (/healthz) fails once the API server has not answered for this long"
        ),
    )
    """Liveness fails once the API server has not answered for this long (see
    :meth:`~kvgate_agent.node.service.NodeAgent.live`)."""

    watch_server_timeout: float = field(
        default=20.0,
        metadata=_seconds("the API server ends each NodeAdmission watch after this; it is renewed"),
    )
    """The API server ends each NodeAdmission watch after this; it is renewed."""

    watch_read_timeout: float = field(
        default=30.0,
        metadata=_seconds("a watch silent this long (above the server timeout) is dead: reconnect"),
    )
    """A watch silent this long (above :attr:`watch_server_timeout`) is dead: reconnect."""

    proc_root: Path = field(
        default=Path("/proc"),
        metadata=flag("host /proc (with hostPID) to map NVML processes to pods", to_field=Path),
    )
    """Where host processes are visible (``/proc`` with ``hostPID``), to map NVML process ids
    to pods."""

    engine_max_age_seconds: float | None = None
    """An engine sample older than this is stale (invalid); None: 3 × :attr:`scrape_seconds`."""

    report_expiry_seconds: float = 10.0
    """A sidecar silent this long counts as disconnected."""
