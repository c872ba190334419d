"""Sidecar injection: whether a pod gets the kvgate sidecar, and the JSON Patch that adds it.

Pure: no I/O, no kopf, no Kubernetes client. The mutating webhook calls :func:`inject` with the
pod of an ``AdmissionReview`` request. Invariant: the same pod always gets the same answer, and
an injected pod is never injected again (the API server may call a webhook more than once:
``reinvocationPolicy: IfNeeded``), but is checked again for port and name clashes, which a
later webhook may have added. The rules are the ``_rule_*`` functions below, in the order
:func:`inject` applies them; the first that decides gives the answer. The pod is read by
:mod:`kvgate_operator.inject_pod` (where kvgate's labels and annotations are named; they are
re-exported here) and the patch built by :mod:`kvgate_operator.inject_patch`.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from kvgate_operator.inject_patch import PatchError, apply_patch, injection_ops
from kvgate_operator.inject_pod import (
    ANNOTATION_ADMIN_PORT,
    ANNOTATION_INJECT,
    ANNOTATION_INJECTED,
    ANNOTATION_MODEL_PORT,
    ANNOTATION_POLICY,
    ANNOTATION_SIDECAR_PORT,
    LABEL_INJECT,
    PodView,
    containers,
    shape_error,
    show,
    tcp_ports,
)
from kvgate_operator.template import (
    ADMIN_PORT_NAME,
    PORT_NAME,
    SIDECAR_NAME,
    TOKEN_VOLUME,
    InjectionConfig,
)

__all__ = [
    "ANNOTATION_ADMIN_PORT",
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


@dataclass(frozen=True)
class _Ports:
    """The ports the sidecar is wired with, and where each came from (for messages). ``admin``
    is None only for a pod injected by a template before the admin port (0.3.0)."""

    model: int
    model_from: str
    sidecar: int
    sidecar_annotated: bool
    admin: int | None
    admin_annotated: bool = False

    @property
    def sidecar_what(self) -> str:
        annotated = f" (annotation {ANNOTATION_SIDECAR_PORT})" if self.sidecar_annotated else ""
        return f"sidecar port {self.sidecar}{annotated}"

    @property
    def admin_what(self) -> str:
        annotated = f" (annotation {ANNOTATION_ADMIN_PORT})" if self.admin_annotated else ""
        return f"sidecar admin port {self.admin}{annotated}"

    def own(self) -> list[tuple[int, str, str]]:
        """The sidecar's ports: (port, what it is in a message, the annotation that moves it)."""
        out = [(self.sidecar, self.sidecar_what, ANNOTATION_SIDECAR_PORT)]
        if self.admin is not None:
            out.append((self.admin, self.admin_what, ANNOTATION_ADMIN_PORT))
        return out


@dataclass(frozen=True)
class _Annotations:
    """The kvgate annotations that tune injection, validated; None where absent."""

    model_port: int | None
    sidecar_port: int | None
    admin_port: int | None
    policy: str | None


def _skip(pod: PodView, reason: str, message: str) -> Injection:
    return Injection("skipped", reason, message, pod.src)


def _refuse(pod: PodView, reason: str, message: str) -> Injection:
    return Injection("refused", reason, message, pod.src)


# --------------------------------------------------------------------------------------------
# The rules, in the order inject() applies them. Each returns the decision, or None to go on.

_Rule = Callable[[PodView, InjectionConfig], Injection | None]


def _rule_excluded_namespace(pod: PodView, config: InjectionConfig) -> Injection | None:
    """1. ``excluded_namespace`` (skipped): the request's or the pod's namespace is in
    ``config.excluded_namespaces`` or is kvgate's own, whatever the labels say. A label on
    kube-system cannot be relied on either way: managed platforms strip it on upgrade
    (https://github.com/Kong/kubernetes-sidecar-injector/issues/4)."""
    pod_ns = pod.meta.get("namespace")
    for ns in (pod.namespace, pod_ns if isinstance(pod_ns, str) else None):
        if ns is None:
            continue
        if ns in config.excluded_namespaces:
            return _skip(pod, "excluded_namespace", f"kvgate: namespace {ns!r} is never injected")
        if config.own_namespace is not None and ns == config.own_namespace:
            return _skip(
                pod,
                "excluded_namespace",
                f"kvgate: namespace {ns!r} is kvgate's own and is never injected",
            )
    return None


