"""Operator faults against a real kube-apiserver + etcd, with real operator processes:

- killed (SIGKILL) at random points of its reconcile passes, again and again, with the cluster
  changing between kills: in the end every NodeAdmission spec and policy status equals the
  from-scratch computation, with no duplicates, no orphans and no dangling owner references;
- two replicas at once (leader election over a Lease): only the leader writes, as the API
  server's own audit log shows (every write is attributed by the writer's User-Agent); the
  leader killed, frozen (SIGSTOP, then woken: it must not write again) and stopped cleanly (it
  releases the Lease): the other takes over and the final specs are right.

The control plane here is this module's own (not the session's ``kube``): it runs with an audit
policy logging every write. Short mode (the test command): ``KILLS_SHORT`` kills. Long mode, by
hand: ``KVGATE_SOAK=long pytest tests/integration/test_operator_faults.py -s`` (``KILLS_LONG``
kills, about four minutes: one start of the operator takes about 2.5 s, so each kill round
costs 4-5 s). Both print their figures (kills, where they landed, passes seen, final diff).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import random
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from kvgate_bench.bench_operator_checks import strip_status
from kvgate_bench.toolkit import (
    free_port,
    http_status,
    parse_samples,
    poll_until,
    series,
    wait_until,
)
from kvgate_operator.desired import compute
from kvgate_operator.reconciler import Reconciler
from kvgate_operator.settings import OperatorSettings
from tests.conftest import REPO, k8s_bin_dir

pytestmark = pytest.mark.k8s

GROUP, VERSION = "kvgate.io", "v1alpha1"
KILLS_SHORT, KILLS_LONG = 8, 50
KILLS = KILLS_LONG if os.environ.get("KVGATE_SOAK") == "long" else KILLS_SHORT
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


@pytest.fixture(scope="module")
def audited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Audited]:
    from kvgate_bench.controlplane import ControlPlane

    bin_dir = k8s_bin_dir()
    if bin_dir is None:
        if os.environ.get("KVGATE_ALLOW_SKIP_K8S") == "1":
            pytest.skip("kube-apiserver/etcd not built (run scripts/build-k8s)")
        pytest.fail("kube-apiserver/etcd not built: run scripts/build-k8s")
    d = tmp_path_factory.mktemp("audit")
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
        observed = Reconciler(api, OperatorSettings()).read()
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


class Replica:
    """``python -m kvgate_operator`` as a child process."""

    def __init__(self, a: Audited, log: Path, **env: str) -> None:
        self.port = free_port()
        self.log = log
        self.env = {
            **a.cp.env,
            "KVGATE_OPERATOR_LIVENESS_PORT": str(self.port),
            "KVGATE_OPERATOR_DEBOUNCE_SECONDS": "0.05",
            "KVGATE_OPERATOR_RESYNC_SECONDS": "5",
            "KVGATE_OPERATOR_WEBHOOK_ENABLED": "false",
            **env,
        }
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Replica:
        with self.log.open("ab") as fh:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvgate_operator"],
                env=self.env,
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
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
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()

    def passes(self) -> int:
        """Passes that wrote something, from the log."""
        return self.log.read_text(errors="replace").count("reconciled: ")


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
            op = Replica(audited, log).start()
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
        op = Replica(audited, log).start()
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
        "passes_that_wrote": op.passes(),
        "settle_s": round(settle, 1),
        "final_diff": left,
    }
    print("operator kill soak:", json.dumps(figures))
    assert left == []
    assert landed["mid-pass"] >= kills // 4, f"too few kills landed inside a pass: {landed}"


# ---------------------------------------------------------------------------------------------
# Two replicas at once


#: Seconds: shorter than the chart's 15/10/2 so takeovers are quick, long enough that a leader
#: starved of CPU on a loaded machine still renews in time.
LEASE_S, RENEW_S, RETRY_S = 8, 6, 1
LEASE = {
    "KVGATE_OPERATOR_LEADER_ELECTION_LEASE_DURATION": str(LEASE_S),
    "KVGATE_OPERATOR_LEADER_ELECTION_RENEW_DEADLINE": str(RENEW_S),
    "KVGATE_OPERATOR_LEADER_ELECTION_RETRY_PERIOD": str(RETRY_S),
}


def holder(api: client.ApiClient, ns: str) -> str:
    try:
        lease = client.CoordinationV1Api(api).read_namespaced_lease("kvgate-operator", ns)
    except ApiException:
        return ""
    return (lease.spec.holder_identity or "") if lease.spec else ""


def served_certificate(port: int) -> bytes:
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        ctx.wrap_socket(raw) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def test_two_replicas_only_the_leader_writes_and_the_other_takes_over(
    audited: Audited, tmp_path: Path
) -> None:
    """Two replicas with the webhook (self-signed certificates in one Secret) and a short
    Lease (``LEASE_S``). Every write the API server audits is attributed to a replica by its
    User-Agent. Then: the leader SIGKILLed (the other takes over within the lease duration and
    a retry), restarted as a follower; the new leader frozen with SIGSTOP (taken over), then
    woken with SIGCONT (it must write nothing more); the leader stopped with SIGTERM (it
    releases the Lease: taken over well within a lease duration)."""
    ns, home = "ha", "kvgate-ha"
    with audited.api() as api:
        ensure_namespace(api, ns)
        ensure_namespace(api, home)
        nodes = [f"ha-node-{i}" for i in range(4)]
        for n in nodes:
            make_node(api, n)
        for i in range(12):
            make_pod(api, ns, f"h-{i:02d}", nodes[i % 4], "g")
        tpm = 10_000
        put_policy(api, ns, "global", global_spec(tpm))

        def replica(name: str) -> Replica:
            return Replica(
                audited,
                tmp_path / f"{name}.log",
                KVGATE_OPERATOR_POD_NAME=name,
                KVGATE_OPERATOR_POD_NAMESPACE=home,
                KVGATE_OPERATOR_WEBHOOK_ENABLED="true",
                KVGATE_OPERATOR_WEBHOOK_PORT=str(free_port()),
                KVGATE_OPERATOR_WEBHOOK_HOST="127.0.0.1",
                **LEASE,
            )

        def change() -> None:
            nonlocal tpm
            tpm += 1000
            put_policy(api, ns, "global", global_spec(tpm))
            converge(audited)

        def takeover(frm: str, within: float) -> tuple[str, float]:
            t0 = time.monotonic()
            got = wait_until(
                lambda: (h := holder(api, home)) not in ("", frm) and h,
                within,
                "a new leader",
                0.05,
            )
            return got, time.monotonic() - t0

        reps = {n: replica(n) for n in ("replica-a", "replica-b")}
        for r in reps.values():
            r.start()
        try:
            wait_until(lambda: holder(api, home), 30, "a leader", 0.1)
            converge(audited)
            first = holder(api, home)
            other = next(n for n in reps if n != first)
            audited.writes()
            for _ in range(3):
                change()
            time.sleep(1)
            phase1 = audited.writes()
            assert set(writers(phase1, leases=False)) == {first}, writers(phase1, leases=False)
            assert set(writers(phase1, leases=True)) == {first}
            # Both serve the webhook with the one certificate from the Secret.
            wait_until(
                lambda: all(
                    _listening(int(r.env["KVGATE_OPERATOR_WEBHOOK_PORT"])) for r in reps.values()
                ),
                30,
                "both webhooks",
            )
            assert _leader_gauge(reps[first].port) == 1 and _leader_gauge(reps[other].port) == 0
            certs = {
                served_certificate(int(r.env["KVGATE_OPERATOR_WEBHOOK_PORT"]))
                for r in reps.values()
            }
            assert len(certs) == 1

            # The leader killed: the follower takes over after the lease runs out.
            reps[first].kill()
            second, killed_s = takeover(first, LEASE_S + 10)
            assert second == other
            change()
            phase2 = audited.writes()
            assert set(writers(phase2, leases=False)) == {second}
            reps[first] = replica(first).start()  # back, as a follower
            wait_until(lambda: _healthz(reps[first].port) == 200, 30, "the follower's liveness")

            # The leader frozen, then woken: the other leads; the woken one writes nothing.
            reps[second].signal(signal.SIGSTOP)
            third, frozen_s = takeover(second, LEASE_S + 10)
            assert third == first
            change()
            reps[second].signal(signal.SIGCONT)
            audited.writes()
            time.sleep(2 * RETRY_S)
            change()
            time.sleep(1)
            phase3 = audited.writes()
            assert set(writers(phase3, leases=False)) == {third}, writers(phase3, leases=False)
            assert second not in writers(phase3, leases=True)

            # The leader stopped cleanly: it releases the Lease.
            reps[third].signal(signal.SIGTERM)
            fourth, released_s = takeover(third, LEASE_S + 10)
            assert fourth == second
            reps[third].proc.wait(20)  # type: ignore[union-attr]
            audited.writes()
            change()
            phase4 = audited.writes()
            assert set(writers(phase4, leases=False)) == {fourth}
            invariants(audited)
        except BaseException:
            for r in reps.values():
                print(f"--- {r.log.name}:", r.log.read_text(errors="replace")[-3000:])
            raise
        finally:
            for r in reps.values():
                r.stop()
    figures = {
        "takeover_after_sigkill_s": round(killed_s, 2),
        "takeover_after_sigstop_s": round(frozen_s, 2),
        "takeover_after_sigterm_s": round(released_s, 2),
        "writes_by_leader_phase1": writers(phase1, leases=False),
    }
    print("operator two replicas:", json.dumps(figures))
    assert released_s < LEASE_S, "a clean stop should hand over before the lease would expire"


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _leader_gauge(port: int) -> float:
    """The replica's ``kvgate_operator_leader`` gauge."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
        text = r.read().decode()
    return series(parse_samples(text))["kvgate_operator_leader"]


def _healthz(port: int) -> int:
    """The liveness endpoint's HTTP status; 0 when nothing listens."""
    return http_status(f"http://127.0.0.1:{port}/healthz")
