"""The operator's Prometheus metrics, in its own registry (never the process-global one), served
at ``/metrics`` on the liveness port next to ``/healthz``."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    disable_created_metrics,
    generate_latest,
)

disable_created_metrics()  # type: ignore[no-untyped-call]  # the _created series only add noise


class OperatorMetrics:
    """The operator's metrics; each instance has its own registry (tests make their own).

    - ``kvgate_webhook_injections_total{action,reason}`` (counter): each decision of the
      sidecar-injection webhook. ``action``: ``injected``, ``already_injected``, ``skipped``,
      ``refused``, or ``error`` (the webhook failed internally and let the pod through uninjected);
      ``reason`` as in :mod:`kvgate_operator.inject` (``internal_error`` for ``error``).
    - ``kvgate_webhook_namespace_lookup_failures_total`` (counter): namespace label lookups that
      failed (the pod was then treated as not opted in through its namespace).
    - ``kvgate_webhook_missed_injections_total`` (counter): pods that asked for the sidecar but were
      admitted without it (webhook down or unreachable), once per pod, when its
      ``InjectionMissed`` Event is posted.
    - ``kvgate_webhook_uninjected_pods`` (gauge): opted-in pods without the sidecar right now (as of
      the last reconcile pass).
    - ``kvgate_webhook_serving`` (gauge): 1 while the webhook's HTTPS server is listening.
    - ``kvgate_webhook_certificate_expiry_timestamp_seconds`` (gauge): when the serving certificate
      expires (Unix seconds).
    - ``kvgate_webhook_certificate_reloads_total`` (counter): serving certificates loaded into the
      running server without a restart.
    - ``kvgate_operator_leader`` (gauge): 1 while this replica leads (holds the leader Lease, or
      runs without an election) and so writes; 0 while it stands by.
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.injections = Counter(
            "kvgate_webhook_injections",
            "Sidecar-injection webhook decisions",
            ["action", "reason"],
            registry=r,
        )
        self.namespace_lookup_failures = Counter(
            "kvgate_webhook_namespace_lookup_failures",
            "Namespace label lookups by the webhook that failed (treated as not opted in)",
            registry=r,
        )
        self.missed_injections = Counter(
            "kvgate_webhook_missed_injections",
            "Pods that asked for the sidecar but were admitted without it (once per pod)",
            registry=r,
        )
        self.uninjected_pods = Gauge(
            "kvgate_webhook_uninjected_pods",
            "Opted-in pods without the sidecar, as of the last reconcile pass",
            registry=r,
        )
        self.serving = Gauge(
            "kvgate_webhook_serving",
            "1 while the webhook's HTTPS server is listening",
            registry=r,
        )
        self.cert_expiry = Gauge(
            "kvgate_webhook_certificate_expiry_timestamp_seconds",
            "When the webhook's serving certificate expires (Unix seconds)",
            registry=r,
        )
        self.cert_reloads = Counter(
            "kvgate_webhook_certificate_reloads",
            "Serving certificates loaded into the running webhook server",
            registry=r,
        )
        self.leader = Gauge(
            "kvgate_operator_leader",
            "1 while this replica holds the leader Lease (or runs without an election)",
            registry=r,
        )

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