def _rule_already_injected(pod: PodView, config: InjectionConfig) -> Injection | None:
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


def _clash_after_injection(pod: PodView) -> Injection | None:
    """The clash (rule 10's checks, volumes aside) between the injected sidecar's ports (those
    named ``kvgate-http`` and ``kvgate-admin``; a template before 0.3.0 had no admin port) and
    the pod's other containers, or None (also for a pod whose shape cannot be checked: the API
    server's own validation refuses it)."""
    if shape_error(pod.src) is not None:
        return None
    sidecar = next(c for _, g in pod.groups() for c in g if c.get("name") == SIDECAR_NAME)
    ports = sidecar.get("ports")
    own = [p for p in ports if isinstance(p, dict)] if isinstance(ports, list) else []

    def port_named(name: str) -> int | None:
        port = next((p.get("containerPort") for p in own if p.get("name") == name), None)
        return port if isinstance(port, int) and not isinstance(port, bool) else None

    port, admin = port_named(PORT_NAME), port_named(ADMIN_PORT_NAME)
    if port is None:
        return None
    spec = {
        key: [c for c in containers(pod.spec, key) if c.get("name") != SIDECAR_NAME]
        for key in ("containers", "initContainers")
    }
    others = PodView({**pod.src, "spec": spec}, pod.namespace, pod.namespace_opt_in)
    annotated = ANNOTATION_SIDECAR_PORT in pod.annotations
    admin_annotated = ANNOTATION_ADMIN_PORT in pod.annotations
    clash = _container_clashes(others, _Ports(0, "", port, annotated, admin, admin_annotated))
    return None if clash is None else replace(clash, pod=pod.src)


def _rule_opted_out(pod: PodView, config: InjectionConfig) -> Injection | None:
    """3. ``opted_out`` (skipped): annotation ``kvgate.io/inject: "false"``, or the pod label
    ``kvgate.io/inject`` with any value but exactly ``"true"`` (``"False"``, ``"no"``...). It
    wins over every opt-in, the namespace's included."""
    if pod.annotations.get(ANNOTATION_INJECT) == "false":
        return _skip(
            pod, "opted_out", f'kvgate: opted out by annotation {ANNOTATION_INJECT}: "false"'
        )
    label = pod.labels.get(LABEL_INJECT)
    if label is not None and label != "true":
        return _skip(pod, "opted_out", f'kvgate: opted out by label {LABEL_INJECT}: "{label}"')
    return None


def _rule_not_opted_in(pod: PodView, config: InjectionConfig) -> Injection | None:
    """4. ``not_opted_in`` (skipped): neither the pod label ``kvgate.io/inject: "true"`` nor
    the namespace's."""
    if pod.by_label or pod.namespace_opt_in:
        return None
    return _skip(
        pod,
        "not_opted_in",
        f'kvgate: neither the pod nor its namespace has label {LABEL_INJECT}: "true"',
    )


def _rule_host_network(pod: PodView, config: InjectionConfig) -> Injection | None:
    """5. ``host_network`` (skipped): ``spec.hostNetwork: true``; the sidecar's port would be
    the node's."""
    if pod.spec.get("hostNetwork") is not True:
        return None
    return _skip(
        pod,
        "host_network",
        "kvgate: hostNetwork pods are not injected (the sidecar's port would be the node's)",
    )


# From here on the pod is opted in: anything that would leave it crash-looping or silently
# unprotected is refused (the API server rejects the pod with the message).


