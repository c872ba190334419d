"""The whole install journey on the local control plane, as a platform engineer would walk it.

``helm install`` the chart (webhook pointing at the operator, which runs here as a local
process); ``kubectl apply -f examples/``; create a model pod in an opted-in namespace and check
the sidecar the webhook injected; run the operator, the node agent and the injected sidecar (with
the command and environment the chart and the webhook wrote, and each with its chart service
account's token from the TokenRequest API) as local processes in front of the simulator; send
traffic and see the policy enforced. A pod in kube-system and an opted-out pod are not injected.
A real Prometheus (``KVGATE_PROMETHEUS``, from scripts/install-prometheus) scrapes the three
every second as the chart's ServiceMonitors and PodMonitor would (static configs, same ports,
paths and target labels); after the traffic every panel query of the chart's Grafana dashboard
and every alert of its PrometheusRule returns data. Then RBAC for real: the chart's service
accounts can do their work and nothing more. Without a prometheus binary the test skips at the
end, after everything else passed.

There is no kubelet: pods never run; the processes a kubelet would start run here, with the
downward-API values (pod IP, host IP) set to loopback.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from kvgate_agent.gpu.fake_scenario import write_scenario
from kvgate_bench.kit.controlplane import ControlPlane
from kvgate_bench.kit.nodestack import chat, fake_gpus, http_get
from kvgate_bench.kit.processes import kvgate_agent_argv, sim_argv, spawn, stop
from kvgate_bench.kit.promserver import (
    PrometheusServer,
    comparison_operand,
    grafana_value,
    monitor_scrape_configs,
    pod_targets,
    prometheus_binary,
    rate_interval,
    service_targets,
    substitute,
)
from kvgate_bench.kit.redisserver import RedisServer
from kvgate_bench.kit.toolkit import free_port, wait_until
from tests.conftest import REPO

CHART = REPO / "charts" / "kvgate"
RELEASE = "kvgate-journey"  # also the namespace; contains "kvgate", so names are "<release>-*"
NODE = "journey-gpu-node"
MODELS = "models"


def resolve_env(env: list[dict[str, Any]], fields: dict[str, str]) -> dict[str, str]:
    """A container's ``env`` as the kubelet would give it: ``value`` (with ``$(VAR)`` expanded
    from variables defined earlier, as Kubernetes does) or ``valueFrom.fieldRef`` from
    ``fields`` (fieldPath → value)."""
    out: dict[str, str] = {}
    for item in env:
        if "value" in item:
            out[item["name"]] = re.sub(
                r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                lambda m: out.get(m.group(1), m.group(0)),
                str(item["value"]),
            )
        else:
            path = item["valueFrom"]["fieldRef"]["fieldPath"]
            out[item["name"]] = fields[path]
    return out


def get(cp: ControlPlane, *args: str) -> Any:
    return json.loads(cp.kubectl("get", *args, "-o", "json").stdout)


class Journey:
    """Processes and files of one journey; stopped at the end."""

    def __init__(self, cp: ControlPlane, work: Path) -> None:
        self.cp = cp
        self.work = work
        self.procs: list[subprocess.Popen[bytes]] = []
        self.webhook_port = free_port()
        self.agent_port = free_port()

    def sa_kubeconfig(self, name: str, pod: dict[str, Any] | None = None) -> Path:
        """A kubeconfig authenticating as the chart's service account ``name``; with ``pod``
        (a Pod object), its token is bound to that pod, as the kubelet mints it."""
        bound = []
        if pod is not None:
            meta = pod["metadata"]
            bound = ["--bound-object-kind", "Pod", "--bound-object-name", meta["name"],
                     "--bound-object-uid", meta["uid"]]  # fmt: skip
        token = self.cp.kubectl("create", "token", name, "-n", RELEASE, "--duration", "2h", *bound)
        return self.cp.kubeconfig_for_token(token.stdout.strip(), name)

    def spawn(self, args: list[str], env: dict[str, str], log: str) -> subprocess.Popen[bytes]:
        proc = spawn(args, self.work / log, env, append=True, new_session=True)
        self.procs.append(proc)
        return proc

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-20:])
            for p in sorted(self.work.glob("*.log"))
        )

    def stop(self) -> None:
        for p in reversed(self.procs):
            stop(p, 15)


# --------------------------------------------------------------------------- Prometheus, Grafana

SCRAPE_S = 1  # the test's scrape interval, seconds (the chart's 30 s would make it slow)
NO_PROMETHEUS = "scripts/install-prometheus installs it; KVGATE_PROMETHEUS names it"
#: Alert conditions that are false after the journey's normal traffic: their expression returns
#: nothing, so the operand of their comparison is evaluated instead and must return series.
SILENT_ALERTS = {
    "KvgateThresholdsFallback",  # the sidecar has live thresholds
    "KvgateAgentDown",  # the agent answers scrapes
    "KvgateAgentGpuDataStale",  # the fake GPUs are read every poll
    "KvgateKvReservedNearCapacity",  # the journey's requests are small
}


def chart_monitoring(cp: ControlPlane, values: list[str]) -> list[dict[str, Any]]:
    """The chart's monitoring objects (ServiceMonitors and their Services, the PodMonitor, the
    PrometheusRule, the dashboard ConfigMap), rendered by ``helm template`` with the install's
    ``values`` and monitoring on (their CRDs are not installed here)."""
    on = ["metrics.serviceMonitor.enabled", "metrics.podMonitor.enabled",
          "metrics.prometheusRule.enabled", "dashboard.enabled"]  # fmt: skip
    out = cp.helm("template", RELEASE, str(CHART), "-n", RELEASE, *values,
                  *(a for v in on for a in ("--set", f"{v}=true")))  # fmt: skip
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def start_prometheus(
    j: Journey, docs: list[dict[str, Any]], workload_pods: list[dict[str, Any]]
) -> PrometheusServer | None:
    """A Prometheus scraping, every :data:`SCRAPE_S`, the endpoints the chart's ServiceMonitors
    find on ``workload_pods`` and its PodMonitor on the cluster's pods (all on loopback)."""
    binary = prometheus_binary()
    if binary is None:
        return None
    services = [d for d in docs if d["kind"] == "Service"]
    pods = get(j.cp, "pods", "--all-namespaces")["items"]
    configs = []
    for m in (d for d in docs if d["kind"] in ("ServiceMonitor", "PodMonitor")):
        if m["kind"] == "ServiceMonitor":
            targets = service_targets(m, services, workload_pods, "127.0.0.1")
        else:
            targets = pod_targets(m, pods, "127.0.0.1")
        assert len(targets) == 1, (m["metadata"]["name"], targets)
        configs += monitor_scrape_configs(m, targets, f"{SCRAPE_S}s")
    assert len(configs) == 3, [c["job_name"] for c in configs]
    prom = PrometheusServer(binary, j.work / "prometheus", configs, interval=f"{SCRAPE_S}s")
    prom.start()
    assert prom.proc is not None
    j.procs.append(prom.proc)
    return prom


