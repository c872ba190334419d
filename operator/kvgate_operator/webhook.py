"""The sidecar-injection webhook, served through kopf: a thin handler around the pure
:func:`kvgate_operator.inject.inject`, a namespace-label cache, and a webhook server that
reloads its certificate without restarting.

Invariant: the webhook blocks a pod only by refusing its injection (a 400 the user sees);
anything else that goes wrong inside the handler lets the pod through uninjected (logged,
counted as ``action="error"``; the reconcile pass then reports it as a missed injection).
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import logging
import ssl
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp.web
import kopf

from kvgate_operator.inject import LABEL_INJECT, Injection, inject
from kvgate_operator.metrics import OperatorMetrics
from kvgate_operator.template import InjectionConfig

log = logging.getLogger("kvgate.operator.webhook")

#: The handler id, and so the URL path (``/inject-sidecar``).
HANDLER_ID = "inject-sidecar"
PATH = "/" + HANDLER_ID


# ----------------------------------------------------------------------------------------------
# The patch


def merge_patch(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON merge patch (RFC 7386) that turns ``before`` into ``after``: objects recurse,
    anything else that differs (lists included) is set whole, removed keys become None."""
    out: dict[str, Any] = {}
    for key, new in after.items():
        old = before.get(key, _ABSENT)
        if old == new:
            continue
        if isinstance(old, Mapping) and isinstance(new, Mapping):
            sub = merge_patch(old, new)
            if sub:
                out[key] = sub
        else:
            out[key] = copy.deepcopy(new)
    for key in before:
        if key not in after:
            out[key] = None
    return out


_ABSENT = object()


# ----------------------------------------------------------------------------------------------
# Namespace labels


class NamespaceLabels:
    """A small cache of namespace labels for the webhook.

    Entries are trusted for ``ttl`` seconds; a miss looks the namespace up through ``lookup``
    (run in a thread, bounded by ``timeout``). A failed lookup is never cached and returns
    None.

    Args:
        lookup: namespace name → its labels (``{}`` when it does not exist); raises on failure.
        ttl: seconds an entry is trusted.
        timeout: seconds a lookup may take.
        clock: monotonic seconds (injected by tests).
        max_entries: entries kept at most (the oldest go first).
    """

    def __init__(
        self,
        lookup: Callable[[str], Mapping[str, str]],
        *,
        ttl: float = 5.0,
        timeout: float = 1.5,
        clock: Callable[[], float] = time.monotonic,
        max_entries: int = 4096,
    ) -> None:
        self.lookup = lookup
        self.ttl = ttl
        self.timeout = timeout
        self.clock = clock
        self.max_entries = max_entries
        self._cache: dict[str, tuple[float, dict[str, str]]] = {}

    async def labels(self, namespace: str, *, fresh: bool = False) -> dict[str, str] | None:
        """The namespace's labels, or None when they could not be read (logged). ``fresh``
        skips the cache (one API call)."""
        hit = self._cache.get(namespace)
        now = self.clock()
        if not fresh and hit is not None and now - hit[0] < self.ttl:
            return hit[1]
        try:
            got = await asyncio.wait_for(asyncio.to_thread(self.lookup, namespace), self.timeout)
        except Exception as exc:  # any failure: the webhook must still answer
            log.warning("labels of namespace %s could not be read: %s", namespace, exc or repr(exc))
            return None
        labels = dict(got or {})
        self._cache.pop(namespace, None)
        self._cache[namespace] = (now, labels)
        while len(self._cache) > self.max_entries:
            self._cache.pop(next(iter(self._cache)))
        return labels


