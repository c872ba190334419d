"""Leader election over a ``coordination.k8s.io/v1`` Lease, so that of several operator replicas
only one writes (NodeAdmissions, policy status, Events, the webhook's certificate Secret and
``caBundle``); the others stand by, serve the webhook, and take over when the leader goes.

The protocol is client-go's (``k8s.io/client-go/tools/leaderelection``, the one
kube-controller-manager and controller-runtime use;
https://kubernetes.io/docs/concepts/architecture/leases/#leader-election):

- every ``retry_period`` seconds a candidate reads the Lease. The holder renews it
  (``renewTime``); another candidate takes it only once the record has not changed for
  ``leaseDurationSeconds`` *by its own monotonic clock* (never by comparing ``renewTime`` with
  its wall clock, so clock skew between nodes does not matter). Every write carries the
  ``resourceVersion`` read, so of two candidates taking an expired Lease at once the API server
  lets one win (409 for the other).
- the holder counts itself leader only until ``renew_deadline`` seconds after the start of its
  last successful renewal (:meth:`LeaderElector.is_leader`, checked before every write), and
  ``renew_deadline < lease_duration``: a leader cut off from the API server, or frozen, stops
  writing at least ``lease_duration - renew_deadline`` seconds before anyone else may take over.
  That margin bounds how late a write already sent may land; like client-go's, this is not a
  fencing token (https://pkg.go.dev/k8s.io/client-go/tools/leaderelection).
- on a clean stop the holder releases the Lease (``holderIdentity`` emptied), so a rolling
  update's new pod takes over within one ``retry_period`` instead of a lease duration.

Why not the client library's own ``kubernetes.leaderelection``: it runs the leader's work in a
thread with no way to stop it when leadership is lost, never releases the Lease, exits the
process on a bad configuration and uses the wall clock; the operator is asyncio and must keep
serving the webhook as a follower. Why not kopf peering: it pauses kopf's handlers only (the
reconcile loop here is not one), and an old and a new pod pause each other during a rollout
(https://github.com/nolar/kopf/issues/734).

:func:`decide` and :func:`observe` are pure (the clock is an argument); :class:`LeaderElector`
does the I/O.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

log = logging.getLogger("kvgate.operator.leader")

#: What one failed round against the API server raises: an error answer, a socket error, or
#: urllib3's own (``MaxRetryError``, ``ReadTimeoutError``, ``ProtocolError``: the kubernetes
#: client wraps only ``SSLError`` in ``ApiException``, and urllib3's are not ``OSError``).
API_ERRORS = (ApiException, OSError, HTTPError, ValueError)

Action = Literal["create", "acquire", "renew", "wait"]


@dataclass(frozen=True)
class LeaseRecord:
    """The parts of a Lease's spec the election reads. ``holder`` is "" when released."""

    holder: str
    duration_s: int
    renew_time: str
    acquire_time: str
    transitions: int

    @classmethod
    def from_object(cls, lease: Mapping[str, Any]) -> LeaseRecord:
        """From a Lease as a dict (camelCase keys, as the API returns it)."""
        spec = lease.get("spec") or {}
        return cls(
            str(spec.get("holderIdentity") or ""),
            int(spec.get("leaseDurationSeconds") or 0),
            str(spec.get("renewTime") or ""),
            str(spec.get("acquireTime") or ""),
            int(spec.get("leaseTransitions") or 0),
        )


@dataclass(frozen=True)
class Observed:
    """The last Lease record seen and when it was first seen so (monotonic seconds)."""

    record: LeaseRecord
    since: float


def observe(prev: Observed | None, record: LeaseRecord, now: float) -> Observed:
    """The observation after reading ``record`` at ``now``: unchanged records keep their
    ``since``; a changed one (renewed, taken, released) restarts it."""
    if prev is not None and prev.record == record:
        return prev
    return Observed(record, now)


