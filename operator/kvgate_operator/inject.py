"""Sidecar injection: decide whether a pod gets the kvgate sidecar and compute the mutation.

Pure: no I/O, no kopf, no Kubernetes client. The mutating admission webhook (served by the
operator) calls :func:`inject` with the pod from the ``AdmissionReview`` request and answers
with :attr:`Injection.allowed`, :attr:`Injection.message` and :attr:`Injection.patch` (RFC 6902
JSON Patch). The same pod always gives the same answer, and an injected pod is never injected
again (the API server may call a webhook more than once: ``reinvocationPolicy: IfNeeded``).

Rules, in the order they are applied (documented for users in the README):

1. ``excluded_namespace`` (skipped): the namespace is in ``config.excluded_namespaces``
   (``kube-system``, ``kube-public``, ``kube-node-lease``) or is kvgate's own namespace, whatever
   the labels say: a label on kube-system cannot be relied on (managed platforms strip them).
2. ``already_injected``: a container or init container named ``kvgate-sidecar``, or the
   annotation ``kvgate.io/injected``, is present. Nothing changes.
3. ``opted_out`` (skipped): annotation ``kvgate.io/inject: "false"``, or the pod label
   ``kvgate.io/inject`` with any value but exactly ``"true"`` (``"false"``, ``"False"``,
   ``"no"``...), wins over every opt-in.
4. ``not_opted_in`` (skipped): neither the pod label ``kvgate.io/inject: "true"`` nor the
   namespace label (``namespace_opt_in``).
5. ``host_network`` (skipped): ``spec.hostNetwork: true``; the sidecar's port would be the node's.
6. ``refused`` (the API server rejects the pod with :attr:`Injection.message`) for anything that
   would leave an opted-in pod crash-looping or silently unprotected: ``bad_annotation`` (an
   unreadable kvgate annotation), ``no_model_port`` (no ``kvgate.io/model-port`` annotation and
   no TCP ``containerPort`` in any container), ``port_clash`` (the sidecar port is the model
   port or a port of another container), ``name_clash`` (a volume ``kvgate-token`` or a port
   named ``kvgate-http`` is already there), ``malformed_pod``.
   Exception: a pod opted in only through its namespace that has no port at all is skipped
   (``no_model_port``): it is not a server (a Job, a debug pod) and must not be blocked.
7. ``injected``: otherwise.

Annotations read on the pod:

- ``kvgate.io/inject``: ``"false"`` opts out; ``"true"`` is accepted; anything else is refused.
- ``kvgate.io/model-port``: the model server's port, 1..65535. Default: the first TCP
  ``containerPort`` of the first container that has one.
- ``kvgate.io/sidecar-port``: the port the sidecar listens on, 1..65535. Default
  ``config.sidecar_port``. Point the Service's ``targetPort`` at it (port name ``kvgate-http``).
- ``kvgate.io/policy``: the RateLimitPolicy expected to govern the pod (informational; passed to
  the sidecar as ``KVGATE_EXPECTED_POLICY``).

Annotation written: ``kvgate.io/injected``, compact JSON with sorted keys, e.g.
``{"modelPort":8000,"native":true,"sidecarPort":8001,"version":"0.1.0"}``; ``version`` is
:data:`TEMPLATE_VERSION`, the version of the injected container's template.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.alias_generators import to_camel

LABEL_INJECT = "kvgate.io/inject"
ANNOTATION_INJECT = "kvgate.io/inject"
ANNOTATION_INJECTED = "kvgate.io/injected"
ANNOTATION_MODEL_PORT = "kvgate.io/model-port"
ANNOTATION_SIDECAR_PORT = "kvgate.io/sidecar-port"
ANNOTATION_POLICY = "kvgate.io/policy"

SIDECAR_NAME = "kvgate-sidecar"
PORT_NAME = "kvgate-http"
TOKEN_VOLUME = "kvgate-token"
TOKEN_DIR = "/var/run/secrets/kvgate"
TOKEN_FILE = TOKEN_DIR + "/token"
RUN_AS_USER = 65532
TEMPLATE_VERSION = "0.1.0"
"""Version of the injected container's template: bump it whenever the template changes, so the
operator can tell pods injected with an older one (``kvgate.io/injected``)."""

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

Action = Literal["injected", "already_injected", "skipped", "refused"]

Resources = dict[str, dict[str, str | int | float]]
"""A container's ``resources``: ``requests`` / ``limits`` → resource name → quantity."""


