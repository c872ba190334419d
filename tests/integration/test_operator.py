"""The operator against the real local control plane: kubectl apply policies, create pods on
fake nodes, and watch the NodeAdmission specs and policy status converge to what computing from
scratch gives, through changes, deletions and an operator restart."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvgate_bench.kit.toolkit import free_port, http_status, poll_until, wait_until
from kvgate_operator.desired import compute
from kvgate_operator.reader import ClusterReader
from kvgate_operator.settings import OperatorSettings
from tests.conftest import policy_doc

GROUP = "kvgate.io"


class Operator:
    """``python -m kvgate_operator`` as a child process against the local control plane."""

    def __init__(self, kube: Any, log: Path) -> None:
        self.kube = kube
        self.log = log
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {
            **self.kube.env,
            "KVGATE_OPERATOR_LIVENESS_PORT": str(self.port),
            "KVGATE_OPERATOR_DEBOUNCE_SECONDS": "0.1",
            "KVGATE_OPERATOR_RESYNC_SECONDS": "3",
            "KVGATE_OPERATOR_WEBHOOK_ENABLED": "false",  # injection is tested in test_webhook.py
        }
        fh = self.log.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvgate_operator"], env=env, stdout=fh, stderr=subprocess.STDOUT
        )

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()

    def healthz(self) -> int:
        return _healthz(self.port)


@pytest.fixture
def operator(crds: Any, tmp_path: Path) -> Iterator[Operator]:
    op = Operator(crds, tmp_path / "operator.log")
    op.start()
    yield op
    op.stop()
    if os.environ.get("KVGATE_SHOW_OPERATOR_LOG"):
        print(op.log.read_text()[-5000:])


def apply(kube: Any, *objs: dict[str, Any]) -> None:
    kube.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objs))


def namespace(kube: Any, name: str) -> str:
    kube.kubectl("create", "namespace", name)
    return name


def node(kube: Any, name: str) -> None:
    apply(kube, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})


def pod(name: str, ns: str, node_name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {
            "nodeName": node_name,
            "containers": [{"name": "vllm", "image": "vllm/vllm-openai"}],
        },
    }


def policy(name: str, ns: str, spec: dict[str, Any]) -> dict[str, Any]:
    doc = policy_doc(spec, name)
    doc["metadata"]["namespace"] = ns
    return doc


def from_scratch(kube: Any) -> tuple[dict[str, Any], dict[Any, Any]]:
    """What the cluster should hold, computed from a fresh read: (node specs, policy statuses
    without timestamps)."""
    with kube.api_client() as api:
        observed = ClusterReader(api, OperatorSettings()).read()
    desired = compute(observed.snapshot)
    return desired.node_specs, {k: v.status() for k, v in desired.policies.items()}


def cluster_state(kube: Any) -> tuple[dict[str, Any], dict[Any, Any]]:
    """What the cluster holds: NodeAdmission specs by node, policy statuses without
    timestamps."""
    nas = json.loads(kube.kubectl("get", "nodeadmissions", "-o", "json").stdout)["items"]
    pols = json.loads(kube.kubectl("get", "rlp", "-A", "-o", "json").stdout)["items"]
    statuses = {}
    for p in pols:
        st = dict(p.get("status") or {})
        st["conditions"] = [
            {k: v for k, v in c.items() if k != "lastTransitionTime"}
            for c in st.get("conditions") or []
        ]
        st.setdefault("conflicts", [])
        statuses[(p["metadata"]["namespace"], p["metadata"]["name"])] = st
    return {n["metadata"]["name"]: n.get("spec") for n in nas}, statuses


def converged(kube: Any, timeout: float = 30) -> tuple[dict[str, Any], dict[Any, Any]]:
    """Wait until the cluster equals the from-scratch computation; return it."""
    want, got = poll_until(
        lambda: (from_scratch(kube), cluster_state(kube)), lambda p: p[0] == p[1], timeout, 0.2
    )
    assert got == want, "did not converge"
    return got


def wait_for(cond: Callable[[], bool], timeout: float = 30) -> None:
    wait_until(cond, timeout, "the condition", interval=0.1)


def entries(specs: dict[str, Any], node_name: str) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in (specs.get(node_name) or {}).get("pods", [])}


def resource_versions(kube: Any) -> dict[str, str]:
    out = {}
    for kind in ("nodeadmissions", "rlp"):
        items = json.loads(kube.kubectl("get", kind, "-A", "-o", "json").stdout)["items"]
        for i in items:
            m = i["metadata"]
            out[f"{kind}/{m.get('namespace', '')}/{m['name']}"] = m["resourceVersion"]
    return out


def llama_policy(ns: str, max_requests: int) -> dict[str, Any]:
    """The lifecycle test's policy: a concurrency cap and a Global request budget."""
    return policy(
        "llama",
        ns,
        {
            "selector": {"matchLabels": {"app": "llama"}},
            "concurrency": {"maxRequests": max_requests},
            "rateLimits": [
                {"name": "global", "per": "Global", "requestsPerMinute": 600, "burstRequests": 100}
            ],
        },
    )


