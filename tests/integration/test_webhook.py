"""The sidecar-injection webhook served by the operator through kopf, against the real local
control plane: a MutatingWebhookConfiguration like the chart's (URL mode, caBundle left empty for
the operator to fill in), pods created with kubectl, the API server calling the operator.

There is no kubelet: pods never run, but the API server still calls the webhook on CREATE and
stores what it returns. The first tests need no cluster: the patch kopf derives from the
handler's merge patch, and the in-place certificate reload of the webhook server.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import aiohttp
import jsonpatch
import kopf
import pytest
import yaml
from cryptography import x509
from kopf._cogs.structs import bodies

from kvgate_agent.sidecar.identity.tenants import tenant_of
from kvgate_bench.kit.processes import kvgate_agent_argv, start
from kvgate_bench.kit.toolkit import (
    fetch_text,
    free_port,
    parse_samples,
    poll_until_async,
    samples_by_labels,
    wait_until,
    wait_until_async,
)
from kvgate_operator.cert_issue import new_ca, new_serving_cert
from kvgate_operator.inject import ANNOTATION_ADMIN_PORT, ANNOTATION_INJECTED, inject
from kvgate_operator.metrics import OperatorMetrics
from kvgate_operator.template import ADMIN_PORT_NAME, PORT_NAME, SIDECAR_NAME, InjectionConfig
from kvgate_operator.webhook import (
    InjectionWebhook,
    NamespaceLabels,
    ReloadingWebhookServer,
    merge_patch,
)
from tests.sync_answers import serve_thresholds
from tests.upstream import CHAT, Upstream

CONFIG_NAME = "kvgate-test-sidecar-injector"
UNGUARDED_CONFIG_NAME = "kvgate-test-unguarded-injector"
SYSTEM_NS = "kvgate-wh-system"
EXCLUDED = ["kube-system", "kube-public", "kube-node-lease", SYSTEM_NS]
IMAGE = "kvgate/kvgate-agent:test"


# ----------------------------------------------------------------------------------------------
# Without a cluster


def model_pod(name: str = "m", ns: str = "models", **meta: Any) -> dict[str, Any]:
    """A model server pod. ``serviceAccountName`` is explicit because the test API server runs
    without the ServiceAccount admission plugin (which sets ``default`` in a real cluster before
    the webhook is called); the injected projected token volume needs one."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, **meta},
        "spec": {
            "serviceAccountName": "default",
            "containers": [
                {"name": "vllm", "image": "vllm/vllm-openai", "ports": [{"containerPort": 8000}]}
            ],
        },
    }


def kopf_json_patch(handler: InjectionWebhook, pod: dict[str, Any]) -> list[dict[str, Any]]:
    """Run the handler the way kopf does, and return the JSON patch kopf would send."""
    body = bodies.Body(cast(bodies.RawBody, pod))
    patch = kopf.Patch(body=body)
    asyncio.run(handler.handle(body=body, patch=patch))
    return [dict(op) for op in patch.as_json_patch()]


def handler_for(ns_labels: dict[str, dict[str, str]] | None = None) -> InjectionWebhook:
    labels = ns_labels or {}
    return InjectionWebhook(
        InjectionConfig(sidecar_image=IMAGE, own_namespace=SYSTEM_NS),
        NamespaceLabels(lambda ns: labels.get(ns, {})),
        OperatorMetrics(),
    )


@pytest.mark.parametrize(
    "pod",
    [
        model_pod(labels={"kvgate.io/inject": "true"}),
        model_pod(labels={"kvgate.io/inject": "true"}, annotations={"a": "b"}),
        {
            **model_pod(labels={"kvgate.io/inject": "true"}),
            "spec": {
                "serviceAccountName": "default",
                "initContainers": [{"name": "init", "image": "busybox"}],
                "containers": model_pod()["spec"]["containers"],
                "volumes": [{"name": "cache", "emptyDir": {}}],
            },
        },
    ],
)
def test_kopf_patch_turns_the_pod_into_exactly_what_inject_intends(pod: dict[str, Any]) -> None:
    want = inject(pod, namespace="models", namespace_opt_in=False, config=handler_for().config).pod
    ops = kopf_json_patch(handler_for(), pod)
    assert ops
    assert jsonpatch.apply_patch(pod, ops) == want
    # The merge patch the handler gives kopf sets the lists inject() appended to as a whole.
    changes = merge_patch(pod, want)
    assert set(changes["spec"]) == {"initContainers", "volumes"}
    assert set(changes["metadata"]) == {"annotations"}


def test_an_injected_pod_gets_an_empty_patch_and_skipped_pods_none() -> None:
    pod = model_pod(labels={"kvgate.io/inject": "true"})
    handler = handler_for()
    injected = jsonpatch.apply_patch(pod, kopf_json_patch(handler, pod))
    assert kopf_json_patch(handler, injected) == []
    assert kopf_json_patch(handler, model_pod()) == []  # not opted in
    counts = {
        (s.labels["action"], s.labels["reason"]): s.value
        for s in parse_samples(handler.metrics.render().decode())
        if s.name == "kvgate_webhook_injections_total"
    }
    assert counts == {
        ("injected", "injected"): 1,
        ("already_injected", "already_injected"): 1,
        ("skipped", "not_opted_in"): 1,
    }


def test_namespace_opt_in_and_lookup_failure() -> None:
    pod = model_pod()
    assert kopf_json_patch(handler_for({"models": {"kvgate.io/inject": "true"}}), pod)

    def broken(ns: str) -> dict[str, str]:
        raise OSError("API server unreachable")

    h = InjectionWebhook(InjectionConfig(), NamespaceLabels(broken), OperatorMetrics())
    assert kopf_json_patch(h, pod) == []  # treated as not opted in, never blocked
    assert kopf_json_patch(h, model_pod(labels={"kvgate.io/inject": "true"}))  # pod label works
    assert h.metrics.namespace_lookup_failures._value.get() == 2


def test_a_namespace_labelled_within_the_cache_lifetime_is_honoured() -> None:
    labels: dict[str, dict[str, str]] = {}
    calls: list[str] = []

    def lookup(ns: str) -> dict[str, str]:
        calls.append(ns)
        return labels.get(ns, {})

    h = InjectionWebhook(InjectionConfig(), NamespaceLabels(lookup, ttl=300), OperatorMetrics())
    assert kopf_json_patch(h, model_pod(labels={"kvgate.io/inject": "true"}))  # caches "models"
    labels["models"] = {"kvgate.io/inject": "true"}  # `kubectl label ns models ...` just now
    # An unlabelled pod only reaches the webhook through the namespace selector: asked again.
    assert kopf_json_patch(h, model_pod())
    assert calls == ["models", "models"]


