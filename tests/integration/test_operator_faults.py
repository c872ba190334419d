"""Operator faults against a real kube-apiserver + etcd, with real operator processes: killed
(SIGKILL) at random points of its reconcile passes, again and again, with the cluster changing
between kills: in the end every NodeAdmission spec and policy status equals the from-scratch
computation, with no duplicates, no orphans and no dangling owner references. (Two replicas at
once, under leader election: tests/integration/test_operator_replicas.py.)

The control plane here is this module's own (not the session's ``kube``): it runs with an audit
policy logging every write (tests/operator_cluster.py). Short mode (the test command):
``KILLS_SHORT`` kills. Long mode, by hand:
``KVGATE_SOAK=long pytest tests/integration/test_operator_faults.py -s`` (``KILLS_LONG``
kills, about four minutes: one start of the operator takes about 2.5 s, so each kill round
costs 4-5 s). Both print their figures (kills, where they landed, passes seen, final diff).
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from kvgate_bench.kit.toolkit import wait_until
from tests.operator_cluster import (
    GROUP,
    VERSION,
    Audited,
    Replica,
    converge,
    core_api,
    custom_api,
    diff,
    ensure_namespace,
    global_spec,
    invariants,
    make_node,
    make_pod,
    put_policy,
)

pytestmark = pytest.mark.k8s

KILLS_SHORT, KILLS_LONG = 8, 50
KILLS = KILLS_LONG if os.environ.get("KVGATE_SOAK") == "long" else KILLS_SHORT


LOCAL_SPEC = {"selector": {"matchLabels": {"app": "l"}}, "concurrency": {"maxRequests": 4}}


@dataclass
class Soak:
    """The soak's cluster: nodes, pods and two policies in one namespace, changed at random."""

    ns: str
    rng: random.Random
    nodes: list[str] = field(default_factory=list)
    pods: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (node, app)
    made: int = 0
    tpm: int = 100_000
    ops: dict[str, int] = field(default_factory=dict)

    def setup(self, api: client.ApiClient, n_nodes: int = 16, n_pods: int = 48) -> None:
        ensure_namespace(api, self.ns)
        for _ in range(n_nodes):
            self.add_node(api)
        for _ in range(n_pods):
            self.add_pod(api)
        put_policy(api, self.ns, "global", global_spec(self.tpm))
        put_policy(api, self.ns, "local", LOCAL_SPEC)

    def add_node(self, api: client.ApiClient) -> None:
        self.made += 1
        name = f"{self.ns}-node-{self.made:03d}"
        make_node(api, name)
        self.nodes.append(name)

    def add_pod(self, api: client.ApiClient) -> None:
        self.made += 1
        name, node, app = f"m-{self.made:04d}", self.rng.choice(self.nodes), self.rng.choice("gl")
        make_pod(api, self.ns, name, node, app)
        self.pods[name] = (node, app)

    def first_global_node(self) -> str:
        """The first node (by name, the order writes start in) holding a ``g`` pod: a new
        Global budget rewrites it."""
        return min(n for n, app in self.pods.values() if app == "g" and n in self.nodes)

    def change(self, api: client.ApiClient) -> None:
        """Always a new Global budget (every node holding a ``g`` pod is rewritten), plus one
        change drawn at random."""
        core = core_api(api)
        self.tpm += 1000
        put_policy(api, self.ns, "global", global_spec(self.tpm))
        op = self.rng.choice(
            ["pods+", "pods-", "relabel", "node-remade", "node+", "node-", "policy-toggle"]
        )
        self.ops[op] = self.ops.get(op, 0) + 1
        if op == "pods+":
            for _ in range(3):
                self.add_pod(api)
        elif op == "pods-" and self.pods:
            for name in self.rng.sample(sorted(self.pods), min(2, len(self.pods))):
                core.delete_namespaced_pod(name, self.ns, grace_period_seconds=0)
                del self.pods[name]
        elif op == "relabel" and self.pods:
            name, app = self.rng.choice(sorted(self.pods)), self.rng.choice("gl")
            core.patch_namespaced_pod(name, self.ns, {"metadata": {"labels": {"app": app}}})
            self.pods[name] = (self.pods[name][0], app)
        elif op == "node-remade":  # same name, new uid: the owner reference must follow
            node = self.rng.choice(self.nodes)
            core.delete_node(node)
            wait_until(lambda: _gone(core, node), 10, f"node {node} deleted")
            make_node(api, node)
        elif op == "node+":
            self.add_node(api)
        elif op == "node-" and len(self.nodes) > 3:
            node = self.nodes.pop(self.rng.randrange(len(self.nodes)))
            core.delete_node(node)  # its pods stay, bound to a node that is gone: not counted
        elif op == "policy-toggle":
            custom = custom_api(api)
            try:
                custom.delete_namespaced_custom_object(
                    GROUP, VERSION, self.ns, "ratelimitpolicies", "local"
                )
            except ApiException as exc:
                if exc.status != 404:
                    raise
                put_policy(api, self.ns, "local", LOCAL_SPEC)