def decide(record: LeaseRecord | None, me: str, observed: Observed | None, now: float) -> Action:
    """What candidate ``me`` does with the Lease read at ``now`` (monotonic seconds):
    ``create`` it (missing), ``renew`` it (ours), ``acquire`` it (released, or unchanged for its
    ``leaseDurationSeconds`` since ``observed.since``), else ``wait``."""
    if record is None:
        return "create"
    if record.holder == me:
        return "renew"
    if not record.holder:
        return "acquire"
    expired = (
        observed is not None
        and observed.record == record
        and now >= observed.since + max(1, record.duration_s)
    )
    return "acquire" if expired else "wait"


def micro_time(when: dt.datetime) -> str:
    """A Kubernetes MicroTime (RFC 3339, microseconds, UTC)."""
    return when.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def lease_body(
    record: LeaseRecord | None,
    action: Action,
    me: str,
    duration_s: float,
    wall: dt.datetime,
    resource_version: str | None,
) -> dict[str, Any]:
    """The Lease to write for ``action`` (``create``, ``acquire`` or ``renew``): held by ``me``
    for ``duration_s`` seconds (rounded up: the field is whole seconds), renewed at ``wall``;
    ``acquireTime`` kept on a renewal, ``leaseTransitions`` counted on a change of holder."""
    now = micro_time(wall)
    kept = record.acquire_time if action == "renew" and record is not None else ""
    transitions = record.transitions if record is not None else 0
    if record is not None and record.holder != me:
        transitions += 1
    meta: dict[str, Any] = {}
    if resource_version is not None:
        meta["resourceVersion"] = resource_version
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": meta,
        "spec": {
            "holderIdentity": me,
            "leaseDurationSeconds": max(1, math.ceil(duration_s)),
            "acquireTime": kept or now,
            "renewTime": now,
            "leaseTransitions": transitions,
        },
    }


