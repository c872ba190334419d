"""The node agent's Prometheus metrics, on a registry of its own.

State gauges (GPU memory, per-pod KV, sidecars connected, data age) are read from the agent's
state at scrape time, so they can never drift from what the agent answers; counters and the sync
latency histogram are updated on their paths.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sized
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kvgate_agent.gpu.monitor import GpuSnapshot
    from kvgate_agent.node.auth import Authenticator
    from kvgate_agent.node.state import NodeState, PodKey

disable_created_metrics()  # type: ignore[no-untyped-call]  # the _created series only add noise

#: Sync handling time buckets, seconds (a cached answer takes well under a millisecond; a
#: TokenReview round trip tens of milliseconds).
SYNC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class HeldSyncs(Protocol):
    """What the metrics read of the sync handler (:class:`~kvgate_agent.node.sync.SyncHandler`)."""

    @property
    def waiters(self) -> Sized: ...


class EngineAges(Protocol):
    """What the metrics read of the engine scraper
    (:class:`~kvgate_agent.node.scrape.EngineScraper`)."""

    def ages(self, now: float) -> Mapping[PodKey, float | None]: ...


class AgentView(Protocol):
    """What the metrics read of the node agent at scrape time
    (:class:`~kvgate_agent.node.service.NodeAgent` is one; this module imports none of the
    modules that count on it)."""

    @property
    def state(self) -> NodeState: ...

    @property
    def auth(self) -> Authenticator: ...

    @property
    def syncs(self) -> HeldSyncs: ...

    @property
    def scraper(self) -> EngineAges: ...

    def ready(self) -> tuple[bool, str]: ...


class _StateCollector(Collector):
    def __init__(self, agent: AgentView, clock: Callable[[], float]) -> None:
        self.agent = agent
        self.clock = clock

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        a = self.agent
        st = a.state
        now = self.clock()
        snap = st.gpus  # one snapshot for the GPU gauges and their age
        yield from self._gpus(snap)
        yield from self._pods()
        yield GaugeMetricFamily(
            "kvgate_node_sidecars_connected",
            "Sidecars that synced within the report expiry",
            value=st.connected(now),
        )
        yield self._ages(now, snap)
        reviews = CounterMetricFamily(
            "kvgate_node_token_reviews",
            "TokenReviews sent to the API server (cache misses), by result",
            labels=["result"],
        )
        reviews.add_metric(["sent"], a.auth.reviews)
        reviews.add_metric(["failed"], a.auth.review_errors)
        reviews.add_metric(["stale_used"], a.auth.stale_uses)
        yield reviews
        implausible = GaugeMetricFamily(
            "kvgate_node_engine_capacity_implausible",
            "1 while a pod's engine reports a KV capacity the agent ignores (see reason)",
            labels=["namespace", "pod", "reason"],
        )
        for (ns, name), why in st.capacity.implausible.items():
            implausible.add_metric([ns, name, why], 1)
        yield implausible
        yield GaugeMetricFamily(
            "kvgate_node_syncs_held",
            "Sidecar syncs held open now (long polls waiting for a change)",
            value=len(a.syncs.waiters),
        )
        yield GaugeMetricFamily(
            "kvgate_node_ready",
            "1 when the agent is ready (see /readyz)",
            value=1 if a.ready()[0] else 0,
        )

    def _gpus(self, snap: GpuSnapshot | None) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """GPU memory (bytes), health, utilization (percent), NVML errors and the process
        entries dropped as implausible (:class:`~kvgate_agent.gpu.monitor.GpuMonitor`)."""
        mem = GaugeMetricFamily(
            "kvgate_node_gpu_memory_bytes",
            "GPU (or MIG slice) memory as NVML reports it, bytes; absent when unreadable",
            labels=["gpu", "kind"],
        )
        healthy = GaugeMetricFamily(
            "kvgate_node_gpu_healthy",
            "1 when NVML reads the GPU, 0 when not",
            labels=["gpu", "reason"],
        )
        util = GaugeMetricFamily(
            "kvgate_node_gpu_utilization_percent",
            "GPU utilization, percent; absent where NVML does not support it (MIG)",
            labels=["gpu"],
        )
        errors = CounterMetricFamily(
            "kvgate_node_nvml_errors", "NVML call failures since start, by kind", labels=["kind"]
        )
        dropped = CounterMetricFamily(
            "kvgate_node_gpu_process_entries_dropped",
            "GPU process entries dropped as implausible since start (pid outside 1..pid_max-1, "
            "used memory negative or above the device total), by GPU and reason",
            labels=["gpu", "reason"],
        )
        if snap is not None:
            for g in snap.gpus:
                for kind, v in (
                    ("total", g.total_bytes),
                    ("used", g.used_bytes),
                    ("free", g.free_bytes),
                    ("reserved", g.reserved_bytes),
                ):
                    if v is not None:
                        mem.add_metric([g.uuid, kind], v)
                healthy.add_metric([g.uuid, g.reason or ""], 1 if g.healthy else 0)
                if g.utilization is not None:
                    util.add_metric([g.uuid], g.utilization)
            for kind, n in snap.errors_by_kind.items():
                errors.add_metric([kind], n)
            for (uuid, reason), n in snap.dropped_processes.items():
                dropped.add_metric([uuid, reason], n)
        yield mem
        yield healthy
        yield util
        yield errors
        yield dropped

    def _pods(self) -> Iterator[GaugeMetricFamily]:
        """Per pod KV (tokens and bytes) and whether its safety net is open."""
        st = self.agent.state
        kv_tokens = GaugeMetricFamily(
            "kvgate_node_pod_kv_tokens",
            "Per pod KV cache: reserved (sidecar), used (engine), capacity (best source), tokens",
            labels=["namespace", "pod", "kind"],
        )
        kv_bytes = GaugeMetricFamily(
            "kvgate_node_pod_kv_bytes",
            "Per pod KV cache as above, bytes (tokens × bytesPerToken of the model)",
            labels=["namespace", "pod", "kind"],
        )
        safety = GaugeMetricFamily(
            "kvgate_node_safety_net_open",
            "1 while the pod may admit, 0 while GPU free memory is below its safety margin",
            labels=["namespace", "pod"],
        )
        status = st.status()
        for p in status.pods:
            key = (p.namespace, p.name)
            bpt = st.bytes_per_token(key)
            cap = st.kv_capacity(key)
            for kind, v in (
                ("reserved", p.kv_reserved_tokens),
                ("used", p.kv_used_tokens),
                ("capacity", cap),
            ):
                if v is None:
                    continue
                kv_tokens.add_metric([p.namespace, p.name, kind], v)
                if bpt is not None:
                    kv_bytes.add_metric([p.namespace, p.name, kind], v * bpt)
            safety.add_metric([p.namespace, p.name], 1 if p.safety_net_open else 0)
        yield kv_tokens
        yield kv_bytes
        yield safety

    def _ages(self, now: float, snap: GpuSnapshot | None) -> GaugeMetricFamily:
        """Age of each input the agent answers from, seconds."""
        a = self.agent
        st = a.state
        age = GaugeMetricFamily(
            "kvgate_node_data_age_seconds",
            "Age of each input: gpu (last NVML poll), nodeadmission (last spec read), "
            "engine (last good scrape, per pod), sync (last report, per pod)",
            labels=["source", "namespace", "pod"],
        )
        if snap is not None:
            age.add_metric(["gpu", "", ""], max(0.0, now - snap.taken_at))
        if st.spec_read_at is not None:
            age.add_metric(["nodeadmission", "", ""], max(0.0, now - st.spec_read_at))
        for (ns, name), (_, at) in st.reports().items():
            held = st.is_held((ns, name))  # a held sync is a sidecar heard from now
            age.add_metric(["sync", ns, name], 0.0 if held else max(0.0, now - at))
        for (ns, name), engine_age in a.scraper.ages(now).items():
            if engine_age is not None:
                age.add_metric(["engine", ns, name], engine_age)
        return age


class NodeMetrics:
    """Metrics of one node agent.

    Attributes:
        syncs: sync requests by result (``ok``, ``not_modified``, ``unauthorized``,
            ``forbidden``, ``invalid``, ``unavailable``).
        sync_seconds: time to handle a sync, seconds (a held sync's wait not included).
        sync_waits: held syncs by outcome (``changed``, ``timeout``, ``superseded``,
            ``disconnected``, ``released``).
        status_writes: NodeAdmission status writes by result (``ok``, ``absent``, ``error``).
        scrapes: engine metric scrapes by result (``ok``, ``error``, ``invalid``).
    """

    def __init__(self, agent: AgentView, clock: Callable[[], float]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.syncs = Counter(
            "kvgate_node_sync_requests", "Sidecar syncs by result", ["result"], registry=r
        )
        self.sync_seconds = Histogram(
            "kvgate_node_sync_duration_seconds",
            "Time to answer a sidecar sync, seconds",
            buckets=SYNC_BUCKETS,
            registry=r,
        )
        self.status_writes = Counter(
            "kvgate_node_status_writes",
            "NodeAdmission status writes by result",
            ["result"],
            registry=r,
        )
        self.scrapes = Counter(
            "kvgate_node_engine_scrapes", "Engine metric scrapes by result", ["result"], registry=r
        )
        self.sync_waits = Counter(
            "kvgate_node_sync_waits",
            "Held syncs (long polls) by how they ended",
            ["outcome"],
            registry=r,
        )
        r.register(_StateCollector(agent, clock))
