"""Two operator replicas at once (leader election over a Lease), against a real kube-apiserver
+ etcd auditing every write: only the leader writes, as the API server's own audit log shows
(every write is attributed by the writer's User-Agent); the leader killed, frozen (SIGSTOP, then
woken: it must not write again) and stopped cleanly (it releases the Lease): the other takes
over and the final specs are right.

The control plane is this module's own, with the audit policy of tests/operator_cluster.py.
"""

from __future__ import annotations

import json
import signal
import socket
import ssl
import time
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from kvgate_bench.kit.toolkit import free_port, http_status, parse_samples, series, wait_until
from tests.operator_cluster import (
    Audited,
    Replica,
    converge,
    ensure_namespace,
    global_spec,
    invariants,
    make_node,
    make_pod,
    put_policy,
    writers,
)

pytestmark = pytest.mark.k8s


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
            reps[first] = replica(first).launched()  # back, as a follower
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
