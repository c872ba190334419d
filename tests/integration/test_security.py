"""Security on the local control plane: who may sync, who may write which NodeAdmission, what the
chart's pods and service accounts may do. Every check is made by the real kube-apiserver (its
TokenReview, RBAC, ValidatingAdmissionPolicy and PodSecurity admission), with real tokens from
its TokenRequest API.

1. Sync tokens (:func:`test_sync_tokens_checked_by_the_real_token_review`): the real node agent
   (``kvgate-agent node``, its TokenReview client against this API server) refuses an expired
   token, a token of a deleted pod (and of a pod deleted and re-created under the same name),
   tokens of another service account, a same-named pod of another namespace, a non-pod-bound
   token and a forged signature; the cases of
   ``tests/integration/test_node_agent.py::test_forged_sync_for_another_pod_is_refused``
   (another pod's token, garbage, the API server's default audience, the right pod) are not
   repeated. "Expired" is a token the API server itself signed the claims of, re-signed with its
   own service-account key with ``exp`` an hour ago: TokenRequest refuses lifetimes under 10
   minutes, so a token minted there cannot expire within a test. The same re-signing with a
   future ``exp`` is accepted, so the refusal is the expiry's.
2. Own node only (:func:`test_an_agent_writes_only_its_own_nodes_status`): the chart's
   ValidatingAdmissionPolicy, acting as node A's agent (a token of the agent's service account
   bound to a pod with ``spec.nodeName`` A, as the kubelet mints it) through the agent's own
   :class:`~kvgate_agent.node.kube.StatusWriter`: A's status is written, B's refused.
3. The chart's pods against PodSecurity admission (:func:`test_chart_pods_against_pod_security`)
   and its service accounts against RBAC (:func:`test_service_accounts_can_do_their_work_only`).

NetworkPolicies cannot be checked here: there is no CNI to enforce them (no kubelet, no pod
network). ``tests/repo/test_chart.py::test_network_policies`` checks their selectors and ports.
"""

from __future__ import annotations

import base64
import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from kvgate_agent.node.kube import StatusWriter
from kvgate_bench.kit.controlplane import ControlPlane
from kvgate_bench.kit.kubeaccess import KubectlError
from kvgate_bench.kit.nodestack import NodeStack, metric_value
from kvgate_bench.kit.toolkit import wait_until
from kvgate_operator.inject import inject
from kvgate_operator.template import InjectionConfig
from tests.conftest import REPO, policy_doc

RELEASE = "kvgate-sec"  # also its namespace; names are "<release>-*"
AGENT_SA, OPERATOR_SA = f"{RELEASE}-agent", f"{RELEASE}-operator"
NODE_A, NODE_B = "sec-node-a", "sec-node-b"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def resign(token: str, key_pem: bytes, **claims: Any) -> str:
    """``token`` (a JWT) with ``claims`` replaced, signed RS256 with ``key_pem`` (RFC 7515)."""
    header, payload, _ = token.split(".")
    body = {**json.loads(_unb64(payload)), **claims}
    signing_input = f"{header}.{_b64(json.dumps(body).encode())}".encode()
    key = serialization.load_pem_private_key(key_pem, password=None)
    assert isinstance(key, rsa.RSAPrivateKey)
    signature = key.sign(signing_input, padding.PKCS1v15(), hashes.SHA256())
    return f"{signing_input.decode()}.{_b64(signature)}"


