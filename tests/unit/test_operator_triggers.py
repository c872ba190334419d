"""Which watch events trigger a reconcile pass (kvgate_operator.triggers): only changes to what
desired state reads."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from kvgate_operator.triggers import WATCHES, Kind, Seen, fingerprint


def pod(**over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "metadata": {"uid": "u1", "name": "p", "namespace": "ns", "labels": {"app": "a"}},
        "spec": {"nodeName": "n1"},
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "False"}]},
    }
    body.update(over)
    return body


def event(body: dict[str, Any], type_: str = "MODIFIED") -> dict[str, Any]:
    return {"type": type_, "object": body}


def changed(kind: Kind, before: dict[str, Any], after: dict[str, Any]) -> bool:
    seen = Seen()
    assert seen.triggers(kind, event(before, "ADDED"))
    return seen.triggers(kind, event(after))


def test_every_kind_is_watched_at_its_api_version() -> None:
    assert {k: (w.group, w.version, w.plural) for k, w in WATCHES.items()} == {
        Kind.POLICIES: ("kvgate.io", "v1alpha1", "ratelimitpolicies"),
        Kind.PODS: ("", "v1", "pods"),
        Kind.NODES: ("", "v1", "nodes"),
        Kind.NODE_ADMISSIONS: ("kvgate.io", "v1alpha1", "nodeadmissions"),
    }


def test_the_first_sight_of_an_object_triggers_and_a_repeat_does_not() -> None:
    seen = Seen()
    assert seen.triggers(Kind.PODS, event(pod(), "ADDED"))
    assert not seen.triggers(Kind.PODS, event(pod()))
    assert len(seen) == 1


@pytest.mark.parametrize(
    "change",
    [
        lambda b: b["metadata"]["labels"].update(app="b"),
        lambda b: b["spec"].update(nodeName="n2"),
        lambda b: b["status"].update(phase="Succeeded"),
        lambda b: b["status"].update(conditions=[{"type": "Ready", "status": "True"}]),
        lambda b: b["metadata"].update(deletionTimestamp="2026-01-01T00:00:00Z"),
    ],
    ids=["labels", "node", "phase", "ready", "terminating"],
)
def test_pod_changes_that_desired_state_reads_trigger(change: Any) -> None:
    after = copy.deepcopy(pod())
    change(after)
    assert changed(Kind.PODS, pod(), after)


def test_pod_status_churn_triggers_nothing() -> None:
    after = copy.deepcopy(pod())
    after["status"]["podIP"] = "10.0.0.7"
    after["status"]["conditions"].append({"type": "ContainersReady", "status": "True"})
    after["metadata"]["resourceVersion"] = "42"
    after["metadata"]["annotations"] = {"x": "y"}
    assert not changed(Kind.PODS, pod(), after)


def test_policies_trigger_on_a_new_generation_or_deletion_not_on_status() -> None:
    before = {"metadata": {"uid": "p1", "generation": 1}, "spec": {}}
    status_write = copy.deepcopy(before) | {"status": {"matchedPods": 3}}
    assert not changed(Kind.POLICIES, before, status_write)
    assert changed(Kind.POLICIES, before, {"metadata": {"uid": "p1", "generation": 2}})
    deleting = {"metadata": {"uid": "p1", "generation": 1, "deletionTimestamp": "t"}}
    assert changed(Kind.POLICIES, before, deleting)


def test_node_admissions_trigger_on_engine_capacity_not_on_heartbeats() -> None:
    def na(capacity: int | None, heartbeat: str) -> dict[str, Any]:
        usage: dict[str, Any] = {"uid": "pod-1", "inFlightRequests": 3}
        if capacity is not None:
            usage["engineKvCapacityTokens"] = capacity
        return {
            "metadata": {"uid": "na1", "generation": 4},
            "status": {"pods": [usage], "lastHeartbeatTime": heartbeat},
        }

    assert not changed(Kind.NODE_ADMISSIONS, na(None, "t1"), na(None, "t2"))
    assert not changed(Kind.NODE_ADMISSIONS, na(65536, "t1"), na(65536, "t2"))
    assert changed(Kind.NODE_ADMISSIONS, na(None, "t1"), na(65536, "t2"))
    assert changed(Kind.NODE_ADMISSIONS, na(1000, "t1"), na(65536, "t1"))
    spec_change = na(None, "t1")
    spec_change["metadata"]["generation"] = 5
    assert changed(Kind.NODE_ADMISSIONS, na(None, "t1"), spec_change)


def test_nodes_trigger_only_on_coming_and_going() -> None:
    node = {"metadata": {"uid": "n1", "labels": {"a": "b"}}, "status": {"conditions": []}}
    relabelled = {"metadata": {"uid": "n1", "labels": {"a": "c"}}, "status": {"x": 1}}
    assert not changed(Kind.NODES, node, relabelled)
    assert changed(Kind.NODES, node, {"metadata": {"uid": "n1", "deletionTimestamp": "t"}})


def test_a_deletion_always_triggers_and_forgets_the_object() -> None:
    seen = Seen()
    seen.triggers(Kind.PODS, event(pod(), "ADDED"))
    assert seen.triggers(Kind.PODS, event(pod(), "DELETED"))
    assert len(seen) == 0
    assert seen.triggers(Kind.PODS, event(pod(), "DELETED"))  # unknown: still a pass
    assert seen.triggers(Kind.PODS, event(pod(), "ADDED"))  # recreated with the same uid


def test_objects_are_told_apart_by_kind_and_uid() -> None:
    seen = Seen()
    assert seen.triggers(Kind.PODS, event(pod()))
    other = pod()
    other["metadata"]["uid"] = "u2"
    assert seen.triggers(Kind.PODS, event(other))
    assert seen.triggers(Kind.NODES, event({"metadata": {"uid": "u1"}}))
    assert len(seen) == 3


def test_fingerprint_tolerates_missing_parts() -> None:
    for kind in Kind:
        assert fingerprint(kind, {}) == fingerprint(kind, {"metadata": None, "status": None})
    assert fingerprint(Kind.PODS, {}) == ((), None, None, False, False)
