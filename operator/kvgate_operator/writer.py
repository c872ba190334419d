"""Writing a reconcile pass's plan to the cluster: NodeAdmission creates, spec patches and
deletes, RateLimitPolicy statuses, their Events, and the ``InjectionMissed`` Events of pods
admitted without the sidecar.

Invariant: every write asks first whether this replica may write (it holds the leader Lease):
when not, :class:`NotLeader` stops the pass. An error on one object is logged and leaves the
others going (the next pass retries what still differs).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from kvgate_agent.contract.api import GROUP as API_GROUP
from kvgate_agent.contract.api import NODE_ADMISSION_PLURAL, RATE_LIMIT_POLICY_PLURAL, VERSION
from kvgate_operator.metrics import OperatorMetrics
from kvgate_operator.missed import EVENT_REASON, MissedPod, ReportedPods, event_name
from kvgate_operator.plan import EventWrite, NodeWrite, Plan, StatusWrite
from kvgate_operator.reader import Observed

log = logging.getLogger("kvgate.operator")
FIELD_MANAGER = "kvgate-operator"
#: Writes in flight at once during a pass (the first pass over a large cluster writes hundreds).
WRITE_CONCURRENCY = 8


@dataclass
class PassStats:
    """What one pass did: writes by kind, and how long it took (seconds)."""

    node_writes: int = 0
    status_writes: int = 0
    events: int = 0
    missed_events: int = 0
    seconds: float = 0.0

    @property
    def writes(self) -> int:
        return self.node_writes + self.status_writes


class NotLeader(Exception):
    """This replica may not write (it does not hold the leader Lease): the pass stops."""


def _detail(exc: ApiException) -> str:
    """The API server's message from an error response, if any."""
    body = exc.body or getattr(exc, "data", None) or ""
    try:
        return str(json.loads(body).get("message", ""))[:500]
    except (TypeError, ValueError, AttributeError):
        return str(body)[:500]