def sync(stack: NodeStack, ns: str, name: str, token: str) -> tuple[int, str]:
    """POST the agent's /v1/sync claiming pod ``ns/name`` with bearer ``token``."""
    req = urllib.request.Request(
        stack.agent_url + "/v1/sync",
        data=json.dumps({"namespace": ns, "name": name}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as e:
        return int(e.code), e.read().decode()


def code_of(answer: tuple[int, str]) -> tuple[int, str, str]:
    """``(status, error code, message)`` of a refused sync (the agent's OpenAI-style error body,
    whose message for a 401 is the TokenReview's own error)."""
    status, body = answer
    if status < 400:
        return status, "", ""
    error = json.loads(body)["error"]
    return status, str(error["code"]), str(error["message"])


def refused(answer: tuple[int, str], status: int, code: str, says: str) -> bool:
    """The sync was refused with ``status`` and ``code``, its message containing ``says``."""
    got = code_of(answer)
    assert got[:2] == (status, code) and says in got[2], got
    return True


@pytest.fixture
def stack(kube: ControlPlane, tmp_path: Path) -> Iterator[NodeStack]:
    s = NodeStack(kube, tmp_path, "sec-sync", node_name="sec-sync-node")
    s.setup_cluster()
    s.start_operator()
    try:
        yield s
    finally:
        s.stop()


def test_sync_tokens_checked_by_the_real_token_review(stack: NodeStack) -> None:
    """The real agent's sync API, each token checked by the API server's TokenReview: 401 for
    an expired token, a forged signature, a deleted pod's token (also once the name is reused);
    403 for another service account's pod, a same-named pod elsewhere, a token bound to no pod;
    200 for the right pod throughout. Every refusal is counted in the agent's metrics."""
    cp, ns = stack.cp, stack.namespace
    stack.start_agent()
    victim = stack.add_model_pod("victim", "http://127.0.0.1:9", start=False)
    policy = policy_doc({"selector": {"matchLabels": {"app": "llm"}}}, "sec")
    policy["metadata"]["namespace"] = ns
    stack.apply(policy)
    wait_until(lambda: (stack.node_admission() or {}).get("spec", {}).get("pods"), 30, "spec")
    good = victim.token_file.read_text()
    assert sync(stack, ns, "victim", good)[0] == 200

    # Expired: the API server's own claims, re-signed with its key, exp an hour ago; the same
    # re-signing with a future exp is accepted (a fresh string: nothing cached).
    now = int(time.time())
    key = cp.certs.sa_key_file.read_bytes()
    past = resign(good, key, iat=now - 7200, nbf=now - 7200, exp=now - 3600)
    assert refused(sync(stack, ns, "victim", past), 401, "invalid_token", "token has expired")
    assert sync(stack, ns, "victim", resign(good, key, iat=now - 60, nbf=now - 60))[0] == 200
    # A forged signature (another key, the same claims).
    other_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    forged = resign(
        good,
        other_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )
    assert refused(sync(stack, ns, "victim", forged), 401, "invalid_token", "invalid bearer")

    # A deleted pod's token (never used before, so not cached): the TokenReview refuses it;
    # and after a pod of the same name is created again (a new uid), still.
    gone = stack.add_model_pod("gone", "http://127.0.0.1:9", start=False)
    gone_token = gone.token_file.read_text()
    cp.kubectl("delete", "pod", "gone", "-n", ns, "--force", "--grace-period=0")
    assert refused(sync(stack, ns, "gone", gone_token), 401, "invalid_token", "invalidated")
    stack.create_pod("gone", {"app": "llm"})
    # (Re-signed with another jti: a new string, so the agent asks the API server again
    # instead of answering from its 5 s cache of refusals; the claims still name the old uid.)
    again = resign(gone_token, key, jti="again")
    assert refused(sync(stack, ns, "gone", again), 401, "invalid_token", "does not match")

    # Another service account: the API server will not bind its token to the victim pod, and
    # its own pod's token does not pass for the victim's.
    stack.apply(
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "intruder",
         "namespace": ns}},
    )  # fmt: skip
    with pytest.raises(KubectlError) as no_token:
        stack.pod_token("victim", victim.uid, service_account="intruder")
    assert "different serviceaccount name" in no_token.value.stderr
    intruder_uid = _pod_with_account(stack, "intruder-pod", "intruder")
    intruder = stack.pod_token("intruder-pod", intruder_uid, service_account="intruder")
    assert refused(sync(stack, ns, "victim", intruder), 403, "wrong_pod", f"{ns}/intruder-pod")
    # A same-named pod in another namespace.
    cp.kubectl("create", "namespace", "sec-sync-other", check=False)
    cp.kubectl("create", "serviceaccount", "model", "-n", "sec-sync-other", check=False)
    twin = NodeStack(cp, stack.work, "sec-sync-other", node_name=stack.node_name)
    twin_uid = twin.create_pod("victim", {"app": "llm"})
    twin_token = twin.pod_token("victim", twin_uid)
    assert refused(sync(stack, ns, "victim", twin_token), 403, "wrong_pod", "sec-sync-other/victim")
    # The victim's service account, for the right audience, but bound to no pod.
    unbound = cp.kubectl(
        "create", "token", "model", "-n", ns, "--audience", "kvgate-agent", "--duration", "1h"
    ).stdout.strip()
    assert refused(sync(stack, ns, "victim", unbound), 403, "not_pod_bound", "bound to a pod")

    # Through all of that, the right pod's token still works.
    assert sync(stack, ns, "victim", good)[0] == 200
    m = stack.agent_url + "/metrics"
    assert metric_value(m, "kvgate_node_sync_requests_total", result="unauthorized") == 4
    assert metric_value(m, "kvgate_node_sync_requests_total", result="forbidden") == 3


