"""The mutation of sidecar injection: the RFC 6902 JSON Patch that adds kvgate to a pod (one
operation per object added), and applying such a patch.

Pure: no I/O, no kopf, no Kubernetes client. :func:`injection_ops` builds the operations from
the pod (read by :mod:`kvgate_operator.inject_pod`) and the :class:`InjectionConfig` (the
container and volumes come from :mod:`kvgate_operator.template`); the webhook returns them as
they are, and :func:`apply_patch` gives the pod they make.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jsonpatch

from kvgate_operator.inject_pod import ANNOTATION_INJECTED, PodView
from kvgate_operator.inject_router import engine_type_ops
from kvgate_operator.inject_store import store_ops
from kvgate_operator.template import (
    InjectionConfig,
    injected_annotation,
    sidecar_container,
    token_volume,
)

__all__ = ["PatchError", "apply_patch", "injection_ops"]


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


def _marker_op(pod: PodView, marker: str) -> dict[str, Any]:
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


def injection_ops(
    pod: PodView,
    config: InjectionConfig,
    *,
    model_port: int,
    sidecar_port: int,
    admin_port: int,
    policy: str | None,
) -> list[dict[str, Any]]:
    """The operations that inject the sidecar into ``pod`` (a pod whose shape can be patched:
    :func:`~kvgate_operator.inject_pod.shape_error` is None), in order: the marker annotation,
    the sidecar (an init container with ``restartPolicy: Always`` when
    ``config.native_sidecar``, else a plain container, appended last), the token volume, then
    the Secret volumes of the store and of the keys and JWKS files, then the EPP engine-type
    label (:func:`~kvgate_operator.inject_router.engine_type_ops`).

    Args:
        pod: the request's pod.
        config: how to inject.
        model_port: the model server's port (1..65535), which the sidecar forwards to.
        sidecar_port: the port the sidecar listens on (1..65535).
        admin_port: the port of the sidecar's admin listener (1..65535).
        policy: the RateLimitPolicy named by the pod's annotation, or None.
    """
    native, files = config.native_sidecar, config.identity_files()
    container = sidecar_container(
        config,
        model_port=model_port,
        sidecar_port=sidecar_port,
        policy=policy,
        admin_port=admin_port,
    )
    marker = injected_annotation(
        model_port=model_port, sidecar_port=sidecar_port, admin_port=admin_port, native=native
    )
    ops = [
        _marker_op(pod, marker),
        _append_op(pod.spec, "initContainers" if native else "containers", container),
        _append_op(pod.spec, "volumes", token_volume(config)),
    ]
    ops += store_ops(config.store)
    ops += [{"op": "add", "path": "/spec/volumes/-", "value": f.pod_volume()} for f in files]
    ops += engine_type_ops(pod.meta.get("labels"), config.epp_engine_type)
    return ops
