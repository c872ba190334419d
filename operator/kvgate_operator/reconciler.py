"""The reconcile loop: read the cluster, compute desired state, write the differences.

Level-triggered: watch events (delivered by kopf) only *trigger* a pass; each pass reads a fresh
snapshot with LIST calls and computes everything from scratch (:mod:`kvgate_operator.desired`),
then writes only what differs (:mod:`kvgate_operator.plan`). So a missed or duplicated event, a
restart mid-pass or a crash between two writes cannot leave anything wrong for longer than the
next pass; bursts of events are debounced into one pass; a periodic resync runs even without
events.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError
from urllib3.exceptions import HTTPError

from kvgate_agent.contract.api import GROUP as API_GROUP
from kvgate_agent.contract.api import NODE_ADMISSION_PLURAL, RATE_LIMIT_POLICY_PLURAL, VERSION
from kvgate_agent.contract.nodeadmission import (
    NodeAdmissionSpec,
)
from kvgate_operator.desired import (
    Key,
    Pod,
    Policy,
    Snapshot,
    compute,
    mark_write_failures,
)
from kvgate_operator.metrics import OperatorMetrics
from kvgate_operator.missed import EVENT_REASON, MissedPod, ReportedPods, event_name, find_missed
from kvgate_operator.plan import EventWrite, NodeWrite, Plan, StatusWrite, plan, stale_owners
from kvgate_operator.settings import OperatorSettings

log = logging.getLogger("kvgate.operator")
FIELD_MANAGER = "kvgate-operator"
#: Writes in flight at once during a pass (the first pass over a large cluster writes hundreds).
WRITE_CONCURRENCY = 8
#: Longest pause before retrying a failed pass, seconds: after an outage the operator passes
#: again within this (plus the pass) of the network healing.
MAX_RETRY_SECONDS = 30.0


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


class PassIncomplete(Exception):
    """A pass whose writes did not all land (the next pass retries them)."""


class NotLeader(Exception):
    """This replica may not write (it does not hold the leader Lease): the pass stops."""


def _detail(exc: ApiException) -> str:
    """The API server's message from an error response, if any."""
    body = exc.body or getattr(exc, "data", None) or ""
    try:
        return str(json.loads(body).get("message", ""))[:500]
    except (TypeError, ValueError, AttributeError):
        return str(body)[:500]


