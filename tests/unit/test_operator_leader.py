"""Leader election (kvgate_operator.leader): the pure decision on a read Lease, and the elector's
bookkeeping against an in-memory Lease store with optimistic concurrency, on a fake clock. The
real API server's part is in tests/integration/test_operator_replicas.py (and, cut off by a
proxy, in tests/integration/test_partitions.py)."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import MaxRetryError, ReadTimeoutError

from kvgate_bench.kit.toolkit import FakeClock
from kvgate_operator.leader import (
    LeaderElector,
    LeaseRecord,
    Observed,
    decide,
    lease_body,
    observe,
)
from kvgate_operator.plan import stale_owners
from kvgate_operator.settings import OperatorSettings


def rec(holder: str, renew: str = "t1", duration: int = 15) -> LeaseRecord:
    return LeaseRecord(holder, duration, renew, "t0", 3)


def test_a_missing_lease_is_created_and_ours_renewed() -> None:
    assert decide(None, "me", None, 0) == "create"
    assert decide(rec("me"), "me", None, 0) == "renew"


def test_a_released_lease_is_taken_at_once() -> None:
    assert decide(rec(""), "me", None, 0) == "acquire"


def test_another_holder_is_waited_for_until_its_record_is_unchanged_for_its_duration() -> None:
    r = rec("other")
    seen = observe(None, r, now=100.0)
    assert decide(r, "me", seen, 100.0) == "wait"
    assert decide(r, "me", observe(seen, r, 114.9), 114.9) == "wait"
    assert decide(r, "me", observe(seen, r, 115.0), 115.0) == "acquire"


def test_a_renewal_restarts_the_wait_by_the_candidates_own_clock() -> None:
    seen = observe(None, rec("other", "t1"), now=100.0)
    renewed = rec("other", "t2")
    later = observe(seen, renewed, now=114.0)
    assert later == Observed(renewed, 114.0)
    assert decide(renewed, "me", later, 120.0) == "wait"  # 6 s since it changed
    assert decide(renewed, "me", later, 129.0) == "acquire"


def test_lease_body_keeps_acquire_time_on_renewal_and_counts_transitions() -> None:
    wall = dt.datetime(2026, 1, 2, 3, 4, 5, 600000, tzinfo=dt.UTC)
    renew = lease_body(rec("me"), "renew", "me", 15, wall, "7")["spec"]
    assert renew["acquireTime"] == "t0" and renew["renewTime"] == "2026-01-02T03:04:05.600000Z"
    assert renew["leaseTransitions"] == 3 and renew["leaseDurationSeconds"] == 15
    taken = lease_body(rec("other"), "acquire", "me", 2.5, wall, "7")
    assert taken["metadata"] == {"resourceVersion": "7"}
    assert taken["spec"]["leaseTransitions"] == 4 and taken["spec"]["leaseDurationSeconds"] == 3
    assert taken["spec"]["acquireTime"] == taken["spec"]["renewTime"]


class Store:
    """CoordinationV1Api's Lease calls on one in-memory Lease, refusing stale resourceVersions
    with 409 as the API server does."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.rv = 0
        self.down = False
        #: Raised by every call when set (e.g. urllib3's MaxRetryError: no answer at all).
        self.error: BaseException | None = None
        #: Called during each read, before it returns (a slow read: the test moves the clock
        #: and changes the Lease meanwhile).
        self.during_read: Callable[[], None] | None = None
        self.reads = 0

    def read_namespaced_lease(self, name: str, ns: str, **_: Any) -> dict[str, Any]:
        self.reads += 1
        if self.error is not None:
            raise self.error
        if self.down:
            raise ApiException(status=503, reason="unavailable")
        if self.during_read is not None:
            self.during_read()
        if self.lease is None:
            raise ApiException(status=404, reason="Not Found")
        return self.lease

    def _put(self, body: dict[str, Any]) -> dict[str, Any]:
        self.rv += 1
        self.lease = {**body, "metadata": {**body["metadata"], "resourceVersion": str(self.rv)}}
        return self.lease

    def create_namespaced_lease(self, ns: str, body: dict[str, Any], **_: Any) -> dict[str, Any]:
        if self.lease is not None:
            raise ApiException(status=409, reason="AlreadyExists")
        return self._put(body)

    def replace_namespaced_lease(
        self, name: str, ns: str, body: dict[str, Any], **_: Any
    ) -> dict[str, Any]:
        assert self.lease is not None
        if self.error is not None:
            raise self.error
        if body["metadata"].get("resourceVersion") != self.lease["metadata"]["resourceVersion"]:
            raise ApiException(status=409, reason="Conflict")
        return self._put(body)