def test_an_opted_in_pod_that_is_skipped_gets_a_warning() -> None:
    h = handler_for()
    host = model_pod(labels={"kvgate.io/inject": "true"})
    host["spec"]["hostNetwork"] = True
    warnings: list[str] = []
    body = bodies.Body(cast(bodies.RawBody, host))
    asyncio.run(h.handle(body=body, patch=kopf.Patch(body=body), warnings=warnings))
    assert len(warnings) == 1 and "host" in warnings[0].lower()
    warnings.clear()
    plain = model_pod()  # never asked: no warning
    body = bodies.Body(cast(bodies.RawBody, plain))
    asyncio.run(h.handle(body=body, patch=kopf.Patch(body=body), warnings=warnings))
    assert warnings == []


def test_a_refusal_is_an_admission_error_and_a_bug_lets_the_pod_pass() -> None:
    pod = model_pod(labels={"kvgate.io/inject": "true"})
    pod["spec"]["containers"][0]["ports"] = [{"containerPort": 8001}]
    with pytest.raises(kopf.AdmissionError) as err:
        kopf_json_patch(handler_for(), pod)
    assert err.value.code == 400 and "sidecar port 8001" in str(err.value)

    def buggy(*_: Any, **__: Any) -> Any:
        raise KeyError("bug")

    h = InjectionWebhook(
        InjectionConfig(), NamespaceLabels(lambda ns: {}), OperatorMetrics(), buggy
    )
    assert kopf_json_patch(h, model_pod(labels={"kvgate.io/inject": "true"})) == []


def peer_cert(port: int, ca_pem: bytes) -> x509.Certificate:
    ctx = ssl.create_default_context(cadata=ca_pem.decode())
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der)


async def test_webhook_server_reloads_its_certificate_in_place(tmp_path: Path) -> None:
    now = dt.datetime.now(dt.UTC)
    ca = new_ca(now)
    first = new_serving_cert(ca, ["127.0.0.1"], now)
    certfile, keyfile = tmp_path / "tls.crt", tmp_path / "tls.key"
    certfile.write_bytes(first.cert_pem)
    keyfile.write_bytes(first.key_pem)
    port = free_port()
    metrics = OperatorMetrics()
    server = ReloadingWebhookServer(
        addr="127.0.0.1",
        port=port,
        host="127.0.0.1",
        certfile=certfile,
        pkeyfile=keyfile,
        file_check_interval=0.2,
        metrics=metrics,
    )

    async def fn(request: Any, **_: Any) -> dict[str, Any]:
        return {"response": {"uid": request["request"]["uid"], "allowed": True}}

    async with server:
        gen = server(fn).__aiter__()
        config = await gen.__anext__()
        assert config["url"] == f"https://127.0.0.1:{port}"
        task = asyncio.ensure_future(gen.__anext__())  # the file-check loop
        try:
            ctx = ssl.create_default_context(cadata=ca.cert_pem.decode())
            async with aiohttp.ClientSession() as http:
                url = f"https://127.0.0.1:{port}/inject-sidecar"
                review = {"request": {"uid": "1"}}
                async with http.post(url, json=review, ssl=ctx) as r:
                    assert (await r.json())["response"]["allowed"] is True
                got = await asyncio.to_thread(peer_cert, port, ca.cert_pem)
                assert got.serial_number == first.cert.serial_number
                # A half-written pair (new cert, old key) is not loaded: the old one stays.
                second = new_serving_cert(ca, ["127.0.0.1"], now)
                certfile.write_bytes(second.cert_pem)
                await asyncio.sleep(0.6)
                got = await asyncio.to_thread(peer_cert, port, ca.cert_pem)
                assert got.serial_number == first.cert.serial_number
                # The key arrives: the next check loads the pair into the same context.
                keyfile.write_bytes(second.key_pem)
                got = await poll_until_async(
                    lambda: asyncio.to_thread(peer_cert, port, ca.cert_pem),
                    lambda c: c.serial_number == second.cert.serial_number,
                    5,
                    0.1,
                )
                assert got.serial_number == second.cert.serial_number, "certificate not reloaded"
                # The listener never went away: the same session still gets answers.
                async with http.post(url, json=review, ssl=ctx) as r:
                    assert r.status == 200
            assert metrics.cert_reloads._value.get() == 1
            assert server.listening
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task


# ----------------------------------------------------------------------------------------------
# Against the local control plane


class WebhookOperator:
    """``python -m kvgate_operator`` with the webhook on 127.0.0.1 (self-signed, Secret in
    ``SYSTEM_NS``, caBundle of ``CONFIG_NAME`` kept in sync)."""

    def __init__(self, kube: Any, log: Path, **env: str) -> None:
        self.kube = kube
        self.log = log
        self.port = free_port()
        self.webhook_port = free_port()
        self.extra_env = env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {
            **self.kube.env,
            "KVGATE_OPERATOR_LIVENESS_PORT": str(self.port),
            "KVGATE_OPERATOR_DEBOUNCE_SECONDS": "0.1",
            "KVGATE_OPERATOR_RESYNC_SECONDS": "2",
            "KVGATE_OPERATOR_POD_NAMESPACE": SYSTEM_NS,
            "KVGATE_OPERATOR_WEBHOOK_ADDR": "127.0.0.1",
            "KVGATE_OPERATOR_WEBHOOK_PORT": str(self.webhook_port),
            "KVGATE_OPERATOR_WEBHOOK_HOST": "127.0.0.1",
            "KVGATE_OPERATOR_WEBHOOK_CONFIG_NAME": CONFIG_NAME,
            "KVGATE_OPERATOR_WEBHOOK_SELF_SIGNED": "true",
            "KVGATE_OPERATOR_WEBHOOK_CERT_SYNC_SECONDS": "1",
            "KVGATE_OPERATOR_INJECTION": json.dumps({"sidecarImage": IMAGE}),
            # Every operator here shares one Lease: a predecessor killed at stop (not released)
            # holds it for a lease duration, so keep that short (the default's 15 s more than
            # once outlasted a wait for the next operator to lead on a busy CI machine).
            "KVGATE_OPERATOR_LEADER_ELECTION_LEASE_DURATION": "6",
            "KVGATE_OPERATOR_LEADER_ELECTION_RENEW_DEADLINE": "4",
            "KVGATE_OPERATOR_LEADER_ELECTION_RETRY_PERIOD": "1",
            **self.extra_env,
        }
        fh = self.log.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvgate_operator"], env=env, stdout=fh, stderr=subprocess.STDOUT
        )
        wait_for(self.listening, 60, "the operator's webhook to listen")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def wait(self, cond: Callable[[], Any], timeout: float, what: str) -> Any:
        """:func:`wait_for`, with this operator's health and the tail of its log in the error."""
        try:
            return wait_for(cond, timeout, what)
        except TimeoutError as exc:
            raise TimeoutError(
                f"{exc}; health {self.health()}; operator log:\n{self.log.read_text()[-4000:]}"
            ) from exc

    def health(self) -> dict[str, Any]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=2) as r:
                return dict(json.loads(r.read()))
        except urllib.error.HTTPError as e:
            return dict(json.loads(e.read() or b"{}"))
        except OSError:
            return {}

    def listening(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"operator exited: {self.log.read_text()[-3000:]}")
        return str(self.health().get("webhook", "")).startswith("listening")

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        text = fetch_text(f"http://127.0.0.1:{self.port}/metrics", timeout=2)
        return samples_by_labels(parse_samples(text))

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics().get((name, tuple(sorted(labels.items()))), 0.0)


