"""From desired and observed state to the writes that close the gap: pure, no I/O.

Only differences become writes, so a steady cluster produces none (no write loops), and a
restart re-plans from scratch without duplicates: NodeAdmission objects are named after their
node, so a second create is impossible and becomes a patch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from kvgate_operator.desired import Desired, Key


@dataclass(frozen=True)
class NodeWrite:
    """Create, patch (spec) or delete one NodeAdmission."""

    action: Literal["create", "patch", "delete"]
    node: str
    spec: dict[str, Any] | None = None
    #: On a patch: also point the object's owner reference at this Node uid (the node was
    #: deleted and made again under the same name, so the reference left dangles).
    owner_uid: str | None = None


@dataclass(frozen=True)
class StatusWrite:
    """Patch one RateLimitPolicy's status."""

    policy: Key
    status: dict[str, Any]


@dataclass(frozen=True)
class EventWrite:
    """An Event on a RateLimitPolicy (``type`` Normal or Warning)."""

    policy: Key
    type: str
    reason: str
    message: str


@dataclass
class Plan:
    """Everything one reconcile pass writes."""

    nodes: list[NodeWrite] = field(default_factory=list)
    statuses: list[StatusWrite] = field(default_factory=list)
    events: list[EventWrite] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.nodes) + len(self.statuses) + len(self.events)


def _strip_times(status: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(status)
    out["conditions"] = [
        {k: v for k, v in c.items() if k != "lastTransitionTime"}
        for c in status.get("conditions") or []
    ]
    out.setdefault("conflicts", [])
    return out


def with_transition_times(
    new: dict[str, Any], old: Mapping[str, Any] | None, now: str
) -> dict[str, Any]:
    """``new`` status with each condition's ``lastTransitionTime`` kept from ``old`` when the
    condition's status did not change, else set to ``now`` (RFC 3339)."""
    before = {c.get("type"): c for c in (old or {}).get("conditions") or []}
    conds = []
    for c in new["conditions"]:
        prev = before.get(c["type"])
        t = prev.get("lastTransitionTime") if prev and prev.get("status") == c["status"] else None
        conds.append({**c, "lastTransitionTime": t or now})
    return {**new, "conditions": conds}


def stale_owners(owners: Mapping[str, str], node_uids: Mapping[str, str]) -> dict[str, str]:
    """NodeAdmissions whose owner reference does not name their node's current uid (``owners``:
    the Node uid each one's owner reference names, "" for none; ``node_uids``: the Nodes), as
    {node: its uid}. A dangling reference would let the garbage collector delete the object."""
    return {
        node: uid for node, owner in owners.items() if (uid := node_uids.get(node)) and owner != uid
    }


def plan(
    desired: Desired,
    node_specs: Mapping[str, Mapping[str, Any] | None],
    policy_status: Mapping[Key, Mapping[str, Any] | None],
    now: str,
    *,
    statuses: bool = True,
    owners: Mapping[str, str] | None = None,
) -> Plan:
    """The writes that take the cluster from what was observed to ``desired``.

    Args:
        desired: from :func:`kvgate_operator.desired.compute`.
        node_specs: the spec of every existing NodeAdmission, by name.
        policy_status: the status of every existing RateLimitPolicy (None when empty).
        now: the time to stamp on changed conditions (RFC 3339).
        statuses: False plans the NodeAdmission writes only (the reconciler writes those first,
            then plans statuses knowing which of them failed).
        owners: NodeAdmissions to re-own, {node: its current uid} (:func:`stale_owners`).
    """
    out = Plan()
    owners = owners or {}
    for node, spec in sorted(desired.node_specs.items()):
        if node not in node_specs:
            out.nodes.append(NodeWrite("create", node, spec))
        elif node_specs[node] != spec or node in owners:
            out.nodes.append(NodeWrite("patch", node, spec, owners.get(node)))
    for node in sorted(set(node_specs) - set(desired.node_specs)):
        out.nodes.append(NodeWrite("delete", node))
    if not statuses:
        return out
    for key, outcome in sorted(desired.policies.items()):
        new = outcome.status()
        old = policy_status.get(key)
        if old is not None and _strip_times(old) == _strip_times(new):
            continue
        out.statuses.append(StatusWrite(key, with_transition_times(new, old, now)))
        old_conflicts = set((old or {}).get("conflicts") or [])
        for c in sorted(set(new["conflicts"]) - old_conflicts):
            out.events.append(EventWrite(key, "Warning", "PolicyConflict", c))
        old_ready: Mapping[str, Any] = next(
            (c for c in (old or {}).get("conditions") or [] if c.get("type") == "Ready"), {}
        )
        if outcome.write_error is not None and old_ready.get("reason") != "WriteFailed":
            out.events.append(EventWrite(key, "Warning", "WriteFailed", outcome.write_error[:1024]))
        was_accepted = any(
            c.get("type") == "Accepted" and c.get("status") == "True"
            for c in (old or {}).get("conditions") or []
        )
        if not outcome.accepted and (
            old is None
            or was_accepted
            or (old or {}).get("observedGeneration") != outcome.generation
        ):
            out.events.append(
                EventWrite(key, "Warning", outcome.accepted_reason, outcome.accepted_message[:1024])
            )
    return out