def _default_resources() -> Resources:
    return {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}}


_PORT_RE = re.compile(r"[1-9][0-9]{0,4}")
_DNS_SUBDOMAIN_RE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


class InjectionConfig(BaseModel):
    """How the sidecar is injected. The chart renders it as JSON (camelCase keys) into the
    operator's environment variable ``KVGATE_OPERATOR_INJECTION``.

    Attributes:
        sidecar_image: the kvgate-agent image; its entrypoint is ``kvgate-agent``.
        image_pull_policy: ``Always``, ``IfNotPresent`` or ``Never``.
        native_sidecar: True: an init container with ``restartPolicy: Always`` (Kubernetes
            >= 1.29), which starts before and stops after the model server; False: a plain
            container appended to ``spec.containers``.
        sidecar_port: TCP port the sidecar listens on, unless the pod annotates
            ``kvgate.io/sidecar-port``.
        agent_port: the node agent's hostPort; the sidecar syncs with
            ``http://$(KVGATE_HOST_IP):<agent_port>``.
        token_audience: audience of the projected service-account token the sidecar presents.
        token_expiration_seconds: lifetime of that token, seconds (Kubernetes minimum 600).
        resources: the sidecar's ``resources`` (``requests`` / ``limits``), copied as is.
        excluded_namespaces: never injected, whatever their labels say.
        own_namespace: kvgate's own namespace, never injected (set by the operator).
        drain_seconds: the sidecar's ``KVGATE_DRAIN_SECONDS`` (> 0).
        log_level: the sidecar's ``KVGATE_LOG_LEVEL``: DEBUG, INFO, WARNING or ERROR.
    """

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )

    sidecar_image: str = Field("ghcr.io/kvgate/kvgate-agent:0.1.0", min_length=1)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    native_sidecar: bool = True
    sidecar_port: int = Field(8001, ge=1, le=65535)
    agent_port: int = Field(9470, ge=1, le=65535)
    token_audience: str = Field("kvgate-agent", min_length=1)
    token_expiration_seconds: int = Field(3600, ge=600, le=2**32)
    resources: Resources = Field(default_factory=_default_resources)
    excluded_namespaces: list[str] = Field(
        default_factory=lambda: ["kube-system", "kube-public", "kube-node-lease"]
    )
    own_namespace: str | None = None
    drain_seconds: int = Field(30, gt=0)
    log_level: str = "INFO"

    @field_validator("resources")
    @classmethod
    def _resource_keys(cls, v: Resources) -> Resources:
        unknown = sorted(set(v) - {"requests", "limits"})
        if unknown:
            raise ValueError(f"only 'requests' and 'limits' are allowed, got {unknown}")
        return v

    @field_validator("log_level")
    @classmethod
    def _log_level(cls, v: str) -> str:
        level = v.upper()
        if level not in LOG_LEVELS:
            raise ValueError(f"must be one of {', '.join(LOG_LEVELS)}, got {v!r}")
        return level


@dataclass(frozen=True)
class Injection:
    """What :func:`inject` decided.

    Attributes:
        action: ``injected``, ``already_injected``, ``skipped`` or ``refused``.
        reason: stable snake_case reason (see the module docstring), for logs and metrics.
        message: human text; for ``refused`` the API server shows it to the user.
        pod: the pod after the mutation (a deep copy; equal to the input unless injected).
        patch: RFC 6902 operations turning the input pod into :attr:`pod`; empty unless
            injected.
    """

    action: Action
    reason: str
    message: str
    pod: dict[str, Any]
    patch: list[dict[str, Any]] = field(default_factory=list)

    @property
    def allowed(self) -> bool:
        """False only for ``refused``: the webhook must then deny the pod."""
        return self.action != "refused"


class PatchError(ValueError):
    """A JSON Patch operation that cannot be applied (bad path, missing member, bad index)."""


# --------------------------------------------------------------------------------------------
# JSON Patch (the subset inject emits, plus remove/replace/test for symmetry)


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"JSON pointer must start with '/': {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def escape_pointer(token: str) -> str:
    """Escape one JSON pointer reference token (RFC 6901): ``~`` → ``~0``, ``/`` → ``~1``."""
    return token.replace("~", "~0").replace("/", "~1")