def wait_for(cond: Callable[[], Any], timeout: float, what: str) -> Any:
    return wait_until(cond, timeout, what, interval=0.1)


def webhook_config(name: str, url: str, *, excluded: list[str] | None = EXCLUDED) -> dict[str, Any]:
    """The chart's MutatingWebhookConfiguration in URL mode, caBundle left for the operator.
    ``excluded=None``: one webhook for every pod labelled kvgate.io/inject=true in any namespace
    (no namespace guard at all)."""
    common = {
        "clientConfig": {"url": url},
        "rules": [
            {
                "operations": ["CREATE"],
                "apiGroups": [""],
                "apiVersions": ["v1"],
                "resources": ["pods"],
                "scope": "Namespaced",
            }
        ],
        "admissionReviewVersions": ["v1"],
        "sideEffects": "None",
        "failurePolicy": "Ignore",
        "timeoutSeconds": 5,
        "reinvocationPolicy": "IfNeeded",
        "matchPolicy": "Equivalent",
    }
    not_excluded = (
        [{"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": excluded}]
        if excluded
        else []
    )
    if excluded is None:
        webhooks = [
            {
                "name": "all.inject.kvgate.io",
                "objectSelector": {"matchLabels": {"kvgate.io/inject": "true"}},
                **common,
            }
        ]
    else:
        webhooks = [
            {
                "name": "ns.inject.kvgate.io",
                "namespaceSelector": {
                    "matchExpressions": [
                        {"key": "kvgate.io/inject", "operator": "In", "values": ["true"]},
                        *not_excluded,
                    ]
                },
                "objectSelector": {
                    "matchExpressions": [
                        {"key": "kvgate.io/inject", "operator": "NotIn", "values": ["false"]}
                    ]
                },
                **common,
            },
            {
                "name": "pod.inject.kvgate.io",
                "namespaceSelector": {
                    "matchExpressions": [
                        {"key": "kvgate.io/inject", "operator": "NotIn", "values": ["true"]},
                        *not_excluded,
                    ]
                },
                "objectSelector": {
                    "matchExpressions": [
                        {"key": "kvgate.io/inject", "operator": "In", "values": ["true"]}
                    ]
                },
                **common,
            },
        ]
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": webhooks,
    }


def apply(kube: Any, *objs: dict[str, Any]) -> None:
    kube.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objs))


def create(kube: Any, obj: dict[str, Any], *, check: bool = True) -> Any:
    return kube.kubectl("create", "-f", "-", "-o", "json", input=json.dumps(obj), check=check)


def get_pod(kube: Any, ns: str, name: str) -> dict[str, Any]:
    return dict(json.loads(kube.kubectl("get", "pod", name, "-n", ns, "-o", "json").stdout))


def namespace(kube: Any, name: str, labels: dict[str, str] | None = None) -> str:
    apply(
        kube,
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": name, "labels": labels or {}},
        },
    )
    return name


def config_bundles(kube: Any, name: str = CONFIG_NAME) -> list[str | None]:
    obj = json.loads(kube.kubectl("get", "mutatingwebhookconfiguration", name, "-o", "json").stdout)
    return [w["clientConfig"].get("caBundle") for w in obj["webhooks"]]


def secret(kube: Any) -> dict[str, Any]:
    return dict(
        json.loads(
            kube.kubectl(
                "get", "secret", "kvgate-webhook-tls", "-n", SYSTEM_NS, "-o", "json"
            ).stdout
        )
    )


def injected(pod: dict[str, Any]) -> bool:
    return ANNOTATION_INJECTED in (pod["metadata"].get("annotations") or {})


def dry_create(kube: Any, obj: dict[str, Any]) -> Any:
    return kube.kubectl(
        "create", "--dry-run=server", "-f", "-", "-o", "json", input=json.dumps(obj), check=False
    )


def effective(kube: Any, ns: str) -> bool:
    """The API server calls the operator with a trusted certificate: a server-side dry run of
    an opted-in pod comes back injected. (The API server picks up a patched caBundle within a
    moment; until then its calls fail and are ignored: failurePolicy Ignore.)"""
    out = dry_create(kube, model_pod("probe", ns, labels={"kvgate.io/inject": "true"}))
    if out.returncode != 0:
        raise AssertionError(f"dry run failed: {out.stderr}")
    return injected(json.loads(out.stdout))


@pytest.fixture(scope="module")
def webhook(crds: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebhookOperator]:
    kube = crds
    namespace(kube, SYSTEM_NS)
    op = WebhookOperator(kube, tmp_path_factory.mktemp("webhook") / "operator.log")
    apply(kube, webhook_config(CONFIG_NAME, f"https://127.0.0.1:{op.webhook_port}/inject-sidecar"))
    assert config_bundles(kube) == [None, None]
    op.start()
    try:
        probe_ns = namespace(kube, "wh-probe")
        wait_for(
            lambda: effective(kube, probe_ns),
            30,
            "the API server to call the webhook with a trusted certificate",
        )
        yield op
    finally:
        op.stop()
        kube.kubectl("delete", "mutatingwebhookconfiguration", CONFIG_NAME, check=False)
        if os.environ.get("KVGATE_SHOW_OPERATOR_LOG"):
            print(op.log.read_text()[-8000:])


