"""The sidecar's ports in sidecar injection (rules 8-10 of :func:`kvgate_operator.inject.inject`,
and rule 2's check of a pod injected before): the annotations that tune them, where the model
server's port comes from, and the clashes with the pod's own ports, port names and volumes.
Pure, like the rest of injection."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from kvgate_operator.inject_pod import (
    ANNOTATION_ADMIN_PORT,
    ANNOTATION_INJECT,
    ANNOTATION_MODEL_PORT,
    ANNOTATION_POLICY,
    ANNOTATION_SIDECAR_PORT,
    PodView,
    containers,
    shape_error,
    show,
    tcp_ports,
)
from kvgate_operator.inject_result import Injection, refuse, skip
from kvgate_operator.template import (
    ADMIN_PORT_NAME,
    PORT_NAME,
    SIDECAR_NAME,
    TOKEN_VOLUME,
    InjectionConfig,
)

__all__ = [
    "Annotations",
    "Ports",
    "check_clashes",
    "clash_after_injection",
    "read_annotations",
    "resolve_ports",
]

PORT_RE = re.compile(r"[1-9][0-9]{0,4}")
DNS_SUBDOMAIN_RE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


@dataclass(frozen=True)
class Ports:
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
class Annotations:
    """The kvgate annotations that tune injection, validated; None where absent."""

    model_port: int | None
    sidecar_port: int | None
    admin_port: int | None
    policy: str | None


def clash_after_injection(pod: PodView) -> Injection | None:
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
    clash = container_clashes(others, Ports(0, "", port, annotated, admin, admin_annotated))
    return None if clash is None else replace(clash, pod=pod.src)


def port_annotation(pod: PodView, key: str) -> int | Injection | None:
    """The port annotated under ``key``; None when absent; the refusal when not 1..65535."""
    if key not in pod.annotations:
        return None
    raw = pod.annotations[key]
    if isinstance(raw, str) and PORT_RE.fullmatch(raw) and int(raw) <= 65535:
        return int(raw)
    return refuse(
        pod,
        "bad_annotation",
        f"kvgate: annotation {key} must be a port number 1..65535, got {show(raw)}",
    )


def read_annotations(pod: PodView) -> Annotations | Injection:
    """8. ``bad_annotation`` (refused): ``kvgate.io/model-port``, ``kvgate.io/sidecar-port`` or
    ``kvgate.io/admin-port`` is not a port 1..65535, or ``kvgate.io/policy`` is not a
    RateLimitPolicy name (a lower-case DNS subdomain)."""
    ports: list[int | None] = []
    for key in (ANNOTATION_MODEL_PORT, ANNOTATION_SIDECAR_PORT, ANNOTATION_ADMIN_PORT):
        port = port_annotation(pod, key)
        if isinstance(port, Injection):
            return port
        ports.append(port)
    model_port, sidecar_port, admin_port = ports
    if ANNOTATION_POLICY not in pod.annotations:
        return Annotations(model_port, sidecar_port, admin_port, None)
    policy = pod.annotations[ANNOTATION_POLICY]
    if isinstance(policy, str) and len(policy) <= 253 and DNS_SUBDOMAIN_RE.fullmatch(policy):
        return Annotations(model_port, sidecar_port, admin_port, policy)
    return refuse(
        pod,
        "bad_annotation",
        f"kvgate: annotation {ANNOTATION_POLICY} must be a RateLimitPolicy name "
        f"(lower-case DNS subdomain), got {show(policy)}",
    )


def resolve_ports(pod: PodView, ann: Annotations, config: InjectionConfig) -> Ports | Injection:
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
        return Ports(ann.model_port, model_from, sidecar, annotated, admin, admin_annotated)
    first = containers(pod.spec, "containers")
    found = next(((c, p[0]) for c in first if (p := tcp_ports(c))), None)
    if found is not None:
        model_from = f"the first containerPort of container {show(found[0].get('name'))}"
        return Ports(found[1], model_from, sidecar, annotated, admin, admin_annotated)
    hint = (
        f"kvgate: cannot tell the model server's port: no container declares a TCP "
        f"containerPort; set annotation {ANNOTATION_MODEL_PORT}"
    )
    if not pod.by_label:
        return skip(pod, "no_model_port", hint + " (pod skipped: namespace opt-in only)")
    return refuse(pod, "no_model_port", hint)


def check_clashes(pod: PodView, ports: Ports) -> Injection | None:
    """10. ``port_clash`` (refused): the sidecar port or its admin port is the model port, the
    two are one port, or either is a TCP port of a container. ``name_clash`` (refused): a
    container already has a port named ``kvgate-http`` or ``kvgate-admin``, or the pod a volume
    named ``kvgate-token``. Containers are checked in order (containers, then init containers),
    each for its ports then its port names; volumes last."""
    for port, what, key in ports.own():
        if port == ports.model:
            return refuse(
                pod,
                "port_clash",
                f"kvgate: {what} is the model server's port ({ports.model_from}); "
                f"set annotation {key} to a free port",
            )
    if ports.admin == ports.sidecar:
        return refuse(
            pod,
            "port_clash",
            f"kvgate: {ports.admin_what} is the {ports.sidecar_what}; set annotation "
            f"{ANNOTATION_ADMIN_PORT} to a free port",
        )
    clash = container_clashes(pod, ports)
    if clash is not None:
        return clash
    if any(v.get("name") == TOKEN_VOLUME for v in pod.spec.get("volumes") or []):
        return refuse(
            pod,
            "name_clash",
            f"kvgate: the pod already has a volume named {TOKEN_VOLUME!r}, which the sidecar "
            f"needs for its token; rename it, or opt the pod out with annotation "
            f'{ANNOTATION_INJECT}: "false"',
        )
    return None


def container_clashes(pod: PodView, ports: Ports) -> Injection | None:
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
                    return refuse(
                        pod,
                        "port_clash",
                        f"kvgate: {what} is already used by {kind} {name}; "
                        f"set annotation {key} to a free port",
                    )
            declared = {p.get("name") for p in c.get("ports") or [] if isinstance(p, dict)}
            taken = next((n for n in names if n in declared), None)
            if taken is not None:
                return refuse(
                    pod,
                    "name_clash",
                    f"kvgate: {kind} {name} already has a port named {taken!r}, which the "
                    f"sidecar needs; rename it",
                )
    return None
