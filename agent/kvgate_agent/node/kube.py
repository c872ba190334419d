"""The node agent's Kubernetes I/O: watch its own NodeAdmission, write its status.

Only this node's object is watched (field selector ``metadata.name=<node>``), so an agent's
traffic does not grow with the cluster. The watch runs in a thread (the ``kubernetes`` client is
blocking); each change is handed to the event loop. A watch that ends or fails is resumed from
the last resourceVersion, and re-listed on ``410 Gone``, with a bounded backoff on errors.

Status is written with a JSON merge patch on the ``status`` subresource (the agent never writes
the spec); the whole status is sent, so stale fields cannot linger.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from kvgate_agent.contract.api import GROUP as API_GROUP
from kvgate_agent.contract.api import NODE_ADMISSION_PLURAL, VERSION
from kvgate_agent.contract.nodeadmission import NodeAdmissionSpec

log = logging.getLogger(__name__)

#: Called on the event loop with the spec (None: no object for this node) or an error text.
SpecCallback = Callable[[NodeAdmissionSpec | None, str | None], None]


def load_api_client(kubeconfig: str | None = None) -> Any:
    """A ``kubernetes`` ApiClient: in-cluster config when running in a pod, else
    ``kubeconfig`` (or ``$KUBECONFIG`` / ``~/.kube/config``).

    Raises:
        kubernetes.config.ConfigException: no usable configuration.
    """
    from kubernetes import client, config

    if kubeconfig is None:
        try:
            config.load_incluster_config()  # type: ignore[no-untyped-call]
            return client.ApiClient()
        except config.ConfigException:
            pass
    cfg = client.Configuration()
    config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)  # type: ignore[no-untyped-call]
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
    """

    def __init__(
        self,
        api_client: Any,
        node_name: str,
        loop: asyncio.AbstractEventLoop,
        on_change: SpecCallback,
        *,
        timeout_seconds: int = 300,
    ) -> None:
        from kubernetes import client

        self.api = client.CustomObjectsApi(api_client)
        self.node_name = node_name
        self.loop = loop
        self.on_change = on_change
        self.timeout_seconds = timeout_seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="kvgate-nodeadmission-watch", daemon=True
        )
        self._watch: Any = None

    def start(self) -> None:
        """Start watching."""
        self._thread.start()

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
        while not self._stop.is_set():
            try:
                if rv is None:
                    listed: Any = self.api.list_cluster_custom_object(
                        API_GROUP,
                        VERSION,
                        NODE_ADMISSION_PLURAL,
                        field_selector=selector,
                        _request_timeout=30,
                    )
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
                ):
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
                backoff = 0.5
            except ApiException as exc:
                if exc.status == 410:
                    rv = None
                    continue
                log.warning(
                    "NodeAdmission watch: %s %s; retry in %.1fs", exc.status, exc.reason, backoff
                )
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)
            except Exception as exc:
                if self._stop.is_set():
                    return
                log.warning("NodeAdmission watch failed: %r; retry in %.1fs", exc, backoff)
                rv = None
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)


class StatusWriter:
    """Writes the NodeAdmission status (blocking; call it in a worker thread)."""

    def __init__(self, api_client: Any, node_name: str) -> None:
        from kubernetes import client

        self.api = client.CustomObjectsApi(api_client)
        self.node_name = node_name

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
                _request_timeout=10,
            )
        except ApiException as exc:
            if exc.status == 404:
                return "absent"
            raise
        log.debug("status written in %.1f ms", (time.perf_counter() - started) * 1000)
        return "ok"
