"""The operator fault tests' shared parts (tests/integration/test_operator_faults.py,
tests/integration/test_operator_replicas.py): a control plane whose API server audits every
write (each attributed to its writer by User-Agent), the cluster's changes, the from-scratch
comparison and invariants, and operator processes."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from kvgate_bench.kit.kubeaccess import strip_status
from kvgate_bench.kit.operator_process import Operator
from kvgate_bench.kit.toolkit import poll_until
from kvgate_operator.desired import compute
from kvgate_operator.reader import ClusterReader
from kvgate_operator.settings import OperatorSettings
from tests.conftest import REPO, k8s_bin_dir

GROUP, VERSION = "kvgate.io", "v1alpha1"
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        {
            "level": "Metadata",
            "verbs": ["create", "update", "patch", "delete", "deletecollection"],
            "resources": [
                {"group": GROUP},
                {"group": "coordination.k8s.io"},
                {"group": "admissionregistration.k8s.io"},
                {"group": "", "resources": ["secrets", "events"]},
            ],
        },
        {"level": "None"},
    ],
}
TEST_AGENT = "kvgate-fault-test"


# ---------------------------------------------------------------------------------------------
# The control plane with an audit log, and the cluster's contents


def core_api(api: client.ApiClient) -> Any:
    """CoreV1Api, untyped (its stubs want models; plain dicts are simpler here)."""
    return client.CoreV1Api(api)


def custom_api(api: client.ApiClient) -> Any:
    return client.CustomObjectsApi(api)


@dataclass
class Audited:
    cp: Any
    log: Path
    offset: int = 0

    def api(self) -> client.ApiClient:
        api: client.ApiClient = self.cp.api_client()
        api.user_agent = TEST_AGENT
        return api

    def writes(self) -> list[dict[str, Any]]:
        """Successful writes logged since the last call."""
        with self.log.open("rb") as fh:
            fh.seek(self.offset)
            data = fh.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        out = []
        for line in data[:end].splitlines():
            ev = json.loads(line)
            if ev.get("stage") == "ResponseComplete" and ev["responseStatus"]["code"] < 300:
                out.append(ev)
        return out


def writers(events: list[dict[str, Any]], *, leases: bool) -> dict[str, int]:
    """Writes by writer: an operator replica's pod name (from its User-Agent
    ``kvgate-operator (<pod>)``), or any other agent not the test's own (kubectl, this
    test's client); writes of the operators' Lease only, or all but Lease writes."""
    out: dict[str, int] = {}
    for ev in events:
        ref = ev["objectRef"]
        if (ref.get("resource") == "leases") != leases:
            continue
        if leases and ref.get("name") != "kvgate-operator":
            continue  # the API server's own Leases
        agent = ev.get("userAgent", "")
        if agent.startswith(("kubectl", TEST_AGENT)):
            continue
        who = agent.split("(", 1)[1].rstrip(")") if agent.startswith("kvgate-operator (") else agent
        out[who] = out.get(who, 0) + 1
    return out


@contextlib.contextmanager
def audited_control_plane(d: Path) -> Iterator[Audited]:
    """A control plane (CRDs applied) whose API server audits every write into ``d``."""
    from kvgate_bench.kit.controlplane import ControlPlane

    bin_dir = k8s_bin_dir()
    if bin_dir is None:
        if os.environ.get("KVGATE_ALLOW_SKIP_K8S") == "1":
            pytest.skip("kube-apiserver/etcd not built (run scripts/build-k8s)")
        pytest.fail("kube-apiserver/etcd not built: run scripts/build-k8s")
    policy, log = d / "policy.yaml", d / "audit.log"
    policy.write_text(yaml.safe_dump(AUDIT_POLICY))
    args = [f"--audit-policy-file={policy}", f"--audit-log-path={log}", "--audit-log-format=json"]
    with ControlPlane(bin_dir, extra_apiserver_args=args) as cp:
        cp.apply_crds(REPO / "crds")
        log.touch()
        yield Audited(cp, log)


def diff(a: Audited) -> list[str]:
    """What differs between the cluster and the from-scratch computation on one fresh read:
    NodeAdmissions (missing, extra, other spec) and policy statuses (timestamps aside)."""
    with a.api() as api:
        observed = ClusterReader(api, OperatorSettings()).read()
    want = compute(observed.snapshot)
    out = [
        f"node {n}"
        for n in sorted(set(want.node_specs) | set(observed.node_specs))
        if want.node_specs.get(n) != observed.node_specs.get(n)
    ]
    for key, outcome in sorted(want.policies.items()):
        if strip_status(observed.policy_status.get(key)) != strip_status(outcome.status()):
            out.append(f"policy {key[0]}/{key[1]}")
    return out


def converge(a: Audited, timeout: float = 60) -> None:
    left = poll_until(lambda: diff(a), lambda d: not d, timeout, 0.2)
    assert not left, f"did not converge: {left}"


def invariants(a: Audited) -> None:
    """No duplicates, no orphans, owner references naming the live Node, sane statuses."""
    with a.api() as api:
        core, custom = core_api(api), custom_api(api)
        nodes = {n.metadata.name: n.metadata.uid for n in core.list_node().items}
        pods = {p.metadata.uid for p in core.list_pod_for_all_namespaces().items}
        nas = custom.list_cluster_custom_object(GROUP, VERSION, "nodeadmissions")["items"]
        pols = custom.list_cluster_custom_object(GROUP, VERSION, "ratelimitpolicies")["items"]
    names = [na["metadata"]["name"] for na in nas]
    assert len(names) == len(set(names)), "duplicate NodeAdmissions"
    assert set(names) == set(nodes), "NodeAdmissions and Nodes differ (orphan or missing)"
    seen: list[str] = []
    for na in nas:
        m = na["metadata"]
        assert na["spec"]["nodeName"] == m["name"]
        refs = [r for r in m.get("ownerReferences") or [] if r["kind"] == "Node"]
        assert [r["uid"] for r in refs] == [nodes[m["name"]]], f"owner of {m['name']}: {refs}"
        assert not m.get("finalizers")
        seen += [e["uid"] for e in na["spec"].get("pods") or []]
    assert len(seen) == len(set(seen)), "a pod in two NodeAdmissions"
    assert set(seen) <= pods, "an entry for a pod that no longer exists"
    now = dt.datetime.now(dt.UTC)
    for p in pols:
        st = p.get("status") or {}
        assert st.get("observedGeneration") == p["metadata"]["generation"]
        for c in st.get("conditions") or []:
            t = dt.datetime.fromisoformat(c["lastTransitionTime"].replace("Z", "+00:00"))
            assert t <= now + dt.timedelta(seconds=5)


# ---------------------------------------------------------------------------------------------
# Cluster changes


def ensure_namespace(api: client.ApiClient, name: str) -> None:
    try:
        core_api(api).create_namespace({"metadata": {"name": name}})
    except ApiException as exc:
        if exc.status != 409:
            raise


def make_node(api: client.ApiClient, name: str) -> None:
    core_api(api).create_node({"metadata": {"name": name}})


def make_pod(api: client.ApiClient, ns: str, name: str, node: str, app: str) -> None:
    body = {
        "metadata": {"name": name, "labels": {"app": app}},
        "spec": {"nodeName": node, "containers": [{"name": "m", "image": "vllm/vllm-openai"}]},
    }
    core_api(api).create_namespaced_pod(ns, body)


def put_policy(api: client.ApiClient, ns: str, name: str, spec: dict[str, Any]) -> None:
    custom = custom_api(api)
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "RateLimitPolicy",
        "metadata": {"name": name},
        "spec": spec,
    }
    try:
        custom.create_namespaced_custom_object(GROUP, VERSION, ns, "ratelimitpolicies", body)
    except ApiException as exc:
        if exc.status != 409:
            raise
        custom.patch_namespaced_custom_object(
            GROUP, VERSION, ns, "ratelimitpolicies", name, {"spec": spec}
        )


def global_spec(tpm: int) -> dict[str, Any]:
    return {
        "selector": {"matchLabels": {"app": "g"}},
        "rateLimits": [{"name": "g", "per": "Global", "tokensPerMinute": tpm}],
    }


# ---------------------------------------------------------------------------------------------
# Operator processes


class Replica(Operator):
    """``python -m kvgate_operator`` as a child process (the benchmarks' launcher), with a
    short debounce and resync; ``env`` over its defaults."""

    def __init__(self, a: Audited, log: Path, **env: str) -> None:
        super().__init__(a.cp, log, debounce=0.05, resync=5)
        self.env.update(env)
        self.port = int(self.env["KVGATE_OPERATOR_LIVENESS_PORT"])

    def launched(self) -> Replica:
        self.start()
        return self

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a frozen one must see its SIGTERM
        super().stop()
