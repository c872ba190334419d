"""Smoke tests of the local control plane (``kvgate_bench.kit.controlplane.ControlPlane``, the
session fixture
``kube``): the real kube-apiserver at the pinned version, with RBAC, PodSecurity admission,
bare pods and nodes, and CRDs. There is no kubelet, scheduler or controller-manager."""

from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.request
import uuid

import pytest
import yaml
from kubernetes import client

from kvgate_bench.kit.controlplane import ControlPlane

pytestmark = pytest.mark.k8s

EXPECTED_VERSION = os.environ.get("K8S_VERSION", "v1.36.3")  # scripts/build-k8s's default


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def test_server_version(kube: ControlPlane) -> None:
    out = json.loads(kube.kubectl("version", "-o", "json").stdout)
    assert out["serverVersion"]["gitVersion"] == EXPECTED_VERSION
    assert kube.get_json("/version")["gitVersion"] == EXPECTED_VERSION


@pytest.mark.parametrize("token", [None, "not-a-valid-token"])
def test_requests_without_credentials_are_refused(kube: ControlPlane, token: str | None) -> None:
    # Trust the server, present no client certificate: anonymous (403) or bad token (401).
    ctx = ssl.create_default_context(cafile=str(kube.certs.ca_file))
    req = urllib.request.Request(f"{kube.url}/api/v1/namespaces")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, context=ctx, timeout=5)
    assert err.value.code in (401, 403)


def test_rbac_applies_to_service_account_tokens(kube: ControlPlane) -> None:
    ns = unique("rbac")
    kube.kubectl("create", "namespace", ns)
    kube.kubectl("create", "serviceaccount", "reader", "-n", ns)
    token = kube.kubectl("create", "token", "reader", "-n", ns).stdout.strip()
    as_reader = kube.kubeconfig_for_token(token)

    denied = kube.kubectl("get", "pods", "-n", ns, kubeconfig=as_reader, check=False)
    assert denied.returncode != 0
    assert "forbidden" in denied.stderr.lower()

    kube.kubectl("create", "role", "pod-reader", "--verb=get,list", "--resource=pods", "-n", ns)
    sa = f"--serviceaccount={ns}:reader"
    kube.kubectl("create", "rolebinding", "reader", "--role=pod-reader", sa, "-n", ns)
    assert kube.kubectl("get", "pods", "-n", ns, kubeconfig=as_reader).returncode == 0
    # The same token through the Python client.
    with kube.api_client(token=token) as api:
        assert client.CoreV1Api(api).list_namespaced_pod(ns).items == []


def pod(name: str, *, privileged: bool = False, node: str | None = None) -> str:
    spec: dict[str, object] = {
        "containers": [
            {
                "name": "c",
                "image": "registry.invalid/never-pulled:1",
                "securityContext": {"privileged": privileged},
            }
        ]
    }
    if node:
        spec["nodeName"] = node
    return yaml.safe_dump(
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}
    )


def test_pod_security_admission_enforces(kube: ControlPlane) -> None:
    ns = unique("restricted")
    kube.kubectl("create", "namespace", ns)
    kube.kubectl("label", "namespace", ns, "pod-security.kubernetes.io/enforce=restricted")
    refused = kube.kubectl(
        "apply", "-n", ns, "-f", "-", input=pod("p", privileged=True), check=False
    )
    assert refused.returncode != 0
    assert "violates PodSecurity" in refused.stderr
    assert '"restricted:latest"' in refused.stderr


def test_pods_with_node_name_and_nodes(kube: ControlPlane) -> None:
    node = unique("node")
    kube.kubectl(
        "apply",
        "-f",
        "-",
        input=yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": node, "labels": {"kvgate.io/test": "yes"}},
            }
        ),
    )
    ns = unique("pods")
    kube.kubectl("create", "namespace", ns)
    kube.kubectl("apply", "-n", ns, "-f", "-", input=pod("p", node=node))
    with kube.api_client() as api:
        core = client.CoreV1Api(api)
        n = api.sanitize_for_serialization(core.read_node(node))
        p = api.sanitize_for_serialization(core.read_namespaced_pod("p", ns))
    assert n["metadata"]["labels"]["kvgate.io/test"] == "yes"
    assert p["spec"]["nodeName"] == node
    assert p["status"]["phase"] == "Pending"  # no kubelet runs it
    # ServiceAccount admission is off: no token volume was injected.
    assert "volumes" not in p["spec"]


CRD = """
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: widgets.smoke.kvgate.io
spec:
  group: smoke.kvgate.io
  scope: Namespaced
  names: {plural: widgets, singular: widget, kind: Widget}
  versions:
    - name: v1
      served: true
      storage: true
      schema:
        openAPIV3Schema:
          type: object
          properties:
            spec:
              type: object
              properties:
                size: {type: integer, minimum: 1}
"""


def test_crd_becomes_established(kube: ControlPlane) -> None:
    kube.kubectl("apply", "--server-side", "-f", "-", input=CRD)
    kube.wait_crd_established("widgets.smoke.kvgate.io")
    widget = {
        "apiVersion": "smoke.kvgate.io/v1",
        "kind": "Widget",
        "metadata": {"name": "w", "namespace": "default"},
        "spec": {"size": 3},
    }
    kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(widget))
    got = json.loads(kube.kubectl("get", "widget", "w", "-n", "default", "-o", "json").stdout)
    assert got["spec"] == {"size": 3}
    # Schema validation is live.
    widget["spec"] = {"size": 0}
    bad = kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(widget), check=False)
    assert bad.returncode != 0
    assert "spec.size" in bad.stderr