def _rule_bad_inject_annotation(pod: PodView, config: InjectionConfig) -> Injection | None:
    """6. ``bad_annotation`` (refused): ``kvgate.io/inject`` is neither ``"true"`` nor
    ``"false"``."""
    value = pod.annotations.get(ANNOTATION_INJECT)
    if value is None or value == "true":
        return None
    return _refuse(
        pod,
        "bad_annotation",
        f'kvgate: annotation {ANNOTATION_INJECT} must be "true" or "false", got {show(value)}',
    )


def _rule_malformed_pod(pod: PodView, config: InjectionConfig) -> Injection | None:
    """7. ``malformed_pod`` (refused): the pod's structure cannot be patched safely (see
    :func:`~kvgate_operator.inject_pod.shape_error`)."""
    shape = shape_error(pod.src)
    if shape is None:
        return None
    return _refuse(pod, "malformed_pod", f"kvgate: cannot inject the sidecar: {shape}")


_GATES: tuple[_Rule, ...] = (
    _rule_excluded_namespace,
    _rule_already_injected,
    _rule_opted_out,
    _rule_not_opted_in,
    _rule_host_network,
    _rule_bad_inject_annotation,
    _rule_malformed_pod,
)


def _port_annotation(pod: PodView, key: str) -> int | Injection | None:
    """The port annotated under ``key``; None when absent; the refusal when not 1..65535."""
    if key not in pod.annotations:
        return None
    raw = pod.annotations[key]
    if isinstance(raw, str) and _PORT_RE.fullmatch(raw) and int(raw) <= 65535:
        return int(raw)
    return _refuse(
        pod,
        "bad_annotation",
        f"kvgate: annotation {key} must be a port number 1..65535, got {show(raw)}",
    )


def _rule_annotations(pod: PodView) -> _Annotations | Injection:
    """8. ``bad_annotation`` (refused): ``kvgate.io/model-port``, ``kvgate.io/sidecar-port`` or
    ``kvgate.io/admin-port`` is not a port 1..65535, or ``kvgate.io/policy`` is not a
    RateLimitPolicy name (a lower-case DNS subdomain)."""
    ports: list[int | None] = []
    for key in (ANNOTATION_MODEL_PORT, ANNOTATION_SIDECAR_PORT, ANNOTATION_ADMIN_PORT):
        port = _port_annotation(pod, key)
        if isinstance(port, Injection):
            return port
        ports.append(port)
    model_port, sidecar_port, admin_port = ports
    if ANNOTATION_POLICY not in pod.annotations:
        return _Annotations(model_port, sidecar_port, admin_port, None)
    policy = pod.annotations[ANNOTATION_POLICY]
    if isinstance(policy, str) and len(policy) <= 253 and _DNS_SUBDOMAIN_RE.fullmatch(policy):
        return _Annotations(model_port, sidecar_port, admin_port, policy)
    return _refuse(
        pod,
        "bad_annotation",
        f"kvgate: annotation {ANNOTATION_POLICY} must be a RateLimitPolicy name "
        f"(lower-case DNS subdomain), got {show(policy)}",
    )


def _rule_ports(pod: PodView, ann: _Annotations, config: InjectionConfig) -> _Ports | Injection:
    """9. ``no_model_port``: no ``kvgate.io/model-port`` annotation and no TCP
    ``containerPort`` in any container. Refused, except for a pod opted in only through its
    namespace: that is skipped (it is not a server, e.g. a Job or a debug pod, and must not be
    blocked)."""
    sidecar = config.sidecar_port if ann.sidecar_port is None else ann.sidecar_port
    annotated = ann.sidecar_port is not None
    admin = config.admin_port if ann.admin_port is None else ann.admin_port
    admin_annotated = ann.admin_port is not None
    if ann.model_port is not None:
        model_from = f"annotation {ANNOTATION_MODEL_PORT}"
        return _Ports(ann.model_port, model_from, sidecar, annotated, admin, admin_annotated)
    first = containers(pod.spec, "containers")
    found = next(((c, p[0]) for c in first if (p := tcp_ports(c))), None)
    if found is not None:
        model_from = f"the first containerPort of container {show(found[0].get('name'))}"
        return _Ports(found[1], model_from, sidecar, annotated, admin, admin_annotated)
    hint = (
        f"kvgate: cannot tell the model server's port: no container declares a TCP "
        f"containerPort; set annotation {ANNOTATION_MODEL_PORT}"
    )
    if not pod.by_label:
        return _skip(pod, "no_model_port", hint + " (pod skipped: namespace opt-in only)")
    return _refuse(pod, "no_model_port", hint)


