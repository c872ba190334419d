"""The node link's own metrics, on the sidecar's one registry (issue 35: each room owns its
metrics): ``kvgate_agent_sync_total{result}`` (every result pre-set to 0), and at scrape time
``kvgate_thresholds_mode{mode}``, ``kvgate_thresholds_age_seconds``,
``kvgate_thresholds_ttl_seconds`` and ``kvgate_policy_generation{namespace, name}``."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvgate_agent.contract.nodeadmission import PolicyRef
from kvgate_agent.sidecar.node_link.sync_state import Mode, SyncResult, SyncState


class _SyncCollector(Collector):
    """The sync's state and the mode enforced, read at scrape time."""

    def __init__(
        self,
        state: SyncState,
        mode: Callable[[], Mode],
        policy: Callable[[], PolicyRef | None],
    ) -> None:
        self.state = state
        self.mode = mode
        self.policy = policy

    def collect(self) -> Iterator[GaugeMetricFamily]:
        now = self.mode()
        g = GaugeMetricFamily(
            "kvgate_thresholds_mode",
            "Where the enforced thresholds stand: 1 for the current mode",
            labels=["mode"],
        )
        for m in Mode:
            g.add_metric([m.value], 1.0 if m is now else 0.0)
        yield g
        age = self.state.age_seconds()
        if age is not None:
            yield GaugeMetricFamily(
                "kvgate_thresholds_age_seconds",
                "Seconds since the last successful sync with the node agent",
                value=age,
            )
        yield GaugeMetricFamily(
            "kvgate_thresholds_ttl_seconds",
            "How long thresholds stay enforced without a successful sync, seconds",
            value=self.state.ttl_seconds,
        )
        ref = self.policy()
        if ref is not None:
            g = GaugeMetricFamily(
                "kvgate_policy_generation",
                "Generation of the RateLimitPolicy the enforced thresholds come from",
                labels=["namespace", "name"],
            )
            g.add_metric([ref.namespace, ref.name], float(ref.generation))
            yield g


class SyncMetrics:
    """The sync with the node agent, exported on ``registry``: :attr:`agent_sync` counted by
    the node link, the rest read at scrape time from ``state``, ``mode()`` (the mode enforced,
    read, never changed, by the scrape) and ``policy()``."""

    def __init__(
        self,
        registry: CollectorRegistry,
        state: SyncState,
        mode: Callable[[], Mode],
        policy: Callable[[], PolicyRef | None],
    ) -> None:
        #: ``kvgate_agent_sync_total{result}``.
        self.agent_sync = Counter(
            "kvgate_agent_sync",
            "Syncs with the node agent by result",
            ["result"],
            registry=registry,
        )
        for r in SyncResult:
            self.agent_sync.labels(r.value)
        registry.register(_SyncCollector(state, mode, policy))