def kube_namespace_lookup(api: Any, timeout: float) -> Callable[[str], Mapping[str, str]]:
    """A :class:`NamespaceLabels` lookup through the kubernetes client (404 → no labels)."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    core = client.CoreV1Api(api)

    def lookup(name: str) -> Mapping[str, str]:
        try:
            ns = core.read_namespace(name, _request_timeout=timeout)
        except ApiException as exc:
            if exc.status == 404:
                return {}
            raise
        return dict((ns.metadata.labels if ns.metadata else None) or {})

    return lookup


# ----------------------------------------------------------------------------------------------
# The handler


class InjectionWebhook:
    """The ``inject-sidecar`` mutating admission handler (register with :meth:`register`).

    Its patch: kopf gives the handler a :class:`kopf.Patch` (a JSON *merge* patch) and answers
    the API server with the JSON Patch that turns the request's object into the merge-patched
    one. A merge patch replaces lists as a whole, so the handler puts the RFC 7386 difference
    between the request's pod and :attr:`Injection.pod` into it (:func:`merge_patch`): the
    lists ``inject()`` appended to whole, and the new annotation. The pod the API server
    stores is therefore exactly ``Injection.pod``; a pod that needs nothing gets no patch.
    A failed namespace lookup counts as "namespace not opted in" (the pod's label still works).
    """

    def __init__(
        self,
        config: InjectionConfig,
        namespaces: NamespaceLabels,
        metrics: OperatorMetrics,
        inject_fn: Callable[..., Any] = inject,
    ) -> None:
        self.config = config
        self.namespaces = namespaces
        self.metrics = metrics
        self.inject_fn = inject_fn

    def register(self, registry: kopf.OperatorRegistry | None = None) -> None:
        """Register the handler with kopf (the default registry unless given).

        kopf's :class:`kopf.WebhookServer` routes ``POST <path>/{id}`` and runs only the
        admission handlers whose id equals ``id``: with ``id="inject-sidecar"``,
        ``https://<host>:<port>/inject-sidecar`` (the path in the chart's
        MutatingWebhookConfiguration) runs exactly this handler, and a request to any other
        path runs none and is allowed unchanged. ``settings.admission.managed`` stays None: the
        chart owns the MutatingWebhookConfiguration, the operator only keeps its ``caBundle``
        in sync (:mod:`kvgate_operator.certs`)."""
        kopf.on.mutate(
            "",
            "v1",
            "pods",
            id=HANDLER_ID,
            operations=["CREATE"],
            side_effects=False,
            ignore_failures=True,
            registry=registry,
        )(self.handle)

    async def handle(
        self,
        body: kopf.Body,
        patch: kopf.Patch,
        logger: logging.Logger | logging.LoggerAdapter[logging.Logger] = log,
        warnings: list[str] | None = None,
        **_: Any,
    ) -> None:
        """Decide, record the decision, and either patch, deny or let the pod pass."""
        pod: dict[str, Any] = copy.deepcopy({k: body[k] for k in body})
        raw_meta = pod.get("metadata")
        meta: dict[str, Any] = raw_meta if isinstance(raw_meta, dict) else {}
        namespace = str(meta.get("namespace") or "")
        try:
            labels = await self.namespaces.labels(namespace) if namespace else {}
            pod_labels = meta.get("labels") if isinstance(meta.get("labels"), dict) else {}
            if (
                namespace
                and labels is not None
                and labels.get(LABEL_INJECT) != "true"
                and (pod_labels or {}).get(LABEL_INJECT) != "true"
            ):
                # The pod's own label did not send it here, so the namespace selector did: the
                # namespace was labelled within the cache's lifetime. Ask again, uncached.
                labels = await self.namespaces.labels(namespace, fresh=True)
            if labels is None:
                self.metrics.namespace_lookup_failures.inc()
                labels = {}
            result = self.inject_fn(
                pod,
                namespace=namespace,
                namespace_opt_in=labels.get(LABEL_INJECT) == "true",
                config=self.config,
            )
            changes = merge_patch(pod, result.pod) if result.action == "injected" else {}
        except Exception:
            logger.exception("sidecar injection failed internally; the pod passes uninjected")
            self.metrics.injections.labels(action="error", reason="internal_error").inc()
            return
        self.metrics.injections.labels(action=result.action, reason=result.reason).inc()
        name = meta.get("name") or f"{meta.get('generateName') or ''}*"
        if not result.allowed:
            log.info("refused pod %s/%s: %s", namespace, name, result.message)
            raise kopf.AdmissionError(result.message, code=400)
        if warnings is not None and _worth_a_warning(result, pod):
            warnings.append(result.message)  # kubectl prints it: the user asked for a sidecar
        if changes:
            log.info("injected pod %s/%s (%s)", namespace, name, result.message)
            patch.update(changes)
        else:
            log.debug("pod %s/%s: %s (%s)", namespace, name, result.action, result.reason)


def _worth_a_warning(result: Injection, pod: Mapping[str, Any]) -> bool:
    """Whether a pod that asked for the sidecar and did not get it should hear why, as an
    admission warning (``kubectl`` prints it): opted in, yet skipped for host networking, no
    port, an excluded namespace, or a stale ``kvgate.io/injected`` annotation."""
    if result.action == "skipped" and result.reason in ("host_network", "no_model_port"):
        return True
    labels = (pod.get("metadata") or {}).get("labels") or {}
    asked = isinstance(labels, Mapping) and labels.get(LABEL_INJECT) == "true"
    if result.action == "skipped" and result.reason == "excluded_namespace":
        return asked
    value = labels.get(LABEL_INJECT) if isinstance(labels, Mapping) else None
    if result.action == "skipped" and result.reason == "opted_out" and value not in (None, "false"):
        return True  # "True", "yes": probably meant as an opt-in, which only "true" is
    return result.action == "already_injected" and "remove the annotation" in result.message


# ----------------------------------------------------------------------------------------------
# The server


class ReloadingWebhookServer(kopf.WebhookServer):
    """kopf's HTTPS webhook server, but the certificate is reloaded in place.

    kopf's own :class:`kopf.WebhookServer` builds its ``SSLContext`` once per server start and,
    when its certificate files change, stops the aiohttp site and starts a new one (closing the
    listening socket: connections in that moment are refused, and it re-yields a client config).
    This subclass keeps one ``SSLContext`` and one listening socket for the whole run and calls
    ``load_cert_chain`` on that same context again when the certificate changes: every new TLS
    handshake then presents the new certificate, handshakes already done keep theirs, and
    nothing is ever not listening. The new pair is first loaded into a scratch context, so a
    half-written or mismatched pair never reaches the live one (OpenSSL would otherwise drop the
    live key on a mismatch). The files are re-read every ``file_check_interval`` seconds
    (cert-manager renews them in place) and on :meth:`reload` (the operator's own rotation).

    If the port cannot be bound, the server logs it and keeps trying instead of failing: the
    operator's reconcile loop must go on (the webhook's ``failurePolicy: Ignore`` lets pods
    through, and the missed-injection check reports them).
    """

    def __init__(
        self,
        *,
        addr: str,
        port: int,
        host: str | None,
        certfile: str | Path,
        pkeyfile: str | Path,
        file_check_interval: float = 60.0,
        metrics: OperatorMetrics | None = None,
        on_loaded: Callable[[bytes], None] | None = None,
    ) -> None:
        super().__init__(
            addr=addr,
            port=port,
            host=host,
            certfile=certfile,
            pkeyfile=pkeyfile,
        )
        self.file_check_interval = file_check_interval  # our own loop reads it (not kopf's)
        self.metrics = metrics
        self.on_loaded = on_loaded
        self.live: ssl.SSLContext | None = None
        self.listening = False
        self._digest: str | None = None

    def _read_pair(self) -> tuple[bytes, bytes]:
        assert self.certfile is not None and self.pkeyfile is not None
        return Path(self.certfile).read_bytes(), Path(self.pkeyfile).read_bytes()

    def reload(self) -> bool:
        """Load the certificate files into the live context if they changed. Returns True when
        a new pair was loaded; a pair that does not load is logged and the old one kept."""
        if self.live is None:
            return False
        try:
            cert, key = self._read_pair()
        except OSError as exc:
            log.warning("webhook certificate files unreadable, keeping the loaded ones: %s", exc)
            return False
        digest = hashlib.sha256(cert + b"\0" + key).hexdigest()
        if digest == self._digest:
            return False
        with tempfile.TemporaryDirectory(prefix="kvgate-tls-") as d:
            certf, keyf = Path(d) / "tls.crt", Path(d) / "tls.key"
            certf.write_bytes(cert)
            keyf.write_bytes(key)
            try:
                _server_context().load_cert_chain(certf, keyf)  # scratch first
            except (ssl.SSLError, OSError, ValueError) as exc:
                log.warning("new webhook certificate does not load, keeping the old one: %s", exc)
                return False
            self.live.load_cert_chain(certf, keyf)
        first = self._digest is None
        self._digest = digest
        if not first:
            log.info("webhook certificate reloaded")
            if self.metrics is not None:
                self.metrics.cert_reloads.inc()
        if self.on_loaded is not None:
            self.on_loaded(cert)
        return True

    async def __call__(self, fn: Any) -> AsyncIterator[Any]:
        async def serve(request: aiohttp.web.Request) -> aiohttp.web.Response:
            return await self._serve(fn, request)

        self.live = _server_context()
        self._digest = None
        if not self.reload():
            raise RuntimeError(f"cannot load the webhook certificate {self.certfile}")
        path = self.path.rstrip("/") if self.path else ""
        app = aiohttp.web.Application()
        app.add_routes([aiohttp.web.post(f"{path}/{{id:.*}}", serve)])
        runner = aiohttp.web.AppRunner(app, handle_signals=False, access_log=None)
        await runner.setup()
        try:
            port = self.port or self._allocate_free_port()
            backoff = 1.0
            while True:
                try:
                    site = aiohttp.web.TCPSite(
                        runner, self.addr or None, port, ssl_context=self.live, reuse_address=True
                    )
                    await site.start()
                    break
                except OSError as exc:
                    log.error(
                        "webhook server cannot listen on %s:%s (%s); retrying in %.0fs",
                        self.addr,
                        port,
                        exc,
                        backoff,
                    )
                    await asyncio.sleep(backoff)
                    backoff = min(30.0, backoff * 2)
            self.listening = True
            if self.metrics is not None:
                self.metrics.serving.set(1)
            host = self.host or self._get_accessible_addr(self.addr)
            url = self._build_url("https", host, port, self.path or "")
            log.info("webhook listening on %s:%s (%s%s)", self.addr, port, url, PATH)
            yield {"url": url}
            while True:
                await asyncio.sleep(self.file_check_interval)
                self.reload()
        finally:
            self.listening = False
            if self.metrics is not None:
                self.metrics.serving.set(0)
            await runner.cleanup()


def _server_context() -> ssl.SSLContext:
    ctx = ssl.create_default_context(purpose=ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx
