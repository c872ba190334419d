"""kopf handlers: thin. Every watch event only triggers a reconcile pass; the work happens in
:mod:`kvgate_operator.reconciler` and the pure modules below it. With the webhook enabled, the
``inject-sidecar`` mutating admission handler (:mod:`kvgate_operator.webhook`) is registered
too, and startup prepares its certificates and server.

No handler here uses a finalizer (only ``on.event``, ``on.startup``, ``on.cleanup`` and
``on.mutate``), so the operator never adds, removes or fights over finalizers on anybody's
objects (field lesson L08, kopf #664).

The liveness port serves ``/healthz`` (the reconcile loop's health, as JSON; 500 when it is
stale) and ``/metrics`` (:mod:`kvgate_operator.metrics`) from one small aiohttp server started
here (kopf's own liveness endpoint cannot serve a second path).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

import aiohttp.web
import kopf
from cryptography import x509
from kubernetes import client, config

from kvgate_agent.contract.nodeadmission import NODE_ADMISSION_PLURAL, RATE_LIMIT_POLICY_PLURAL
from kvgate_agent.contract.policy import API_GROUP
from kvgate_operator.certs import CertificateManager, KubeCertStore
from kvgate_operator.metrics import OperatorMetrics
from kvgate_operator.reconciler import Reconciler
from kvgate_operator.settings import OperatorSettings
from kvgate_operator.webhook import (
    InjectionWebhook,
    NamespaceLabels,
    ReloadingWebhookServer,
    kube_namespace_lookup,
)

log = logging.getLogger("kvgate.operator")
SETTINGS = OperatorSettings()
METRICS = OperatorMetrics()
_state: dict[str, Any] = {}


def _not_started(namespace: str) -> dict[str, str]:
    raise RuntimeError("the operator has not started yet")


WEBHOOK = InjectionWebhook(
    SETTINGS.injection,
    NamespaceLabels(
        _not_started,
        ttl=SETTINGS.webhook_namespace_cache_seconds,
        timeout=SETTINGS.webhook_namespace_lookup_timeout,
    ),
    METRICS,
)
if SETTINGS.webhook_enabled:
    WEBHOOK.register()


def _api_client() -> client.ApiClient:
    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except config.ConfigException:
        config.load_kube_config()  # type: ignore[no-untyped-call]
    return client.ApiClient()


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
    """Configure kopf's watches and start the reconcile loop."""
    settings.watching.server_timeout = SETTINGS.watch_server_timeout
    settings.watching.client_timeout = SETTINGS.watch_client_timeout
    settings.watching.connect_timeout = SETTINGS.connect_timeout
    settings.posting.level = logging.WARNING
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)  # no line per watch event
    settings.persistence.finalizer = "kvgate.io/unused-finalizer"  # never added: no on.create
    reconciler = Reconciler(_api_client(), SETTINGS, metrics=METRICS)
    _state["reconciler"] = reconciler
    _state["liveness"] = await _serve_liveness(SETTINGS.liveness_port)
    if SETTINGS.webhook_enabled:
        server = await _webhook_server()
        _state["webhook_server"] = server
        settings.admission.server = server
        settings.admission.managed = None  # the chart owns the configuration
    _state["task"] = asyncio.create_task(reconciler.run())
    reconciler.trigger()


@kopf.on.cleanup()
async def cleanup(**_: Any) -> None:
    """Stop the reconcile loop, the certificate loop and the liveness server."""
    for key in ("task", "cert_task"):
        task = _state.get(key)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    runner: aiohttp.web.AppRunner | None = _state.get("liveness")
    if runner is not None:
        await runner.cleanup()
    cert_dir = _state.get("cert_tmp")
    if cert_dir is not None:
        shutil.rmtree(cert_dir, ignore_errors=True)


# ------------------------------------------------------------------------------ the webhook


def _cert_loaded(cert_pem: bytes) -> None:
    """Record the serving certificate's expiry (a metric)."""
    with contextlib.suppress(ValueError):
        cert = x509.load_pem_x509_certificate(cert_pem)
        METRICS.cert_expiry.set(cert.not_valid_after_utc.timestamp())
        _state["cert_not_after"] = cert.not_valid_after_utc


async def _webhook_server() -> ReloadingWebhookServer:
    """Certificates (from the cert-manager directory, or self-signed and kept in the Secret,
    with the caBundle synced and a rotation loop) and the server that serves them."""
    s = SETTINGS
    WEBHOOK.namespaces.lookup = kube_namespace_lookup(
        _api_client(), s.webhook_namespace_lookup_timeout
    )

    def server(certfile: Path, keyfile: Path) -> ReloadingWebhookServer:
        return ReloadingWebhookServer(
            addr=s.webhook_addr,
            port=s.webhook_port,
            host=s.webhook_hosts[0],
            certfile=certfile,
            pkeyfile=keyfile,
            file_check_interval=s.webhook_cert_sync_seconds,
            metrics=METRICS,
            on_loaded=_cert_loaded,
        )

    if s.webhook_cert_dir is not None:
        log.info("webhook certificates from %s (reloaded when they change)", s.webhook_cert_dir)
        return server(s.webhook_cert_dir / "tls.crt", s.webhook_cert_dir / "tls.key")
    manager = CertificateManager(
        KubeCertStore(_api_client()),
        namespace=s.pod_namespace,
        secret_name=s.webhook_secret_name,
        webhook_config_name=s.webhook_config_name,
        hosts=s.webhook_hosts,
    )
    await asyncio.to_thread(manager.ensure)
    await asyncio.to_thread(manager.sync_ca_bundle)
    directory = Path(tempfile.mkdtemp(prefix="kvgate-webhook-"))
    _state["cert_tmp"] = directory
    certfile, keyfile = manager.write_files(directory)
    # The files only change through the rotation loop below, which reloads at once; the
    # server's own file check is then just a backstop.
    srv = server(certfile, keyfile)
    _state["cert_manager"] = manager
    _state["cert_task"] = asyncio.create_task(
        _rotate_forever(manager, srv, directory, s.webhook_cert_sync_seconds)
    )
    return srv