def test_policy_lifecycle_converges_and_a_steady_cluster_writes_nothing(
    crds: Any, operator: Operator
) -> None:
    kube = crds
    ns = namespace(kube, "lifecycle")
    for n in ("lc-node-1", "lc-node-2"):
        node(kube, n)
    apply(
        kube,
        pod("llama-0", ns, "lc-node-1", {"app": "llama"}),
        pod("llama-1", ns, "lc-node-2", {"app": "llama"}),
        pod("web-0", ns, "lc-node-1", {"app": "web"}),
        llama_policy(ns, max_requests=16),
    )
    specs, statuses = converged(kube)
    a = entries(specs, "lc-node-1")["llama-0"]
    assert "web-0" not in entries(specs, "lc-node-1")
    assert a["policy"]["name"] == "llama" and a["thresholds"]["concurrency"]["maxRequests"] == 16
    # No kubelet: no pod is Ready, so the Global budget splits across both matched pods.
    assert a["thresholds"]["rateLimits"][0]["requestsPerMinute"] == 300
    st = statuses[(ns, "llama")]
    assert st["matchedPods"] == 2 and st["observedGeneration"] == 1
    assert {c["type"]: c["status"] for c in st["conditions"]} == {
        "Accepted": "True",
        "Ready": "True",
    }
    assert operator.healthz() == 200

    # Steady state: several resync periods, zero writes.
    before = resource_versions(kube)
    time.sleep(7)
    assert resource_versions(kube) == before

    # Change the policy: generation 2 reaches the specs.
    apply(
        kube,
        llama_policy(ns, max_requests=4),
    )
    specs, statuses = converged(kube)
    a = entries(specs, "lc-node-1")["llama-0"]
    assert a["policy"]["generation"] == 2 and a["thresholds"]["concurrency"]["maxRequests"] == 4
    assert statuses[(ns, "llama")]["observedGeneration"] == 2

    # Relabel a pod out: the other gets the whole Global budget.
    kube.kubectl("label", "pod", "llama-1", "-n", ns, "app=other", "--overwrite")
    specs, statuses = converged(kube)
    assert entries(specs, "lc-node-2") == {}
    assert (
        entries(specs, "lc-node-1")["llama-0"]["thresholds"]["rateLimits"][0]["requestsPerMinute"]
        == 600
    )
    assert statuses[(ns, "llama")]["matchedPods"] == 1

    # Delete the pod, then the policy.
    kube.kubectl("delete", "pod", "llama-0", "-n", ns, "--wait=false")
    specs, statuses = converged(kube)
    assert statuses[(ns, "llama")]["matchedPods"] == 0
    kube.kubectl("delete", "rlp", "llama", "-n", ns)
    specs, _ = converged(kube)
    assert entries(specs, "lc-node-1") == {} and entries(specs, "lc-node-2") == {}

    # Node removal: its NodeAdmission goes.
    kube.kubectl("delete", "node", "lc-node-2")
    specs, _ = converged(kube)
    assert "lc-node-2" not in specs and "lc-node-1" in specs


def test_conflicting_policies_are_resolved_by_age_and_reported(
    crds: Any, operator: Operator
) -> None:
    kube = crds
    ns = namespace(kube, "conflicts")
    node(kube, "cf-node-1")
    apply(
        kube,
        pod("m-0", ns, "cf-node-1", {"app": "m", "tier": "gold"}),
        policy("first", ns, {"selector": {"matchLabels": {"app": "m"}}}),
    )
    converged(kube)
    time.sleep(1.1)  # creationTimestamp has 1 s resolution
    apply(kube, policy("second", ns, {"selector": {"matchLabels": {"tier": "gold"}}}))
    specs, statuses = converged(kube)
    assert entries(specs, "cf-node-1")["m-0"]["policy"]["name"] == "first"
    assert statuses[(ns, "second")]["conflicts"] == [f"{ns}/m-0: governed by older policy first"]
    assert statuses[(ns, "first")]["conflicts"] == [f"{ns}/m-0: also selected by second"]

    def warned() -> bool:
        ev = json.loads(kube.kubectl("get", "events", "-n", ns, "-o", "json").stdout)["items"]
        return any(
            e["reason"] == "PolicyConflict" and e["involvedObject"]["name"] == "second" for e in ev
        )

    wait_for(warned, 15)


