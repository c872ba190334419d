"""From cluster state to desired state: pure functions, no I/O, no kopf.

A :class:`Snapshot` of RateLimitPolicies, Pods, Nodes and the node agents' reports goes in; the
``NodeAdmission`` spec of every node and the status of every policy come out (:func:`compute`).
Invariant: the result depends on the snapshot alone, so computing from scratch after any event
or an operator restart converges to the same objects.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from kvgate_agent.contract.nodeadmission import (
    NodeAdmissionSpec,
    PodAdmission,
    PodThresholds,
    PolicyRef,
)
from kvgate_agent.contract.policy import (
    LabelSelector,
    LimitScope,
    PolicyError,
    RateLimitPolicySpec,
    parse_policy,
)
from kvgate_operator.inject_store import ANNOTATION_STORE, STORE_KIND

Key = tuple[str, str]  # (namespace, name)


@dataclass(frozen=True)
class Policy:
    """A RateLimitPolicy as read from the API server. ``spec`` is None when invalid
    (``error`` says why)."""

    namespace: str
    name: str
    uid: str
    generation: int
    created: str
    spec: RateLimitPolicySpec | None
    error: str | None = None
    deleting: bool = False

    @property
    def key(self) -> Key:
        return (self.namespace, self.name)

    @classmethod
    def from_object(cls, obj: Mapping[str, Any]) -> Policy:
        """Parse a RateLimitPolicy object (a dict as the API returns it)."""
        meta = obj.get("metadata") or {}
        spec: RateLimitPolicySpec | None = None
        error = None
        try:
            spec = parse_policy(
                {k: obj[k] for k in ("apiVersion", "kind", "metadata", "spec") if k in obj}
            ).spec
        except PolicyError as exc:
            error = str(exc)
        return cls(
            meta.get("namespace", ""),
            meta["name"],
            meta.get("uid", ""),
            int(meta.get("generation") or 0),
            meta.get("creationTimestamp") or "",
            spec,
            error,
            meta.get("deletionTimestamp") is not None,
        )


@dataclass(frozen=True)
class Pod:
    """The parts of a Pod the operator reads."""

    namespace: str
    name: str
    uid: str
    labels: Mapping[str, str]
    node: str | None
    active: bool
    ready: bool
    #: The webhook gave its sidecar a store (annotation ``kvgate.io/store``): it leases shared
    #: limits instead of enforcing its split of them.
    store: bool = False

    @property
    def key(self) -> Key:
        return (self.namespace, self.name)

    @classmethod
    def from_object(cls, obj: Mapping[str, Any]) -> Pod:
        """Parse a Pod object (a dict as the API returns it)."""
        meta = obj.get("metadata") or {}
        status = obj.get("status") or {}
        phase = status.get("phase")
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions") or []
        )
        return cls(
            meta.get("namespace", ""),
            meta["name"],
            meta.get("uid", ""),
            dict(meta.get("labels") or {}),
            (obj.get("spec") or {}).get("nodeName"),
            meta.get("deletionTimestamp") is None and phase not in ("Succeeded", "Failed"),
            ready,
            (meta.get("annotations") or {}).get(ANNOTATION_STORE) == STORE_KIND,
        )


@dataclass(frozen=True)
class Snapshot:
    """Everything desired state depends on.

    ``nodes`` maps node name to uid. ``engine_capacity`` maps a pod uid to the KV capacity in
    tokens its engine reported (from NodeAdmission status, written by the agent). ``store``:
    the webhook injects sidecars with a store for ``shared`` limits now (the chart's
    ``store.url``); each pod's own :attr:`Pod.store` decides its thresholds.
    """

    policies: Mapping[Key, Policy]
    pods: Mapping[Key, Pod]
    nodes: Mapping[str, str]
    engine_capacity: Mapping[str, int] = field(default_factory=dict)
    store: bool = False


@dataclass
class PolicyOutcome:
    """What a policy's status should say."""

    generation: int
    accepted: bool
    accepted_reason: str
    accepted_message: str
    matched: list[Key] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    lost: int = 0
    write_error: str | None = None
    #: None: the policy has no shared limit; else whether a store holds them.
    shared_store: bool | None = None
    #: Matched pods whose sidecar has no store although the others (or the chart) have one.
    store_less: int = 0

    def status(self) -> dict[str, Any]:
        """The status fields (conditions without timestamps; the reconciler adds them).

        Ready reasons: ``ThresholdsWritten``; ``WriteFailed`` (a NodeAdmission holding some of
        its pods could not be written: the message says which and why); ``NoMatchingPods``;
        ``AllPodsGovernedElsewhere`` (every pod it selects is governed by an older policy);
        ``NotAccepted``."""
        n = len(self.matched)
        ready = self.accepted and n > 0 and self.write_error is None
        if not self.accepted:
            ready_reason, ready_msg = "NotAccepted", "the policy is not accepted"
        elif self.write_error is not None:
            ready_reason, ready_msg = "WriteFailed", self.write_error[:1024]
        elif n == 0 and self.lost:
            ready_reason = "AllPodsGovernedElsewhere"
            ready_msg = f"all {self.lost} selected pod(s) are governed by older policies"
        elif n == 0:
            ready_reason = "NoMatchingPods"
            ready_msg = "no pod bound to an existing node matches the selector"
        else:
            ready_reason = "ThresholdsWritten"
            ready_msg = f"thresholds written for {n} pod(s) bound to nodes"
        return {
            "observedGeneration": self.generation,
            "matchedPods": n,
            "conflicts": sorted(self.conflicts),
            "conditions": [
                {
                    "type": "Accepted",
                    "status": "True" if self.accepted else "False",
                    "reason": self.accepted_reason,
                    "message": self.accepted_message,
                    "observedGeneration": self.generation,
                },
                {
                    "type": "Ready",
                    "status": "True" if ready else "False",
                    "reason": ready_reason,
                    "message": ready_msg,
                    "observedGeneration": self.generation,
                },
                *self._shared_condition(),
            ],
        }

    def _shared_condition(self) -> list[dict[str, Any]]:
        """``SharedLimits`` (only for a policy with ``shared`` limits): True ``Store`` when the
        sidecars lease them from the store, False ``NoStore`` when they fall back to per-pod
        budgets (no ``store.url`` in the chart values), False ``MixedStore`` when some matched pods
        were injected without one."""
        if self.shared_store is None:
            return []
        ok = self.shared_store
        if ok and self.store_less:
            return [
                {
                    "type": "SharedLimits",
                    "status": "False",
                    "reason": "MixedStore",
                    "message": f"{self.store_less} pod(s) were injected without the store: they "
                    "enforce their split of Global shared limits per pod until recreated",
                    "observedGeneration": self.generation,
                }
            ]
        return [
            {
                "type": "SharedLimits",
                "status": "True" if ok else "False",
                "reason": "Store" if ok else "NoStore",
                "message": "shared limits hold across pods through the store"
                if ok
                else "no store configured (chart value store.url): shared limits are enforced "
                "per pod, as if not shared",
                "observedGeneration": self.generation,
            }
        ]