def _normalized(spec: dict[str, Any] | None) -> dict[str, Any] | None:
    """A stored NodeAdmission spec in the operator's own serialisation (defaults the API server
    filled in made explicit the same way), so comparing with the desired spec sees only real
    differences. A spec that does not parse is returned as is (it will be rewritten)."""
    if spec is None:
        return None
    try:
        return NodeAdmissionSpec.model_validate(spec).model_dump(
            by_alias=True, exclude_none=True, mode="json"
        )
    except ValidationError:
        return spec


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Reconciler:
    """Reads, computes and writes; :meth:`run` is the long-running loop.

    Args:
        api: a configured ``kubernetes.client.ApiClient``.
        settings: operator settings (debounce, resync).
        clock: monotonic seconds (injected for tests of the loop's bookkeeping).
        metrics: where the missed-injection counts go (a private instance when not given).
        may_write: whether this replica may write now (the leader election's
            :meth:`~kvgate_operator.leader.LeaderElector.is_leader`); asked before each pass and
            before each write. Default: always.
        identity: this replica's name (its pod name), the ``reportingInstance`` of its Events.
    """

    def __init__(
        self,
        api: client.ApiClient,
        settings: OperatorSettings,
        clock: Callable[[], float] = time.monotonic,
        metrics: OperatorMetrics | None = None,
        may_write: Callable[[], bool] = lambda: True,
        identity: str = "kvgate-operator",
    ) -> None:
        self.api = api
        self.identity = identity
        self.settings = settings
        self.clock = clock
        self.may_write = may_write
        self.metrics = metrics if metrics is not None else OperatorMetrics()
        self.reported_missed = ReportedPods()
        self._namespaces_unreadable = False
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self._wake = asyncio.Event()
        self.last_pass_ok: float | None = None
        #: When this replica last started leading (None: it never took over; without an
        #: election it writes from the start, and the first pass counts).
        self.leading_since: float | None = None
        #: Clear while a pass's worker thread runs (cancelling the loop does not stop it).
        self._idle = threading.Event()
        self._idle.set()
        self.last_stats = PassStats()
        self.total_writes = 0
        self.passes = 0

    # ------------------------------------------------------------------ loop

    def trigger(self) -> None:
        """Ask for a pass soon (debounced)."""
        self._wake.set()

    async def run(self) -> None:
        """Reconcile on every trigger (debounced) and at least every ``resync_seconds``.
        A failed pass, whatever it raised, is logged (with its traceback when unexpected) and
        retried with backoff; it never stops the loop."""
        backoff = 1.0
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.settings.resync_seconds)
            await asyncio.sleep(self.settings.debounce_seconds)
            self._wake.clear()
            if not self.may_write():
                continue  # a follower: the election triggers a pass when this replica leads
            try:
                await self.reconcile_once()
                backoff = 1.0
            except NotLeader:
                log.warning("leadership lost during a pass: its remaining writes were dropped")
            except Exception as exc:  # never let the loop die: liveness would fail for good
                # (HTTPError: urllib3's timeouts and refused connections, which are not OSErrors)
                expected = (ApiException, OSError, ValueError, PassIncomplete, HTTPError)
                log.warning(
                    "reconcile pass failed, retrying in %.0fs: %s",
                    backoff,
                    exc,
                    exc_info=not isinstance(exc, expected),
                )
                await asyncio.sleep(backoff)
                backoff = min(MAX_RETRY_SECONDS, backoff * 2)
                self._wake.set()

    def started_leading(self) -> None:
        """This replica just took over: its liveness counts from now (a follower runs no
        pass, so its last one, if any, is old)."""
        self.leading_since = self.clock()

    def healthy(self) -> tuple[bool, str]:
        """Liveness: a pass succeeded, or this replica took over, recently (within
        ``liveness_stale_seconds``)."""
        stale = self.settings.liveness_stale_seconds
        if self.leading_since is not None and (
            self.last_pass_ok is None or self.last_pass_ok < self.leading_since
        ):
            age = self.clock() - self.leading_since
            if age > stale:
                return False, f"leading for {age:.0f}s without a successful reconcile pass"
            return True, f"leading for {age:.1f}s, no pass since"
        if self.last_pass_ok is None:
            return False, "no reconcile pass has completed yet"
        age = self.clock() - self.last_pass_ok
        if age > stale:
            return False, f"last successful reconcile pass was {age:.0f}s ago"
        return True, f"last pass {age:.1f}s ago, {self.total_writes} writes so far"

    async def wait_idle(self, within: float) -> bool:
        """Wait up to ``within`` seconds for a running pass's worker thread to end; whether
        none runs any more."""
        return await asyncio.to_thread(self._idle.wait, within)

    def _pass_in_thread(self) -> PassStats:
        try:
            return self._pass()
        finally:
            self._idle.set()

    async def reconcile_once(self) -> PassStats:
        """One pass: read, compute, plan, write. Returns what it wrote."""
        t0 = time.perf_counter()
        # Reading, computing and writing all run in a worker thread: the event loop (kopf's
        # watches) is never blocked by a pass, however large the cluster.
        self._idle.clear()
        stats = await asyncio.to_thread(self._pass_in_thread)
        stats.seconds = time.perf_counter() - t0
        self.last_stats = stats
        self.total_writes += stats.writes
        self.passes += 1
        self.last_pass_ok = self.clock()
        if stats.writes or stats.events or stats.missed_events:
            log.info(
                "reconciled: %d NodeAdmission writes, %d policy status writes, %d events, "
                "%d missed-injection events in %.2fs",
                stats.node_writes,
                stats.status_writes,
                stats.events,
                stats.missed_events,
                stats.seconds,
            )
        return stats

    def _guard(self) -> None:
        if not self.may_write():
            raise NotLeader("this replica does not hold the leader Lease")

    def _pass(self) -> PassStats:
        self._guard()
        observed = self.read()
        desired = compute(observed.snapshot)
        # Stored specs are compared raw first; only those that differ are normalised (the API
        # server may have filled in defaults), so a steady pass validates nothing.
        specs = {
            node: spec if spec == desired.node_specs.get(node) else _normalized(spec)
            for node, spec in observed.node_specs.items()
        }
        # NodeAdmissions first; then statuses and events, which say if any of them failed.
        stats = PassStats()
        failed: dict[str, str] = {}
        owners = stale_owners(observed.node_owners(), observed.snapshot.nodes)
        node_plan = plan(desired, specs, {}, _now(), statuses=False, owners=owners)
        with ThreadPoolExecutor(WRITE_CONCURRENCY) as pool:
            results = list(pool.map(lambda w: self._write_node(w, observed), node_plan.nodes))
        for w, error in zip(node_plan.nodes, results, strict=True):
            if error is None:
                stats.node_writes += 1
            else:
                failed[w.node] = error
        if failed:
            mark_write_failures(desired, observed.snapshot, failed)
        rest = plan(
            desired,
            {n: desired.node_specs[n] for n in desired.node_specs},
            observed.policy_status,
            _now(),
        )
        more = self.write(rest, observed)
        stats.status_writes, stats.events = more.status_writes, more.events
        stats.missed_events = self.report_missed(observed.missed)
        if failed:
            # Counted as a failed pass: retried with backoff, and the liveness probe fails if
            # this persists (status and a Warning event already say why).
            raise PassIncomplete(
                f"{len(failed)} NodeAdmission write(s) failed: "
                + "; ".join(f"{n}: {e}" for n, e in sorted(failed.items()))
            )
        return stats

    # ------------------------------------------------------------------ I/O

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
        self._guard()
        now = dt.datetime.now(dt.UTC)
        body = client.CoreV1Event(
            metadata=client.V1ObjectMeta(name=event_name(m), namespace=m.namespace),
            involved_object=client.V1ObjectReference(
                api_version="v1", kind="Pod", name=m.name, namespace=m.namespace, uid=m.uid or None
            ),
            type="Warning",
            reason=EVENT_REASON,
            message=m.message,
            first_timestamp=now,
            last_timestamp=now,
            count=1,
            source=client.V1EventSource(component="kvgate-operator"),
            reporting_component="kvgate.io/operator",
            reporting_instance=self.identity,
        )
        self.core.create_namespaced_event(m.namespace, body)

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
        self._guard()
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
        self._guard()
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
        self._guard()
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
        now = dt.datetime.now(dt.UTC)
        body = client.CoreV1Event(
            metadata=client.V1ObjectMeta(generate_name=f"{name}.", namespace=ns),
            involved_object=client.V1ObjectReference(
                api_version=f"{API_GROUP}/{VERSION}",
                kind="RateLimitPolicy",
                name=name,
                namespace=ns,
                uid=uid or None,
            ),
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
        self.core.create_namespaced_event(ns, body)