def check_expr(prom: PrometheusServer, expr: str, at: float, where: str) -> list[dict[str, Any]]:
    """Evaluate ``expr`` at ``at`` (Unix seconds; an error fails) and return its series. If it
    returns none (a condition that is false, as it should be after normal traffic), the operand
    of its comparison must (see :func:`~kvgate_bench.kit.promserver.comparison_operand`)."""
    got = prom.query(expr, at)
    if not got:
        inner = comparison_operand(expr)
        assert inner is not None, f"{where}: {expr!r} returned no data"
        assert prom.query(inner, at), f"{where}: neither {expr!r} nor its operand returned data"
    return got


def check_monitoring(
    prom: PrometheusServer, docs: list[dict[str, Any]], traffic_end: float
) -> None:
    """Every panel query of the chart's dashboard (its variables on All, then on every value
    their own queries list) and every alert of its PrometheusRule, evaluated by the real
    Prometheus just after the traffic (ended at ``traffic_end``, Unix seconds), returns data;
    where a comparison filters everything out (an alert that does not fire, "GPU safety net
    closed" with the net open), its operand does.
    (A quantile over a histogram nothing was observed in is a series valued NaN: the
    journey's requests never queue, so "Queue wait" has its series but no value.)"""
    expected = {f"{RELEASE}-operator-metrics", f"{RELEASE}-agent", f"{RELEASE}/{RELEASE}-sidecars"}
    wait_until(lambda: prom.targets_up() == dict.fromkeys(expected, 1), 30,
               "every target scraped\n" + prom.tail())  # fmt: skip
    # Evaluated two scrapes after the traffic: Grafana's $__rate_interval (4 scrapes) then holds
    # samples from before and after the last requests.
    at = traffic_end + 2 * SCRAPE_S
    wait_until(lambda: float(prom.query("min(timestamp(up))")[0]["value"][1]) >= at, 30,
               "scrapes after the traffic")  # fmt: skip
    (cm,) = (d for d in docs if d["kind"] == "ConfigMap" and "kvgate.json" in d["data"])
    dash = json.loads(cm["data"]["kvgate.json"])
    variables = {v["name"]: v for v in dash["templating"]["list"] if v["type"] == "query"}
    options = {}
    for name, v in variables.items():  # label_values(metric, label), as Grafana lists them
        call = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", v["query"]["query"])
        assert call is not None, v
        options[name] = prom.label_values(call[2], call[1])
    assert options == {"namespace": [MODELS], "node": [NODE]}, options
    panels = [
        (p["title"], t["expr"]) for p in _panels(dash["panels"]) for t in p.get("targets", [])
    ]
    builtins = {"__rate_interval": rate_interval(SCRAPE_S, SCRAPE_S), "__interval": f"{SCRAPE_S}s"}
    for choice in ({n: None for n in variables}, options):
        values = {n: grafana_value(variables[n], choice[n]) for n in variables} | builtins
        for title, expr in panels:
            got = check_expr(prom, substitute(expr, values), at, f"panel {title!r} ({choice})")
            if title == "Decisions by outcome":  # the last request shows
                assert sum(float(r["value"][1]) for r in got) > 0, got
    (rule,) = (d for d in docs if d["kind"] == "PrometheusRule")
    fired = {r["alert"]: bool(check_expr(prom, r["expr"], at, r["alert"]))
             for g in rule["spec"]["groups"] for r in g["rules"]}  # fmt: skip
    assert {a for a, f in fired.items() if not f} >= SILENT_ALERTS, fired


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in panels:
        yield p
        yield from _panels(p.get("panels") or [])