class LeaderElector:
    """Campaigns for the Lease ``namespace/name`` as ``identity``; :meth:`run` loops forever.

    Args:
        api: a configured ``kubernetes.client.ApiClient``.
        namespace, name: the Lease.
        identity: this replica's unique name (its pod name: see
            :func:`kvgate_operator.app.replica_identity`).
        lease_duration, renew_deadline, retry_period: seconds, as in client-go
            (``retry_period < renew_deadline < lease_duration``).
        on_change: called with the new state whenever this replica starts or stops leading.
        clock: monotonic seconds (injected by tests).
    """

    def __init__(
        self,
        api: client.ApiClient,
        *,
        namespace: str,
        name: str,
        identity: str,
        lease_duration: float,
        renew_deadline: float,
        retry_period: float,
        on_change: Callable[[bool], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.coord = client.CoordinationV1Api(api)
        self.api: Any = api  # sanitize_for_serialization is untyped
        self.namespace, self.name, self.identity = namespace, name, identity
        self.lease_duration = lease_duration
        self.renew_deadline = renew_deadline
        self.retry_period = retry_period
        self.on_change = on_change
        self.clock = clock
        #: The holder seen last ("" when none or unknown).
        self.holder = ""
        #: Monotonic time of the last answer from the API server about the Lease.
        self.last_contact: float | None = None
        self._observed: Observed | None = None
        self._valid_until: float | None = None
        self._was_leader = False

    def is_leader(self) -> bool:
        """True while this replica may write: within ``renew_deadline`` of the start of its last
        successful renewal."""
        return self._valid_until is not None and self.clock() < self._valid_until

    async def run(self) -> None:
        """Campaign and renew every ``retry_period`` (followers with up to 20 % jitter, as
        client-go), forever; errors are logged and retried: nothing but cancellation ends it
        (a replica whose election stopped would never renew nor campaign again)."""
        while True:
            try:
                await self.try_once()
            except Exception:
                log.exception("leader election: round failed; retrying")
            jitter = 0.0 if self.is_leader() else random.uniform(0, 0.2)
            await asyncio.sleep(self.retry_period * (1 + jitter))

    async def try_once(self) -> bool:
        """One round: read the Lease and create, take or renew it when due. Returns whether
        this replica leads afterwards."""
        started = self.clock()
        try:
            won = await asyncio.to_thread(self._attempt)
        except API_ERRORS as exc:
            log.warning("leader election: Lease %s/%s: %s", self.namespace, self.name, exc)
            won = False
        if won:
            self._valid_until = started + self.renew_deadline
        self._report()
        return self.is_leader()

    def _report(self) -> None:
        leading = self.is_leader()
        if leading != self._was_leader:
            self._was_leader = leading
            if leading:
                log.info(
                    "leader election: %s leads (Lease %s/%s)",
                    self.identity,
                    self.namespace,
                    self.name,
                )
            else:
                log.warning("leader election: %s stopped leading; writes paused", self.identity)
            if self.on_change is not None:
                self.on_change(leading)

    def _attempt(self) -> bool:
        """Read the Lease, then write it when due. The record read is dated by the clock taken
        once the read returned (a renewal may have landed at any time while the read was in
        flight, so dating it by the read's start would let a follower take over early); the
        leader's own validity counts from the start of the round instead (:meth:`try_once`),
        the earliest its renewal may have landed, so it stops before any follower may start."""
        timeout = max(1.0, self.renew_deadline / 2)
        try:
            lease: dict[str, Any] | None = self.api.sanitize_for_serialization(
                self.coord.read_namespaced_lease(
                    self.name, self.namespace, _request_timeout=timeout
                )
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
            lease = None
        now = self.last_contact = self.clock()
        record = LeaseRecord.from_object(lease) if lease is not None else None
        if record is not None:
            self._observed = observe(self._observed, record, now)
            self.holder = record.holder
        action = decide(record, self.identity, self._observed, now)
        if action == "wait":
            return False
        rv = (lease or {}).get("metadata", {}).get("resourceVersion") if lease else None
        body = lease_body(
            record, action, self.identity, self.lease_duration, dt.datetime.now(dt.UTC), rv
        )
        body["metadata"]["name"] = self.name
        try:
            if lease is None:
                self.coord.create_namespaced_lease(
                    self.namespace, cast(Any, body), _request_timeout=timeout
                )
            else:
                self.coord.replace_namespaced_lease(
                    self.name, self.namespace, cast(Any, body), _request_timeout=timeout
                )
        except ApiException as exc:
            if exc.status in (404, 409):  # someone else wrote it meanwhile: they won
                return False
            raise
        if action == "acquire":
            log.info("leader election: %s took the Lease from %r", self.identity, self.holder)
        self.holder = self.identity
        return True

    async def release(self) -> None:
        """Give the Lease up (on a clean stop), so another replica takes over within one
        ``retry_period``. Only while leading; errors are logged (the Lease then expires)."""
        if not self.is_leader():
            return
        self._valid_until = None
        self._report()
        try:
            await asyncio.to_thread(self._release)
        except API_ERRORS as exc:
            log.warning("leader election: releasing the Lease failed: %s", exc)

    def _release(self) -> None:
        lease = self.api.sanitize_for_serialization(
            self.coord.read_namespaced_lease(self.name, self.namespace, _request_timeout=2)
        )
        if LeaseRecord.from_object(lease).holder != self.identity:
            return
        spec = dict(lease.get("spec") or {})
        spec.update(
            holderIdentity="", leaseDurationSeconds=1, renewTime=micro_time(dt.datetime.now(dt.UTC))
        )
        lease["spec"] = spec
        self.coord.replace_namespaced_lease(
            self.name, self.namespace, cast(Any, lease), _request_timeout=2
        )
        log.info("leader election: %s released the Lease", self.identity)

    def describe(self, stale_after: float) -> tuple[bool, str]:
        """Liveness of a follower: (ok, why); OK while the API server answered about the Lease
        within ``stale_after`` seconds."""
        if self.last_contact is None:
            return False, "leader election: the Lease has not been read yet"
        age = self.clock() - self.last_contact
        if age > stale_after:
            return False, f"leader election: no answer about the Lease for {age:.0f}s"
        return True, f"standing by (leader: {self.holder or 'none'}), Lease read {age:.1f}s ago"
