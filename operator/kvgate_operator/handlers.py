"""kopf handlers: thin. Every watch event only triggers a reconcile pass; the work happens in
:mod:`kvgate_operator.reconciler` and the pure modules below it.

No handler here uses a finalizer (only ``on.event``, ``on.startup``, ``on.cleanup`` and
``on.probe``), so the operator never adds, removes or fights over finalizers on anybody's
objects (field lesson L08, kopf #664).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import kopf
from kubernetes import client, config

from kvgate_agent.contract.nodeadmission import NODE_ADMISSION_PLURAL, RATE_LIMIT_POLICY_PLURAL
from kvgate_agent.contract.policy import API_GROUP
from kvgate_operator.reconciler import Reconciler
from kvgate_operator.settings import OperatorSettings

log = logging.getLogger("kvgate.operator")
SETTINGS = OperatorSettings()
_state: dict[str, Any] = {}


def _api_client() -> client.ApiClient:
    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except config.ConfigException:
        config.load_kube_config()  # type: ignore[no-untyped-call]
    return client.ApiClient()


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
    """Configure kopf's watches and start the reconcile loop."""
    settings.watching.server_timeout = SETTINGS.watch_server_timeout
    settings.watching.client_timeout = SETTINGS.watch_client_timeout
    settings.watching.connect_timeout = SETTINGS.connect_timeout
    settings.posting.level = logging.WARNING
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)  # no line per watch event
    settings.persistence.finalizer = "kvgate.io/unused-finalizer"  # never added: no on.create
    reconciler = Reconciler(_api_client(), SETTINGS)
    _state["reconciler"] = reconciler
    _state["task"] = asyncio.create_task(reconciler.run())
    reconciler.trigger()


@kopf.on.cleanup()
async def cleanup(**_: Any) -> None:
    """Stop the reconcile loop."""
    task = _state.get("task")
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _fingerprint(kind: str, body: Any) -> object:
    """The parts of an object that desired state depends on; other changes (pod status churn,
    the agent's heartbeats, our own status writes) trigger nothing."""
    meta = body.get("metadata") or {}
    deleting = meta.get("deletionTimestamp") is not None
    if kind == "pods":
        status = body.get("status") or {}
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions") or []
        )
        labels = tuple(sorted((meta.get("labels") or {}).items()))
        return (
            labels,
            (body.get("spec") or {}).get("nodeName"),
            status.get("phase"),
            ready,
            deleting,
        )
    if kind == "policies":
        return (meta.get("generation"), deleting)
    if kind == "nodeadmissions":
        pods = (body.get("status") or {}).get("pods") or []
        capacity = tuple(
            sorted(
                (p.get("uid"), p.get("engineKvCapacityTokens"))
                for p in pods
                if p.get("engineKvCapacityTokens")
            )
        )
        return (meta.get("generation"), capacity)
    return deleting  # nodes: only their coming and going matters


_seen: dict[tuple[str, str], object] = {}


def _on_event(kind: str) -> Any:
    def handler(event: Any, **_: Any) -> None:
        body = event.get("object") or {}
        key = (kind, (body.get("metadata") or {}).get("uid", ""))
        if event.get("type") == "DELETED":
            _seen.pop(key, None)
        else:
            fp = _fingerprint(kind, body)
            if _seen.get(key, _MISSING) == fp:
                return
            _seen[key] = fp
        r = _state.get("reconciler")
        if r is not None:
            r.trigger()

    handler.__name__ = f"trigger_on_{kind}"
    return handler


_MISSING = object()
kopf.on.event(API_GROUP, "v1alpha1", RATE_LIMIT_POLICY_PLURAL)(_on_event("policies"))
kopf.on.event("", "v1", "pods")(_on_event("pods"))
kopf.on.event("", "v1", "nodes")(_on_event("nodes"))
kopf.on.event(API_GROUP, "v1alpha1", NODE_ADMISSION_PLURAL)(_on_event("nodeadmissions"))


@kopf.on.probe(id="reconciler")
def reconciler_alive(**_: Any) -> str:
    """Liveness: fails (the endpoint answers 500) when no pass succeeded recently."""
    r: Reconciler | None = _state.get("reconciler")
    task: asyncio.Task[None] | None = _state.get("task")
    if r is None or task is None or task.done():
        raise kopf.PermanentError("the reconcile loop is not running")
    ok, why = r.healthy()
    if not ok:
        raise kopf.PermanentError(why)
    return why
