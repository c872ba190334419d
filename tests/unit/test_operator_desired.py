"""The operator's pure core: selection, conflicts, Global split, planning writes."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate_agent.contract.policy import LabelSelector
from kvgate_operator.desired import Pod, Policy, Snapshot, compute, selects
from kvgate_operator.inject_store import ANNOTATION_STORE, STORE_KIND
from kvgate_operator.plan import plan, with_transition_times
from tests.conftest import policy_doc


def pol(
    name: str,
    spec: dict[str, Any],
    ns: str = "m",
    created: str = "2026-01-01T00:00:00Z",
    generation: int = 1,
) -> Policy:
    doc = policy_doc({"selector": {"matchLabels": {"app": "llm"}}, **spec}, name)
    doc["metadata"].update(
        namespace=ns, uid=f"uid-{name}", generation=generation, creationTimestamp=created
    )
    return Policy.from_object(doc)


def pod(
    name: str,
    node: str | None = "n1",
    ns: str = "m",
    labels: dict[str, str] | None = None,
    ready: bool = True,
    terminating: bool = False,
    store: bool = False,
) -> Pod:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": ns,
        "uid": f"uid-{name}",
        "labels": {"app": "llm"} if labels is None else labels,
    }
    if store:
        meta["annotations"] = {ANNOTATION_STORE: STORE_KIND}
    if terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return Pod.from_object(
        {
            "metadata": meta,
            "spec": {"nodeName": node},
            "status": {
                "phase": "Running",
                "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            },
        }
    )


def snap(
    policies: list[Policy],
    pods: list[Pod],
    nodes: tuple[str, ...] = ("n1", "n2"),
    capacity: dict[str, int] | None = None,
) -> Snapshot:
    return Snapshot(
        {p.key: p for p in policies},
        {p.key: p for p in pods},
        {n: f"uid-{n}" for n in nodes},
        capacity or {},
    )


def entries(d: Any, node: str) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in d.node_specs[node]["pods"]}


def test_label_selector_semantics() -> None:
    sel = LabelSelector.model_validate(
        {
            "matchLabels": {"app": "llm"},
            "matchExpressions": [
                {"key": "tier", "operator": "In", "values": ["a", "b"]},
                {"key": "canary", "operator": "DoesNotExist"},
            ],
        }
    )
    assert selects(sel, {"app": "llm", "tier": "a"})
    assert not selects(sel, {"app": "llm", "tier": "c"})
    assert not selects(sel, {"app": "llm", "tier": "a", "canary": "1"})
    assert not selects(sel, {"tier": "a"})
    assert selects(LabelSelector(), {"anything": "x"})
    assert not selects(None, {"app": "llm"})


def test_only_bound_live_pods_on_existing_nodes_in_the_namespace_count() -> None:
    d = compute(
        snap(
            [pol("p", {})],
            [
                pod("ok"),
                pod("unbound", node=None),
                pod("gone-node", node="n9"),
                pod("terminating", terminating=True),
                pod("other-ns", ns="x"),
                pod("unlabelled", labels={"app": "web"}),
            ],
        )
    )
    assert set(entries(d, "n1")) == {"ok"}
    assert d.policies[("m", "p")].matched == [("m", "ok")]
    assert d.node_specs["n2"] == {"nodeName": "n2", "pods": []}  # every node gets one


def test_entry_carries_identity_policy_ref_and_thresholds() -> None:
    d = compute(
        snap(
            [
                pol(
                    "p",
                    {
                        "concurrency": {"maxRequests": 8},
                        "capacity": {"kvCacheTokens": 4096},
                        "model": {
                            "numLayers": 32,
                            "numKVHeads": 8,
                            "headDim": 128,
                            "kvCacheDtype": "bf16",
                        },
                    },
                    generation=3,
                )
            ],
            [pod("a")],
        )
    )
    e = entries(d, "n1")["a"]
    assert e["uid"] == "uid-a" and e["namespace"] == "m"
    assert e["policy"] == {"namespace": "m", "name": "p", "uid": "uid-p", "generation": 3}
    t = e["thresholds"]
    assert t["concurrency"] == {"maxRequests": 8}
    assert t["kvCapacityTokens"] == 4096 and t["bytesPerToken"] == 131072
    assert "selector" not in t


def test_global_limits_split_across_ready_pods() -> None:
    spec = {
        "rateLimits": [
            {
                "name": "g",
                "per": "Global",
                "requestsPerMinute": 600,
                "burstRequests": 90,
                "tokensPerMinute": 60000,
            },
            {"name": "t", "per": "Tenant", "requestsPerMinute": 60},
        ]
    }
    d = compute(snap([pol("p", spec)], [pod("a"), pod("b", node="n2"), pod("c", ready=False)]))
    for node, name in (("n1", "a"), ("n2", "b"), ("n1", "c")):
        t = entries(d, node)[name]["thresholds"]
        g, tenant = t["rateLimits"]
        assert t["globalShare"] == 0.5
        assert g["requestsPerMinute"] == 300 and g["burstRequests"] == 45
        assert g["tokensPerMinute"] == 30000
        assert tenant["requestsPerMinute"] == 60  # per-tenant limits are not split


def test_oldest_policy_wins_a_contested_pod_and_both_report_it() -> None:
    old = pol("old", {}, created="2026-01-01T00:00:00Z")
    new = pol("new", {}, created="2026-02-01T00:00:00Z")
    d = compute(snap([new, old], [pod("a")]))
    assert entries(d, "n1")["a"]["policy"]["name"] == "old"
    assert d.policies[("m", "old")].status()["matchedPods"] == 1
    assert d.policies[("m", "new")].status()["matchedPods"] == 0
    assert d.policies[("m", "new")].conflicts == ["m/a: governed by older policy old"]
    assert d.policies[("m", "old")].conflicts == ["m/a: also selected by new"]


def test_engine_reported_capacity_beats_the_explicit_one() -> None:
    p = pol("p", {"capacity": {"fromEngineMetrics": True, "kvCacheTokens": 1000}})
    d = compute(snap([p], [pod("a"), pod("b")], capacity={"uid-a": 50000}))
    assert entries(d, "n1")["a"]["thresholds"]["kvCapacityTokens"] == 50000
    assert entries(d, "n1")["b"]["thresholds"]["kvCapacityTokens"] == 1000


def test_invalid_policy_is_not_accepted_and_governs_nothing() -> None:
    doc = policy_doc({"selector": {}, "queue": {"order": "LIFO"}}, "bad")
    doc["metadata"].update(namespace="m", generation=2)
    bad = Policy.from_object(doc)
    d = compute(snap([bad], [pod("a")]))
    st_ = d.policies[("m", "bad")].status()
    accepted = st_["conditions"][0]
    assert accepted["status"] == "False" and accepted["reason"] == "InvalidSpec"
    assert "spec.queue.order" in accepted["message"]
    assert entries(d, "n1") == {}


def test_plan_is_empty_once_converged_and_preserves_transition_times() -> None:
    s = snap(
        [pol("p", {}), pol("q", {"selector": {"matchLabels": {"app": "none"}}})],
        [pod("a"), pod("b", node="n2")],
    )
    d = compute(s)
    first = plan(d, {}, {("m", "p"): None, ("m", "q"): None}, "T1")
    assert [w.action for w in first.nodes] == ["create", "create"]
    assert len(first.statuses) == 2
    # Apply it, then plan again: nothing to do.
    specs = {w.node: w.spec for w in first.nodes}
    statuses = {w.policy: w.status for w in first.statuses}
    assert len(plan(compute(s), specs, statuses, "T2")) == 0
    # A node disappears: its NodeAdmission goes; the policy's Ready keeps its time if unchanged.
    s2 = snap(list(s.policies.values()), list(s.pods.values()), nodes=("n1",))
    p2 = plan(compute(s2), specs, statuses, "T3")
    assert [(w.action, w.node) for w in p2.nodes] == [("delete", "n2")]
    (sw,) = [w for w in p2.statuses if w.policy == ("m", "p")]
    assert sw.status["matchedPods"] == 1
    times = {c["type"]: c["lastTransitionTime"] for c in sw.status["conditions"]}
    assert times == {"Accepted": "T1", "Ready": "T1"}


def test_transition_time_changes_only_with_the_status() -> None:
    old = {"conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "T0"}]}
    new = {"conditions": [{"type": "Ready", "status": "False", "reason": "x"}]}
    assert with_transition_times(new, old, "T9")["conditions"][0]["lastTransitionTime"] == "T9"


def test_new_conflicts_and_invalid_policies_raise_events_once() -> None:
    s = snap([pol("old", {}), pol("new", {}, created="2026-03-01T00:00:00Z")], [pod("a")])
    p1 = plan(compute(s), {}, {}, "T")
    assert sorted(e.reason for e in p1.events) == ["PolicyConflict", "PolicyConflict"]
    statuses = {w.policy: w.status for w in p1.statuses}
    specs = {w.node: w.spec for w in p1.nodes}
    assert plan(compute(s), specs, statuses, "T2").events == []


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32))
def test_compute_does_not_depend_on_listing_order(seed: int) -> None:
    rng = random.Random(seed)
    policies = [
        pol(
            f"p{i}",
            {
                "selector": {"matchLabels": {"g": str(i % 3)}},
                "rateLimits": [{"name": "g", "per": "Global", "requestsPerMinute": 100}],
            },
            created=f"2026-01-0{1 + i % 3}T00:00:00Z",
        )
        for i in range(6)
    ]
    pods = [
        pod(f"pod{i}", node=f"n{1 + i % 2}", labels={"g": str(i % 4)}, ready=i % 5 != 0)
        for i in range(20)
    ]
    a = compute(snap(policies, pods))
    rng.shuffle(policies)
    rng.shuffle(pods)
    b = compute(snap(policies, pods))
    assert a.node_specs == b.node_specs
    assert {k: v.status() for k, v in a.policies.items()} == {
        k: v.status() for k, v in b.policies.items()
    }


def test_failed_node_writes_make_affected_policies_not_ready_with_an_event() -> None:
    from kvgate_operator.desired import mark_write_failures

    s = snap(
        [pol("p", {}), pol("q", {"selector": {"matchLabels": {"app": "other"}}})],
        [pod("a"), pod("b", node="n2"), pod("c", labels={"app": "other"})],
    )
    d = compute(s)
    mark_write_failures(d, s, {"n2": "422 Unprocessable Entity: spec.pods: Too many"})
    ready = {c["type"]: c for c in d.policies[("m", "p")].status()["conditions"]}["Ready"]
    assert ready["status"] == "False" and ready["reason"] == "WriteFailed"
    assert "NodeAdmission n2 could not be written: 422" in ready["message"]
    other = {c["type"]: c for c in d.policies[("m", "q")].status()["conditions"]}["Ready"]
    assert other["status"] == "True"  # its pods are on n1 only
    p1 = plan(d, {}, {}, "T")
    assert [e.reason for e in p1.events if e.policy == ("m", "p")] == ["WriteFailed"]
    statuses = {w.policy: w.status for w in p1.statuses}
    assert [e.reason for e in plan(d, {}, statuses, "T2").events] == []  # once, not per pass


def test_a_policy_whose_pods_all_belong_to_an_older_one_says_so() -> None:
    d = compute(
        snap([pol("old", {}), pol("new", {}, created="2026-05-01T00:00:00Z")], [pod("a"), pod("b")])
    )
    ready = {c["type"]: c for c in d.policies[("m", "new")].status()["conditions"]}["Ready"]
    assert ready["reason"] == "AllPodsGovernedElsewhere" and "all 2" in ready["message"]


def test_shared_global_limits_keep_the_whole_budget_with_a_store() -> None:
    spec = {
        "rateLimits": [
            {"name": "g", "per": "Global", "shared": True, "requestsPerMinute": 600},
            {"name": "h", "per": "Global", "requestsPerMinute": 600},
        ]
    }
    pods = [pod("a"), pod("b", node="n2")]
    leased = [pod("a", store=True), pod("b", node="n2", store=True)]
    with_store = compute(replace(snap([pol("p", spec)], leased), store=True))
    g, h = entries(with_store, "n1")["a"]["thresholds"]["rateLimits"]
    assert g["requestsPerMinute"] == 600  # leased from the store, not split
    assert h["requestsPerMinute"] == 300
    cond = {c["type"]: c for c in with_store.policies[("m", "p")].status()["conditions"]}
    assert cond["SharedLimits"]["status"] == "True"
    without = compute(snap([pol("p", spec)], pods))
    g, _ = entries(without, "n1")["a"]["thresholds"]["rateLimits"]
    assert g["requestsPerMinute"] == 300  # per pod, as if not shared, and the status says so
    cond = {c["type"]: c for c in without.policies[("m", "p")].status()["conditions"]}
    assert cond["SharedLimits"]["status"] == "False"
    assert cond["SharedLimits"]["reason"] == "NoStore"
    # Pods injected before store.url was set: store-less, they keep their split whatever the
    # operator's own settings say, and the condition says the fleet is mixed.
    mixed = compute(replace(snap([pol("p", spec)], [leased[0], pods[1]]), store=True))
    g, _ = entries(mixed, "n1")["a"]["thresholds"]["rateLimits"]
    assert g["requestsPerMinute"] == 600
    g, _ = entries(mixed, "n2")["b"]["thresholds"]["rateLimits"]
    assert g["requestsPerMinute"] == 300
    cond = {c["type"]: c for c in mixed.policies[("m", "p")].status()["conditions"]}
    assert cond["SharedLimits"]["status"] == "False"
    assert (
        cond["SharedLimits"]["reason"] == "MixedStore"
        and "1 pod" in cond["SharedLimits"]["message"]
    )
    old = compute(replace(snap([pol("p", spec)], pods), store=True))
    g, _ = entries(old, "n1")["a"]["thresholds"]["rateLimits"]
    assert g["requestsPerMinute"] == 300  # no pod has a store yet: each its split
    plain = compute(snap([pol("p", {})], pods))
    assert "SharedLimits" not in {
        c["type"] for c in plain.policies[("m", "p")].status()["conditions"]
    }