def _rule_clashes(pod: PodView, ports: _Ports) -> Injection | None:
    """10. ``port_clash`` (refused): the sidecar port or its admin port is the model port, the
    two are one port, or either is a TCP port of a container. ``name_clash`` (refused): a
    container already has a port named ``kvgate-http`` or ``kvgate-admin``, or the pod a volume
    named ``kvgate-token``. Containers are checked in order (containers, then init containers),
    each for its ports then its port names; volumes last."""
    for port, what, key in ports.own():
        if port == ports.model:
            return _refuse(
                pod,
                "port_clash",
                f"kvgate: {what} is the model server's port ({ports.model_from}); "
                f"set annotation {key} to a free port",
            )
    if ports.admin == ports.sidecar:
        return _refuse(
            pod,
            "port_clash",
            f"kvgate: {ports.admin_what} is the {ports.sidecar_what}; set annotation "
            f"{ANNOTATION_ADMIN_PORT} to a free port",
        )
    clash = _container_clashes(pod, ports)
    if clash is not None:
        return clash
    if any(v.get("name") == TOKEN_VOLUME for v in pod.spec.get("volumes") or []):
        return _refuse(
            pod,
            "name_clash",
            f"kvgate: the pod already has a volume named {TOKEN_VOLUME!r}, which the sidecar "
            f"needs for its token; rename it, or opt the pod out with annotation "
            f'{ANNOTATION_INJECT}: "false"',
        )
    return None


def _container_clashes(pod: PodView, ports: _Ports) -> Injection | None:
    """Rule 10's checks of the containers (then init containers), in order: each for its TCP
    ports (``port_clash``), then its port names (``name_clash``)."""
    own = ports.own()
    names = (PORT_NAME, ADMIN_PORT_NAME)
    for kind, group in pod.groups():
        for c in group:
            name = show(c.get("name"))
            used = tcp_ports(c)
            for port, what, key in own:
                if port in used:
                    return _refuse(
                        pod,
                        "port_clash",
                        f"kvgate: {what} is already used by {kind} {name}; "
                        f"set annotation {key} to a free port",
                    )
            declared = {p.get("name") for p in c.get("ports") or [] if isinstance(p, dict)}
            taken = next((n for n in names if n in declared), None)
            if taken is not None:
                return _refuse(
                    pod,
                    "name_clash",
                    f"kvgate: {kind} {name} already has a port named {taken!r}, which the "
                    f"sidecar needs; rename it",
                )
    return None


def _rule_inject(
    pod: PodView, ports: _Ports, policy: str | None, config: InjectionConfig
) -> Injection:
    """11. ``injected``: the marker annotation, the sidecar (an init container with
    ``restartPolicy: Always`` when ``config.native_sidecar``, else a plain container, appended
    last), the token volume, the Secret volumes (store, keys, JWKS) and the EPP engine-type
    label (:func:`~kvgate_operator.inject_patch.injection_ops`). The patch is the single source of
    truth: the returned pod is the patch applied."""
    assert ports.admin is not None  # None only for a pod injected before, never injected again
    ops = injection_ops(
        pod,
        config,
        model_port=ports.model,
        sidecar_port=ports.sidecar,
        admin_port=ports.admin,
        policy=policy,
    )
    mode = "native sidecar (init container)" if config.native_sidecar else "container"
    return Injection(
        "injected",
        "injected",
        f"kvgate: sidecar injected as a {mode}: port {ports.sidecar} -> model port {ports.model}"
        f" (admin port {ports.admin})",
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
    p = PodView(copy.deepcopy(dict(pod)), namespace, namespace_opt_in)
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