def test_operator_killed_mid_reconcile_converges_after_restart(
    crds: Any, operator: Operator
) -> None:
    kube = crds
    ns = namespace(kube, "restart")
    nodes = [f"rs-node-{i}" for i in range(5)]
    for n in nodes:
        node(kube, n)
    apply(
        kube,
        policy(
            "p",
            ns,
            {
                "selector": {"matchLabels": {"app": "r"}},
                "rateLimits": [{"name": "g", "per": "Global", "tokensPerMinute": 100000}],
            },
        ),
    )
    converged(kube)
    operator.kill()
    # While the operator is down: 40 new pods and a policy change.
    apply(kube, *(pod(f"r-{i}", ns, nodes[i % 5], {"app": "r"}) for i in range(40)))
    apply(
        kube,
        policy(
            "p",
            ns,
            {
                "selector": {"matchLabels": {"app": "r"}},
                "rateLimits": [{"name": "g", "per": "Global", "tokensPerMinute": 200000}],
            },
        ),
    )
    operator.start()
    time.sleep(0.6)  # let it begin writing, then kill it mid-pass
    operator.kill()
    operator.start()
    specs, statuses = converged(kube, timeout=60)
    share = [
        e["thresholds"]["rateLimits"][0]["tokensPerMinute"]
        for n in nodes
        for e in entries(specs, n).values()
    ]
    assert len(share) == 40 and set(share) == {5000}
    assert statuses[(ns, "p")]["matchedPods"] == 40
    nas = json.loads(kube.kubectl("get", "nodeadmissions", "-o", "json").stdout)["items"]
    names = [n["metadata"]["name"] for n in nas]
    assert len(names) == len(set(names))  # no duplicates
    for n in nas:  # nobody's finalizers were touched, none were added
        assert not n["metadata"].get("finalizers")


def test_policy_without_pods_is_accepted_but_not_ready(crds: Any, operator: Operator) -> None:
    kube = crds
    ns = namespace(kube, "nopods")
    apply(kube, policy("empty", ns, {"selector": {"matchLabels": {"app": "nothing"}}}))
    _, statuses = converged(kube)
    conds = {c["type"]: c for c in statuses[(ns, "empty")]["conditions"]}
    assert conds["Accepted"]["status"] == "True"
    assert conds["Ready"]["status"] == "False" and conds["Ready"]["reason"] == "NoMatchingPods"


def test_engine_capacity_reported_by_the_agent_reaches_the_thresholds(
    crds: Any, operator: Operator
) -> None:
    kube = crds
    ns = namespace(kube, "engine")
    node(kube, "en-node-1")
    apply(
        kube,
        pod("e-0", ns, "en-node-1", {"app": "e"}),
        policy(
            "p",
            ns,
            {
                "selector": {"matchLabels": {"app": "e"}},
                "capacity": {"fromEngineMetrics": True, "kvCacheTokens": 1000},
            },
        ),
    )
    specs, _ = converged(kube)
    assert entries(specs, "en-node-1")["e-0"]["thresholds"]["kvCapacityTokens"] == 1000
    uid = entries(specs, "en-node-1")["e-0"]["uid"]
    # The node agent writes the status subresource; the operator reacts to it.
    status = {
        "status": {
            "pods": [{"namespace": ns, "name": "e-0", "uid": uid, "engineKvCapacityTokens": 65536}]
        }
    }
    kube.kubectl(
        "patch",
        "nodeadmission",
        "en-node-1",
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps(status),
    )
    specs, _ = converged(kube)
    assert entries(specs, "en-node-1")["e-0"]["thresholds"]["kvCapacityTokens"] == 65536


def test_other_controllers_finalizers_are_left_alone(crds: Any, operator: Operator) -> None:
    kube = crds
    ns = namespace(kube, "finalizers")
    node(kube, "fz-node-1")
    p = policy("p", ns, {"selector": {"matchLabels": {"app": "f"}}})
    p["metadata"]["finalizers"] = ["example.com/keep-me"]
    apply(kube, p, pod("f-0", ns, "fz-node-1", {"app": "f"}))
    converged(kube)
    time.sleep(1)
    got = json.loads(kube.kubectl("get", "rlp", "p", "-n", ns, "-o", "json").stdout)
    assert got["metadata"]["finalizers"] == ["example.com/keep-me"]
    pod_obj = json.loads(kube.kubectl("get", "pod", "f-0", "-n", ns, "-o", "json").stdout)
    assert not pod_obj["metadata"].get("finalizers")
    # Deleting the policy leaves it terminating (our finalizer-free operator does not block it,
    # nor remove the other controller's finalizer); its pods are released at once.
    kube.kubectl("delete", "rlp", "p", "-n", ns, "--wait=false")
    specs, _ = converged(kube)
    assert entries(specs, "fz-node-1") == {}  # a terminating policy governs nothing
    got = json.loads(kube.kubectl("get", "rlp", "p", "-n", ns, "-o", "json").stdout)
    assert got["metadata"]["finalizers"] == ["example.com/keep-me"]
    kube.kubectl(
        "patch", "rlp", "p", "-n", ns, "--type=merge", "-p", '{"metadata": {"finalizers": []}}'
    )


