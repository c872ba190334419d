"""Sidecar injection: whether a pod gets the kvgate sidecar, and the JSON Patch that adds it.

Pure: no I/O, no kopf, no Kubernetes client. The mutating webhook calls :func:`inject` with the
pod of an ``AdmissionReview`` request. Invariant: the same pod always gets the same answer, and
an injected pod is never injected again (the API server may call a webhook more than once:
``reinvocationPolicy: IfNeeded``), but is checked again for port and name clashes, which a
later webhook may have added. The rules are the ``_rule_*`` functions below, in the order
:func:`inject` applies them; the first that decides gives the answer.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import jsonpatch

from kvgate_operator.inject_router import engine_type_ops
from kvgate_operator.inject_store import store_ops
from kvgate_operator.template import (
    PORT_NAME,
    SIDECAR_NAME,
    TOKEN_VOLUME,
    InjectionConfig,
    injected_annotation,
    sidecar_container,
    token_volume,
)

__all__ = [
    "ANNOTATION_INJECT",
    "ANNOTATION_INJECTED",
    "ANNOTATION_MODEL_PORT",
    "ANNOTATION_POLICY",
    "ANNOTATION_SIDECAR_PORT",
    "LABEL_INJECT",
    "Action",
    "Injection",
    "PatchError",
    "apply_patch",
    "inject",
]

LABEL_INJECT = "kvgate.io/inject"
"""Pod or namespace label: exactly ``"true"`` opts in; on a pod, any other value opts out."""
ANNOTATION_INJECT = "kvgate.io/inject"
"""Pod annotation: ``"false"`` opts out, ``"true"`` is accepted, anything else is refused."""
ANNOTATION_INJECTED = "kvgate.io/injected"
"""Written on injection: compact JSON, sorted keys, e.g.
``{"modelPort":8000,"native":true,"sidecarPort":8001,"version":"0.2.0"}``."""
ANNOTATION_MODEL_PORT = "kvgate.io/model-port"
"""The model server's port, 1..65535. Default: the first TCP ``containerPort`` of the first
container that has one."""
ANNOTATION_SIDECAR_PORT = "kvgate.io/sidecar-port"
"""The sidecar's port, 1..65535. Default ``InjectionConfig.sidecar_port``."""
ANNOTATION_POLICY = "kvgate.io/policy"
"""The RateLimitPolicy expected to govern the pod (informational; the sidecar's
``KVGATE_EXPECTED_POLICY``)."""

Action = Literal["injected", "already_injected", "skipped", "refused"]

_PORT_RE = re.compile(r"[1-9][0-9]{0,4}")
_DNS_SUBDOMAIN_RE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


