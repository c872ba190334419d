"""The pod of a sidecar-injection request, read defensively: kvgate's labels and annotations,
the containers and their TCP ports, and whether the pod's shape can be patched at all.

Pure: no I/O, no kopf, no Kubernetes client. The webhook gets whatever the client sent, before
the API server validates it: every reader here returns ``{}`` / ``[]`` / None for a part that is
absent or not of the expected type, and never raises.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ANNOTATION_ADMIN_PORT",
    "ANNOTATION_INJECT",
    "ANNOTATION_INJECTED",
    "ANNOTATION_MODEL_PORT",
    "ANNOTATION_POLICY",
    "ANNOTATION_SIDECAR_PORT",
    "LABEL_INJECT",
    "PodView",
    "containers",
    "shape_error",
    "show",
    "tcp_ports",
]

LABEL_INJECT = "kvgate.io/inject"
"""Pod or namespace label: exactly ``"true"`` opts in; on a pod, any other value opts out."""
ANNOTATION_INJECT = "kvgate.io/inject"
"""Pod annotation: ``"false"`` opts out, ``"true"`` is accepted, anything else is refused."""
ANNOTATION_INJECTED = "kvgate.io/injected"
"""Written on injection: compact JSON, sorted keys, e.g.
``{"adminPort":9471,"modelPort":8000,"native":true,"sidecarPort":8001,"version":"0.3.0"}``
(templates before 0.3.0 had no admin port and no ``adminPort``)."""
ANNOTATION_MODEL_PORT = "kvgate.io/model-port"
"""The model server's port, 1..65535. Default: the first TCP ``containerPort`` of the first
container that has one."""
ANNOTATION_SIDECAR_PORT = "kvgate.io/sidecar-port"
"""The sidecar's port, 1..65535. Default ``InjectionConfig.sidecar_port``."""
ANNOTATION_ADMIN_PORT = "kvgate.io/admin-port"
"""The port of the sidecar's admin listener (per-tenant metrics), 1..65535. Default
``InjectionConfig.admin_port``."""
ANNOTATION_POLICY = "kvgate.io/policy"
"""The RateLimitPolicy expected to govern the pod (informational; the sidecar's
``KVGATE_EXPECTED_POLICY``)."""


def _dict(x: Any) -> dict[str, Any]:
    return x if isinstance(x, dict) else {}


def containers(spec: Mapping[str, Any], key: str) -> list[dict[str, Any]]:
    """The objects of the list ``spec[key]`` (``containers``, ``initContainers``); [] when it
    is absent or not a list."""
    items = spec.get(key)
    if not isinstance(items, list):
        return []
    return [c for c in items if isinstance(c, dict)]


def tcp_ports(container: Mapping[str, Any]) -> list[int]:
    """The container's valid TCP ``containerPort`` values (1..65535), in order."""
    out: list[int] = []
    ports = container.get("ports")
    for p in ports if isinstance(ports, list) else []:
        if not isinstance(p, dict):
            continue
        num = p.get("containerPort")
        if p.get("protocol", "TCP") not in ("TCP", None):
            continue
        if isinstance(num, int) and not isinstance(num, bool) and 1 <= num <= 65535:
            out.append(num)
    return out


def show(value: Any, limit: int = 64) -> str:
    """``value`` for a message: a string in ``repr``, anything else as JSON, cut to ``limit``
    characters (ending ``...``)."""
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class PodView:
    """The request's pod (``src``: a deep copy, never changed) and its parts, each ``{}`` /
    ``[]`` where absent or not of the expected type.

    Attributes:
        src: the pod as sent.
        namespace: the request's namespace (authoritative; ``metadata.namespace`` may be unset).
        namespace_opt_in: the namespace has the label ``kvgate.io/inject: "true"``.
    """

    src: dict[str, Any]
    namespace: str
    namespace_opt_in: bool

    @property
    def meta(self) -> dict[str, Any]:
        return _dict(self.src.get("metadata"))

    @property
    def labels(self) -> dict[str, Any]:
        return _dict(self.meta.get("labels"))

    @property
    def annotations(self) -> dict[str, Any]:
        return _dict(self.meta.get("annotations"))

    @property
    def spec(self) -> dict[str, Any]:
        return _dict(self.src.get("spec"))

    @property
    def by_label(self) -> bool:
        """Opted in by the pod's own label (not only through its namespace)."""
        return self.labels.get(LABEL_INJECT) == "true"

    def groups(self) -> list[tuple[str, list[dict[str, Any]]]]:
        """``("container", spec.containers)`` and ``("init container", spec.initContainers)``."""
        return [
            ("container", containers(self.spec, "containers")),
            ("init container", containers(self.spec, "initContainers")),
        ]


def shape_error(pod: Mapping[str, Any]) -> str | None:
    """Why the pod's structure cannot be patched safely (``metadata``, its labels or
    annotations not objects; ``spec`` missing; ``spec.containers`` missing or empty; a
    container, init container, volume or port list not a list of objects), or None."""
    meta = pod.get("metadata")
    if meta is not None and not isinstance(meta, dict):
        return "metadata is not an object"
    for key in ("labels", "annotations"):
        val = _dict(meta).get(key)
        if val is not None and not isinstance(val, dict):
            return f"metadata.{key} is not an object"
    spec = pod.get("spec")
    if not isinstance(spec, dict):
        return "spec is missing or not an object"
    items = spec.get("containers")
    if not isinstance(items, list) or not items:
        return "spec.containers is missing or empty"
    for key in ("containers", "initContainers", "volumes"):
        items = spec.get(key)
        if items is None:
            continue
        if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
            return f"spec.{key} is not a list of objects"
    for key in ("containers", "initContainers"):
        for c in spec.get(key) or []:
            ports = c.get("ports")
            if ports is not None and not (
                isinstance(ports, list) and all(isinstance(p, dict) for p in ports)
            ):
                return f"spec.{key}[name={show(c.get('name'))}].ports is not a list of objects"
    return None