def _pod_with_account(stack: NodeStack, name: str, account: str) -> str:
    stack.apply(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": stack.namespace},
            "spec": {
                "nodeName": stack.node_name,
                "serviceAccountName": account,
                "containers": [{"name": "c", "image": "busybox"}],
            },
        }
    )
    pod = json.loads(
        stack.cp.kubectl("get", "pod", name, "-n", stack.namespace, "-o", "json").stdout
    )
    return str(pod["metadata"]["uid"])


# ----------------------------------------------------------------------------------------------
# The chart's objects, rendered by the real helm


def render(cp: ControlPlane, *sets: str) -> list[dict[str, Any]]:
    """``helm template`` of the chart (release and namespace :data:`RELEASE`) for this API
    server's Kubernetes version."""
    args = [f"--set={s}" for s in sets]
    args.append("--kube-version=" + str(cp.get_json("/version")["gitVersion"]).lstrip("v"))
    out = cp.helm("template", RELEASE, str(REPO / "charts" / "kvgate"), "-n", RELEASE, *args).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


@pytest.fixture(scope="module")
def release(crds: ControlPlane) -> ControlPlane:
    """The chart's service accounts, RBAC and admission policy applied in namespace
    :data:`RELEASE` (not the webhook configuration: pointing at no operator, it would slow every
    opted-in pod creation of the other tests), plus two Nodes and their NodeAdmissions."""
    cp = crds
    keep = {
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    }
    docs = [d for d in render(cp) if d["kind"] in keep]
    assert {d["kind"] for d in docs} == keep
    cp.kubectl("create", "namespace", RELEASE, check=False)
    cp.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
    for node in (NODE_A, NODE_B):
        cp.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([
            {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}},
            {"apiVersion": "kvgate.io/v1alpha1", "kind": "NodeAdmission",
             "metadata": {"name": node}, "spec": {"nodeName": node, "pods": []}},
        ]))  # fmt: skip
    return cp


def agent_token_on(cp: ControlPlane, node: str) -> str:
    """What the kubelet gives node ``node``'s agent: a token of the agent's service account
    bound to its pod (created here from the chart's DaemonSet template, bound to ``node``)."""
    ds = one(render(cp), "DaemonSet", AGENT_SA)
    name = f"{AGENT_SA}-{node}"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": RELEASE},
        "spec": {**ds["spec"]["template"]["spec"], "nodeName": node},
    }
    cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(pod))
    uid = json.loads(cp.kubectl("get", "pod", name, "-n", RELEASE, "-o", "json").stdout)[
        "metadata"
    ]["uid"]
    return cp.kubectl(
        "create", "token", AGENT_SA, "-n", RELEASE, "--duration", "1h",
        "--bound-object-kind", "Pod", "--bound-object-name", name, "--bound-object-uid", uid,
    ).stdout.strip()  # fmt: skip