async def _rotate_forever(
    manager: CertificateManager,
    server: ReloadingWebhookServer,
    directory: Path,
    interval: float,
) -> None:
    """Renew what is due (the caBundle is patched before a new CA's certificate is served),
    reload the server in place, and keep the caBundle in sync (a Helm upgrade resets it)."""
    while True:
        await asyncio.sleep(interval)
        try:
            reasons = await asyncio.to_thread(manager.check)
            if reasons:
                manager.write_files(directory)
                server.reload()
            await asyncio.to_thread(manager.sync_ca_bundle)
        except Exception:  # never let the loop die: the next round retries
            log.exception("webhook certificate check failed")


# ------------------------------------------------------------------------------ liveness


async def _serve_liveness(port: int) -> aiohttp.web.AppRunner:
    app = aiohttp.web.Application()
    app.add_routes([aiohttp.web.get("/healthz", _healthz), aiohttp.web.get("/metrics", _metrics)])
    runner = aiohttp.web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    await aiohttp.web.TCPSite(runner, "0.0.0.0", port, reuse_address=True).start()
    return runner


async def _healthz(_: aiohttp.web.Request) -> aiohttp.web.Response:
    body: dict[str, Any] = {}
    status = 200
    try:
        body["reconciler"] = reconciler_alive()
    except kopf.PermanentError as exc:
        body["reconciler"] = str(exc)
        status = 500
    if SETTINGS.webhook_enabled:
        server = _state.get("webhook_server")
        not_after: dt.datetime | None = _state.get("cert_not_after")
        listening = server is not None and server.listening
        body["webhook"] = ("listening" if listening else "not listening") + (
            f", certificate valid until {not_after:%Y-%m-%dT%H:%M:%SZ}" if not_after else ""
        )
    return aiohttp.web.json_response(body, status=status)


async def _metrics(_: aiohttp.web.Request) -> aiohttp.web.Response:
    return aiohttp.web.Response(
        body=METRICS.render(), headers={"Content-Type": METRICS.content_type}
    )


def _fingerprint(kind: str, body: Any) -> object:
    """The parts of an object that desired state depends on; other changes (pod status churn,
    the agent's heartbeats, our own status writes) trigger nothing."""
    meta = body.get("metadata") or {}
    deleting = meta.get("deletionTimestamp") is not None
    if kind == "pods":
        status = body.get("status") or {}
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions") or []
        )
        labels = tuple(sorted((meta.get("labels") or {}).items()))
        return (
            labels,
            (body.get("spec") or {}).get("nodeName"),
            status.get("phase"),
            ready,
            deleting,
        )
    if kind == "policies":
        return (meta.get("generation"), deleting)
    if kind == "nodeadmissions":
        pods = (body.get("status") or {}).get("pods") or []
        capacity = tuple(
            sorted(
                (p.get("uid"), p.get("engineKvCapacityTokens"))
                for p in pods
                if p.get("engineKvCapacityTokens")
            )
        )
        return (meta.get("generation"), capacity)
    return deleting  # nodes: only their coming and going matters


_seen: dict[tuple[str, str], object] = {}


def _on_event(kind: str) -> Any:
    def handler(event: Any, **_: Any) -> None:
        body = event.get("object") or {}
        key = (kind, (body.get("metadata") or {}).get("uid", ""))
        if event.get("type") == "DELETED":
            _seen.pop(key, None)
        else:
            fp = _fingerprint(kind, body)
            if _seen.get(key, _MISSING) == fp:
                return
            _seen[key] = fp
        r = _state.get("reconciler")
        if r is not None:
            r.trigger()

    handler.__name__ = f"trigger_on_{kind}"
    return handler


_MISSING = object()
kopf.on.event(API_GROUP, "v1alpha1", RATE_LIMIT_POLICY_PLURAL)(_on_event("policies"))
kopf.on.event("", "v1", "pods")(_on_event("pods"))
kopf.on.event("", "v1", "nodes")(_on_event("nodes"))
kopf.on.event(API_GROUP, "v1alpha1", NODE_ADMISSION_PLURAL)(_on_event("nodeadmissions"))


def reconciler_alive() -> str:
    """Liveness: fails (``/healthz`` answers 500) when no pass succeeded recently."""
    r: Reconciler | None = _state.get("reconciler")
    task: asyncio.Task[None] | None = _state.get("task")
    if r is None or task is None or task.done():
        raise kopf.PermanentError("the reconcile loop is not running")
    ok, why = r.healthy()
    if not ok:
        raise kopf.PermanentError(why)
    return why