def _gone(core: Any, node: str) -> bool:
    try:
        core.read_node(node)
    except ApiException as exc:
        return bool(exc.status == 404)
    return False


# ---------------------------------------------------------------------------------------------
# Operator processes


def first_write(api: client.ApiClient, node: str, timeout: float = 30) -> None:
    """Return as soon as NodeAdmission ``node`` is written (polled every 10 ms)."""
    rv = resource_version(api, node)
    wait_until(lambda: resource_version(api, node) != rv, timeout, "a first write", 0.01)


def resource_version(api: client.ApiClient, node: str) -> str:
    try:
        obj = custom_api(api).get_cluster_custom_object(GROUP, VERSION, "nodeadmissions", node)
    except ApiException:
        return ""
    return str(obj["metadata"]["resourceVersion"])


# ---------------------------------------------------------------------------------------------
# Killed at random points


@pytest.mark.timeout(90 + 10 * KILLS)
def test_operator_killed_at_random_points_converges_without_duplicates_or_orphans(
    audited: Audited, tmp_path: Path
) -> None:
    """Each round changes the cluster, starts the operator and SIGKILLs it: half the rounds at
    a random delay after the start (before, during or after its first pass), half right after
    its first NodeAdmission write landed (0-30 ms later: inside the pass, which writes 16
    NodeAdmissions, 8 at a time, then the policies' status). Where each kill landed is
    measured: the differences from the from-scratch state before the start and after the kill
    (unchanged: before any write; fewer: mid-pass; none: after convergence)."""
    kills = KILLS
    rng = random.Random(11)
    soak = Soak("soak", rng)
    log = tmp_path / "operator.log"
    with audited.api() as api:
        soak.setup(api)
        landed = {"before any write": 0, "mid-pass": 0, "after convergence": 0}
        for i in range(kills):
            soak.change(api)
            before = len(diff(audited))
            op = Replica(audited, log).launched()
            if i % 2:
                first_write(api, soak.first_global_node())
                time.sleep(rng.uniform(0, 0.03))
            else:
                time.sleep(rng.uniform(0.5, 3.0))
            op.kill()
            after = len(diff(audited))
            where = (
                "after convergence"
                if after == 0
                else "before any write"
                if after >= before
                else "mid-pass"
            )
            landed[where] += 1
        op = Replica(audited, log).launched()
        t0 = time.monotonic()
        converge(audited)
        settle = time.monotonic() - t0
        invariants(audited)
        left = diff(audited)
        op.stop()
    figures = {
        "kills": kills,
        "landed": landed,
        "changes": soak.ops,
        "passes_that_wrote": len(op.passes()),
        "settle_s": round(settle, 1),
        "final_diff": left,
    }
    print("operator kill soak:", json.dumps(figures))
    assert left == []
    assert landed["mid-pass"] >= kills // 4, f"too few kills landed inside a pass: {landed}"