def test_an_agent_writes_only_its_own_nodes_status(release: ControlPlane) -> None:
    """Node A's agent (its pod-bound token names node A, as ``kubectl auth whoami`` shows) writes
    A's NodeAdmission status through the agent's own StatusWriter and is refused B's (403 from
    the chart's ValidatingAdmissionPolicy, B unchanged); the same service account with a token
    bound to no pod is refused even A's."""
    from kubernetes.client.exceptions import ApiException

    cp = release
    token = agent_token_on(cp, NODE_A)
    who = json.loads(
        cp.kubectl("auth", "whoami", "-o", "json", kubeconfig=cp.kubeconfig_for_token(token)).stdout
    )["status"]["userInfo"]
    assert who["username"] == f"system:serviceaccount:{RELEASE}:{AGENT_SA}"
    assert who["extra"]["authentication.kubernetes.io/node-name"] == [NODE_A]

    with cp.api_client(token) as api:
        writer_b = StatusWriter(api, NODE_B)

        def b_refused() -> bool:
            try:
                writer_b.write({"heartbeatTime": "2026-01-01T00:00:00Z"})
            except ApiException as e:
                return e.status == 403 and "ValidatingAdmissionPolicy" in str(e.body)
            return False  # the policy is not active yet (it takes a moment after creation)

        wait_until(b_refused, 30, "node A's agent refused NodeAdmission " + NODE_B)
        admin_patch(cp, NODE_B, "2026-01-01T00:00:03Z")
        with pytest.raises(ApiException) as refused:
            writer_b.write({"heartbeatTime": "2026-01-01T00:00:04Z"})
        assert refused.value.status == 403
        assert f"may write only NodeAdmission {NODE_A}, not {NODE_B}" in str(refused.value.body)
        assert heartbeat(cp, NODE_B) == "2026-01-01T00:00:03Z"  # unchanged
        assert StatusWriter(api, NODE_A).write({"heartbeatTime": "2026-01-01T00:00:01Z"}) == "ok"
        assert heartbeat(cp, NODE_A) == "2026-01-01T00:00:01Z"

    # The same service account with a token bound to no pod (no node name): refused for every
    # node, its "own" included.
    unbound = cp.kubectl("create", "token", AGENT_SA, "-n", RELEASE, "--duration", "1h")
    with cp.api_client(unbound.stdout.strip()) as api, pytest.raises(ApiException) as e:
        StatusWriter(api, NODE_A).write({"heartbeatTime": "2026-01-01T00:00:02Z"})
    assert e.value.status == 403 and "not bound to a pod on a node" in str(e.value.body)
    assert heartbeat(cp, NODE_A) == "2026-01-01T00:00:01Z"


def admin_patch(cp: ControlPlane, node: str, heartbeat: str) -> None:
    """Write NodeAdmission ``node``'s status heartbeat as the admin (not subject to the policy)."""
    cp.kubectl(
        "patch", "nodeadmission", node, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": {"heartbeatTime": heartbeat}}),
    )  # fmt: skip


def heartbeat(cp: ControlPlane, node: str) -> str | None:
    na = json.loads(cp.kubectl("get", "nodeadmission", node, "-o", "json").stdout)
    return (na.get("status") or {}).get("heartbeatTime")


# ----------------------------------------------------------------------------------------------
# Pod Security


def pss_namespace(cp: ControlPlane, level: str) -> str:
    """A namespace enforcing (and warning at) Pod Security ``level``."""
    ns = f"sec-pss-{level}"
    cp.kubectl("create", "namespace", ns, check=False)
    cp.kubectl(
        "label", "namespace", ns, "--overwrite",
        f"pod-security.kubernetes.io/enforce={level}", f"pod-security.kubernetes.io/warn={level}",
    )  # fmt: skip
    return ns