@dataclass
class Desired:
    """Desired NodeAdmission specs (by node name, as JSON-ready dicts) and policy outcomes."""

    node_specs: dict[str, dict[str, Any]]
    policies: dict[Key, PolicyOutcome]


def selects(selector: LabelSelector | None, labels: Mapping[str, str]) -> bool:
    """Kubernetes label-selector semantics (matchLabels AND every matchExpression).
    A missing selector selects nothing (the CRD requires one); an empty one selects all."""
    if selector is None:
        return False
    for k, v in selector.match_labels.items():
        if labels.get(k) != v:
            return False
    for req in selector.match_expressions:
        has = req.key in labels
        if req.operator == "In" and (not has or labels[req.key] not in req.values):
            return False
        if req.operator == "NotIn" and has and labels[req.key] in req.values:
            return False
        if req.operator == "Exists" and not has:
            return False
        if req.operator == "DoesNotExist" and has:
            return False
    return True


def _precedence(p: Policy) -> tuple[str, str, str]:
    return (p.created, p.namespace, p.name)


def resolve_thresholds(
    spec: RateLimitPolicySpec, share: float, engine_kv_capacity: int | None, store: bool = False
) -> PodThresholds:
    """One pod's thresholds: ``per: Global`` rates × ``share`` and bursts × ``share`` (at least
    1), the best known KV capacity (tokens) and bytes per token. With a ``store``, ``shared``
    Global limits keep the whole budget: the sidecars lease it from the store."""
    limits = []
    for rl in spec.rate_limits:
        if rl.per is LimitScope.GLOBAL and share < 1 and not (store and rl.shared):
            upd: dict[str, Any] = {}
            if rl.requests_per_minute is not None:
                upd["requests_per_minute"] = rl.requests_per_minute * share
            if rl.tokens_per_minute is not None:
                upd["tokens_per_minute"] = rl.tokens_per_minute * share
            if rl.burst_requests is not None:
                upd["burst_requests"] = max(1, math.floor(rl.burst_requests * share))
            if rl.burst_tokens is not None:
                upd["burst_tokens"] = max(1, math.floor(rl.burst_tokens * share))
            rl = rl.model_copy(update=upd)
        limits.append(rl)
    kv = spec.capacity.kv_cache_tokens
    if spec.capacity.from_engine_metrics and engine_kv_capacity is not None:
        kv = engine_kv_capacity
    fields = {
        name: getattr(spec, name) for name in RateLimitPolicySpec.model_fields if name != "selector"
    }
    fields["rate_limits"] = limits
    try:
        return PodThresholds(
            **fields,
            global_share=share,
            kv_capacity_tokens=kv,
            bytes_per_token=spec.model.bytes_per_token,
        )
    except ValidationError as exc:  # pragma: no cover - the inputs were validated already
        raise ValueError(f"cannot resolve thresholds: {exc}") from None