def test_liveness_endpoint_reports_the_reconcile_loop(crds: Any, operator: Operator) -> None:
    wait_for(lambda: operator.healthz() == 200, 30)
    with urllib.request.urlopen(f"http://127.0.0.1:{operator.port}/healthz", timeout=2) as r:
        body = json.loads(r.read())
    assert "last pass" in body["reconciler"]


def test_a_rejected_node_admission_write_is_reported_and_retried(
    crds: Any, operator: Operator
) -> None:
    kube = crds
    ns = namespace(kube, "toomany")
    node(kube, "tm-node-1")
    apply(kube, policy("p", ns, {"selector": {"matchLabels": {"app": "t"}}}))
    # 257 pods on one node: more than the CRD's 256 entries per NodeAdmission.
    apply(kube, *(pod(f"t-{i:03d}", ns, "tm-node-1", {"app": "t"}) for i in range(257)))

    def ready() -> dict[str, Any]:
        got = json.loads(kube.kubectl("get", "rlp", "p", "-n", ns, "-o", "json").stdout)
        conds = (got.get("status") or {}).get("conditions") or []
        cond: dict[str, Any] = {c["type"]: c for c in conds}.get("Ready", {})
        return cond

    wait_for(lambda: ready().get("reason") == "WriteFailed", 30)
    assert "NodeAdmission tm-node-1 could not be written" in ready()["message"]
    assert "must have at most 256 items" in ready()["message"]

    def warned() -> bool:
        ev = json.loads(kube.kubectl("get", "events", "-n", ns, "-o", "json").stdout)["items"]
        return any(e["reason"] == "WriteFailed" for e in ev)

    wait_for(warned, 15)
    kube.kubectl("delete", "pod", "t-000", "-n", ns, "--wait=false", "--grace-period=0", "--force")
    # Retried (with backoff) until it lands.
    wait_for(lambda: ready().get("reason") == "ThresholdsWritten", 60)
    specs, _ = converged(kube)
    assert len(entries(specs, "tm-node-1")) == 256


def test_operator_in_process_converges_and_serves_liveness(
    crds: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The operator run in this process by kopf's KopfRunner (standalone, cluster-wide, its
    handlers from kvgate_operator.handlers, its settings from the same environment variables
    the subprocess gets) reaches the same NodeAdmission and policy status."""
    import kopf.testing
    from kubernetes import client
    from kubernetes.config import kube_config

    kube = crds
    port = free_port()
    for name, value in {
        "KVGATE_OPERATOR_LIVENESS_PORT": str(port),
        "KVGATE_OPERATOR_DEBOUNCE_SECONDS": "0.1",
        "KVGATE_OPERATOR_RESYNC_SECONDS": "3",
        "KVGATE_OPERATOR_WEBHOOK_ENABLED": "false",
    }.items():
        monkeypatch.setenv(name, value)
    # kopf's login and the operator's client read the kubeconfig at this path (the client
    # library reads $KUBECONFIG once, at import); the default client configuration they set
    # is put back afterwards.
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kube.kubeconfig))
    monkeypatch.setattr(client.Configuration, "_default", client.Configuration._default)
    ns = namespace(kube, "inprocess")
    node(kube, "ip-node-1")
    args = ["run", "--standalone", "--all-namespaces", "-m", "kvgate_operator.handlers"]
    with kopf.testing.KopfRunner(args, timeout=60) as runner:
        apply(
            kube,
            pod("llama-0", ns, "ip-node-1", {"app": "llama"}),
            pod("web-0", ns, "ip-node-1", {"app": "web"}),
            llama_policy(ns, max_requests=8),
        )
        specs, statuses = converged(kube)
        a = entries(specs, "ip-node-1")["llama-0"]
        assert "web-0" not in entries(specs, "ip-node-1")
        assert a["policy"]["name"] == "llama"
        assert a["thresholds"]["concurrency"]["maxRequests"] == 8
        st = statuses[(ns, "llama")]
        assert st["matchedPods"] == 1 and st["observedGeneration"] == 1
        assert {c["type"]: c["status"] for c in st["conditions"]} == {
            "Accepted": "True",
            "Ready": "True",
        }
        wait_for(lambda: _healthz(port) == 200, 30)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
            assert "last pass" in json.loads(r.read())["reconciler"]
    assert runner.exception is None and runner.exit_code == 0
    assert _healthz(port) == 0  # cleanup stopped the liveness server


def _healthz(port: int) -> int:
    """The liveness endpoint's HTTP status; 0 when nothing listens."""
    return http_status(f"http://127.0.0.1:{port}/healthz")
