"""The node agent's Kubernetes I/O: watch its own NodeAdmission, write its status.

Only this node's object is watched (field selector ``metadata.name=<node>``), so an agent's
traffic does not grow with the cluster. The watch runs in a thread (the ``kubernetes`` client is
blocking); each change is handed to the event loop. A watch that ends or fails is resumed from
the last resourceVersion, and re-listed on ``410 Gone``, with a bounded backoff on errors.

Status is written with a JSON merge patch on the ``status`` subresource (the agent never writes
the spec); the whole status is sent, so stale fields cannot linger.

A silently dead connection to the API server (a partition, a lost NAT entry: open, no bytes) is
noticed within :data:`WATCH_READ_TIMEOUT_SECONDS`: the API server ends each watch after
:data:`WATCH_SERVER_TIMEOUT_SECONDS` (so a healthy watch is never silent longer than that), the
client gives up on a read silent past the read timeout, every other call has its own bound, and
the sockets send TCP keep-alive probes (:data:`KEEPALIVE`), which catch a dead peer on an idle
connection even where no read is pending. :class:`ApiContact` keeps when the API server last
answered, for the agent's liveness.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from kvgate_agent.contract.api import GROUP as API_GROUP
from kvgate_agent.contract.api import NODE_ADMISSION_PLURAL, VERSION
from kvgate_agent.contract.keepalive import KEEPALIVE
from kvgate_agent.contract.nodeadmission import NodeAdmissionSpec

log = logging.getLogger(__name__)

#: Called on the event loop with the spec (None: no object for this node) or an error text.
SpecCallback = Callable[[NodeAdmissionSpec | None, str | None], None]


#: Seconds the API server keeps one watch open (its ``timeoutSeconds``) before the agent renews
#: it from the last resourceVersion (no re-list).
WATCH_SERVER_TIMEOUT_SECONDS = 20
#: Seconds a read may stay silent before the call is abandoned: above the watch's server timeout,
#: so only a dead connection trips it.
WATCH_READ_TIMEOUT_SECONDS = 30.0
#: Seconds to connect (TCP and TLS handshake) to the API server.
CONNECT_TIMEOUT_SECONDS = 10.0
#: Longest pause between two watch attempts after errors, seconds.
MAX_BACKOFF_SECONDS = 5.0


@dataclass(slots=True)
class ApiContact:
    """When the API server last answered the agent (monotonic seconds; None: never yet)."""

    clock: Callable[[], float] = time.monotonic
    last_ok: float | None = None

    def ok(self) -> None:
        """The API server answered (a list, a watch event, a watch ended by the server, a
        status write)."""
        self.last_ok = self.clock()

    def age(self) -> float | None:
        """Seconds since the last answer; None before the first."""
        return None if self.last_ok is None else max(0.0, self.clock() - self.last_ok)


def load_api_client(kubeconfig: str | None = None) -> Any:
    """A ``kubernetes`` ApiClient: in-cluster config when running in a pod, else
    ``kubeconfig`` (or ``$KUBECONFIG`` / ``~/.kube/config``); with TCP keep-alive
    (:data:`KEEPALIVE`) on its sockets.

    Raises:
        kubernetes.config.ConfigException: no usable configuration.
    """
    from kubernetes import client, config
    from kubernetes.utils.keepalive import tcp_keepalive_socket_options

    cfg = client.Configuration()
    loaded = False
    if kubeconfig is None:
        try:
            config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
            loaded = True
        except config.ConfigException:
            pass
    if not loaded:
        config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)  # type: ignore[no-untyped-call]
    cfg.socket_options = tcp_keepalive_socket_options(*KEEPALIVE)
    return client.ApiClient(cfg)


def parse_spec(
    obj: dict[str, Any] | None, node_name: str
) -> tuple[NodeAdmissionSpec | None, str | None]:
    """The spec of a NodeAdmission object (None for no object) and an error text when the spec
    cannot be read (then the caller keeps what it had)."""
    if obj is None:
        return None, None
    try:
        spec = NodeAdmissionSpec.model_validate(obj.get("spec") or {})
    except ValidationError as exc:
        return None, f"NodeAdmission {node_name}: invalid spec: {exc.error_count()} errors: {exc}"
    return spec, None


class NodeAdmissionWatch:
    """Watches one NodeAdmission in a daemon thread.

    Args:
        api_client: a ``kubernetes`` ApiClient.
        node_name: the node (= the object's name).
        loop: the event loop ``on_change`` runs on.
        on_change: see :data:`SpecCallback`.
        timeout_seconds: server-side watch timeout before the watch is renewed.
        read_timeout: seconds a read may stay silent before the watch (or list) is abandoned
            and retried; must exceed ``timeout_seconds``.
        contact: where each answer of the API server is recorded (liveness).
    """

    def __init__(
        self,
        api_client: Any,
        node_name: str,
        loop: asyncio.AbstractEventLoop,
        on_change: SpecCallback,
        *,
        timeout_seconds: int = WATCH_SERVER_TIMEOUT_SECONDS,
        read_timeout: float = WATCH_READ_TIMEOUT_SECONDS,
        contact: ApiContact | None = None,
    ) -> None:
        from kubernetes import client

        if not read_timeout > timeout_seconds:
            raise ValueError(f"read_timeout {read_timeout} must exceed {timeout_seconds}")
        self.api = client.CustomObjectsApi(api_client)
        self.node_name = node_name
        self.loop = loop
        self.on_change = on_change
        self.timeout_seconds = timeout_seconds
        self.read_timeout = read_timeout
        self.contact = contact if contact is not None else ApiContact()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="kvgate-nodeadmission-watch", daemon=True
        )
        self._watch: Any = None

    def start(self) -> None:
        """Start watching."""
        self._thread.start()

    def alive(self) -> bool:
        """Whether the watch thread runs (it ends only on :meth:`stop`)."""
        return self._thread.is_alive()

    def stop(self) -> None:
        """Stop watching (the thread ends at its next event or timeout)."""
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()

    def _emit(self, obj: dict[str, Any] | None) -> None:
        spec, error = parse_spec(obj, self.node_name)
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.on_change, spec, error)

    def _run(self) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        backoff = 0.5
        rv: str | None = None
        selector = f"metadata.name={self.node_name}"
        bound = (CONNECT_TIMEOUT_SECONDS, self.read_timeout)  # (connect, each read)
        while not self._stop.is_set():
            try:
                if rv is None:
                    listed: Any = self.api.list_cluster_custom_object(
                        API_GROUP,
                        VERSION,
                        NODE_ADMISSION_PLURAL,
                        field_selector=selector,
                        _request_timeout=bound,
                    )
                    self.contact.ok()
                    items = listed.get("items") or []
                    self._emit(items[0] if items else None)
                    rv = listed["metadata"]["resourceVersion"]
                self._watch = watch.Watch()  # type: ignore[no-untyped-call]
                for event in self._watch.stream(
                    self.api.list_cluster_custom_object,
                    API_GROUP,
                    VERSION,
                    NODE_ADMISSION_PLURAL,
                    field_selector=selector,
                    resource_version=rv,
                    timeout_seconds=self.timeout_seconds,
                    allow_watch_bookmarks=True,
                    _request_timeout=bound,
                ):
                    self.contact.ok()
                    if self._stop.is_set():
                        return
                    kind, obj = event["type"], event["object"]
                    if kind == "ERROR":
                        if isinstance(obj, dict) and obj.get("code") == 410:
                            rv = None  # too old: re-list
                            break
                        raise RuntimeError(f"watch error: {obj}")
                    rv = obj.get("metadata", {}).get("resourceVersion", rv)
                    if kind in ("ADDED", "MODIFIED"):
                        self._emit(obj)
                    elif kind == "DELETED":
                        self._emit(None)
                self.contact.ok()  # ended by the server's timeout: the connection works
                backoff = 0.5
            except ApiException as exc:
                self.contact.ok()  # an answer, if a refusal: the network works
                if exc.status == 410:
                    rv = None
                    continue
                log.warning(
                    "NodeAdmission watch: %s %s; retry in %.1fs", exc.status, exc.reason, backoff
                )
                self._stop.wait(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)
            except Exception as exc:
                if self._stop.is_set():
                    return
                log.warning("NodeAdmission watch failed: %r; retry in %.1fs", exc, backoff)
                rv = None
                self._stop.wait(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)


class StatusWriter:
    """Writes the NodeAdmission status (blocking; call it in a worker thread)."""

    def __init__(self, api_client: Any, node_name: str, contact: ApiContact | None = None) -> None:
        from kubernetes import client

        self.api = client.CustomObjectsApi(api_client)
        self.node_name = node_name
        self.contact = contact if contact is not None else ApiContact()

    def write(self, status: dict[str, Any]) -> str:
        """Merge-patch ``status`` onto the object. Returns ``"ok"``, ``"absent"`` (no object
        for this node yet: the operator creates it when a policy governs a pod here) or raises
        ``kubernetes.client.exceptions.ApiException`` for other refusals."""
        from kubernetes.client.exceptions import ApiException

        started = time.perf_counter()
        try:
            self.api.patch_cluster_custom_object_status(
                API_GROUP,
                VERSION,
                NODE_ADMISSION_PLURAL,
                self.node_name,
                {"status": status},
                _request_timeout=(CONNECT_TIMEOUT_SECONDS, 10),
            )
        except ApiException as exc:
            self.contact.ok()  # an answer, if a refusal: the network works
            if exc.status == 404:
                return "absent"
            raise
        self.contact.ok()
        log.debug("status written in %.1f ms", (time.perf_counter() - started) * 1000)
        return "ok"