class ClusterWriter:
    """Writes a pass's plan, and the Events of missed injections.

    Holds the API clients, this replica's identity (the ``reportingInstance`` of its Events),
    the leader check asked before each write, and the pods whose ``InjectionMissed`` Event was
    already posted (by uid, bounded: :class:`~kvgate_operator.missed.ReportedPods`).

    Args:
        api: a configured ``kubernetes.client.ApiClient``.
        metrics: where the missed-injection counts go.
        may_write: whether this replica may write now (the leader election's
            :meth:`~kvgate_operator.leader.LeaderElector.is_leader`).
        identity: this replica's name (its pod name).
    """

    def __init__(
        self,
        api: client.ApiClient,
        metrics: OperatorMetrics,
        may_write: Callable[[], bool],
        identity: str,
    ) -> None:
        self.identity = identity
        self.metrics = metrics
        self.may_write = may_write
        self.reported_missed = ReportedPods()
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)

    def guard(self) -> None:
        """Raises :class:`NotLeader` unless this replica may write now."""
        if not self.may_write():
            raise NotLeader("this replica does not hold the leader Lease")

    def write_nodes(
        self, writes: list[NodeWrite], observed: Observed
    ) -> tuple[int, dict[str, str]]:
        """Carry out NodeAdmission writes, up to ``WRITE_CONCURRENCY`` at a time: how many
        landed, and the reason each other one did not, by node.

        Raises:
            NotLeader: this replica may not write any more.
        """
        written = 0
        failed: dict[str, str] = {}
        with ThreadPoolExecutor(WRITE_CONCURRENCY) as pool:
            results = list(pool.map(lambda w: self._write_node(w, observed), writes))
        for w, error in zip(writes, results, strict=True):
            if error is None:
                written += 1
            else:
                failed[w.node] = error
        return written, failed

    def write(self, todo: Plan, observed: Observed) -> PassStats:
        """Carry out a plan, up to ``WRITE_CONCURRENCY`` requests at a time. Errors on one
        object are logged and leave the rest going: the next pass retries what still differs."""
        stats = PassStats()
        with ThreadPoolExecutor(WRITE_CONCURRENCY) as pool:
            stats.node_writes = sum(self._write_node(w, observed) is None for w in todo.nodes)
            stats.status_writes = sum(pool.map(self._write_status, todo.statuses))
            stats.events = sum(pool.map(lambda e: self._write_event(e, observed), todo.events))
        return stats

    def _write_node(self, w: NodeWrite, observed: Observed) -> str | None:
        """One NodeAdmission write; None when it landed, else the reason it did not.

        Raises:
            NotLeader: this replica may not write any more.
        """
        self.guard()
        uid = observed.snapshot.nodes.get(w.node)
        try:
            if w.action == "delete":
                self.custom.delete_cluster_custom_object(
                    API_GROUP, VERSION, NODE_ADMISSION_PLURAL, w.node
                )
            elif w.action == "create":
                body = {
                    "apiVersion": f"{API_GROUP}/{VERSION}",
                    "kind": "NodeAdmission",
                    "metadata": {
                        "name": w.node,
                        "labels": {"app.kubernetes.io/managed-by": "kvgate-operator"},
                        # Owned by the Node: a real cluster's garbage collector removes it
                        # with its node even while the operator is down.
                        "ownerReferences": [
                            {"apiVersion": "v1", "kind": "Node", "name": w.node, "uid": uid}
                        ]
                        if uid
                        else [],
                    },
                    "spec": w.spec,
                }
                try:
                    self.custom.create_cluster_custom_object(
                        API_GROUP,
                        VERSION,
                        NODE_ADMISSION_PLURAL,
                        body,
                        field_manager=FIELD_MANAGER,
                    )
                except ApiException as exc:
                    if exc.status != 409:
                        raise
                    self._patch_spec(w.node, w.spec)  # created meanwhile: converge
            else:
                self._patch_spec(w.node, w.spec, w.owner_uid, observed)
            return None
        except ApiException as exc:
            if w.action == "delete" and exc.status == 404:
                return None
            log.warning(
                "NodeAdmission %s %s failed: %s %s", w.action, w.node, exc.reason, _detail(exc)
            )
            return f"{exc.status} {exc.reason}: {_detail(exc)}"

    def _write_status(self, w: StatusWrite) -> int:
        self.guard()
        ns, name = w.policy
        try:
            self.custom.patch_namespaced_custom_object_status(
                API_GROUP,
                VERSION,
                ns,
                RATE_LIMIT_POLICY_PLURAL,
                name,
                {"status": w.status},
                field_manager=FIELD_MANAGER,
            )
            return 1
        except ApiException as exc:
            if exc.status != 404:  # deleted meanwhile
                log.warning("status of %s/%s failed: %s %s", ns, name, exc.reason, _detail(exc))
            return 0

    def _write_event(self, e: EventWrite, observed: Observed) -> int:
        self.guard()
        ns, name = e.policy
        try:
            self._event(
                ns, name, observed.policy_uids.get(e.policy, ""), e.type, e.reason, e.message
            )
            return 1
        except ApiException as exc:
            log.warning("event on %s/%s failed: %s", ns, name, exc.reason)
            return 0

    def _patch_spec(
        self,
        node: str,
        spec: dict[str, Any] | None,
        owner_uid: str | None = None,
        observed: Observed | None = None,
    ) -> None:
        # A merge patch would merge into the old pods list; replace the spec as a whole.
        ops: list[dict[str, Any]] = [{"op": "replace", "path": "/spec", "value": spec}]
        if owner_uid:
            others = [
                r
                for r in (observed.node_owner_refs.get(node, []) if observed else [])
                if r.get("kind") != "Node"
            ]
            ref = {"apiVersion": "v1", "kind": "Node", "name": node, "uid": owner_uid}
            ops.append({"op": "add", "path": "/metadata/ownerReferences", "value": [*others, ref]})
        self.custom.patch_cluster_custom_object(
            API_GROUP,
            VERSION,
            NODE_ADMISSION_PLURAL,
            node,
            ops,
            field_manager=FIELD_MANAGER,
            _content_type="application/json-patch+json",
        )

    def _event(self, ns: str, name: str, uid: str, type_: str, reason: str, message: str) -> None:
        """An Event on the RateLimitPolicy ``ns/name`` (named by the API server)."""
        self._post_event(
            ns,
            client.V1ObjectMeta(generate_name=f"{name}.", namespace=ns),
            client.V1ObjectReference(
                api_version=f"{API_GROUP}/{VERSION}",
                kind="RateLimitPolicy",
                name=name,
                namespace=ns,
                uid=uid or None,
            ),
            type_,
            reason,
            message,
        )

    def _post_event(
        self,
        namespace: str,
        metadata: client.V1ObjectMeta,
        involved_object: client.V1ObjectReference,
        type_: str,
        reason: str,
        message: str,
    ) -> None:
        """Post one Event (``count`` 1, first and last seen now, reported by this replica) in
        ``namespace``.

        Raises:
            ApiException: the API server refused it (409: ``metadata.name`` exists already).
        """
        now = dt.datetime.now(dt.UTC)
        body = client.CoreV1Event(
            metadata=metadata,
            involved_object=involved_object,
            type=type_,
            reason=reason,
            message=message,
            first_timestamp=now,
            last_timestamp=now,
            count=1,
            source=client.V1EventSource(component="kvgate-operator"),
            reporting_component="kvgate.io/operator",
            reporting_instance=self.identity,
        )
        self.core.create_namespaced_event(namespace, body)

    def report_missed(self, missed: list[MissedPod]) -> int:
        """One ``InjectionMissed`` Warning Event per missed pod (by uid), the counter and the
        gauge. Returns how many Events were posted. A failed post is retried next pass."""
        self.metrics.uninjected_pods.set(len(missed))
        posted = 0
        for m in self.reported_missed.new(missed):
            try:
                self._pod_event(m)
            except ApiException as exc:
                # 409: posted before (by an earlier run); 404: the namespace went away.
                if exc.status in (404, 409):
                    self.reported_missed.add(m.uid)
                else:
                    log.warning(
                        "InjectionMissed event on pod %s/%s failed: %s", m.namespace, m.name, exc
                    )
                continue
            log.warning("pod %s/%s: injection missed: %s", m.namespace, m.name, m.message)
            self.reported_missed.add(m.uid)
            self.metrics.missed_injections.inc()
            posted += 1
        return posted

    def _pod_event(self, m: MissedPod) -> None:
        """The ``InjectionMissed`` Warning Event on the pod (named by :func:`event_name`, so
        posting it twice is a 409)."""
        self.guard()
        self._post_event(
            m.namespace,
            client.V1ObjectMeta(name=event_name(m), namespace=m.namespace),
            client.V1ObjectReference(
                api_version="v1", kind="Pod", name=m.name, namespace=m.namespace, uid=m.uid or None
            ),
            "Warning",
            EVENT_REASON,
            m.message,
        )
