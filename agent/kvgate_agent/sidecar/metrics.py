"""The sidecar's Prometheus metrics, on a registry of its own (no global state).

Gauges that mirror admission state (in-flight, KV reserved, queue length, bucket levels) are read
from admission at scrape time by a custom collector, so the hot path never updates them and
they can never drift from the truth.

Each room owns its metrics on that one registry (issue 35): the upstream room's
(:class:`~kvgate_agent.sidecar.upstream.metrics.UpstreamMetrics`), the engine room's
(:class:`~kvgate_agent.sidecar.engine.metrics.EngineMetrics`), both composed here, and the node
link's (:class:`~kvgate_agent.sidecar.node_link.sync_metrics.SyncMetrics`, built by the node
link itself). What stays here is the request's: admission, its decisions and queue, the tokens
settled, the clients' side as the request path counts it, and the tenant label bound
(:class:`TenantLabels`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvgate_agent.admission import AdmissionStats, AsyncAdmission, TenantStats
from kvgate_agent.sidecar.engine import EngineMetrics
from kvgate_agent.sidecar.upstream import Flag, FlagGauge, UpstreamMetrics

disable_created_metrics()  # type: ignore[no-untyped-call]  # the _created series only add noise to every counter

#: Queue wait buckets, seconds: from sub-millisecond to the 1-hour maxWaitSeconds bound.
QUEUE_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 3600)


class TenantLabels:
    """Bounded tenant label values for metrics: the first ``limit`` tenants seen keep their own
    label, every later one is reported as ``other``, so clients sending endless tenant ids cannot
    blow up the metric series count."""

    OTHER = "other"

    def __init__(self, limit: int = 50) -> None:
        self.limit = limit
        self._known: set[str] = set()

    def __call__(self, tenant: str) -> str:
        """The label value for ``tenant``."""
        if tenant in self._known:
            return tenant
        if len(self._known) < self.limit:
            self._known.add(tenant)
            return tenant
        return self.OTHER


class _AdmissionCollector(Collector):
    def __init__(self, admission: AsyncAdmission, labels: TenantLabels) -> None:
        self.admission = admission
        self.labels = labels

    def collect(self) -> Iterator[GaugeMetricFamily]:
        c = self.admission.stats()
        yield GaugeMetricFamily(
            "kvgate_in_flight_requests", "Admitted requests not yet finished", value=c.in_flight
        )
        yield GaugeMetricFamily(
            "kvgate_queue_length", "Requests waiting for admission", value=c.queue_length
        )
        yield GaugeMetricFamily(
            "kvgate_kv_reserved_tokens",
            "KV cache reserved by admitted requests, tokens",
            value=c.kv_reserved_tokens,
        )
        cap = c.kv_capacity_tokens
        bpt = self.admission.config.bytes_per_token
        if cap is not None:
            yield GaugeMetricFamily(
                "kvgate_kv_capacity_tokens", "KV capacity admission enforces, tokens", value=cap
            )
        if bpt is not None:
            yield GaugeMetricFamily(
                "kvgate_kv_reserved_bytes",
                "KV cache reserved by admitted requests, bytes",
                value=c.kv_reserved_tokens * bpt,
            )
            if cap is not None:
                yield GaugeMetricFamily(
                    "kvgate_kv_capacity_bytes",
                    "KV capacity admission enforces, bytes",
                    value=cap * bpt,
                )
        yield from self._limits(c)
        level = GaugeMetricFamily(
            "kvgate_bucket_level",
            "Units left in a rate-limit bucket (tenant label bounded)",
            labels=["limit", "unit", "tenant"],
        )
        capacity = GaugeMetricFamily(
            "kvgate_bucket_capacity",
            "Effective capacity of a rate-limit bucket",
            labels=["limit", "unit", "tenant"],
        )
        ts = self.admission.tenant_stats()
        for name, unit, key, lvl, cp in ts.bucket_levels:
            tenant = "" if key == "" else self.labels(key)
            if tenant == TenantLabels.OTHER:
                continue
            level.add_metric([name, unit, tenant], lvl)
            capacity.add_metric([name, unit, tenant], cp)
        yield level
        yield capacity
        yield GaugeMetricFamily(
            "kvgate_tenants_tracked", "Tenant buckets held in memory", value=ts.tenants_tracked
        )
        yield from self._fair_shares(ts)
        yield GaugeMetricFamily(
            "kvgate_seconds_per_output_token",
            "Observed decode time per output token (moving average), seconds",
            value=c.seconds_per_token,
        )

    def _fair_shares(self, ts: TenantStats) -> Iterator[GaugeMetricFamily]:
        """Each tenant's fair-queue counter and attained service (tenant label bounded, as the
        buckets': tenants past the bound are not exported one by one)."""
        counter = GaugeMetricFamily(
            "kvgate_tenant_virtual_counter",
            "The fair queue's virtual counter of a tenant: weighted service received "
            "(charge units / class weight); the backlogged tenant with the smallest goes first",
            labels=["tenant"],
        )
        attained = GaugeMetricFamily(
            "kvgate_tenant_attained_service",
            "Service a tenant received, token-weighted (prompt x promptTokenWeight + output x "
            "outputTokenWeight of queue.fairness), settled to real usage",
            labels=["tenant"],
        )
        for tenant, c, served in ts.fair_shares:
            label = self.labels(tenant)
            if label == TenantLabels.OTHER:
                continue
            counter.add_metric([label], c)
            attained.add_metric([label], served)
        yield counter
        yield attained

    @staticmethod
    def _limits(c: AdmissionStats) -> Iterator[GaugeMetricFamily]:
        """The concurrency limit enforced now, the adaptive limit's input, the KV headroom."""
        cap = c.kv_capacity_tokens
        if c.concurrency_limit is not None:
            yield GaugeMetricFamily(
                "kvgate_concurrency_limit",
                "Concurrency cap enforced now (the lowest of the policy's, the engine's slots "
                "and the adaptive limit of slo.tpotSeconds), requests",
                value=c.concurrency_limit,
            )
        if c.inter_token_seconds is not None:
            yield GaugeMetricFamily(
                "kvgate_inter_token_seconds",
                "Smoothed time between streamed output tokens (the adaptive limit's input), s",
                value=c.inter_token_seconds,
            )
        if cap is not None:
            yield GaugeMetricFamily(
                "kvgate_kv_headroom_tokens",
                "KV kept free for the growth of predicted reservations in flight, tokens",
                value=c.kv_headroom_tokens,
            )