def sidecar_of(pod: dict[str, Any]) -> dict[str, Any]:
    found = [c for c in pod["spec"].get("initContainers") or [] if c["name"] == SIDECAR_NAME]
    assert len(found) == 1, pod["spec"]
    return dict(found[0])


def test_the_operator_fills_in_the_ca_bundle_from_its_secret(
    crds: Any, webhook: WebhookOperator
) -> None:
    kube = crds
    bundles = config_bundles(kube)
    stored = base64.b64decode(secret(kube)["data"]["ca-bundle.crt"])
    assert bundles == [base64.b64encode(stored).decode()] * 2
    ca = x509.load_pem_x509_certificate(base64.b64decode(secret(kube)["data"]["ca.crt"]))
    serving = peer_cert(webhook.webhook_port, stored)
    assert serving.issuer == ca.subject
    assert webhook.metric("kvgate_webhook_serving") == 1
    assert webhook.metric("kvgate_webhook_certificate_expiry_timestamp_seconds") == pytest.approx(
        serving.not_valid_after_utc.timestamp()
    )


def test_a_pod_in_an_opted_in_namespace_is_injected(crds: Any, webhook: WebhookOperator) -> None:
    kube = crds
    ns = namespace(kube, "wh-ns-optin", {"kvgate.io/inject": "true"})
    before = webhook.metric("kvgate_webhook_injections_total", action="injected", reason="injected")
    created = json.loads(create(kube, model_pod("llama-0", ns)).stdout)
    pod = get_pod(kube, ns, "llama-0")
    assert created["metadata"]["uid"] == pod["metadata"]["uid"]
    assert injected(pod)
    marker = json.loads(pod["metadata"]["annotations"][ANNOTATION_INJECTED])
    assert marker["modelPort"] == 8000 and marker["native"] is True
    sc = sidecar_of(pod)
    assert sc["image"] == IMAGE and sc["restartPolicy"] == "Always"
    env = {e["name"]: e for e in sc["env"]}
    assert env["KVGATE_UPSTREAM"]["value"] == "http://127.0.0.1:8000"
    assert env["KVGATE_POD_UID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.uid"
    assert sc["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert sc["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert sc["securityContext"]["runAsNonRoot"] is True
    assert sc["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert [c["name"] for c in pod["spec"]["containers"]] == ["vllm"]
    assert "kvgate-token" in [v["name"] for v in pod["spec"]["volumes"]]
    after = webhook.metric("kvgate_webhook_injections_total", action="injected", reason="injected")
    assert after >= before + 1


def test_a_labelled_pod_in_a_plain_namespace_is_injected_and_others_are_not(
    crds: Any, webhook: WebhookOperator
) -> None:
    kube = crds
    ns = namespace(kube, "wh-pod-optin")
    create(kube, model_pod("labelled", ns, labels={"kvgate.io/inject": "true"}))
    create(kube, model_pod("plain", ns))
    assert injected(get_pod(kube, ns, "labelled"))
    sidecar_of(get_pod(kube, ns, "labelled"))
    plain = get_pod(kube, ns, "plain")
    assert not injected(plain) and not plain["spec"].get("initContainers")


def test_opted_out_pods_are_not_injected(crds: Any, webhook: WebhookOperator) -> None:
    kube = crds
    ns = namespace(kube, "wh-optout", {"kvgate.io/inject": "true"})
    before = webhook.metric("kvgate_webhook_injections_total", action="skipped", reason="opted_out")
    create(kube, model_pod("by-annotation", ns, annotations={"kvgate.io/inject": "false"}))
    create(kube, model_pod("by-label", ns, labels={"kvgate.io/inject": "false"}))
    for name in ("by-annotation", "by-label"):
        pod = get_pod(kube, ns, name)
        assert not injected(pod) and not pod["spec"].get("initContainers")
    # The annotation opt-out reached the operator (selectors read labels only) and was skipped.
    after = webhook.metric("kvgate_webhook_injections_total", action="skipped", reason="opted_out")
    assert after == before + 1


def test_kube_system_is_never_injected_even_without_the_configurations_guard(
    crds: Any, webhook: WebhookOperator
) -> None:
    kube = crds
    labels = {"kvgate.io/inject": "true"}
    create(kube, model_pod("wh-guarded", "kube-system", labels=labels))
    assert not injected(get_pod(kube, "kube-system", "wh-guarded"))
    # Now a configuration without any namespace exclusion (as if a platform stripped it):
    # the API server sends kube-system pods, and the operator itself skips them
    # (https://github.com/Kong/kubernetes-sidecar-injector/issues/4).
    before = webhook.metric(
        "kvgate_webhook_injections_total", action="skipped", reason="excluded_namespace"
    )
    unguarded = webhook_config(
        UNGUARDED_CONFIG_NAME,
        f"https://127.0.0.1:{webhook.webhook_port}/inject-sidecar",
        excluded=None,
    )
    ca = base64.b64decode(secret(kube)["data"]["ca-bundle.crt"])
    unguarded["webhooks"][0]["clientConfig"]["caBundle"] = base64.b64encode(ca).decode()
    apply(kube, unguarded)
    try:
        # Wait until the API server calls the unguarded configuration for kube-system pods.
        def called() -> bool:
            dry_create(kube, model_pod("wh-probe", "kube-system", labels=labels))
            now = webhook.metric(
                "kvgate_webhook_injections_total", action="skipped", reason="excluded_namespace"
            )
            return now > before

        wait_for(called, 30, "the unguarded configuration to be called")
        before = webhook.metric(
            "kvgate_webhook_injections_total", action="skipped", reason="excluded_namespace"
        )
        create(kube, model_pod("wh-unguarded", "kube-system", labels=labels))
        pod = get_pod(kube, "kube-system", "wh-unguarded")
        assert not injected(pod) and not pod["spec"].get("initContainers")
        after = webhook.metric(
            "kvgate_webhook_injections_total", action="skipped", reason="excluded_namespace"
        )
        assert after == before + 1
        # The operator's own namespace likewise.
        create(kube, model_pod("wh-own", SYSTEM_NS, labels=labels))
        assert not injected(get_pod(kube, SYSTEM_NS, "wh-own"))
    finally:
        kube.kubectl("delete", "mutatingwebhookconfiguration", UNGUARDED_CONFIG_NAME)


def test_a_port_clash_is_refused_with_the_message_in_kubectls_error(
    crds: Any, webhook: WebhookOperator
) -> None:
    kube = crds
    ns = namespace(kube, "wh-clash")
    pod = model_pod("clash", ns, labels={"kvgate.io/inject": "true"})
    pod["spec"]["containers"].append(
        {"name": "metrics", "image": "exporter", "ports": [{"containerPort": 8001}]}
    )
    out = create(kube, pod, check=False)
    assert out.returncode != 0
    assert 'admission webhook "pod.inject.kvgate.io" denied the request' in out.stderr
    assert "kvgate: sidecar port 8001 is already used by container 'metrics'" in out.stderr
    assert "kvgate.io/sidecar-port" in out.stderr  # how to fix it
    gone = kube.kubectl("get", "pod", "clash", "-n", ns, check=False)
    assert gone.returncode != 0
    assert webhook.metric("kvgate_webhook_injections_total", action="refused", reason="port_clash")


def test_an_injected_sidecar_has_an_admin_port_and_a_clash_with_it_names_its_annotation(
    crds: Any, webhook: WebhookOperator
) -> None:
    """The webhook gives the sidecar its admin listener (per-tenant metrics, what the chart's
    PodMonitor scrapes): the container port ``kvgate-admin``, 9471 unless the pod annotates
    ``kvgate.io/admin-port``, as ``KVGATE_ADMIN_LISTEN``; a container already on it is refused
    with the annotation to set."""
    kube = crds
    ns = namespace(kube, "wh-admin-port", {"kvgate.io/inject": "true"})
    for name, marks, admin in (
        ("default-admin", {}, 9471),
        ("moved-admin", {ANNOTATION_ADMIN_PORT: "19471"}, 19471),
    ):
        create(kube, model_pod(name, ns, annotations=marks))
        pod = get_pod(kube, ns, name)
        sc = sidecar_of(pod)
        assert sc["ports"] == [
            {"name": PORT_NAME, "containerPort": 8001, "protocol": "TCP"},
            {"name": ADMIN_PORT_NAME, "containerPort": admin, "protocol": "TCP"},
        ]
        env = {e["name"]: e.get("value") for e in sc["env"]}
        assert env["KVGATE_ADMIN_LISTEN"] == f"0.0.0.0:{admin}"
        assert env["KVGATE_LISTEN"] == "0.0.0.0:8001"
        marker = json.loads(pod["metadata"]["annotations"][ANNOTATION_INJECTED])
        assert (marker["adminPort"], marker["sidecarPort"]) == (admin, 8001)
    clash = model_pod("admin-clash", ns)
    clash["spec"]["containers"].append(
        {"name": "exporter", "image": "exporter", "ports": [{"containerPort": 9471}]}
    )
    out = create(kube, clash, check=False)
    assert out.returncode != 0
    assert "kvgate: sidecar admin port 9471 is already used by container 'exporter'" in out.stderr
    assert "set annotation kvgate.io/admin-port to a free port" in out.stderr
    assert kube.kubectl("get", "pod", "admin-clash", "-n", ns, check=False).returncode != 0


def kubelet_env(container: dict[str, Any], fields: dict[str, str]) -> dict[str, str]:
    """A container's ``env`` as the kubelet gives it: each ``value`` with ``$(VAR)`` of the
    variables before it expanded, each ``fieldRef`` from ``fields`` (its field path -> value)."""
    out: dict[str, str] = {}
    for item in container["env"]:
        if "value" in item:
            value = str(item["value"])
            for k, v in out.items():
                value = value.replace(f"$({k})", v)
        else:
            value = fields[item["valueFrom"]["fieldRef"]["fieldPath"]]
        out[item["name"]] = value
    return out


async def test_an_injected_sidecar_serves_each_tenant_on_its_admin_port_only(
    crds: Any, webhook: WebhookOperator, upstream: Upstream, tmp_path: Path
) -> None:
    """The real ``kvgate-agent sidecar`` run with the command and environment the webhook wrote
    into a pod (ports moved by annotation to free ones: this machine is the node), under a
    policy naming tenants by credentials (the node agent's answer, ``tenants.header:
    authorization``): a tenant's series are on the admin port's ``/metrics``, where the chart's
    PodMonitor scrapes, and not on the clients' port's ``/kvgate/metrics``; the clients' port
    keeps the router gauges on ``/metrics``."""
    kube = crds
    ns = await asyncio.to_thread(namespace, kube, "wh-admin-http", {"kvgate.io/inject": "true"})
    sidecar_port, admin_port = free_port(), free_port()
    model_port = int(upstream.url.rsplit(":", 1)[1])
    annotations = {
        "kvgate.io/model-port": str(model_port),
        "kvgate.io/sidecar-port": str(sidecar_port),
        ANNOTATION_ADMIN_PORT: str(admin_port),
    }
    await asyncio.to_thread(create, kube, model_pod("served", ns, annotations=annotations))
    pod = await asyncio.to_thread(get_pod, kube, ns, "served")
    sc = sidecar_of(pod)
    named = {p["name"]: p["containerPort"] for p in sc["ports"]}
    assert named == {PORT_NAME: sidecar_port, ADMIN_PORT_NAME: admin_port}
    env = kubelet_env(sc, {
        "metadata.namespace": ns, "metadata.name": "served", "metadata.uid": pod["metadata"]["uid"],
        "status.podIP": "127.0.0.1", "status.hostIP": "127.0.0.1",
    })  # fmt: skip
    assert env["KVGATE_UPSTREAM"] == upstream.url
    agent_url, agent = await serve_thresholds({"tenants": {"header": "authorization"}})
    (tmp_path / "token").write_text("tok")
    # Only where the node agent and the projected token are: this test's, not the node's.
    env.update(KVGATE_AGENT_URL=agent_url, KVGATE_TOKEN_FILE=str(tmp_path / "token"))
    proc = await asyncio.to_thread(
        start, kvgate_agent_argv(*sc["args"]), tmp_path / "sidecar.log",
        env={**os.environ, **env}, url=f"http://127.0.0.1:{sidecar_port}", ready="/healthz",
        timeout=30.0,
    )  # fmt: skip
    try:
        async with aiohttp.ClientSession() as s:
            chat = f"{proc.url}/v1/chat/completions"
            bearer = {"Authorization": "Bearer sk-team-secret"}

            async def live() -> bool:
                async with s.post(chat, json=CHAT, headers=bearer) as r:
                    await r.read()
                    return r.headers.get("x-kvgate-thresholds") == "live" and r.status == 200

            await wait_until_async(live, 20, "the node agent's policy enforced", interval=0.2)
            tenant = tenant_of({"authorization": bearer["Authorization"]}, "authorization")
            assert tenant.startswith("key-")
            async with s.get(f"{proc.url}/kvgate/metrics") as r:
                public = await r.text()
            async with s.get(f"http://127.0.0.1:{admin_port}/metrics") as r:
                assert r.status == 200
                admin = await r.text()
            async with s.get(f"{proc.url}/metrics") as r:
                router = await r.text()
    finally:
        await asyncio.to_thread(proc.stop)
        await agent.cleanup()
    assert f'tenant="{tenant}"' in admin
    assert 'kvgate_admission_decisions_total{outcome="admitted"' in admin
    assert tenant not in public and "kvgate_in_flight_requests" in public
    assert "kvgate_queue_depth" in router and tenant not in router


class PortAdder:
    """A second mutating webhook, as a service mesh or a monitoring agent would install: it adds
    a ``metrics-exporter`` container listening on the port in the pod's annotation
    ``test.kvgate.io/exporter-port`` (default 8001, the sidecar's), once. A real HTTPS server
    on loopback (its own CA) in a thread; ``seen`` records the containers and init containers of
    every pod it was sent."""

    ANNOTATION = "test.kvgate.io/exporter-port"

    def __init__(self, tmp: Path) -> None:
        import http.server
        import threading

        now = dt.datetime.now(dt.UTC)
        self.ca = new_ca(now, common_name="port-adder-ca")
        pair = new_serving_cert(self.ca, ["127.0.0.1"], now)
        (tmp / "adder.crt").write_bytes(pair.cert_pem)
        (tmp / "adder.key").write_bytes(pair.key_pem)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(tmp / "adder.crt", tmp / "adder.key")
        self.seen: list[list[str]] = []
        adder = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                body = json.dumps(adder.review(review)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def review(self, review: dict[str, Any]) -> dict[str, Any]:
        pod = review["request"]["object"]
        spec = pod["spec"]
        names = [c["name"] for k in ("initContainers", "containers") for c in spec.get(k) or []]
        self.seen.append(names)
        response: dict[str, Any] = {"uid": review["request"]["uid"], "allowed": True}
        if "metrics-exporter" not in names:
            port = int((pod["metadata"].get("annotations") or {}).get(self.ANNOTATION, "8001"))
            exporter = {
                "name": "metrics-exporter",
                "image": "prom/statsd-exporter",
                "ports": [{"containerPort": port}],
            }
            ops = [{"op": "add", "path": "/spec/containers/-", "value": exporter}]
            response["patchType"] = "JSONPatch"
            response["patch"] = base64.b64encode(json.dumps(ops).encode()).decode()
        kind = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}
        return {**kind, "response": response}

    def config(self, name: str, ns: str) -> dict[str, Any]:
        """Its MutatingWebhookConfiguration, for pods of ``ns`` only; ``name`` sorts after the
        kvgate configuration's, so the API server calls it after kvgate, and then kvgate again
        (``reinvocationPolicy: IfNeeded``)."""
        return {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": name},
            "webhooks": [
                {
                    "name": "port-adder.test.kvgate.io",
                    "clientConfig": {
                        "url": f"https://127.0.0.1:{self.port}/add",
                        "caBundle": base64.b64encode(self.ca.cert_pem).decode(),
                    },
                    "rules": [
                        {
                            "operations": ["CREATE"],
                            "apiGroups": [""],
                            "apiVersions": ["v1"],
                            "resources": ["pods"],
                        }
                    ],
                    "namespaceSelector": {
                        "matchLabels": {"kubernetes.io/metadata.name": ns},
                    },
                    "admissionReviewVersions": ["v1"],
                    "sideEffects": "None",
                    "failurePolicy": "Fail",  # never silently skipped: the test must see it
                    "timeoutSeconds": 5,
                    "reinvocationPolicy": "Never",
                }
            ],
        }

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_port_clash_added_by_a_later_webhook_is_refused_on_reinvocation(
    crds: Any, webhook: WebhookOperator, tmp_path: Path
) -> None:
    """kvgate injects; a second webhook then adds a container on the sidecar's port; the API
    server calls kvgate again (its reinvocationPolicy IfNeeded): the pod is refused with the
    first-invocation message, never admitted with two containers on one port."""
    kube = crds
    ns = namespace(kube, "wh-reinvoke")
    adder = PortAdder(tmp_path)
    name = "zz-kvgate-test-port-adder"
    assert name > CONFIG_NAME
    try:
        apply(kube, adder.config(name, ns))
        labels = {"kvgate.io/inject": "true"}
        ann = {PortAdder.ANNOTATION: "9000"}
        # Until the API server calls the adder, a dry run comes back without its container.
        wait_for(
            lambda: (
                "metrics-exporter"
                in [
                    c["name"]
                    for c in json.loads(
                        dry_create(
                            kube, model_pod("probe", ns, labels=labels, annotations=ann)
                        ).stdout
                    )["spec"]["containers"]
                ]
            ),
            30,
            "the API server to call the second webhook",
        )
        # A container on another port: injected by kvgate, then the exporter added, admitted.
        create(kube, model_pod("other-port", ns, labels=labels, annotations=ann))
        pod = get_pod(kube, ns, "other-port")
        assert injected(pod) and sidecar_of(pod)
        assert [c["name"] for c in pod["spec"]["containers"]] == ["vllm", "metrics-exporter"]
        # On the sidecar's port: refused, with the message of a first-invocation clash.
        before = webhook.metric(
            "kvgate_webhook_injections_total", action="refused", reason="port_clash"
        )
        adder.seen.clear()
        out = create(kube, model_pod("same-port", ns, labels=labels), check=False)
        assert out.returncode != 0, out.stdout
        assert "kvgate: sidecar port 8001 is already used by container 'metrics-exporter'" in (
            out.stderr
        )
        assert "kvgate.io/sidecar-port" in out.stderr
        # The adder was called with kvgate's sidecar already in the pod: the refusal came from
        # the reinvocation, not from a first invocation that saw the exporter.
        assert adder.seen and all(SIDECAR_NAME in names for names in adder.seen), adder.seen
        assert kube.kubectl("get", "pod", "same-port", "-n", ns, check=False).returncode != 0
        after = webhook.metric(
            "kvgate_webhook_injections_total", action="refused", reason="port_clash"
        )
        assert after >= before + 1
    finally:
        kube.kubectl("delete", "mutatingwebhookconfiguration", name, check=False)
        adder.close()


def test_cert_manager_mode_serves_the_mounted_certificate_and_reloads_it(
    crds: Any, webhook: WebhookOperator, tmp_path: Path
) -> None:
    """With KVGATE_OPERATOR_WEBHOOK_CERT_DIR (cert-manager's mounted Secret) the operator makes
    no certificate and patches no caBundle, and picks up a renewed pair without a restart."""
    kube = crds
    now = dt.datetime.now(dt.UTC)
    ca = new_ca(now)
    first = new_serving_cert(ca, ["127.0.0.1"], now)
    tls = tmp_path / "tls"
    tls.mkdir()

    def mount(pair: Any) -> None:  # like the kubelet's atomic swap of a Secret volume
        for name, data in (("tls.key", pair.key_pem), ("tls.crt", pair.cert_pem)):
            (tls / f".{name}").write_bytes(data)
            os.replace(tls / f".{name}", tls / name)

    mount(first)
    (tls / "ca.crt").write_bytes(ca.cert_pem)
    name = "kvgate-test-certmanager-injector"
    op = WebhookOperator(
        kube,
        tmp_path / "operator.log",
        KVGATE_OPERATOR_WEBHOOK_CERT_DIR=str(tls),
        KVGATE_OPERATOR_WEBHOOK_SELF_SIGNED="false",
        KVGATE_OPERATOR_WEBHOOK_CONFIG_NAME=name,
        KVGATE_OPERATOR_WEBHOOK_CERT_SYNC_SECONDS="0.5",
    )
    config = webhook_config(name, f"https://127.0.0.1:{op.webhook_port}/inject-sidecar")
    bundle = base64.b64encode(ca.cert_pem).decode()  # what cert-manager's cainjector sets
    for wh in config["webhooks"]:
        wh["clientConfig"]["caBundle"] = bundle
    webhook.stop()  # only the cert-manager-mode operator answers meanwhile
    apply(kube, config)
    try:
        op.start()
        ns = namespace(kube, "wh-certdir")
        wait_for(lambda: effective(kube, ns), 30, "the cert-manager-mode webhook")
        assert peer_cert(op.webhook_port, ca.cert_pem).serial_number == first.cert.serial_number
        pid = op.proc.pid if op.proc else None
        second = new_serving_cert(ca, ["127.0.0.1"], now)
        mount(second)
        wait_for(
            lambda: (
                peer_cert(op.webhook_port, ca.cert_pem).serial_number == second.cert.serial_number
            ),
            15,
            "the renewed certificate to be served",
        )
        create(kube, model_pod("after-renewal", ns, labels={"kvgate.io/inject": "true"}))
        assert injected(get_pod(kube, ns, "after-renewal"))
        assert op.proc is not None and op.proc.pid == pid and op.proc.poll() is None
        assert op.metric("kvgate_webhook_certificate_reloads_total") == 1
        assert config_bundles(kube, name) == [bundle, bundle]  # untouched by the operator
    finally:
        op.stop()
        kube.kubectl("delete", "mutatingwebhookconfiguration", name, check=False)
        webhook.start()


def served_cert(port: int) -> tuple[int, bytes]:
    """The serving certificate the webhook presents now (not verified): (serial, the key id of
    the CA that signed it)."""
    cert = x509.load_pem_x509_certificate(
        ssl.get_server_certificate(("127.0.0.1", port), timeout=5).encode()
    )
    aki = cert.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
    return cert.serial_number, aki.key_identifier or b""


@pytest.mark.timeout(600 if os.environ.get("KVGATE_SOAK") == "long" else 300)
def test_certificate_rotation_under_load_fails_no_admission(
    crds: Any, webhook: WebhookOperator, tmp_path: Path
) -> None:
    """Pods are created continuously (4 threads) while the operator rotates its serving
    certificate every ~2 s and its CA every ~6 s (lifetimes of seconds through the settings,
    checked every 0.5 s): every create succeeds and every pod is injected, so the API server
    never met a certificate it did not trust (failurePolicy Ignore would have let a pod through
    uninjected). Short mode: 120 creates over ~20 s; ``KVGATE_SOAK=long``: 1,200 over ~200 s."""
    from concurrent.futures import ThreadPoolExecutor

    from kubernetes import client

    kube = crds
    long = os.environ.get("KVGATE_SOAK") == "long"
    total, duration = (1200, 200.0) if long else (120, 20.0)
    name = "kvgate-test-rotating-injector"
    op = WebhookOperator(
        kube,
        tmp_path / "operator.log",
        KVGATE_OPERATOR_WEBHOOK_CONFIG_NAME=name,
        KVGATE_OPERATOR_WEBHOOK_SECRET_NAME="kvgate-webhook-tls-rotating",
        KVGATE_OPERATOR_WEBHOOK_CERT_SYNC_SECONDS="0.5",
        KVGATE_OPERATOR_WEBHOOK_CA_LIFETIME_SECONDS="14",
        KVGATE_OPERATOR_WEBHOOK_CA_RENEW_BEFORE_SECONDS="8",
        KVGATE_OPERATOR_WEBHOOK_SERVING_LIFETIME_SECONDS="8",
        KVGATE_OPERATOR_WEBHOOK_SERVING_RENEW_BEFORE_SECONDS="6",
    )
    apply(kube, webhook_config(name, f"https://127.0.0.1:{op.webhook_port}/inject-sidecar"))
    webhook.stop()  # only the rotating operator injects meanwhile
    try:
        op.start()
        ns = namespace(kube, "wh-rotation", {"kvgate.io/inject": "true"})
        wait_for(lambda: effective(kube, ns), 30, "the rotating operator's webhook")
        # It rotates only once it leads (a follower adopts the Secret): on a busy machine the
        # lease can take longer to come than the 20 s of creates, so wait for its first rotation.
        op.wait(
            lambda: op.metric("kvgate_operator_leader") == 1, 90, "the rotating operator to lead"
        )
        op.wait(
            lambda: op.metric("kvgate_webhook_certificate_reloads_total") >= 1,
            30,
            "the rotating operator, leading, to renew its certificate",
        )
        failures: list[str] = []
        uninjected: list[str] = []
        seconds: list[float] = []
        start = time.monotonic()

        def create_one(i: int) -> None:
            time.sleep(max(0.0, start + i * duration / total - time.monotonic()))
            t = time.monotonic()
            try:
                with kube.api_client() as api:
                    core: Any = client.CoreV1Api(api)
                    got = core.create_namespaced_pod(
                        ns, model_pod(f"r-{i}", ns), _request_timeout=30
                    )
            except Exception as exc:  # any failed admission is a finding
                failures.append(f"r-{i}: {exc}")
                return
            seconds.append(time.monotonic() - t)
            if ANNOTATION_INJECTED not in (got.metadata.annotations or {}):
                uninjected.append(f"r-{i}")

        served: set[tuple[int, bytes]] = set()
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(create_one, i) for i in range(total)]
            while not all(f.done() for f in futures):
                served.add(served_cert(op.webhook_port))
                time.sleep(0.2)
        cas = {aki for _, aki in served}
        reloads = op.metric("kvgate_webhook_certificate_reloads_total")
        seconds.sort()
        print(
            f"rotation under load: {total} creates in {time.monotonic() - start:.1f}s, "
            f"{len(failures)} failed, {len(uninjected)} uninjected; {len(served)} serving "
            f"certificates from {len(cas)} CAs seen, {reloads:.0f} reloads; create p50 "
            f"{seconds[len(seconds) // 2] * 1000:.0f} ms, max {seconds[-1] * 1000:.0f} ms"
        )
        assert failures == [] and uninjected == []
        assert len(served) >= duration / 4 and len(cas) >= 3, (len(served), len(cas))
        assert reloads >= duration / 4
        assert "Traceback" not in op.log.read_text()
    finally:
        op.stop()
        kube.kubectl("delete", "mutatingwebhookconfiguration", name, check=False)
        webhook.start()


def test_a_pod_created_while_the_operator_is_down_is_reported_as_missed(
    crds: Any, webhook: WebhookOperator
) -> None:
    """The webhook gone (the operator stopped: connections refused) and the webhook hung (the
    operator frozen with SIGSTOP: its socket accepts, nothing answers): the API server admits
    the pod as is (failurePolicy Ignore; after timeoutSeconds when hung), and the operator,
    back, reports each pod once (an InjectionMissed event, the missed-injection metrics)."""
    kube = crds
    ns = namespace(kube, "wh-missed", {"kvgate.io/inject": "true"})

    def warned(uid: str) -> list[dict[str, Any]]:
        events = json.loads(kube.kubectl("get", "events", "-n", ns, "-o", "json").stdout)["items"]
        return [
            e
            for e in events
            if e["reason"] == "InjectionMissed" and e["involvedObject"].get("uid") == uid
        ]

    webhook.stop()
    # failurePolicy Ignore: the API server cannot reach the webhook and admits the pod as is.
    create(kube, model_pod("uninjected", ns))
    pod = get_pod(kube, ns, "uninjected")
    assert not injected(pod)
    uid = pod["metadata"]["uid"]
    webhook.start()

    events = wait_for(lambda: warned(uid), 30, "an InjectionMissed event")
    assert events[0]["type"] == "Warning"
    assert "namespace label kvgate.io/inject=true" in events[0]["message"]
    # The counter moves once the Event's POST has returned: read it until it does (the full
    # suite's load once caught the scrape between the two).
    wait_for(
        lambda: webhook.metric("kvgate_webhook_missed_injections_total") >= 1,
        10,
        "the missed-injection counter",
    )
    assert webhook.metric("kvgate_webhook_uninjected_pods") >= 1

    # Hung: the operator frozen; the create waits out timeoutSeconds (5 s), then passes.
    assert webhook.proc is not None
    missed_before = webhook.metric("kvgate_webhook_missed_injections_total")
    os.kill(webhook.proc.pid, signal.SIGSTOP)
    try:
        t = time.monotonic()
        out = create(kube, model_pod("while-hung", ns), check=False)
        took = time.monotonic() - t
    finally:
        os.kill(webhook.proc.pid, signal.SIGCONT)
    assert out.returncode == 0, out.stderr
    hung = get_pod(kube, ns, "while-hung")
    assert not injected(hung)
    assert 4 <= took < 30, took  # the webhook's timeoutSeconds, not a hang of the API server
    print(f"webhook hung: the create took {took:.1f}s and passed uninjected")
    wait_for(lambda: warned(hung["metadata"]["uid"]), 30, "an InjectionMissed event (hung)")
    wait_for(
        lambda: webhook.metric("kvgate_webhook_missed_injections_total") == missed_before + 1,
        10,
        "the missed-injection counter (hung)",
    )
    assert webhook.listening()  # the thawed operator serves again
    create(kube, model_pod("after-thaw", ns))
    assert injected(get_pod(kube, ns, "after-thaw"))
    # Once per pod: more passes post nothing more.
    time.sleep(5)
    assert len(warned(uid)) == 1 and events[0].get("count", 1) == 1
    assert len(warned(hung["metadata"]["uid"])) == 1


def test_a_restarted_operator_keeps_its_ca_and_the_ca_bundle(
    crds: Any, webhook: WebhookOperator
) -> None:
    kube = crds
    bundles = config_bundles(kube)
    rv = secret(kube)["metadata"]["resourceVersion"]
    ca_before = secret(kube)["data"]["ca.crt"]
    webhook.stop()
    webhook.start()
    ns = namespace(kube, "wh-restart")
    wait_for(lambda: effective(kube, ns), 30, "the restarted webhook")
    time.sleep(2)  # a few certificate sync rounds
    assert config_bundles(kube) == bundles
    assert secret(kube)["metadata"]["resourceVersion"] == rv
    assert secret(kube)["data"]["ca.crt"] == ca_before


def test_new_host_names_rewrite_the_stored_certificate(crds: Any, webhook: WebhookOperator) -> None:
    """A changed KVGATE_OPERATOR_WEBHOOK_HOST renews the serving certificate and the Secret is
    really updated (replacing a Secret must keep its immutable type), under the same CA."""
    kube = crds
    before = secret(kube)
    bundles = config_bundles(kube)
    webhook.stop()
    webhook.extra_env["KVGATE_OPERATOR_WEBHOOK_HOST"] = "127.0.0.1,kvgate-webhook.renamed.svc"
    try:
        webhook.start()
        wait_for(
            lambda: (
                secret(kube)["metadata"]["resourceVersion"] != before["metadata"]["resourceVersion"]
            ),
            30,
            "the Secret to be rewritten",
        )
        after = secret(kube)
        assert after["type"] == before["type"]
        assert after["data"]["ca.crt"] == before["data"]["ca.crt"]  # same CA: no bundle churn
        cert = x509.load_pem_x509_certificate(base64.b64decode(after["data"]["tls.crt"]))
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert "kvgate-webhook.renamed.svc" in san.get_values_for_type(x509.DNSName)
        assert config_bundles(kube) == bundles
        assert "Invalid" not in webhook.log.read_text()
    finally:
        webhook.stop()
        webhook.extra_env.pop("KVGATE_OPERATOR_WEBHOOK_HOST")
        webhook.start()
