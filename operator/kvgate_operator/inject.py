"""Sidecar injection: whether a pod gets the kvgate sidecar, and the JSON Patch that adds it.

Pure: no I/O, no kopf, no Kubernetes client. The mutating webhook calls :func:`inject` with the
pod of an ``AdmissionReview`` request. Invariant: the same pod always gets the same answer, and
an injected pod is never injected again (the API server may call a webhook more than once:
``reinvocationPolicy: IfNeeded``), but is checked again for port and name clashes, which a
later webhook may have added. The rules are the ``_rule_*`` functions below, in the order
:func:`inject` applies them; the first that decides gives the answer. The pod is read by
:mod:`kvgate_operator.inject_pod` (where kvgate's labels and annotations are named; they are
re-exported here), the sidecar's ports read and checked by :mod:`kvgate_operator.inject_ports`
(rules 8-10), the answer is an :mod:`kvgate_operator.inject_result` and the patch is built by
:mod:`kvgate_operator.inject_patch`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

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
    shape_error,
    show,
)
from kvgate_operator.inject_ports import (
    Ports,
    check_clashes,
    clash_after_injection,
    read_annotations,
    resolve_ports,
)
from kvgate_operator.inject_result import Action, Injection, refuse, skip
from kvgate_operator.template import SIDECAR_NAME, InjectionConfig

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
            return skip(pod, "excluded_namespace", f"kvgate: namespace {ns!r} is never injected")
        if config.own_namespace is not None and ns == config.own_namespace:
            return skip(
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
        clash = clash_after_injection(pod) if ANNOTATION_INJECTED in pod.annotations else None
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


def _rule_opted_out(pod: PodView, config: InjectionConfig) -> Injection | None:
    """3. ``opted_out`` (skipped): annotation ``kvgate.io/inject: "false"``, or the pod label
    ``kvgate.io/inject`` with any value but exactly ``"true"`` (``"False"``, ``"no"``...). It
    wins over every opt-in, the namespace's included."""
    if pod.annotations.get(ANNOTATION_INJECT) == "false":
        return skip(
            pod, "opted_out", f'kvgate: opted out by annotation {ANNOTATION_INJECT}: "false"'
        )
    label = pod.labels.get(LABEL_INJECT)
    if label is not None and label != "true":
        return skip(pod, "opted_out", f'kvgate: opted out by label {LABEL_INJECT}: "{label}"')
    return None


def _rule_not_opted_in(pod: PodView, config: InjectionConfig) -> Injection | None:
    """4. ``not_opted_in`` (skipped): neither the pod label ``kvgate.io/inject: "true"`` nor
    the namespace's."""
    if pod.by_label or pod.namespace_opt_in:
        return None
    return skip(
        pod,
        "not_opted_in",
        f'kvgate: neither the pod nor its namespace has label {LABEL_INJECT}: "true"',
    )


def _rule_host_network(pod: PodView, config: InjectionConfig) -> Injection | None:
    """5. ``host_network`` (skipped): ``spec.hostNetwork: true``; the sidecar's port would be
    the node's."""
    if pod.spec.get("hostNetwork") is not True:
        return None
    return skip(
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
    return refuse(
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
    return refuse(pod, "malformed_pod", f"kvgate: cannot inject the sidecar: {shape}")


_GATES: tuple[_Rule, ...] = (
    _rule_excluded_namespace,
    _rule_already_injected,
    _rule_opted_out,
    _rule_not_opted_in,
    _rule_host_network,
    _rule_bad_inject_annotation,
    _rule_malformed_pod,
)


def _rule_inject(
    pod: PodView, ports: Ports, policy: str | None, config: InjectionConfig
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
    ann = read_annotations(p)
    if isinstance(ann, Injection):
        return ann
    ports = resolve_ports(p, ann, config)
    if isinstance(ports, Injection):
        return ports
    return check_clashes(p, ports) or _rule_inject(p, ports, ann.policy, config)
