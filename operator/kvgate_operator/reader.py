"""Reading the cluster for a reconcile pass: one LIST of each collection the operator's desired
state depends on (policies, pods, nodes, NodeAdmissions, and, with the webhook enabled,
namespaces), as plain dicts, into an :class:`Observed`.

Invariant: reads only (no write, no leader check: a follower may read); each pass reads afresh,
nothing is cached between passes but whether the namespaces were readable (to log that once).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from kvgate_agent.contract.api import GROUP as API_GROUP
from kvgate_agent.contract.api import NODE_ADMISSION_PLURAL, RATE_LIMIT_POLICY_PLURAL, VERSION
from kvgate_operator.desired import Key, Pod, Policy, Snapshot
from kvgate_operator.missed import MissedPod, find_missed
from kvgate_operator.settings import OperatorSettings

log = logging.getLogger("kvgate.operator")


@dataclass
class Observed:
    """One consistent-enough read of the cluster."""

    snapshot: Snapshot
    node_specs: dict[str, dict[str, Any] | None]
    policy_status: dict[Key, dict[str, Any] | None]
    policy_uids: dict[Key, str]
    #: Opted-in pods admitted without the sidecar (only with the webhook enabled).
    missed: list[MissedPod] = field(default_factory=list)
    #: Each NodeAdmission's owner references, by name.
    node_owner_refs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def node_owners(self) -> dict[str, str]:
        """The Node uid each NodeAdmission's owner reference names ("" for none)."""
        return {
            name: next((r.get("uid") or "" for r in refs if r.get("kind") == "Node"), "")
            for name, refs in self.node_owner_refs.items()
        }


class ClusterReader:
    """Reads what one reconcile pass needs from the API server.

    Holds the API client, the settings that scope the read (the watched namespace, whether the
    webhook is enabled and its injection rules) and whether the namespaces could not be read
    last time (a warning is logged once until they can).

    Args:
        api: a configured ``kubernetes.client.ApiClient``.
        settings: operator settings.
    """

    def __init__(self, api: client.ApiClient, settings: OperatorSettings) -> None:
        self.api = api
        self.settings = settings
        self.core = client.CoreV1Api(api)
        self._namespaces_unreadable = False

    def _list(self, path: str) -> list[dict[str, Any]]:
        """LIST a collection as plain dicts (the client's model deserialisation is far slower
        than json for thousands of pods)."""
        items: list[dict[str, Any]] = []
        cont = None
        while True:
            query: list[tuple[str, Any]] = [("limit", 500)]
            if cont:
                query.append(("continue", cont))
            params = self.api.param_serialize(
                "GET",
                path,
                query_params=query,
                header_params={"Accept": "application/json"},
                auth_settings=["BearerToken"],
            )
            resp = self.api.call_api(*params)
            resp.read()  # type: ignore[no-untyped-call]
            if not 200 <= resp.status < 300:
                raise ApiException(status=resp.status, reason=resp.reason)
            body = json.loads(resp.data or b"{}")
            items.extend(body.get("items") or [])
            cont = (body.get("metadata") or {}).get("continue")
            if not cont:
                return items

    def read(self) -> Observed:
        """LIST policies, pods, nodes and NodeAdmissions (and, with the webhook enabled,
        namespaces, for the missed-injection check)."""
        ns = self.settings.namespace
        pol_path = (
            f"/apis/{API_GROUP}/{VERSION}/namespaces/{ns}/{RATE_LIMIT_POLICY_PLURAL}"
            if ns
            else f"/apis/{API_GROUP}/{VERSION}/{RATE_LIMIT_POLICY_PLURAL}"
        )
        pod_path = f"/api/v1/namespaces/{ns}/pods" if ns else "/api/v1/pods"
        raw_policies = self._list(pol_path)
        raw_pods = self._list(pod_path)
        raw_nodes = self._list("/api/v1/nodes")
        raw_nas = self._list(f"/apis/{API_GROUP}/{VERSION}/{NODE_ADMISSION_PLURAL}")
        policies = {}
        status: dict[Key, dict[str, Any] | None] = {}
        uids: dict[Key, str] = {}
        for obj in raw_policies:
            p = Policy.from_object(obj)
            policies[p.key] = p
            status[p.key] = obj.get("status") or None
            uids[p.key] = p.uid
        pods = {}
        for obj in raw_pods:
            pod = Pod.from_object(obj)
            pods[pod.key] = pod
        nodes = {n["metadata"]["name"]: n["metadata"].get("uid", "") for n in raw_nodes}
        specs: dict[str, dict[str, Any] | None] = {}
        owner_refs: dict[str, list[dict[str, Any]]] = {}
        capacity: dict[str, int] = {}
        for na in raw_nas:
            specs[na["metadata"]["name"]] = na.get("spec")
            owner_refs[na["metadata"]["name"]] = list(na["metadata"].get("ownerReferences") or [])
            for usage in (na.get("status") or {}).get("pods") or []:
                cap = usage.get("engineKvCapacityTokens")
                if usage.get("uid") and isinstance(cap, int) and cap > 0:
                    capacity[usage["uid"]] = cap
        snap = Snapshot(
            policies, pods, nodes, capacity, store=self.settings.injection.store is not None
        )
        missed: list[MissedPod] = []
        if self.settings.webhook_enabled:
            missed = find_missed(raw_pods, self._namespace_labels(), self.settings.injection)
        return Observed(snap, specs, status, uids, missed, owner_refs)

    def _namespace_labels(self) -> dict[str, dict[str, str]] | None:
        """Labels by namespace (the watched one only, when namespaced); None when they cannot
        be read (then only pod labels count as opting in; logged once until it works)."""
        ns = self.settings.namespace
        try:
            if ns:
                obj = self.core.read_namespace(ns)
                found = {ns: dict((obj.metadata.labels if obj.metadata else None) or {})}
            else:
                found = {
                    n["metadata"]["name"]: dict(n["metadata"].get("labels") or {})
                    for n in self._list("/api/v1/namespaces")
                }
        except ApiException as exc:
            if not self._namespaces_unreadable:
                log.warning(
                    "namespaces cannot be read (%s %s): the missed-injection check sees only "
                    "pods with the label itself",
                    exc.status,
                    exc.reason,
                )
            self._namespaces_unreadable = True
            return None
        self._namespaces_unreadable = False
        return found