@pytest.fixture
def journey(kube: ControlPlane, tmp_path: Path) -> Iterator[Journey]:
    j = Journey(kube, tmp_path)
    try:
        yield j
    finally:
        j.stop()
        kube.helm("uninstall", RELEASE, "-n", RELEASE, "--wait=false", check=False)


def test_install_inject_enforce_and_rbac(
    journey: Journey, redis_server: Callable[..., RedisServer]
) -> None:
    cp, j = journey.cp, journey
    store = redis_server()  # the chart does not install Redis: one runs here
    # 1. helm install, with the webhook pointing at the operator run here.
    values = [
        "--set", f"webhook.url=https://127.0.0.1:{j.webhook_port}/inject-sidecar",
        "--set", f"agent.port={j.agent_port}",
        "--set", f"operator.port={free_port()}",
        "--set", f"store.url={store.url}",
    ]  # fmt: skip
    cp.helm("install", RELEASE, str(CHART), "-n", RELEASE, "--create-namespace", *values)
    mwc = get(cp, "mutatingwebhookconfiguration", f"{RELEASE}-sidecar-injector")
    assert [w["failurePolicy"] for w in mwc["webhooks"]] == ["Ignore", "Ignore"]
    assert all(w["timeoutSeconds"] <= 5 and w["sideEffects"] == "None" for w in mwc["webhooks"])

    # 2. The operator, as the chart's Deployment runs it and as its service account.
    dep = get(cp, "deployment", f"{RELEASE}-operator", "-n", RELEASE)
    op = dep["spec"]["template"]["spec"]["containers"][0]
    pod_name = f"{RELEASE}-operator-0"
    env = resolve_env(op["env"], {"metadata.namespace": RELEASE, "metadata.name": pod_name})
    env.update(
        KVGATE_OPERATOR_WEBHOOK_PORT=str(j.webhook_port),
        KVGATE_OPERATOR_WEBHOOK_HOST="127.0.0.1",  # the operator runs here, not in the pod
        KVGATE_OPERATOR_DEBOUNCE_SECONDS="0.05",
    )
    assert op["command"] == ["kvgate-operator"]
    j.spawn(
        [sys.executable, "-m", "kvgate_operator"],
        {**cp.env, **env, "KUBECONFIG": str(j.sa_kubeconfig(f"{RELEASE}-operator"))},
        "operator.log",
    )

    def ca_synced() -> bool:
        got = get(cp, "mutatingwebhookconfiguration", f"{RELEASE}-sidecar-injector")
        return all(w["clientConfig"].get("caBundle") for w in got["webhooks"])

    wait_until(ca_synced, 60, "the operator to fill in the webhook's caBundle\n" + j.logs())
    secret = get(cp, "secret", f"{RELEASE}-webhook-tls", "-n", RELEASE)
    assert set(secret["data"]) >= {"tls.crt", "tls.key"}
    # It leads (the chart's Role lets its service account take the leader Lease).
    lease = get(cp, "lease", f"{RELEASE}-operator", "-n", RELEASE)
    assert lease["spec"]["holderIdentity"] == pod_name

    # 3. The user's side: a namespace opted in, the examples applied, a Node for the pod.
    cp.kubectl("create", "namespace", MODELS, check=False)
    cp.kubectl("label", "namespace", MODELS, "kvgate.io/inject=true", "--overwrite")
    cp.kubectl("apply", "-f", str(REPO / "examples"))
    cp.kubectl("create", "serviceaccount", "model", "-n", MODELS, check=False)
    cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}}
    ))  # fmt: skip
    model_port, sidecar_port, admin_port = free_port(), free_port(), free_port()

    def model_pod(name: str, ns: str, labels: dict[str, str], **annotations: str) -> Any:
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": ns,
                "labels": labels,
                "annotations": {
                    "kvgate.io/sidecar-port": str(sidecar_port),
                    "kvgate.io/admin-port": str(admin_port),  # the PodMonitor scrapes it
                    **annotations,
                },
            },
            "spec": {
                "nodeName": NODE,
                "serviceAccountName": "model",
                "containers": [
                    {
                        "name": "vllm",
                        "image": "vllm/vllm-openai:v0.11.0",
                        "ports": [{"name": "http", "containerPort": model_port}],
                    }
                ],
            },
        }
        cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(pod))
        return get(cp, "pod", name, "-n", ns)

    # Injected, once the webhook answers (failurePolicy Ignore: retry until it does).
    def injected() -> Any:
        pod = model_pod("chat-small-0", MODELS, {"app": "chat-small"})
        if "kvgate.io/injected" in pod["metadata"].get("annotations", {}):
            return pod
        cp.kubectl("delete", "pod", "chat-small-0", "-n", MODELS, "--force", "--grace-period=0")
        return None

    pod = wait_until(injected, 60, "a pod injected by the webhook\n" + j.logs(), interval=0.5)
    sidecars = [c for c in pod["spec"].get("initContainers", []) if c["name"] == "kvgate-sidecar"]
    assert len(sidecars) == 1 and sidecars[0]["restartPolicy"] == "Always"  # native sidecar
    sc = sidecars[0]
    record = json.loads(pod["metadata"]["annotations"]["kvgate.io/injected"])
    assert record["modelPort"] == model_port and record["sidecarPort"] == sidecar_port
    assert record["adminPort"] == admin_port
    assert sc["securityContext"]["runAsNonRoot"] and sc["securityContext"]["readOnlyRootFilesystem"]
    assert sc["readinessProbe"]["httpGet"]["path"] == "/readyz"
    token_vol = next(v for v in pod["spec"]["volumes"] if v["name"] == "kvgate-token")
    projected = token_vol["projected"]["sources"][0]["serviceAccountToken"]
    assert projected["audience"] == "kvgate-agent"
    uid = pod["metadata"]["uid"]
    cp.kubectl(
        "patch", "pod", "chat-small-0", "-n", MODELS, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": {
            "phase": "Running", "podIP": "127.0.0.1", "hostIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True"}],
        }}),
    )  # fmt: skip

    # Not injected: kube-system (whatever its labels say) and an opted-out pod.
    ks = model_pod("labelled-system-pod", "kube-system", {"kvgate.io/inject": "true"})
    assert not ks["spec"].get("initContainers") and len(ks["spec"]["containers"]) == 1
    out = model_pod("opted-out", MODELS, {"app": "other"}, **{"kvgate.io/inject": "false"})
    assert not out["spec"].get("initContainers")
    assert "kvgate.io/injected" not in out["metadata"]["annotations"]

    # 4. The node agent, as the chart's DaemonSet runs it and as its service account.
    ds = get(cp, "daemonset", f"{RELEASE}-agent", "-n", RELEASE)
    agent = ds["spec"]["template"]["spec"]["containers"][0]
    assert agent["args"] == ["node"] and ds["spec"]["template"]["spec"]["hostPID"] is True
    env = resolve_env(agent["env"], {"spec.nodeName": NODE})
    # Its pod on the node (the chart's policy lets an agent write only the NodeAdmission of the
    # node its pod-bound token names).
    agent_pod = {"apiVersion": "v1", "kind": "Pod",
                 "metadata": {"name": f"{RELEASE}-agent-0", "namespace": RELEASE,
                              "labels": ds["spec"]["template"]["metadata"]["labels"]},
                 "spec": {**ds["spec"]["template"]["spec"], "nodeName": NODE}}  # fmt: skip
    cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(agent_pod))
    agent_pod = get(cp, "pod", f"{RELEASE}-agent-0", "-n", RELEASE)
    scenario = j.work / "gpus.json"
    write_scenario(scenario, fake_gpus(1))
    env.update(
        KVGATE_LISTEN=f"127.0.0.1:{j.agent_port}",  # hostPort on the host IP = loopback here
        KVGATE_GPU_BACKEND=f"fake:{scenario}",  # no GPU on this machine
        KVGATE_KUBECONFIG_FILE=str(j.sa_kubeconfig(f"{RELEASE}-agent", agent_pod)),
        KVGATE_SYNC_INTERVAL="0.25",
    )
    j.spawn(kvgate_agent_argv(*agent["args"]), env, "agent.log")
    agent_url = f"http://127.0.0.1:{j.agent_port}"
    wait_until(lambda: http_get(agent_url + "/readyz")[0] == 200, 60, "agent\n" + j.logs())

    # 5. The model server and the injected sidecar, with the webhook's command and environment.
    #    A 32k context: the request below that asks more than a tenant's whole budget must fit
    #    the engine's context, since a reservation is bounded by the context (a larger
    #    max_tokens is the engine's to refuse or cut).
    j.spawn(
        sim_argv("--port", str(model_port), "--model", "sim", "--decode-ms", "1",
                 "--max-model-len", "32768"),
        dict(os.environ), "sim.log",
    )  # fmt: skip
    env = resolve_env(
        sc["env"],
        {
            "metadata.namespace": MODELS,
            "metadata.name": "chat-small-0",
            "metadata.uid": uid,
            "status.podIP": "127.0.0.1",
            "status.hostIP": "127.0.0.1",
        },
    )
    assert env["KVGATE_UPSTREAM"] == f"http://127.0.0.1:{model_port}"
    assert env["KVGATE_AGENT_URL"] == agent_url
    assert env["KVGATE_STORE_URL"] == store.url
    # The projected token volume, as the kubelet would write it.
    token = cp.kubectl(
        "create", "token", "model", "-n", MODELS, "--audience", projected["audience"],
        "--bound-object-kind", "Pod", "--bound-object-name", "chat-small-0",
        "--bound-object-uid", uid,
    ).stdout.strip()  # fmt: skip
    token_file = j.work / "token"
    token_file.write_text(token)
    env["KVGATE_TOKEN_FILE"] = str(token_file)
    assert env["KVGATE_ADMIN_LISTEN"] == f"0.0.0.0:{admin_port}"
    env["KVGATE_LISTEN"] = f"127.0.0.1:{sidecar_port}"
    env["KVGATE_ADMIN_LISTEN"] = f"127.0.0.1:{admin_port}"
    j.spawn(
        kvgate_agent_argv(*sc["args"]),
        {**dict(os.environ), **env},
        "sidecar.log",
    )
    url = f"http://127.0.0.1:{sidecar_port}"
    # A real Prometheus scraping the three, as the chart's monitors would (None: not installed).
    operator_pod = {
        "metadata": {"name": pod_name, "namespace": RELEASE,
                     "labels": dep["spec"]["template"]["metadata"]["labels"]},
        "spec": dep["spec"]["template"]["spec"],
    }  # fmt: skip
    monitoring = chart_monitoring(cp, values)
    prom = start_prometheus(j, monitoring, [operator_pod, agent_pod])

    # 6. Traffic: the example policy chat-small (a selector and the SLO) governs it, and the
    #    platform engineer adds a budget per tenant (20000 tokens per minute).
    def live() -> bool:
        return chat(url, 8)[1].get("x-kvgate-thresholds") == "live, store=shared"

    wait_until(live, 60, "the sidecar's thresholds from the agent\n" + j.logs(), interval=0.2)
    status, _, body = chat(url, 8)
    assert status == 200, body
    generation = get(cp, "rlp", "chat-small", "-n", MODELS)["metadata"]["generation"]
    cp.kubectl("patch", "rlp", "chat-small", "-n", MODELS, "--type=json", "-p", json.dumps([
        {"op": "add", "path": "/spec/rateLimits", "value": [
            {"name": "per-tenant", "per": "Tenant", "tokensPerMinute": 20000}]},
    ]))  # fmt: skip

    def budget_applied() -> bool:  # the sidecar enforces the patched generation
        _, text = http_get(url + "/kvgate/metrics")
        return any(
            ln.startswith("kvgate_policy_generation{") and float(ln.split()[-1]) > generation
            for ln in text.splitlines()
        )

    wait_until(budget_applied, 60, "the per-tenant budget enforced\n" + j.logs(), interval=0.2)
    # More than the tenant's whole bucket (within the engine's context): never fits.
    status, headers, _ = chat(url, 30000)
    assert status == 400 and headers.get("x-kvgate-reason") == "exceeds_capacity", headers
    admitted = [chat(url, 4000, tenant="team-b")[0] for _ in range(6)]
    assert chat(url, 8)[0] == 200  # quick: the last decision just before traffic_end
    traffic_end = time.time()
    assert admitted[:4] == [200] * 4 and set(admitted) <= {200, 429}, admitted
    na = get(cp, "nodeadmission", NODE)
    assert [p["name"] for p in na["spec"]["pods"]] == ["chat-small-0"]
    assert na["spec"]["pods"][0]["policy"]["name"] == "chat-small"
    wait_until(lambda: get(cp, "nodeadmission", NODE).get("status", {}).get("heartbeatTime"), 30,
               "the agent's status")  # fmt: skip
    if prom is not None:
        check_monitoring(prom, monitoring, traffic_end)
    # A shared limit: leased from the store (its key appears), the policy's status says so.
    cp.kubectl("patch", "rlp", "chat-small", "-n", MODELS, "--type=json", "-p", json.dumps([
        {"op": "add", "path": "/spec/rateLimits/-", "value": {
            "name": "fleet", "per": "Global", "shared": True, "requestsPerMinute": 6000}},
    ]))  # fmt: skip
    key = "kvgate:{models/chat-small}:fleet:requests:"
    r = redis.Redis.from_url(store.url)

    def leased() -> bool:
        chat(url, 8, tenant="team-c")
        return bool(r.exists(key))

    wait_until(leased, 60, "a lease of the shared limit\n" + j.logs(), interval=0.5)
    r.close()
    conds = get(cp, "rlp", "chat-small", "-n", MODELS)["status"]["conditions"]
    assert {c["type"]: c["status"] for c in conds}["SharedLimits"] == "True"

    # 7. RBAC for real, as the chart's service accounts.
    def can(sa: str, *args: str) -> bool:
        res = cp.kubectl("auth", "can-i", *args, kubeconfig=j.sa_kubeconfig(sa), check=False)
        return res.stdout.strip() == "yes"

    operator, agent_sa = f"{RELEASE}-operator", f"{RELEASE}-agent"
    assert can(operator, "list", "pods", "--all-namespaces")
    assert can(operator, "patch", "nodeadmissions")
    assert can(operator, "patch", "ratelimitpolicies", "--subresource=status", "-n", MODELS)
    assert can(operator, "get", f"secret/{RELEASE}-webhook-tls", "-n", RELEASE)
    assert not can(operator, "list", "secrets", "-n", RELEASE)
    assert not can(operator, "get", "secrets", "-n", "kube-system")
    assert not can(operator, "get", "secret/other", "-n", RELEASE)
    assert not can(operator, "delete", "pods", "-n", MODELS)
    assert not can(operator, "create", "pods", "-n", MODELS)
    assert not can(operator, "patch", "mutatingwebhookconfiguration/someone-elses")
    assert can(agent_sa, "watch", "nodeadmissions")
    assert can(agent_sa, "patch", "nodeadmissions", "--subresource=status")
    assert can(agent_sa, "create", "tokenreviews")
    assert not can(agent_sa, "patch", "nodeadmissions")  # the spec is the operator's
    assert not can(agent_sa, "list", "pods", "--all-namespaces")
    assert not can(agent_sa, "get", "pods", "-n", MODELS)
    assert not can(agent_sa, "get", "secrets", "-n", RELEASE)
    assert not can(agent_sa, "list", "ratelimitpolicies", "-n", MODELS)
    # The processes really ran as those accounts and did their work (no admin credentials).
    for log in ("operator.log", "agent.log", "sidecar.log"):
        text = (j.work / log).read_text()
        assert "Forbidden" not in text and " 403" not in text, f"{log}:\n{text[-3000:]}"
    if prom is None:
        pytest.skip(f"the monitoring part did not run: no prometheus ({NO_PROMETHEUS})")