class Api:
    def sanitize_for_serialization(self, obj: Any) -> Any:
        return obj


def elector(
    store: Store, clock: FakeClock, me: str, changes: list[bool], retry_period: float = 2
) -> LeaderElector:
    e = LeaderElector(
        Api(),  # type: ignore[arg-type]
        namespace="ns",
        name="lease",
        identity=me,
        lease_duration=15,
        renew_deadline=10,
        retry_period=retry_period,
        on_change=changes.append,
        clock=clock,
    )
    e.coord = store  # type: ignore[assignment]
    return e


async def test_one_of_two_candidates_leads_and_the_other_takes_over_after_expiry() -> None:
    store, clock = Store(), FakeClock()
    a_changes: list[bool] = []
    a, b = elector(store, clock, "a", a_changes), elector(store, clock, "b", [])
    assert await a.try_once() and not await b.try_once()
    assert a.is_leader() and not b.is_leader() and b.holder == "a"
    assert a_changes == [True]
    # a stops renewing (frozen): it stops counting itself leader at the renew deadline,
    # before b may take over at the lease duration.
    clock.advance(10)
    assert not a.is_leader()
    assert not await b.try_once()
    clock.advance(4.9)
    assert not await b.try_once()  # unchanged for 14.9 s by b's clock
    clock.advance(0.1)
    assert await b.try_once() and b.is_leader()
    assert store.lease is not None and store.lease["spec"]["leaseTransitions"] == 1
    # a wakes: the Lease is b's, a does not lead (and wrote nothing).
    rv = store.rv
    assert not await a.try_once() and store.rv == rv
    assert a_changes == [True, False]


async def test_a_leader_cut_off_from_the_api_server_stops_at_the_renew_deadline() -> None:
    store, clock = Store(), FakeClock()
    a = elector(store, clock, "a", [])
    assert await a.try_once()
    store.down = True
    clock.advance(9)
    assert await a.try_once()  # the failed renewal leaves 1 s of the deadline
    clock.advance(1)
    assert not await a.try_once()
    store.down = False
    assert await a.try_once()  # still its Lease: renewed


def no_answer() -> MaxRetryError:
    """What the kubernetes client raises when the API server cannot be reached (urllib3's,
    not an OSError nor an ApiException)."""
    return MaxRetryError(None, "/apis/coordination.k8s.io", reason=ConnectionRefusedError())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "error",
    [no_answer(), ReadTimeoutError(None, "/apis", "read timed out"), ConnectionResetError()],  # type: ignore[arg-type]
    ids=["MaxRetryError", "ReadTimeoutError", "OSError"],
)
async def test_no_answer_from_the_api_server_is_a_failed_round_not_a_crash(
    error: BaseException,
) -> None:
    store, clock = Store(), FakeClock()
    changes: list[bool] = []
    a = elector(store, clock, "a", changes)
    assert await a.try_once()
    store.error = error
    clock.advance(9)
    assert await a.try_once()  # the failed renewal leaves 1 s of the deadline
    clock.advance(1)
    assert not await a.try_once() and changes == [True, False]
    store.error = None
    assert await a.try_once() and changes == [True, False, True]  # still its Lease: renewed
    store.error = error
    await a.release()  # logged, not raised: the Lease then expires
    assert not a.is_leader()


