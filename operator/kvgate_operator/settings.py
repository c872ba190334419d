"""Operator settings, from environment variables ``KVGATE_OPERATOR_*`` (pydantic-settings)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvgate_operator.cert_issue import (
    CA_LIFETIME,
    CA_RENEW_BEFORE,
    SERVING_LIFETIME,
    SERVING_RENEW_BEFORE,
    Lifetimes,
)
from kvgate_operator.template import InjectionConfig


class OperatorSettings(BaseSettings):
    """All operator settings; each field reads ``KVGATE_OPERATOR_<FIELD>`` and has its docstring
    under it."""

    model_config = SettingsConfigDict(env_prefix="KVGATE_OPERATOR_")

    namespace: str | None = None
    """Watch only this namespace's policies and pods (None: the whole cluster)."""
    debounce_seconds: float = Field(0.2, ge=0, le=60)
    """Wait after a watch event before a pass, so a burst is one pass."""
    resync_seconds: float = Field(300.0, gt=0)
    """A pass runs at least this often even without events."""
    liveness_stale_seconds: float = Field(900.0, gt=0)
    """The liveness probe fails when no pass succeeded for this long. Three resyncs: a pass runs at
    least every ``resync_seconds`` and every API call is bounded (below), so a pass cannot hang; the
    operator rides out an API server outage by itself and passes again within a minute of the
    network healing. Failing sooner would restart it during an outage, where a restart helps nothing
    and the kubelet's restart back-off would then delay its recovery; after three failed resyncs, a
    restart (fresh connections and credentials) is the remedy left."""
    watch_server_timeout: int = Field(20, gt=0)
    """Seconds the API server keeps one watch open before the operator re-establishes it from the
    last resourceVersion, without a re-list (kopf ``watching.server_timeout``); short, so a healthy
    watch is never silent for long."""
    watch_client_timeout: int = Field(30, gt=0)
    """Seconds one watch request may last in all before the client treats it as hung and reconnects
    (kopf ``watching.client_timeout``); above the server timeout. This is what notices a watch on a
    silently dead connection (held open, no bytes): within 30 s by default."""
    connect_timeout: int = Field(10, gt=0)
    """Seconds to connect (TCP and TLS handshake) to the API server."""
    request_timeout: float = Field(30.0, gt=0)
    """Seconds any other API call may take: kopf's whole request (``networking.request_timeout``)
    and each silence between bytes of the reconcile pass's calls (the kubernetes client's read
    timeout)."""
    liveness_port: int = Field(8080, ge=0, le=65535)
    """Port of the liveness endpoint (``/healthz``) and of ``/metrics``."""
    standalone: bool = True
    """Run without kopf peering (kopf's own multi-replica scheme; off: replicas are coordinated by
    ``leader_election`` instead, see README "High availability")."""
    leader_election: bool = True
    """Of several replicas only the holder of the Lease ``leader_election_lease_name`` in
    ``pod_namespace`` writes (:mod:`kvgate_operator.leader`); needs ``pod_namespace`` (without it, a
    local run, there is no election and this process always writes)."""
    leader_election_lease_name: str = Field("kvgate-operator", min_length=1)
    """The Lease's name."""
    leader_election_lease_duration: float = Field(15.0, gt=0)
    """Seconds a follower waits, after the Lease last changed, before taking it over (client-go's
    default 15)."""
    leader_election_renew_deadline: float = Field(10.0, gt=0)
    """Seconds after its last successful renewal the leader stops writing (client-go's default 10);
    below the lease duration."""
    leader_election_retry_period: float = Field(2.0, gt=0)
    """Seconds between two attempts to take or renew the Lease (client-go's default 2); below the
    renew deadline."""
    pod_name: str | None = None
    """This replica's pod name (downward API): its identity in the Lease and in its User-Agent
    (unset: the host name and a random suffix)."""

    pod_namespace: str | None = None
    """The namespace the operator runs in (downward API). The webhook's certificate Secret lives
    there, and it is never injected."""
    webhook_enabled: bool = True
    """Serve the sidecar-injection webhook (``/inject-sidecar``). False: no webhook server, no
    certificates, no missed-injection check."""
    webhook_addr: str = "0.0.0.0"
    """The address the webhook's HTTPS server listens on."""
    webhook_port: int = Field(9443, ge=1, le=65535)
    """The webhook's HTTPS port (the chart's Service maps 443 to it)."""
    webhook_host: str | None = "localhost,127.0.0.1"
    """The host name(s) the API server calls the webhook by, comma-separated: the SANs of the self-
    signed serving certificate (e.g. ``kvgate-webhook.kvgate-system.svc``; ``127.0.0.1`` for a local
    run). Empty (or None): ``localhost,127.0.0.1`` too."""
    webhook_config_name: str | None = None
    """The MutatingWebhookConfiguration whose ``caBundle`` the operator keeps equal to its self-
    signed CA (None: it patches nothing)."""
    webhook_cert_dir: Path | None = None
    """A directory with ``tls.crt`` and ``tls.key`` provided from outside (cert-manager); the
    operator then neither makes certificates nor patches the ``caBundle`` (cert-manager's cainjector
    does), and reloads the files when they change. Takes precedence over ``webhook_self_signed``."""
    webhook_self_signed: bool = True
    """Without ``webhook_cert_dir``, make a CA and a serving certificate and keep them in the Secret
    ``webhook_secret_name``. False without a ``webhook_cert_dir`` is a configuration error."""
    webhook_secret_name: str = Field("kvgate-webhook-tls", min_length=1)
    """The Secret (in ``pod_namespace``) with the self-signed CA and serving certificate."""
    webhook_cert_sync_seconds: float = Field(60.0, gt=0)
    """How often the operator checks its certificate for renewal, re-syncs the ``caBundle`` (a Helm
    upgrade may have reset it) and, with ``webhook_cert_dir``, re-reads the files.
    webhook_ca_lifetime_seconds, webhook_ca_renew_before_seconds, webhook_serving_lifetime_seconds,
    webhook_serving_renew_before_seconds: the self-signed CA's and serving certificate's lifetimes
    and how long before their end they are renewed (default 365/90 and 90/30 days; see
    :class:`~kvgate_operator.cert_issue.Lifetimes` for the constraints)."""
    webhook_ca_lifetime_seconds: float = Field(CA_LIFETIME.total_seconds(), gt=0)
    webhook_ca_renew_before_seconds: float = Field(CA_RENEW_BEFORE.total_seconds(), gt=0)
    webhook_serving_lifetime_seconds: float = Field(SERVING_LIFETIME.total_seconds(), gt=0)
    webhook_serving_renew_before_seconds: float = Field(SERVING_RENEW_BEFORE.total_seconds(), gt=0)
    webhook_namespace_cache_seconds: float = Field(5.0, ge=0)
    """How long the webhook trusts a namespace's labels before looking them up again."""
    webhook_namespace_lookup_timeout: float = Field(1.5, gt=0)
    """Seconds a namespace lookup may take; past it the pod is treated as not opted in through its
    namespace (the request must answer well within the webhook's ``timeoutSeconds``)."""
    injection: InjectionConfig = Field(default_factory=InjectionConfig)
    """How the sidecar is injected, JSON with camelCase keys (the chart renders it;
    :class:`~kvgate_operator.template.InjectionConfig`). ``ownNamespace`` defaults to
    ``pod_namespace``."""

    @model_validator(mode="after")
    def _watch(self) -> OperatorSettings:
        if self.watch_client_timeout <= self.watch_server_timeout:
            raise ValueError(
                f"KVGATE_OPERATOR_WATCH_CLIENT_TIMEOUT ({self.watch_client_timeout}) must exceed "
                f"KVGATE_OPERATOR_WATCH_SERVER_TIMEOUT ({self.watch_server_timeout})"
            )
        return self

    @model_validator(mode="after")
    def _election(self) -> OperatorSettings:
        if not (
            self.leader_election_retry_period
            < self.leader_election_renew_deadline
            < self.leader_election_lease_duration
        ):
            raise ValueError(
                "leader election needs retry_period < renew_deadline < lease_duration (got "
                f"{self.leader_election_retry_period}, {self.leader_election_renew_deadline}, "
                f"{self.leader_election_lease_duration})"
            )
        return self

    @property
    def elects(self) -> bool:
        """Whether this replica takes part in leader election (enabled and a namespace known)."""
        return self.leader_election and bool(self.pod_namespace)

    @model_validator(mode="after")
    def _webhook(self) -> OperatorSettings:
        if self.injection.own_namespace is None and self.pod_namespace:
            self.injection = self.injection.model_copy(update={"own_namespace": self.pod_namespace})
        if self.webhook_enabled and self.webhook_cert_dir is None and not self.webhook_self_signed:
            raise ValueError(
                "the webhook needs certificates: set KVGATE_OPERATOR_WEBHOOK_CERT_DIR "
                "(cert-manager) or KVGATE_OPERATOR_WEBHOOK_SELF_SIGNED=true, or disable it with "
                "KVGATE_OPERATOR_WEBHOOK_ENABLED=false"
            )
        self.webhook_lifetimes  # noqa: B018  # raises ValueError when inconsistent
        return self

    @property
    def webhook_lifetimes(self) -> Lifetimes:
        """The self-signed certificates' lifetimes (:class:`~kvgate_operator.cert_issue.Lifetimes`).

        Raises:
            ValueError: inconsistent lifetimes and renewal margins.
        """
        return Lifetimes(
            ca=dt.timedelta(seconds=self.webhook_ca_lifetime_seconds),
            ca_renew_before=dt.timedelta(seconds=self.webhook_ca_renew_before_seconds),
            serving=dt.timedelta(seconds=self.webhook_serving_lifetime_seconds),
            serving_renew_before=dt.timedelta(seconds=self.webhook_serving_renew_before_seconds),
        )

    @property
    def webhook_hosts(self) -> list[str]:
        """The serving certificate's host names and IP addresses."""
        if not self.webhook_host:
            return ["localhost", "127.0.0.1"]
        return [h.strip() for h in self.webhook_host.split(",") if h.strip()]