def mark_write_failures(desired: Desired, snap: Snapshot, failed: dict[str, str]) -> None:
    """Record on each policy that NodeAdmission writes for the nodes in ``failed`` (node name ->
    the API server's reason) did not land, so its Ready condition says so."""
    for outcome in desired.policies.values():
        nodes = sorted(
            {n for k in outcome.matched if (n := snap.pods[k].node) is not None and n in failed}
        )
        if nodes:
            outcome.write_error = "; ".join(
                f"NodeAdmission {n} could not be written: {failed[n]}" for n in nodes
            )


def _validate(policies: Mapping[Key, Policy]) -> tuple[dict[Key, PolicyOutcome], list[Policy]]:
    """Every policy's acceptance, and the accepted ones, oldest first (precedence order)."""
    outcomes: dict[Key, PolicyOutcome] = {}
    valid: list[Policy] = []
    for p in policies.values():
        if p.spec is None:
            outcomes[p.key] = PolicyOutcome(p.generation, False, "InvalidSpec", p.error or "")
        elif p.deleting:  # being deleted (another controller's finalizer may hold it)
            outcomes[p.key] = PolicyOutcome(
                p.generation, False, "Deleting", "the policy is being deleted"
            )
        elif p.spec.selector is None:
            outcomes[p.key] = PolicyOutcome(
                p.generation, False, "SelectorMissing", "spec.selector is required in a cluster"
            )
        else:
            outcomes[p.key] = PolicyOutcome(p.generation, True, "Valid", "the policy is valid")
            valid.append(p)
    valid.sort(key=_precedence)
    return outcomes, valid