@dataclass(frozen=True)
class Injection:
    """What :func:`inject` decided.

    Attributes:
        action: ``injected``, ``already_injected``, ``skipped`` or ``refused``.
        reason: stable snake_case reason (named by the rule that decided), for logs and metrics.
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


_PATCH_OPS = frozenset({"add", "remove", "replace", "test"})


def apply_patch(doc: Mapping[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """Apply RFC 6902 operations ``add``, ``remove``, ``replace`` and ``test`` (with the
    ``jsonpatch`` library) to a deep copy of ``doc`` and return it (``doc`` is not changed).

    Raises:
        PatchError: an operation is unknown or does not apply (missing parent, bad index,
            failed ``test``), or the result is not an object.
    """
    for op in ops:
        if op.get("op") not in _PATCH_OPS:
            raise PatchError(f"unsupported op {op.get('op')!r}")
    try:
        result = jsonpatch.apply_patch(dict(doc), ops)
    except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
        raise PatchError(str(exc)) from exc
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


def _show(value: Any, limit: int = 64) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class _Pod:
    """The request's pod (a deep copy) and its parts, each ``{}`` / ``[]`` where absent or not
    of the expected type."""

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
            ("container", _containers(self.spec, "containers")),
            ("init container", _containers(self.spec, "initContainers")),
        ]

    def skip(self, reason: str, message: str) -> Injection:
        return Injection("skipped", reason, message, self.src)

    def refuse(self, reason: str, message: str) -> Injection:
        return Injection("refused", reason, message, self.src)


@dataclass(frozen=True)
class _Ports:
    """The ports the sidecar is wired with, and where each came from (for messages)."""

    model: int
    model_from: str
    sidecar: int
    sidecar_annotated: bool

    @property
    def sidecar_what(self) -> str:
        annotated = f" (annotation {ANNOTATION_SIDECAR_PORT})" if self.sidecar_annotated else ""
        return f"sidecar port {self.sidecar}{annotated}"


@dataclass(frozen=True)
class _Annotations:
    """The kvgate annotations that tune injection, validated; None where absent."""

    model_port: int | None
    sidecar_port: int | None
    policy: str | None


# --------------------------------------------------------------------------------------------
# The rules, in the order inject() applies them. Each returns the decision, or None to go on.

_Rule = Callable[[_Pod, InjectionConfig], Injection | None]


def _rule_excluded_namespace(pod: _Pod, config: InjectionConfig) -> Injection | None:
    """1. ``excluded_namespace`` (skipped): the request's or the pod's namespace is in
    ``config.excluded_namespaces`` or is kvgate's own, whatever the labels say. A label on
    kube-system cannot be relied on either way: managed platforms strip it on upgrade
    (https://github.com/Kong/kubernetes-sidecar-injector/issues/4)."""
    pod_ns = pod.meta.get("namespace")
    for ns in (pod.namespace, pod_ns if isinstance(pod_ns, str) else None):
        if ns is None:
            continue
        if ns in config.excluded_namespaces:
            return pod.skip("excluded_namespace", f"kvgate: namespace {ns!r} is never injected")
        if config.own_namespace is not None and ns == config.own_namespace:
            return pod.skip(
                "excluded_namespace",
                f"kvgate: namespace {ns!r} is kvgate's own and is never injected",
            )
    return None


def _rule_already_injected(pod: _Pod, config: InjectionConfig) -> Injection | None:
    """2. ``already_injected``: a container or init container named ``kvgate-sidecar``, or the
    annotation ``kvgate.io/injected``, is present (whatever the config now says). Except
    ``port_clash`` / ``name_clash`` (refused, as rule 10): a pod kvgate injected (annotation and
    container both present) whose other containers now use the sidecar's port or port name, as
    when a later webhook added a container and the API server calls kvgate again
    (``reinvocationPolicy: IfNeeded``): two containers on one port crash-loop."""
    names = {c.get("name") for _, group in pod.groups() for c in group}
    if SIDECAR_NAME in names:
        clash = _clash_after_injection(pod) if ANNOTATION_INJECTED in pod.annotations else None
        if clash is not None:
            return clash
        message = f"kvgate: the pod already has a container {SIDECAR_NAME!r}"
    elif ANNOTATION_INJECTED in pod.annotations:
        message = (
            f"kvgate: the pod has annotation {ANNOTATION_INJECTED} but no {SIDECAR_NAME!r} "
            f"container; remove the annotation to have the sidecar injected"
        )
    else:
        return None
    return Injection("already_injected", "already_injected", message, pod.src)


def _clash_after_injection(pod: _Pod) -> Injection | None:
    """The clash (rule 10's checks, volumes aside) between the injected sidecar's port (its
    port named ``kvgate-http``) and the pod's other containers, or None (also for a pod whose
    shape cannot be checked: the API server's own validation refuses it)."""
    if _shape_error(pod.src) is not None:
        return None
    sidecar = next(c for _, g in pod.groups() for c in g if c.get("name") == SIDECAR_NAME)
    ports = sidecar.get("ports")
    own = [p for p in ports if isinstance(p, dict)] if isinstance(ports, list) else []
    port = next((p.get("containerPort") for p in own if p.get("name") == PORT_NAME), None)
    if not isinstance(port, int) or isinstance(port, bool):
        return None
    spec = {
        key: [c for c in _containers(pod.spec, key) if c.get("name") != SIDECAR_NAME]
        for key in ("containers", "initContainers")
    }
    others = _Pod({**pod.src, "spec": spec}, pod.namespace, pod.namespace_opt_in)
    annotated = ANNOTATION_SIDECAR_PORT in pod.annotations
    clash = _container_clashes(others, _Ports(0, "", port, annotated))
    return None if clash is None else replace(clash, pod=pod.src)


def _rule_opted_out(pod: _Pod, config: InjectionConfig) -> Injection | None:
    """3. ``opted_out`` (skipped): annotation ``kvgate.io/inject: "false"``, or the pod label
    ``kvgate.io/inject`` with any value but exactly ``"true"`` (``"False"``, ``"no"``...). It
    wins over every opt-in, the namespace's included."""
    if pod.annotations.get(ANNOTATION_INJECT) == "false":
        return pod.skip(
            "opted_out", f'kvgate: opted out by annotation {ANNOTATION_INJECT}: "false"'
        )
    label = pod.labels.get(LABEL_INJECT)
    if label is not None and label != "true":
        return pod.skip("opted_out", f'kvgate: opted out by label {LABEL_INJECT}: "{label}"')
    return None


def _rule_not_opted_in(pod: _Pod, config: InjectionConfig) -> Injection | None:
    """4. ``not_opted_in`` (skipped): neither the pod label ``kvgate.io/inject: "true"`` nor
    the namespace's."""
    if pod.by_label or pod.namespace_opt_in:
        return None
    return pod.skip(
        "not_opted_in",
        f'kvgate: neither the pod nor its namespace has label {LABEL_INJECT}: "true"',
    )


def _rule_host_network(pod: _Pod, config: InjectionConfig) -> Injection | None:
    """5. ``host_network`` (skipped): ``spec.hostNetwork: true``; the sidecar's port would be
    the node's."""
    if pod.spec.get("hostNetwork") is not True:
        return None
    return pod.skip(
        "host_network",
        "kvgate: hostNetwork pods are not injected (the sidecar's port would be the node's)",
    )


# From here on the pod is opted in: anything that would leave it crash-looping or silently
# unprotected is refused (the API server rejects the pod with the message).


def _rule_bad_inject_annotation(pod: _Pod, config: InjectionConfig) -> Injection | None:
    """6. ``bad_annotation`` (refused): ``kvgate.io/inject`` is neither ``"true"`` nor
    ``"false"``."""
    value = pod.annotations.get(ANNOTATION_INJECT)
    if value is None or value == "true":
        return None
    return pod.refuse(
        "bad_annotation",
        f'kvgate: annotation {ANNOTATION_INJECT} must be "true" or "false", got {_show(value)}',
    )


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


def _rule_malformed_pod(pod: _Pod, config: InjectionConfig) -> Injection | None:
    """7. ``malformed_pod`` (refused): the pod's structure cannot be patched safely (see
    :func:`_shape_error`)."""
    shape = _shape_error(pod.src)
    if shape is None:
        return None
    return pod.refuse("malformed_pod", f"kvgate: cannot inject the sidecar: {shape}")


_GATES: tuple[_Rule, ...] = (
    _rule_excluded_namespace,
    _rule_already_injected,
    _rule_opted_out,
    _rule_not_opted_in,
    _rule_host_network,
    _rule_bad_inject_annotation,
    _rule_malformed_pod,
)


def _port_annotation(pod: _Pod, key: str) -> int | Injection | None:
    """The port annotated under ``key``; None when absent; the refusal when not 1..65535."""
    if key not in pod.annotations:
        return None
    raw = pod.annotations[key]
    if isinstance(raw, str) and _PORT_RE.fullmatch(raw) and int(raw) <= 65535:
        return int(raw)
    return pod.refuse(
        "bad_annotation",
        f"kvgate: annotation {key} must be a port number 1..65535, got {_show(raw)}",
    )


def _rule_annotations(pod: _Pod) -> _Annotations | Injection:
    """8. ``bad_annotation`` (refused): ``kvgate.io/model-port`` or ``kvgate.io/sidecar-port``
    is not a port 1..65535, or ``kvgate.io/policy`` is not a RateLimitPolicy name (a lower-case
    DNS subdomain)."""
    model_port = _port_annotation(pod, ANNOTATION_MODEL_PORT)
    if isinstance(model_port, Injection):
        return model_port
    sidecar_port = _port_annotation(pod, ANNOTATION_SIDECAR_PORT)
    if isinstance(sidecar_port, Injection):
        return sidecar_port
    if ANNOTATION_POLICY not in pod.annotations:
        return _Annotations(model_port, sidecar_port, None)
    policy = pod.annotations[ANNOTATION_POLICY]
    if isinstance(policy, str) and len(policy) <= 253 and _DNS_SUBDOMAIN_RE.fullmatch(policy):
        return _Annotations(model_port, sidecar_port, policy)
    return pod.refuse(
        "bad_annotation",
        f"kvgate: annotation {ANNOTATION_POLICY} must be a RateLimitPolicy name "
        f"(lower-case DNS subdomain), got {_show(policy)}",
    )


def _rule_ports(pod: _Pod, ann: _Annotations, config: InjectionConfig) -> _Ports | Injection:
    """9. ``no_model_port``: no ``kvgate.io/model-port`` annotation and no TCP
    ``containerPort`` in any container. Refused, except for a pod opted in only through its
    namespace: that is skipped (it is not a server, e.g. a Job or a debug pod, and must not be
    blocked)."""
    sidecar = config.sidecar_port if ann.sidecar_port is None else ann.sidecar_port
    annotated = ann.sidecar_port is not None
    if ann.model_port is not None:
        return _Ports(ann.model_port, f"annotation {ANNOTATION_MODEL_PORT}", sidecar, annotated)
    containers = _containers(pod.spec, "containers")
    found = next(((c, p[0]) for c in containers if (p := _tcp_ports(c))), None)
    if found is not None:
        model_from = f"the first containerPort of container {_show(found[0].get('name'))}"
        return _Ports(found[1], model_from, sidecar, annotated)
    hint = (
        f"kvgate: cannot tell the model server's port: no container declares a TCP "
        f"containerPort; set annotation {ANNOTATION_MODEL_PORT}"
    )
    if not pod.by_label:
        return pod.skip("no_model_port", hint + " (pod skipped: namespace opt-in only)")
    return pod.refuse("no_model_port", hint)


def _rule_clashes(pod: _Pod, ports: _Ports) -> Injection | None:
    """10. ``port_clash`` (refused): the sidecar port is the model port or a TCP port of a
    container. ``name_clash`` (refused): a container already has a port named ``kvgate-http``,
    or the pod a volume named ``kvgate-token``. Containers are checked in order (containers,
    then init containers), each for its ports then its port names; volumes last."""
    if ports.sidecar == ports.model:
        return pod.refuse(
            "port_clash",
            f"kvgate: {ports.sidecar_what} is the model server's port ({ports.model_from}); "
            f"set annotation {ANNOTATION_SIDECAR_PORT} to a free port",
        )
    clash = _container_clashes(pod, ports)
    if clash is not None:
        return clash
    if any(v.get("name") == TOKEN_VOLUME for v in pod.spec.get("volumes") or []):
        return pod.refuse(
            "name_clash",
            f"kvgate: the pod already has a volume named {TOKEN_VOLUME!r}, which the sidecar "
            f"needs for its token; rename it, or opt the pod out with annotation "
            f'{ANNOTATION_INJECT}: "false"',
        )
    return None


def _container_clashes(pod: _Pod, ports: _Ports) -> Injection | None:
    """Rule 10's checks of the containers (then init containers), in order: each for its TCP
    ports (``port_clash``), then its port names (``name_clash``)."""
    fix = f"set annotation {ANNOTATION_SIDECAR_PORT} to a free port"
    for kind, group in pod.groups():
        for c in group:
            name = _show(c.get("name"))
            if ports.sidecar in _tcp_ports(c):
                return pod.refuse(
                    "port_clash",
                    f"kvgate: {ports.sidecar_what} is already used by {kind} {name}; {fix}",
                )
            if any(
                isinstance(p, dict) and p.get("name") == PORT_NAME for p in c.get("ports") or []
            ):
                return pod.refuse(
                    "name_clash",
                    f"kvgate: {kind} {name} already has a port named {PORT_NAME!r}, which the "
                    f"sidecar needs; rename it",
                )
    return None


# --------------------------------------------------------------------------------------------
# The mutation: one patch operation per object added


def _marker_op(pod: _Pod, marker: str) -> dict[str, Any]:
    """``add`` the ``kvgate.io/injected`` annotation, creating ``metadata`` or
    ``metadata.annotations`` when absent."""
    if not isinstance(pod.src.get("metadata"), dict):
        return {
            "op": "add",
            "path": "/metadata",
            "value": {"annotations": {ANNOTATION_INJECTED: marker}},
        }
    if not isinstance(pod.meta.get("annotations"), dict):
        return {
            "op": "add",
            "path": "/metadata/annotations",
            "value": {ANNOTATION_INJECTED: marker},
        }
    path = jsonpatch.JsonPointer.from_parts(("metadata", "annotations", ANNOTATION_INJECTED))
    return {"op": "add", "path": path.path, "value": marker}


def _append_op(spec: Mapping[str, Any], key: str, item: Any) -> dict[str, Any]:
    """``add`` ``item`` at the end of ``spec[key]``, creating the list when absent or null."""
    if isinstance(spec.get(key), list):
        return {"op": "add", "path": f"/spec/{key}/-", "value": item}
    return {"op": "add", "path": f"/spec/{key}", "value": [item]}


def _rule_inject(
    pod: _Pod, ports: _Ports, policy: str | None, config: InjectionConfig
) -> Injection:
    """11. ``injected``: the marker annotation, the sidecar (an init container with
    ``restartPolicy: Always`` when ``config.native_sidecar``, else a plain container, appended
    last), the token volume, the Secret volumes (store, keys, JWKS) and the EPP engine-type label.
    The patch is the single source of truth: the returned pod is the patch applied."""
    native, files = config.native_sidecar, config.identity_files()
    container = sidecar_container(
        config, model_port=ports.model, sidecar_port=ports.sidecar, policy=policy
    )
    marker = injected_annotation(model_port=ports.model, sidecar_port=ports.sidecar, native=native)
    ops = [
        _marker_op(pod, marker),
        _append_op(pod.spec, "initContainers" if native else "containers", container),
        _append_op(pod.spec, "volumes", token_volume(config)),
    ]
    ops += store_ops(config.store)
    ops += [{"op": "add", "path": "/spec/volumes/-", "value": f.pod_volume()} for f in files]
    ops += engine_type_ops(pod.meta.get("labels"), config.epp_engine_type)
    mode = "native sidecar (init container)" if native else "container"
    return Injection(
        "injected",
        "injected",
        f"kvgate: sidecar injected as a {mode}: port {ports.sidecar} -> model port {ports.model}",
        apply_patch(pod.src, ops),
        ops,
    )


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
        The :class:`Injection` of the first rule that decides. Never raises for any pod
        content: unreadable input gives ``refused`` (when opted in) or ``skipped``.
    """
    p = _Pod(copy.deepcopy(dict(pod)), namespace, namespace_opt_in)
    for rule in _GATES:
        decided = rule(p, config)
        if decided is not None:
            return decided
    ann = _rule_annotations(p)
    if isinstance(ann, Injection):
        return ann
    ports = _rule_ports(p, ann, config)
    if isinstance(ports, Injection):
        return ports
    return _rule_clashes(p, ports) or _rule_inject(p, ports, ann.policy, config)
