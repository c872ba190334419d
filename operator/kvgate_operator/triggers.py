"""Which watch events trigger a reconcile pass. Pure: functions over watch events, no kopf.

Invariant: an event triggers a pass only when something :mod:`kvgate_operator.desired` reads
has changed (or the object went away); pod status churn, the node agents' heartbeats and the
operator's own status writes trigger nothing.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

from kvgate_agent.contract.api import API_VERSION, NODE_ADMISSION_PLURAL, RATE_LIMIT_POLICY_PLURAL


class Kind(enum.Enum):
    """A watched kind; the value names the kopf handler (``trigger_on_<value>``)."""

    POLICIES = "policies"
    PODS = "pods"
    NODES = "nodes"
    NODE_ADMISSIONS = "nodeadmissions"


@dataclass(frozen=True)
class Watch:
    """What kopf watches for a kind: ``group`` ("" for the core API), ``version``, ``plural``."""

    group: str
    version: str
    plural: str


_GROUP, _VERSION = API_VERSION.split("/")

#: Every watched kind and the resource kopf watches for it.
WATCHES: Mapping[Kind, Watch] = {
    Kind.POLICIES: Watch(_GROUP, _VERSION, RATE_LIMIT_POLICY_PLURAL),
    Kind.PODS: Watch("", "v1", "pods"),
    Kind.NODES: Watch("", "v1", "nodes"),
    Kind.NODE_ADMISSIONS: Watch(_GROUP, _VERSION, NODE_ADMISSION_PLURAL),
}


def _dict(x: Any) -> Mapping[str, Any]:
    return x if isinstance(x, Mapping) else {}


def _pod(body: Mapping[str, Any], meta: Mapping[str, Any], deleting: bool) -> Hashable:
    status = _dict(body.get("status"))
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    labels = tuple(sorted(_dict(meta.get("labels")).items()))
    return (labels, _dict(body.get("spec")).get("nodeName"), status.get("phase"), ready, deleting)


def _node_admission(body: Mapping[str, Any], meta: Mapping[str, Any]) -> Hashable:
    pods = _dict(body.get("status")).get("pods") or []
    capacity = tuple(
        sorted(
            (p.get("uid"), p.get("engineKvCapacityTokens"))
            for p in pods
            if p.get("engineKvCapacityTokens")
        )
    )
    return (meta.get("generation"), capacity)


def fingerprint(kind: Kind, body: Mapping[str, Any]) -> Hashable:
    """The parts of an object (a dict as the API returns it) that desired state depends on:
    two versions of an object with equal fingerprints compute the same desired state.

    Pods: labels, node, phase, readiness, terminating. Policies: generation (the spec),
    terminating. NodeAdmissions: generation and the engine KV capacities (tokens) the agents
    reported. Nodes: only whether they are terminating (their coming and going)."""
    meta = _dict(body.get("metadata"))
    deleting = meta.get("deletionTimestamp") is not None
    if kind is Kind.PODS:
        return _pod(body, meta, deleting)
    if kind is Kind.POLICIES:
        return (meta.get("generation"), deleting)
    if kind is Kind.NODE_ADMISSIONS:
        return _node_admission(body, meta)
    return deleting


class Seen:
    """The last fingerprint seen per object (kind and uid), to tell real changes from churn."""

    def __init__(self) -> None:
        self._last: dict[tuple[Kind, str], Hashable] = {}

    def __len__(self) -> int:
        return len(self._last)

    def triggers(self, kind: Kind, event: Mapping[str, Any]) -> bool:
        """Whether a watch event (``{"type": ..., "object": ...}``) should trigger a pass, and
        remember it: a ``DELETED`` event always does (and forgets the object); any other when
        the object is new or its :func:`fingerprint` changed."""
        body = _dict(event.get("object"))
        key = (kind, str(_dict(body.get("metadata")).get("uid", "")))
        if event.get("type") == "DELETED":
            self._last.pop(key, None)
            return True
        fp = fingerprint(kind, body)
        if key in self._last and self._last[key] == fp:
            return False
        self._last[key] = fp
        return True
