"""The running operator as one object: settings, metrics, the reconcile loop, the liveness
server and (when enabled) the sidecar-injection webhook with its certificates.

Invariant: nothing is built at import. :mod:`kvgate_operator.handlers` makes one
:class:`Operator` at kopf startup and keeps it in kopf's memo; the handlers only delegate to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import shutil
import socket
import tempfile
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp.web
import kopf
from cryptography import x509
from kubernetes import client

from kvgate_operator.cert_objects import KubeCertObjects
from kvgate_operator.certs import CertificateManager
from kvgate_operator.kubeclient import default_api_client
from kvgate_operator.leader import LeaderElector
from kvgate_operator.metrics import OperatorMetrics
from kvgate_operator.reconciler import Reconciler
from kvgate_operator.settings import OperatorSettings
from kvgate_operator.triggers import Kind, Seen
from kvgate_operator.webhook import (
    InjectionWebhook,
    NamespaceLabels,
    ReloadingWebhookServer,
    kube_namespace_lookup,
)

log = logging.getLogger("kvgate.operator")

#: kopf's pauses between retries of a failed API call, seconds (its default goes up to 21 s,
#: which alone would use a third of the minute the operator has to recover after an outage);
#: a watch whose retries are spent is simply restarted.
KOPF_ERROR_BACKOFFS = (1.0, 2.0, 4.0, 8.0)
#: Objects per page of kopf's initial LISTs (as the reconcile pass's own LISTs).
KOPF_LIST_CHUNK = 500


def replica_identity(settings: OperatorSettings) -> str:
    """This replica's identity in the leader Lease and its User-Agent: the pod name, unique in
    the cluster and kept across container restarts (a leader's crashed container, restarted in
    the same pod, takes its Lease back at once: the kubelet restarts a container only once the
    old one is dead); without one (a local run), the host name and a random suffix."""
    if settings.pod_name:
        return settings.pod_name
    return f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"


def _not_started(namespace: str) -> dict[str, str]:
    raise RuntimeError("the operator has not started yet")


class Operator:
    """The operator's state and lifecycle: :meth:`start` at kopf startup, :meth:`stop` at
    cleanup, :meth:`on_event` for every watch event.

    Args:
        settings: the operator settings.
        api_client: makes a kubernetes ``ApiClient`` (called at :meth:`start`); default:
            :func:`~kvgate_operator.kubeclient.default_api_client` with the settings' timeouts.
    """

    def __init__(
        self,
        settings: OperatorSettings,
        api_client: Callable[[], client.ApiClient] | None = None,
    ) -> None:
        self.settings = settings
        self.identity = replica_identity(settings)
        self._make_api_client = api_client or (
            lambda: default_api_client(settings.connect_timeout, settings.request_timeout)
        )
        self.metrics = OperatorMetrics()
        self.seen = Seen()
        self.webhook = InjectionWebhook(
            settings.injection,
            NamespaceLabels(
                _not_started,
                ttl=settings.webhook_namespace_cache_seconds,
                timeout=settings.webhook_namespace_lookup_timeout,
            ),
            self.metrics,
        )
        self.reconciler: Reconciler | None = None
        self.webhook_server: ReloadingWebhookServer | None = None
        #: When the serving certificate expires (None until one is loaded).
        self.cert_not_after: dt.datetime | None = None
        self._task: asyncio.Task[None] | None = None
        self._liveness: aiohttp.web.AppRunner | None = None
        #: The self-signed certificates' rotation loop and the directory of their files.
        self._cert_task: asyncio.Task[None] | None = None
        self._cert_dir: Path | None = None
        #: The leader election (None without one: this replica always writes).
        self.elector: LeaderElector | None = None
        self._elector_task: asyncio.Task[None] | None = None
        #: Set by :meth:`stop`: from then on nothing is written (an in-flight pass stops at
        #: its next write).
        self._stopping = False

    def api_client(self) -> client.ApiClient:
        """A kubernetes client whose User-Agent names this replica (audit logs tell replicas
        apart by it)."""
        api = self._make_api_client()
        api.user_agent = f"kvgate-operator ({self.identity})"
        return api

    def may_write(self) -> bool:
        """Whether this replica may write now: it is not stopping, and it leads or there is no
        election."""
        return not self._stopping and (self.elector is None or self.elector.is_leader())

    def _leadership_changed(self, leading: bool) -> None:
        self.metrics.leader.set(1 if leading else 0)
        if leading and self.reconciler is not None:
            self.reconciler.started_leading()
            self.reconciler.trigger()  # from scratch: nothing seen while following is missed

    # ------------------------------------------------------------------ lifecycle

    async def start(
        self, kopf_settings: kopf.OperatorSettings, registry: kopf.OperatorRegistry | None = None
    ) -> None:
        """Configure kopf's watches, start the liveness server and the reconcile loop and, with
        the webhook enabled, prepare its certificates and server and register its handler (in
        ``registry``, kopf's default one unless given)."""
        s = self.settings
        kopf_settings.watching.server_timeout = s.watch_server_timeout
        kopf_settings.watching.client_timeout = s.watch_client_timeout
        kopf_settings.watching.connect_timeout = s.connect_timeout
        kopf_settings.networking.connect_timeout = s.connect_timeout
        kopf_settings.networking.request_timeout = s.request_timeout
        kopf_settings.networking.error_backoffs = KOPF_ERROR_BACKOFFS
        # kopf's initial LIST of each watched kind is one request bounded by the request
        # timeout in all: in pages, a large cluster's LIST of pods fits in it.
        kopf_settings.watching.chunk_size = KOPF_LIST_CHUNK
        kopf_settings.posting.level = logging.WARNING
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)  # no line per watch event
        kopf_settings.persistence.finalizer = "kvgate.io/unused-finalizer"  # never added
        if s.elects:
            assert s.pod_namespace is not None
            self.elector = LeaderElector(
                self.api_client(),
                namespace=s.pod_namespace,
                name=s.leader_election_lease_name,
                identity=self.identity,
                lease_duration=s.leader_election_lease_duration,
                renew_deadline=s.leader_election_renew_deadline,
                retry_period=s.leader_election_retry_period,
                on_change=self._leadership_changed,
            )
            await self.elector.try_once()  # so the webhook's certificates know who writes
            self._elector_task = asyncio.create_task(self.elector.run())  # renew from now on
        else:
            log.info("no leader election (disabled, or no pod namespace): this replica writes")
            self.metrics.leader.set(1)
        self.reconciler = Reconciler(
            self.api_client(),
            s,
            metrics=self.metrics,
            may_write=self.may_write,
            identity=self.identity,
        )
        if self.elector is not None and self.elector.is_leader():
            self.reconciler.started_leading()  # won in the first round above
        self._liveness = await self._serve_liveness(s.liveness_port)
        if s.webhook_enabled:
            self.webhook_server = await self._webhook_server()
            kopf_settings.admission.server = self.webhook_server
            kopf_settings.admission.managed = None  # the chart owns the configuration
            self.webhook.register(registry)
        self._task = asyncio.create_task(self.reconciler.run())
        self.reconciler.trigger()

    async def stop(self) -> None:
        """Stop the reconcile loop, the certificate loop and the election (releasing the Lease
        when leading), then the liveness server.

        Cancelling the loop does not stop a pass's worker thread: writes stop at once (the pass
        stops at its next write), and the Lease is released only once the pass has ended (or
        after ``request_timeout`` seconds, the longest one write in flight may take), so the
        next leader never writes while this one still does."""
        self._stopping = True
        for task in (self._task, self._cert_task, self._elector_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.reconciler is not None and not await self.reconciler.wait_idle(
            self.settings.request_timeout
        ):
            log.warning("a reconcile pass still runs after %.0fs", self.settings.request_timeout)
        if self.elector is not None:
            await self.elector.release()
        if self._liveness is not None:
            await self._liveness.cleanup()
        if self._cert_dir is not None:
            shutil.rmtree(self._cert_dir, ignore_errors=True)

    def on_event(self, kind: Kind, event: Mapping[str, Any]) -> None:
        """A watch event: ask for a pass when it changes what desired state reads
        (:mod:`kvgate_operator.triggers`)."""
        if self.seen.triggers(kind, event) and self.reconciler is not None:
            self.reconciler.trigger()

    def reconciler_alive(self) -> str:
        """Liveness of the reconcile loop: a description when a pass succeeded recently.

        Raises:
            kopf.PermanentError: the loop is not running, or no pass succeeded recently.
        """
        r, task = self.reconciler, self._task
        if r is None or task is None or task.done():
            raise kopf.PermanentError("the reconcile loop is not running")
        if self._elector_task is not None and self._elector_task.done():
            raise kopf.PermanentError("the leader election is not running")
        if self.elector is not None and not self.elector.is_leader():
            ok, why = self.elector.describe(self.settings.liveness_stale_seconds)
            if not ok:
                raise kopf.PermanentError(why)
            return why
        ok, why = r.healthy()
        if not ok:
            raise kopf.PermanentError(why)
        return why

    # ------------------------------------------------------------------ the webhook

    def _cert_loaded(self, cert_pem: bytes) -> None:
        """Record the serving certificate's expiry (a metric)."""
        with contextlib.suppress(ValueError):
            cert = x509.load_pem_x509_certificate(cert_pem)
            self.metrics.cert_expiry.set(cert.not_valid_after_utc.timestamp())
            self.cert_not_after = cert.not_valid_after_utc

    def _server(self, certfile: Path, keyfile: Path) -> ReloadingWebhookServer:
        s = self.settings
        return ReloadingWebhookServer(
            addr=s.webhook_addr,
            port=s.webhook_port,
            host=s.webhook_hosts[0],
            certfile=certfile,
            pkeyfile=keyfile,
            file_check_interval=s.webhook_cert_sync_seconds,
            metrics=self.metrics,
            on_loaded=self._cert_loaded,
        )

    async def _webhook_server(self) -> ReloadingWebhookServer:
        """Certificates (from the cert-manager directory, or self-signed and kept in the Secret,
        with the caBundle synced and a rotation loop) and the server that serves them."""
        s = self.settings
        self.webhook.namespaces.lookup = kube_namespace_lookup(
            self.api_client(), s.webhook_namespace_lookup_timeout
        )
        if s.webhook_cert_dir is not None:
            log.info("webhook certificates from %s (reloaded when they change)", s.webhook_cert_dir)
            return self._server(s.webhook_cert_dir / "tls.crt", s.webhook_cert_dir / "tls.key")
        manager = CertificateManager(
            KubeCertObjects(self.api_client()),
            namespace=s.pod_namespace,
            secret_name=s.webhook_secret_name,
            webhook_config_name=s.webhook_config_name,
            hosts=s.webhook_hosts,
            lifetimes=s.webhook_lifetimes,
        )
        await _initial_certificates(manager, s.webhook_cert_sync_seconds, self.may_write)
        directory = self._cert_dir = Path(tempfile.mkdtemp(prefix="kvgate-webhook-"))
        certfile, keyfile = manager.write_files(directory)
        # The files only change through the rotation loop below, which reloads at once; the
        # server's own file check is then just a backstop.
        srv = self._server(certfile, keyfile)
        self._cert_task = asyncio.create_task(
            _rotate_forever(manager, srv, directory, s.webhook_cert_sync_seconds, self.may_write)
        )
        return srv

    # ------------------------------------------------------------------ liveness

    async def _serve_liveness(self, port: int) -> aiohttp.web.AppRunner:
        app = aiohttp.web.Application()
        app.add_routes(
            [aiohttp.web.get("/healthz", self._healthz), aiohttp.web.get("/metrics", self._metrics)]
        )
        runner = aiohttp.web.AppRunner(app, handle_signals=False, access_log=None)
        await runner.setup()
        await aiohttp.web.TCPSite(runner, "0.0.0.0", port, reuse_address=True).start()
        return runner

    async def _healthz(self, _: aiohttp.web.Request) -> aiohttp.web.Response:
        """``/healthz``: the reconcile loop's health (and the webhook's), as JSON; 500 when
        no pass succeeded recently."""
        body: dict[str, Any] = {}
        status = 200
        try:
            body["reconciler"] = self.reconciler_alive()
        except kopf.PermanentError as exc:
            body["reconciler"] = str(exc)
            status = 500
        if self.settings.webhook_enabled:
            server, not_after = self.webhook_server, self.cert_not_after
            listening = server is not None and server.listening
            body["webhook"] = ("listening" if listening else "not listening") + (
                f", certificate valid until {not_after:%Y-%m-%dT%H:%M:%SZ}" if not_after else ""
            )
        return aiohttp.web.json_response(body, status=status)

    async def _metrics(self, _: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.Response(
            body=self.metrics.render(), headers={"Content-Type": self.metrics.content_type}
        )


async def _initial_certificates(
    manager: CertificateManager, interval: float, leading: Callable[[], bool]
) -> None:
    """The certificates to start serving. The leader loads them from the Secret, or makes and
    stores them, and syncs the caBundle. A follower writes nothing: it waits up to ``interval``
    seconds for the leader's in the Secret (at a first install the leader may still be making
    them), unless it becomes the leader meanwhile; else it serves in-memory ones until the
    Secret appears (:meth:`CertificateManager.follow`)."""
    deadline = asyncio.get_running_loop().time() + interval
    while True:
        if leading():
            await asyncio.to_thread(manager.ensure)
            await asyncio.to_thread(manager.sync_ca_bundle)
            return
        await asyncio.to_thread(manager.follow)
        if manager.certs is not None:
            return
        if asyncio.get_running_loop().time() >= deadline:
            log.warning(
                "webhook certificates: none in %s yet; serving in-memory ones", manager.where
            )
            manager.provisional()
            return
        await asyncio.sleep(0.5)


async def _rotate_forever(
    manager: CertificateManager,
    server: ReloadingWebhookServer,
    directory: Path,
    interval: float,
    leading: Callable[[], bool] = lambda: True,
) -> None:
    """Every ``interval`` seconds, on the leader: renew what is due (the caBundle is patched
    before a new CA's certificate is served), reload the server in place, and keep the caBundle
    in sync (a Helm upgrade resets it). On a follower: adopt what the leader stored in the
    Secret (read only), and reload."""
    while True:
        await asyncio.sleep(interval)
        try:
            if leading():
                reasons = await asyncio.to_thread(manager.check)
            else:
                reasons = await asyncio.to_thread(manager.follow)
            if reasons:
                manager.write_files(directory)
                server.reload()
            if leading():
                await asyncio.to_thread(manager.sync_ca_bundle)
        except Exception:  # never let the loop die: the next round retries
            log.exception("webhook certificate check failed")