class SidecarMetrics:
    """All sidecar metrics, on one registry: the request path's own here, and the rooms' (their
    objects composed here, each registering its families on :attr:`registry`).

    Attributes:
        registry: the registry to expose.
        tenant_label: the bounded tenant label of a request's series (:class:`TenantLabels`).
        decisions: ``kvgate_admission_decisions_total{outcome, reason, tenant}``.
        queue_wait: ``kvgate_queue_wait_seconds`` histogram (requests that waited).
        upstream: the upstream room's
            (:class:`~kvgate_agent.sidecar.upstream.metrics.UpstreamMetrics`):
            ``kvgate_upstream_errors_total{kind}``, ``kvgate_upstream_resends_total`` and
            ``kvgate_upstream_up``.
        client_disconnects: ``kvgate_client_disconnects_total``.
        client_timeouts: ``kvgate_client_timeouts_total{phase}``: connections closed because the
            request headers (``phase="headers"``) or body (``"body"``) came too slowly.
        tokens: ``kvgate_tokens_total{kind, tenant}`` (prompt / completion tokens settled).
        prefix_cached_tokens: ``kvgate_prefix_cached_tokens_total{source}``: prompt tokens
            expected in the engine's prefix cache at admission (``source="expected"``: reserved
            and charged as not newly allocated) and reported cached by the engine when the
            request ended (``"reported"``), both 0 from the start.
        ttft: ``kvgate_time_to_first_token_seconds`` through the sidecar (streams only).
        decision_counts: decisions so far by outcome (for the node agent's sync report).
        policy_mismatch: the governing policy is not the annotated one
            (``kvgate_policy_mismatch``).
        engine: the engine room's (:class:`~kvgate_agent.sidecar.engine.metrics.EngineMetrics`):
            ``kvgate_engine_capacity_unknown`` and, with ``--tokenizer engine``,
            ``kvgate_engine_prompt_counts_total{source}``.

    The client metrics stay here: the upstream room counts the disconnects and the body
    timeouts, the top the header timeouts, the edge only calls back. So does
    ``kvgate_prefix_cached_tokens_total``: admission's expectation (counted by the pipeline)
    and the engine's report settled by the upstream room, as ``kvgate_tokens_total``; the engine
    room reads none of it. The node link's own metrics (the sync: ``kvgate_agent_sync_total``,
    ``kvgate_thresholds_*``, ``kvgate_policy_generation``) are
    :class:`~kvgate_agent.sidecar.node_link.sync_metrics.SyncMetrics`, on :attr:`registry`.
    The rooms' families are registered where the exposition has always had them: the upstream
    counters after the queue wait, ``kvgate_upstream_up`` after admission's gauges, the
    engine's last.
    """

    def __init__(self, admission: AsyncAdmission, tenant_label_limit: int = 50) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.tenant_label = TenantLabels(tenant_label_limit)
        self.policy_mismatch = Flag(False)  # set by the sidecar after each agent answer
        r = self.registry
        self.decisions = Counter(
            "kvgate_admission_decisions",
            "Admission decisions",
            ["outcome", "reason", "tenant"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "kvgate_queue_wait_seconds",
            "Time admitted or expired requests waited in the queue",
            buckets=QUEUE_WAIT_BUCKETS,
            registry=r,
        )
        self.upstream = UpstreamMetrics(r)
        self.client_disconnects = Counter(
            "kvgate_client_disconnects",
            "Admitted requests whose client went away before the response ended",
            registry=r,
        )
        self.client_timeouts = Counter(
            "kvgate_client_timeouts",
            "Requests cut because the client sent headers or body too slowly",
            ["phase"],
            registry=r,
        )
        self.tokens = Counter(
            "kvgate_tokens", "Tokens settled against buckets", ["kind", "tenant"], registry=r
        )
        self.prefix_cached_tokens = Counter(
            "kvgate_prefix_cached_tokens",
            "Prompt tokens in the engine's prefix cache: expected at admission (reserved and "
            "charged as not newly allocated) or reported by the engine when the request ended",
            ["source"],
            registry=r,
        )
        for source in ("expected", "reported"):
            self.prefix_cached_tokens.labels(source)
        self.ttft = Histogram(
            "kvgate_time_to_first_token_seconds",
            "Time from request arrival to the first streamed byte, seconds",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        r.register(_AdmissionCollector(admission, self.tenant_label))
        self.upstream.export_up()
        r.register(
            FlagGauge(
                "kvgate_policy_mismatch",
                "1 while the governing RateLimitPolicy is not the one the pod's kvgate.io/policy "
                "annotation names",
                self.policy_mismatch,
            )
        )
        self.engine = EngineMetrics(r)
        self.decision_counts: dict[str, int] = {}
        self._decision_children: dict[tuple[str, str, str], Any] = {}  # series by labels
        self._token_children: dict[tuple[str, str], Any] = {}

    def count_decision(self, outcome: str, reason: str, tenant_label: str) -> None:
        """Count one admission decision (the Prometheus counter and the per-outcome totals)."""
        key = (outcome, reason, tenant_label)
        child = self._decision_children.get(key)
        if child is None:  # labels() builds and checks a key each call: once per series here
            child = self._decision_children[key] = self.decisions.labels(*key)
        child.inc()
        self.decision_counts[outcome] = self.decision_counts.get(outcome, 0) + 1

    def count_tokens(self, kind: str, tenant_label: str, tokens: int) -> None:
        """Add ``tokens`` to ``kvgate_tokens_total{kind, tenant}`` (``kind``: prompt or
        completion)."""
        key = (kind, tenant_label)
        child = self._token_children.get(key)
        if child is None:
            child = self._token_children[key] = self.tokens.labels(*key)
        child.inc(tokens)