def try_pod(cp: ControlPlane, ns: str, name: str, spec: dict[str, Any]) -> list[str] | None:
    """Create a Pod (``--dry-run=server``: every admission check, nothing stored). None when
    PodSecurity admitted it without a warning; else the reasons it gave, e.g.
    ``["host namespaces", "hostPort"]``."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns},
           "spec": spec}  # fmt: skip
    res = cp.kubectl(
        "create", "--dry-run=server", "-f", "-", input=yaml.safe_dump(pod), check=False
    )
    text = res.stderr + res.stdout
    found = re.search(r'violates PodSecurity "[a-z]+:latest": (.*)', text)
    if found is None:
        assert res.returncode == 0, text
        return None
    return re.findall(r"(?:^|, )([^(,]+?) \(", found.group(1))


def test_chart_pods_against_pod_security(kube: ControlPlane) -> None:
    """The operator's pod and an injected model pod pass "restricted"; the agent's is refused by
    "restricted" and by "baseline" exactly for its two documented needs (hostPID, hostPort),
    admitted by "privileged", and by "restricted" is refused for hostPort alone with
    ``agent.hostPID=false``."""
    cp = kube
    restricted, baseline, privileged = (pss_namespace(cp, lv) for lv in
                                        ("restricted", "baseline", "privileged"))  # fmt: skip
    docs = render(cp)
    operator = one(docs, "Deployment", OPERATOR_SA)["spec"]["template"]["spec"]
    assert try_pod(cp, restricted, "operator", operator) is None
    agent = one(docs, "DaemonSet", AGENT_SA)["spec"]["template"]["spec"]
    needs = ["host namespaces", "hostPort"]
    assert try_pod(cp, restricted, "agent", agent) == needs
    assert try_pod(cp, baseline, "agent", agent) == needs
    assert try_pod(cp, privileged, "agent", agent) is None
    no_pid = one(render(cp, "agent.hostPID=false"), "DaemonSet", AGENT_SA)
    assert try_pod(cp, restricted, "agent", no_pid["spec"]["template"]["spec"]) == ["hostPort"]

    # A model pod that meets "restricted" itself still does once the webhook's template adds
    # the sidecar: native (an init container) and plain.
    env = one(docs, "Deployment", OPERATOR_SA)["spec"]["template"]["spec"]["containers"][0]["env"]
    injection = json.loads(
        next(e["value"] for e in env if e["name"] == "KVGATE_OPERATOR_INJECTION")
    )
    model: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "model", "namespace": restricted,
                     "labels": {"kvgate.io/inject": "true"}},
        "spec": {
            # Set by the ServiceAccount admission plugin in a real cluster (off here).
            "serviceAccountName": "default",
            "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{
                "name": "vllm", "image": "vllm/vllm-openai:v0.11.0",
                "ports": [{"name": "http", "containerPort": 8000}],
                "securityContext": {"allowPrivilegeEscalation": False,
                                    "capabilities": {"drop": ["ALL"]}},
            }],
        },
    }  # fmt: skip
    assert try_pod(cp, restricted, "model", model["spec"]) is None
    for native in (True, False):
        config = InjectionConfig.model_validate({**injection, "nativeSidecar": native})
        done = inject(model, namespace=restricted, namespace_opt_in=False, config=config)
        assert done.action == "injected", done.message
        spec = done.pod["spec"]
        sidecars = spec.get("initContainers" if native else "containers")
        assert "kvgate-sidecar" in [c["name"] for c in sidecars]
        assert try_pod(cp, restricted, "model", spec) is None


# ----------------------------------------------------------------------------------------------
# RBAC, as each service account


def can(api: Any, verb: str, resource: str, ns: str = "", group: str = "", **extra: str) -> bool:
    """A SelfSubjectAccessReview as the caller of ``api``."""
    from kubernetes import client

    attrs = client.V1ResourceAttributes(
        verb=verb, resource=resource, namespace=ns or None, group=group, **extra
    )
    review = client.V1SelfSubjectAccessReview(
        spec=client.V1SelfSubjectAccessReviewSpec(resource_attributes=attrs)
    )
    status = client.AuthorizationV1Api(api).create_self_subject_access_review(review).status
    return status is not None and bool(status.allowed)


KV = "kvgate.io"
ADMISSION = "admissionregistration.k8s.io"
#: (verb, resource, namespace, group, extra attributes) each may do...
AGENT_MAY = [
    ("watch", "nodeadmissions", "", KV, {}),
    ("patch", "nodeadmissions", "", KV, {"subresource": "status"}),
    ("create", "tokenreviews", "", "authentication.k8s.io", {}),
]
#: ... and must not.
AGENT_MUST_NOT = [
    ("create", "nodeadmissions", "", KV, {}),
    ("patch", "nodeadmissions", "", KV, {}),  # the spec is the operator's
    ("delete", "nodeadmissions", "", KV, {}),
    ("list", "ratelimitpolicies", "models", KV, {}),
    ("patch", "ratelimitpolicies", "models", KV, {"subresource": "status"}),
    ("get", "secrets", RELEASE, "", {}),
    ("list", "secrets", "kube-system", "", {}),
    ("get", "pods", "models", "", {}),
    ("create", "pods", RELEASE, "", {}),
    ("create", "serviceaccounts", RELEASE, "", {"subresource": "token"}),
    ("create", "subjectaccessreviews", "", "authorization.k8s.io", {}),
    ("patch", "nodes", "", "", {}),
    ("update", "validatingadmissionpolicies", "", ADMISSION, {}),
    ("delete", "validatingadmissionpolicybindings", "", ADMISSION, {}),
]
OPERATOR_MAY = [
    ("list", "pods", "", "", {}),
    ("watch", "nodes", "", "", {}),
    ("create", "nodeadmissions", "", KV, {}),
    ("delete", "nodeadmissions", "", KV, {}),
    ("patch", "ratelimitpolicies", "models", KV, {"subresource": "status"}),
    ("get", "secrets", RELEASE, "", {"name": f"{RELEASE}-webhook-tls"}),
    ("create", "secrets", RELEASE, "", {}),
    ("patch", "mutatingwebhookconfigurations", "", ADMISSION,
     {"name": f"{RELEASE}-sidecar-injector"}),
    ("create", "events", "models", "", {}),
]  # fmt: skip
OPERATOR_MUST_NOT = [
    ("list", "secrets", RELEASE, "", {}),
    ("get", "secrets", RELEASE, "", {"name": "someone-elses"}),
    ("get", "secrets", "kube-system", "", {"name": f"{RELEASE}-webhook-tls"}),
    ("create", "secrets", "models", "", {}),
    ("create", "pods", "models", "", {}),
    ("delete", "pods", "models", "", {}),
    ("create", "pods", "models", "", {"subresource": "exec"}),
    ("update", "pods", "models", "", {}),
    ("patch", "ratelimitpolicies", "models", KV, {}),  # users own the spec
    ("patch", "nodeadmissions", "", KV, {"subresource": "status"}),  # the agents' part
    ("patch", "mutatingwebhookconfigurations", "", ADMISSION, {"name": "someone-elses"}),
    ("create", "mutatingwebhookconfigurations", "", ADMISSION, {}),
    ("update", "validatingadmissionpolicies", "", ADMISSION, {}),
    ("delete", "validatingadmissionpolicybindings", "", ADMISSION, {}),
    ("create", "serviceaccounts", "models", "", {"subresource": "token"}),
    ("create", "tokenreviews", "", "authentication.k8s.io", {}),
    ("update", "customresourcedefinitions", "", "apiextensions.k8s.io", {}),
    ("create", "clusterrolebindings", "", "rbac.authorization.k8s.io", {}),
]


def test_service_accounts_can_do_their_work_only(release: ControlPlane) -> None:
    """Each chart service account, with a real token from the TokenRequest API: what it needs is
    allowed, a list of what it must not do is refused (SelfSubjectAccessReview, as the API
    server's RBAC decides it), and a few of each are tried for real."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    cp = release
    operator_token = cp.kubectl(
        "create", "token", OPERATOR_SA, "-n", RELEASE, "--duration", "1h"
    ).stdout.strip()
    for token, may, must_not in (
        (agent_token_on(cp, NODE_A), AGENT_MAY, AGENT_MUST_NOT),
        (operator_token, OPERATOR_MAY, OPERATOR_MUST_NOT),
    ):
        with cp.api_client(token) as api:
            wrong = [r for r in may if not can(api, r[0], r[1], r[2], r[3], **r[4])]
            wrong += [r for r in must_not if can(api, r[0], r[1], r[2], r[3], **r[4])]
            assert wrong == [], wrong

    def status_of(call: Any) -> int:
        try:
            call()
        except ApiException as e:
            return int(e.status)
        return 200

    with cp.api_client(agent_token_on(cp, NODE_A)) as api:
        core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
        review = client.V1TokenReview(spec=client.V1TokenReviewSpec(token="x"))
        assert status_of(lambda: client.AuthenticationV1Api(api).create_token_review(review)) == 200
        assert (
            status_of(lambda: custom.list_cluster_custom_object(KV, "v1alpha1", "nodeadmissions"))
            == 200
        )
        assert status_of(lambda: core.list_namespaced_secret(RELEASE)) == 403
        assert (
            status_of(
                lambda: custom.patch_cluster_custom_object(
                    KV, "v1alpha1", "nodeadmissions", NODE_A, {"spec": {"pods": []}}
                )
            )
            == 403
        )
        assert (
            status_of(
                lambda: custom.delete_cluster_custom_object(
                    KV, "v1alpha1", "nodeadmissions", NODE_B
                )
            )
            == 403
        )
    with cp.api_client(operator_token) as api:
        core = client.CoreV1Api(api)
        assert status_of(lambda: core.list_pod_for_all_namespaces(limit=1)) == 200
        assert status_of(lambda: core.list_namespaced_secret("kube-system")) == 403
        assert status_of(lambda: core.read_namespaced_secret("someone-elses", RELEASE)) == 403
        policies = client.AdmissionregistrationV1Api(api)
        assert (
            status_of(
                lambda: policies.delete_validating_admission_policy_binding(
                    f"{RELEASE}-agent-own-node"
                )
            )
            == 403
        )