async def test_the_election_loop_survives_any_error_and_keeps_campaigning() -> None:
    """``run`` must never end: a replica whose election task died would never renew nor
    campaign again (a leader turned follower for good)."""
    store, clock = Store(), FakeClock()
    a = elector(store, clock, "a", [], retry_period=0.001)
    store.error = RuntimeError("a bug in a round")
    task = asyncio.create_task(a.run())
    try:
        for error in (RuntimeError("a bug in a round"), no_answer()):
            store.error, reads = error, store.reads
            while store.reads < reads + 3:
                await asyncio.sleep(0.001)
                assert not task.done(), task.exception()
        store.error = None
        while not a.is_leader():
            await asyncio.sleep(0.001)
            assert not task.done(), task.exception()
    finally:
        task.cancel()


async def test_a_renewal_seen_by_a_slow_read_is_dated_when_the_read_returned() -> None:
    """A follower's read in flight for 6 s returns a renewal that may have landed at its very
    end: the follower may take over only a lease duration after the read returned, not after
    it started."""
    store, clock = Store(), FakeClock()
    a, b = elector(store, clock, "a", []), elector(store, clock, "b", [])
    assert await a.try_once() and not await b.try_once()
    clock.advance(10)

    def slow_read_meanwhile_renewed() -> None:
        assert store.lease is not None
        store.lease["spec"] = {**store.lease["spec"], "renewTime": "renewed"}
        clock.advance(6)
        store.during_read = None

    store.during_read = slow_read_meanwhile_renewed
    assert not await b.try_once()  # started at 10, returned at 16 with the renewal
    clock.advance(10)  # 26: a lease duration (15) after the read's start, not its return
    assert not await b.try_once() and store.lease is not None
    assert store.lease["spec"]["holderIdentity"] == "a"
    clock.advance(5)  # 31: unchanged for 15 s since it was seen
    assert await b.try_once()


async def test_a_released_lease_is_taken_by_the_next_attempt() -> None:
    store, clock = Store(), FakeClock()
    a, b = elector(store, clock, "a", []), elector(store, clock, "b", [])
    assert await a.try_once() and not await b.try_once()
    await a.release()
    assert not a.is_leader()
    assert await b.try_once()


async def test_follower_liveness_needs_recent_answers_about_the_lease() -> None:
    store, clock = Store(), FakeClock()
    a, b = elector(store, clock, "a", []), elector(store, clock, "b", [])
    assert b.describe(60) == (False, "leader election: the Lease has not been read yet")
    await a.try_once()
    await b.try_once()
    ok, why = b.describe(60)
    assert ok and "leader: a" in why
    clock.advance(61)
    assert not b.describe(60)[0]


def test_settings_refuse_timings_out_of_order() -> None:
    with pytest.raises(ValueError, match="retry_period < renew_deadline < lease_duration"):
        OperatorSettings(leader_election_renew_deadline=20)
    assert not OperatorSettings().elects  # no pod namespace: a local run, no election
    assert OperatorSettings(pod_namespace="kvgate-system").elects


def test_stale_owner_references_are_found() -> None:
    owners = {"n1": "uid-1", "n2": "old", "n3": "", "gone": "x"}
    nodes = {"n1": "uid-1", "n2": "uid-2", "n3": "uid-3"}
    assert stale_owners(owners, nodes) == {"n2": "uid-2", "n3": "uid-3"}


def test_a_node_made_again_under_its_name_gets_its_node_admission_re_owned() -> None:
    from kvgate_operator.desired import Desired
    from kvgate_operator.plan import NodeWrite, plan

    spec = {"nodeName": "n1", "pods": []}
    desired = Desired({"n1": spec, "n2": {"nodeName": "n2", "pods": []}}, {})
    todo = plan(
        desired,
        {"n1": spec, "n2": desired.node_specs["n2"]},
        {},
        "now",
        owners=stale_owners({"n1": "old", "n2": "uid-2"}, {"n1": "uid-1", "n2": "uid-2"}),
    )
    assert todo.nodes == [NodeWrite("patch", "n1", spec, "uid-1")]


def test_the_identity_is_the_pod_name_else_unique_per_process() -> None:
    from kvgate_operator.app import replica_identity

    assert replica_identity(OperatorSettings(pod_name="kvgate-operator-7d9-x2")) == (
        "kvgate-operator-7d9-x2"
    )
    local = OperatorSettings()
    assert replica_identity(local) != replica_identity(local)