def _index(container: list[Any], token: str, *, allow_end: bool) -> int:
    if token == "-" and allow_end:
        return len(container)
    if not re.fullmatch(r"0|[1-9][0-9]*", token):
        raise PatchError(f"bad array index {token!r}")
    i = int(token)
    if i > len(container) or (i == len(container) and not allow_end):
        raise PatchError(f"array index {i} out of range (length {len(container)})")
    return i


def _parent(doc: Any, tokens: list[str]) -> Any:
    node = doc
    for tok in tokens:
        if isinstance(node, dict):
            if tok not in node:
                raise PatchError(f"member {tok!r} not found")
            node = node[tok]
        elif isinstance(node, list):
            node = node[_index(node, tok, allow_end=False)]
        else:
            raise PatchError(f"cannot descend into {type(node).__name__} at {tok!r}")
    return node


def apply_patch(doc: Mapping[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """Apply RFC 6902 operations ``add``, ``remove``, ``replace`` and ``test`` to a deep copy of
    ``doc`` and return it (``doc`` is not changed).

    Raises:
        PatchError: an operation is unknown or does not apply (missing parent, bad index,
            failed ``test``).
    """
    result: Any = copy.deepcopy(dict(doc))
    for op in ops:
        kind = op.get("op")
        tokens = _pointer(str(op.get("path", "")))
        value = copy.deepcopy(op.get("value"))
        if not tokens:
            if kind in ("add", "replace"):
                result = value
                continue
            if kind == "test":
                if result != value:
                    raise PatchError("test failed at ''")
                continue
            raise PatchError(f"cannot {kind} the whole document")
        parent = _parent(result, tokens[:-1])
        last = tokens[-1]
        if kind == "add":
            if isinstance(parent, dict):
                parent[last] = value
            elif isinstance(parent, list):
                parent.insert(_index(parent, last, allow_end=True), value)
            else:
                raise PatchError(f"cannot add to {type(parent).__name__}")
        elif kind in ("remove", "replace", "test"):
            if isinstance(parent, dict):
                if last not in parent:
                    raise PatchError(f"member {last!r} not found")
                key: Any = last
            elif isinstance(parent, list):
                key = _index(parent, last, allow_end=False)
            else:
                raise PatchError(f"cannot {kind} in {type(parent).__name__}")
            if kind == "remove":
                del parent[key]
            elif kind == "replace":
                parent[key] = value
            elif parent[key] != value:
                raise PatchError(f"test failed at {op.get('path')!r}")
        else:
            raise PatchError(f"unsupported op {kind!r}")
    if not isinstance(result, dict):
        raise PatchError("the patched document is not an object")
    return result


# --------------------------------------------------------------------------------------------
# Reading the pod defensively: the webhook gets whatever the client sent, before validation.


def _dict(x: Any) -> dict[str, Any]:
    return x if isinstance(x, dict) else {}


def _containers(spec: Mapping[str, Any], key: str) -> list[dict[str, Any]]:
    items = spec.get(key)
    if not isinstance(items, list):
        return []
    return [c for c in items if isinstance(c, dict)]


def _tcp_ports(container: Mapping[str, Any]) -> list[int]:
    """The container's valid TCP ``containerPort`` values, in order."""
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


def _shape_error(pod: Mapping[str, Any]) -> str | None:
    """Why the pod's structure cannot be patched safely, or None."""
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
    containers = spec.get("containers")
    if not isinstance(containers, list) or not containers:
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
                return f"spec.{key}[name={_show(c.get('name'))}].ports is not a list of objects"
    return None


def _port_annotation(annotations: Mapping[str, Any], key: str) -> tuple[int | None, str | None]:
    """(port, None) when annotated validly, (None, None) when absent, (None, error) when bad."""
    if key not in annotations:
        return None, None
    raw = annotations[key]
    if isinstance(raw, str) and _PORT_RE.fullmatch(raw) and int(raw) <= 65535:
        return int(raw), None
    return None, (f"kvgate: annotation {key} must be a port number 1..65535, got {_show(raw)}")


def _show(value: Any, limit: int = 64) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _skip(pod: dict[str, Any], reason: str, message: str) -> Injection:
    return Injection("skipped", reason, message, pod)


def _refuse(pod: dict[str, Any], reason: str, message: str) -> Injection:
    return Injection("refused", reason, message, pod)


# --------------------------------------------------------------------------------------------
# The injected objects


def _probe(path: str, port: int, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "failureThreshold": failures,
    }


def sidecar_container(
    config: InjectionConfig, *, model_port: int, sidecar_port: int, policy: str | None
) -> dict[str, Any]:
    """The ``kvgate-sidecar`` container: ``kvgate-agent sidecar`` in cluster mode (thresholds
    from the node agent), proxying ``0.0.0.0:<sidecar_port>`` to ``127.0.0.1:<model_port>``.

    The env order is fixed: ``KVGATE_HOST_IP`` precedes ``KVGATE_AGENT_URL``, which refers to
    it as ``$(KVGATE_HOST_IP)`` (Kubernetes expands only variables defined earlier)."""

    def field_ref(name: str, path: str) -> dict[str, Any]:
        return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}

    env: list[dict[str, Any]] = [
        {"name": "KVGATE_UPSTREAM", "value": f"http://127.0.0.1:{model_port}"},
        {"name": "KVGATE_LISTEN", "value": f"0.0.0.0:{sidecar_port}"},
        field_ref("KVGATE_HOST_IP", "status.hostIP"),
        {"name": "KVGATE_AGENT_URL", "value": f"http://$(KVGATE_HOST_IP):{config.agent_port}"},
        field_ref("KVGATE_POD_NAMESPACE", "metadata.namespace"),
        field_ref("KVGATE_POD_NAME", "metadata.name"),
        field_ref("KVGATE_POD_UID", "metadata.uid"),
        field_ref("KVGATE_POD_IP", "status.podIP"),
        {"name": "KVGATE_TOKEN_FILE", "value": TOKEN_FILE},
        {"name": "KVGATE_DRAIN_SECONDS", "value": str(config.drain_seconds)},
        {"name": "KVGATE_LOG_LEVEL", "value": config.log_level},
    ]
    if policy is not None:
        env.append({"name": "KVGATE_EXPECTED_POLICY", "value": policy})
    container: dict[str, Any] = {
        "name": SIDECAR_NAME,
        "image": config.sidecar_image,
        "imagePullPolicy": config.image_pull_policy,
        "args": ["sidecar"],
        "ports": [{"name": PORT_NAME, "containerPort": sidecar_port, "protocol": "TCP"}],
        "env": env,
        "resources": copy.deepcopy(config.resources),
        "volumeMounts": [{"name": TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True}],
        "readinessProbe": _probe("/readyz", sidecar_port, 5, 3),
        "livenessProbe": _probe("/healthz", sidecar_port, 10, 3),
        "startupProbe": _probe("/healthz", sidecar_port, 1, 30),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    if config.native_sidecar:
        container["restartPolicy"] = "Always"
    return container


def token_volume(config: InjectionConfig) -> dict[str, Any]:
    """The ``kvgate-token`` volume: a projected service-account token for the node agent."""
    return {
        "name": TOKEN_VOLUME,
        "projected": {
            "sources": [
                {
                    "serviceAccountToken": {
                        "audience": config.token_audience,
                        "expirationSeconds": config.token_expiration_seconds,
                        "path": "token",
                    }
                }
            ]
        },
    }


def injected_annotation(*, model_port: int, sidecar_port: int, native: bool) -> str:
    """The value of ``kvgate.io/injected``: compact JSON, sorted keys."""
    return json.dumps(
        {
            "modelPort": model_port,
            "native": native,
            "sidecarPort": sidecar_port,
            "version": TEMPLATE_VERSION,
        },
        sort_keys=True,
        separators=(",", ":"),
    )


def _append_op(parent: Mapping[str, Any], parent_path: str, key: str, item: Any) -> dict[str, Any]:
    """``add`` ``item`` at the end of ``parent[key]``, creating the list when absent or null."""
    if isinstance(parent.get(key), list):
        return {"op": "add", "path": f"{parent_path}/{key}/-", "value": item}
    return {"op": "add", "path": f"{parent_path}/{key}", "value": [item]}


# --------------------------------------------------------------------------------------------
# The decision


def inject(
    pod: Mapping[str, Any],
    *,
    namespace: str,
    namespace_opt_in: bool,
    config: InjectionConfig,
) -> Injection:
    """Decide whether ``pod`` gets the kvgate sidecar, and compute the mutation.

    Args:
        pod: the Pod object of the admission request (a dict as the API sends it; it may lack
            ``metadata.name`` and ``metadata.namespace``). Not modified.
        namespace: the request's namespace (authoritative; ``metadata.namespace`` may be unset).
        namespace_opt_in: the namespace has the label ``kvgate.io/inject: "true"``.
        config: how to inject.

    Returns:
        The :class:`Injection`. Never raises for any pod content: unreadable input gives
        ``refused`` (when opted in) or ``skipped``.
    """
    src: dict[str, Any] = copy.deepcopy(dict(pod))
    meta = _dict(src.get("metadata"))
    labels = _dict(meta.get("labels"))
    annotations = _dict(meta.get("annotations"))
    spec = _dict(src.get("spec"))

    # 1. Namespaces kvgate never touches (L13: a label there cannot be trusted either way).
    own = config.own_namespace
    pod_ns = meta.get("namespace")
    for ns in (namespace, pod_ns if isinstance(pod_ns, str) else None):
        if ns is None:
            continue
        if ns in config.excluded_namespaces:
            return _skip(src, "excluded_namespace", f"kvgate: namespace {ns!r} is never injected")
        if own is not None and ns == own:
            return _skip(
                src,
                "excluded_namespace",
                f"kvgate: namespace {ns!r} is kvgate's own and is never injected",
            )

    # 2. Idempotence: never a second sidecar.
    names = {
        c.get("name") for key in ("containers", "initContainers") for c in _containers(spec, key)
    }
    if SIDECAR_NAME in names:
        return Injection(
            "already_injected",
            "already_injected",
            f"kvgate: the pod already has a container {SIDECAR_NAME!r}",
            src,
        )
    if ANNOTATION_INJECTED in annotations:
        return Injection(
            "already_injected",
            "already_injected",
            f"kvgate: the pod has annotation {ANNOTATION_INJECTED} but no {SIDECAR_NAME!r} "
            f"container; remove the annotation to have the sidecar injected",
            src,
        )

    # 3./4. Opt-out beats opt-in.
    ann_inject = annotations.get(ANNOTATION_INJECT)
    label_inject = labels.get(LABEL_INJECT)
    if ann_inject == "false":
        return _skip(
            src, "opted_out", f'kvgate: opted out by annotation {ANNOTATION_INJECT}: "false"'
        )
    if label_inject is not None and label_inject != "true":
        # "false", but also "False", "no", "off": anything but exactly "true" is not an
        # opt-in, and in an opted-in namespace the pod's own label must win.
        return _skip(
            src, "opted_out", f'kvgate: opted out by label {LABEL_INJECT}: "{label_inject}"'
        )
    by_label = label_inject == "true"
    if not (by_label or namespace_opt_in):
        return _skip(
            src,
            "not_opted_in",
            f'kvgate: neither the pod nor its namespace has label {LABEL_INJECT}: "true"',
        )

    # 5. Nothing to protect through the pod network.
    if spec.get("hostNetwork") is True:
        return _skip(
            src,
            "host_network",
            "kvgate: hostNetwork pods are not injected (the sidecar's port would be the node's)",
        )

    # 6. Opted in: refuse rather than inject something that cannot work.
    if ann_inject is not None and ann_inject != "true":
        return _refuse(
            src,
            "bad_annotation",
            f'kvgate: annotation {ANNOTATION_INJECT} must be "true" or "false", '
            f"got {_show(ann_inject)}",
        )
    shape = _shape_error(src)
    if shape is not None:
        return _refuse(src, "malformed_pod", f"kvgate: cannot inject the sidecar: {shape}")

    model_ann, err = _port_annotation(annotations, ANNOTATION_MODEL_PORT)
    if err is not None:
        return _refuse(src, "bad_annotation", err)
    sidecar_ann, err = _port_annotation(annotations, ANNOTATION_SIDECAR_PORT)
    if err is not None:
        return _refuse(src, "bad_annotation", err)
    policy: str | None = None
    if ANNOTATION_POLICY in annotations:
        raw = annotations[ANNOTATION_POLICY]
        if not (isinstance(raw, str) and len(raw) <= 253 and _DNS_SUBDOMAIN_RE.fullmatch(raw)):
            return _refuse(
                src,
                "bad_annotation",
                f"kvgate: annotation {ANNOTATION_POLICY} must be a RateLimitPolicy name "
                f"(lower-case DNS subdomain), got {_show(raw)}",
            )
        policy = raw

    containers = _containers(spec, "containers")
    init_containers = _containers(spec, "initContainers")
    if model_ann is not None:
        model_port = model_ann
        model_from = f"annotation {ANNOTATION_MODEL_PORT}"
    else:
        found = next(((c, p[0]) for c in containers if (p := _tcp_ports(c))), None)
        if found is None:
            hint = (
                f"kvgate: cannot tell the model server's port: no container declares a TCP "
                f"containerPort; set annotation {ANNOTATION_MODEL_PORT}"
            )
            if not by_label:
                return _skip(src, "no_model_port", hint + " (pod skipped: namespace opt-in only)")
            return _refuse(src, "no_model_port", hint)
        model_port = found[1]
        model_from = f"the first containerPort of container {_show(found[0].get('name'))}"
    sidecar_port = config.sidecar_port if sidecar_ann is None else sidecar_ann
    sidecar_what = f"sidecar port {sidecar_port}" + (
        "" if sidecar_ann is None else f" (annotation {ANNOTATION_SIDECAR_PORT})"
    )

    fix = f"set annotation {ANNOTATION_SIDECAR_PORT} to a free port"
    if sidecar_port == model_port:
        return _refuse(
            src,
            "port_clash",
            f"kvgate: {sidecar_what} is the model server's port ({model_from}); {fix}",
        )
    for kind, group in (("container", containers), ("init container", init_containers)):
        for c in group:
            if sidecar_port in _tcp_ports(c):
                return _refuse(
                    src,
                    "port_clash",
                    f"kvgate: {sidecar_what} is already used by {kind} "
                    f"{_show(c.get('name'))}; {fix}",
                )
            for p in c.get("ports") or []:
                if isinstance(p, dict) and p.get("name") == PORT_NAME:
                    return _refuse(
                        src,
                        "name_clash",
                        f"kvgate: {kind} {_show(c.get('name'))} already has a port named "
                        f"{PORT_NAME!r}, which the sidecar needs; rename it",
                    )
    volumes = spec.get("volumes") or []
    if any(v.get("name") == TOKEN_VOLUME for v in volumes):
        return _refuse(
            src,
            "name_clash",
            f"kvgate: the pod already has a volume named {TOKEN_VOLUME!r}, which the sidecar "
            f"needs for its token; rename it, or opt the pod out with annotation "
            f'{ANNOTATION_INJECT}: "false"',
        )

    # 7. Inject. The patch is the single source of truth: the returned pod is the patch applied.
    native = config.native_sidecar
    container = sidecar_container(
        config, model_port=model_port, sidecar_port=sidecar_port, policy=policy
    )
    marker = injected_annotation(model_port=model_port, sidecar_port=sidecar_port, native=native)
    ops: list[dict[str, Any]] = []
    if not isinstance(src.get("metadata"), dict):
        ops.append(
            {
                "op": "add",
                "path": "/metadata",
                "value": {"annotations": {ANNOTATION_INJECTED: marker}},
            }
        )
    elif not isinstance(meta.get("annotations"), dict):
        ops.append(
            {"op": "add", "path": "/metadata/annotations", "value": {ANNOTATION_INJECTED: marker}}
        )
    else:
        ops.append(
            {
                "op": "add",
                "path": "/metadata/annotations/" + escape_pointer(ANNOTATION_INJECTED),
                "value": marker,
            }
        )
    ops.append(_append_op(spec, "/spec", "initContainers" if native else "containers", container))
    ops.append(_append_op(spec, "/spec", "volumes", token_volume(config)))
    mode = "native sidecar (init container)" if native else "container"
    return Injection(
        "injected",
        "injected",
        f"kvgate: sidecar injected as a {mode}: port {sidecar_port} -> model port {model_port}",
        apply_patch(src, ops),
        ops,
    )