def _assign(snap: Snapshot, valid: list[Policy], outcomes: dict[Key, PolicyOutcome]) -> None:
    """Give each counted pod to the oldest valid policy of its namespace that selects it
    (``matched``); every other policy selecting it records the conflict (``lost``,
    ``conflicts``)."""
    by_ns: dict[str, list[Policy]] = {}
    for p in valid:
        by_ns.setdefault(p.namespace, []).append(p)
    for pod in sorted(snap.pods.values(), key=lambda x: x.key):
        if not pod.active or pod.node is None or pod.node not in snap.nodes:
            continue
        hits = [
            p
            for p in by_ns.get(pod.namespace, ())
            if selects(p.spec.selector if p.spec else None, pod.labels)
        ]
        if not hits:
            continue
        winner = hits[0]
        outcomes[winner.key].matched.append(pod.key)
        for loser in hits[1:]:
            outcomes[loser.key].lost += 1
            outcomes[loser.key].conflicts.append(
                f"{pod.namespace}/{pod.name}: governed by older policy {winner.name}"
            )
            outcomes[winner.key].conflicts.append(
                f"{pod.namespace}/{pod.name}: also selected by {loser.name}"
            )


def _entries(snap: Snapshot, policy: Policy, outcome: PolicyOutcome) -> list[PodAdmission]:
    """The NodeAdmission entries of a policy's matched pods, with their thresholds."""
    assert policy.spec is not None
    members = [snap.pods[k] for k in outcome.matched]
    ready = sum(1 for m in members if m.ready)
    has_global = any(rl.per is LimitScope.GLOBAL for rl in policy.spec.rate_limits)
    # Without a Global limit the share means nothing: keep it 1 so pods coming and going
    # do not rewrite every other pod's thresholds.
    share = 1.0 / (ready or len(members)) if has_global else 1.0
    # a store-less pod takes its 1/N of a Global limit, a pod with a store leases it whole
    ref = PolicyRef(
        namespace=policy.namespace,
        name=policy.name,
        uid=policy.uid or None,
        generation=policy.generation,
    )
    return [
        PodAdmission(
            namespace=pod.namespace,
            name=pod.name,
            uid=pod.uid,
            policy=ref,
            thresholds=resolve_thresholds(
                policy.spec, min(1.0, share), snap.engine_capacity.get(pod.uid), pod.store
            ),
        )
        for pod in members
    ]


def compute(snap: Snapshot) -> Desired:
    """Desired NodeAdmission specs for every node (JSON-ready, entries sorted by namespace and
    name) and the status of every policy.

    Rules: a policy selects pods in its own namespace by its label selector; a pod counts when
    it is bound to an existing node, not terminating and not finished. A policy being deleted
    governs nothing. Of two policies selecting one pod the oldest (creationTimestamp, then
    name) wins and both report the overlap. ``per: Global`` limits are split evenly across the
    policy's ready pods (across all matched pods when none is ready), except ``shared`` ones
    for pods whose sidecar has a store (annotation ``kvgate.io/store``: they lease the whole
    budget). The engine's reported KV
    capacity beats ``capacity.kvCacheTokens`` when ``fromEngineMetrics`` is set.
    """
    outcomes, valid = _validate(snap.policies)
    _assign(snap, valid, outcomes)
    for p in valid:
        if p.spec is not None and any(rl.shared for rl in p.spec.rate_limits):
            o = outcomes[p.key]
            with_store = sum(1 for k in o.matched if snap.pods[k].store)
            o.shared_store = snap.store or with_store > 0
            o.store_less = len(o.matched) - with_store if o.shared_store else 0
    pods_by_node: dict[str, list[dict[str, Any]]] = {n: [] for n in snap.nodes}
    for pol_key, outcome in outcomes.items():
        if not outcome.matched:
            continue
        for entry in _entries(snap, snap.policies[pol_key], outcome):
            node = snap.pods[(entry.namespace, entry.name)].node
            assert node is not None
            pods_by_node[node].append(
                entry.model_dump(by_alias=True, exclude_none=True, mode="json")
            )
    node_specs = {}
    for node, entries in pods_by_node.items():
        entries.sort(key=lambda e: (e["namespace"], e["name"]))
        node_specs[node] = NodeAdmissionSpec(node_name=node).model_dump(
            by_alias=True, exclude_none=True, mode="json"
        ) | {"pods": entries}
    return Desired(node_specs, outcomes)
