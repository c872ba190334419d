"""The Helm chart charts/kvgate, rendered by the helm that scripts/build-k8s builds; no cluster.

- ``helm lint --strict`` passes for every scenario in ``charts/kvgate/ci/*-values.yaml`` (and
  plain ``helm lint`` for the defaults);
- ``helm template`` of each scenario (release ``kvgate``, namespace ``kvgate-system``) equals its
  golden file in tests/golden/chart/; ``KVGATE_UPDATE_GOLDEN=1`` rewrites a stale one and still
  fails, so the new output gets reviewed and committed;
- values.schema.json rejects unknown keys at every level and out-of-range values, and
  values.yaml documents every key it sets;
- the chart's CRDs are byte-identical to crds/;
- RBAC has no wildcards, the agent gets exactly its three rules, Secrets only through the
  operator's namespaced Role;
- the operator's pod meets Pod Security "restricted" and rolls out replica by replica (leader
  election: one Lease, its own namespaced Role) with a PodDisruptionBudget; the agent's
  only exceptions are hostPID and its hostPort;
- the injection settings the operator reads (KVGATE_OPERATOR_INJECTION) are JSON with exactly
  the agreed keys, accepted by the operator's own ``InjectionConfig``, and every
  KVGATE_OPERATOR_* variable is an ``OperatorSettings`` field;
- every metric the dashboard and the PrometheusRule query exists in the Python sources.

Installing the chart into a real API server is the end-to-end journey's job.

helm runs ~100 ms per call, so the calls run concurrently, once per module.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import subprocess
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvgate_operator.inject_store import store_env
from kvgate_operator.settings import OperatorSettings
from kvgate_operator.template import ADMIN_PORT_NAME, InjectionConfig
from tests.conftest import REPO, k8s_bin_dir

CHART = REPO / "charts" / "kvgate"
GOLDEN = REPO / "tests" / "golden" / "chart"
SCENARIOS = sorted(
    p.name.removesuffix("-values.yaml") for p in (CHART / "ci").glob("*-values.yaml")
)
RELEASE = "kvgate"
NAMESPACE = "kvgate-system"
KUBE_VERSION = "1.36.0"  # pinned: a helm built without version ldflags defaults to 1.20

#: The keys of KVGATE_OPERATOR_INJECTION, the contract with the operator's webhook.
INJECTION_KEYS = {
    "passthroughPaths",
    "sidecarImage",
    "imagePullPolicy",
    "nativeSidecar",
    "sidecarPort",
    "adminPort",
    "agentPort",
    "tokenAudience",
    "tokenExpirationSeconds",
    "resources",
    "excludedNamespaces",
    "ownNamespace",
    "drainSeconds",
    "headerTimeoutSeconds",
    "bodyTimeoutSeconds",
    "upstreamTimeoutSeconds",
    "logLevel",
    "apiKeysSecret",
    "apiKeysKey",
    "jwksSecret",
    "jwksKey",
    "eppEngineType",
}
SYSTEM_NAMESPACES = {"kube-system", "kube-public", "kube-node-lease"}

Docs = list[dict[str, Any]]
Helm = Callable[..., list[subprocess.CompletedProcess[str]]]
Lints = dict[tuple[str, bool], subprocess.CompletedProcess[str]]


def test_scenarios_present() -> None:
    assert {
        "default",
        "cert-manager",
        "monitoring",
        "local-operator",
        "plain-container",
    } <= set(SCENARIOS)


# ----------------------------------------------------------------------------------------------
# Running helm


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    """``run(argv, argv, ...)``: run several helm commands concurrently, each a list of
    arguments; returns their CompletedProcesses in order. helm's homes are a temp dir."""
    bin_dir = k8s_bin_dir()
    binary = bin_dir / "helm" if bin_dir is not None else None
    if binary is None or not os.access(binary, os.X_OK):
        if os.environ.get("KVGATE_ALLOW_SKIP_K8S") == "1":
            pytest.skip("helm not built (run scripts/build-k8s)")
        pytest.fail(
            "helm not built: run scripts/build-k8s (or scripts/test), or point KVGATE_K8S_BIN "
            "at a directory holding it; KVGATE_ALLOW_SKIP_K8S=1 skips instead"
        )
    home = tmp_path_factory.mktemp("helm")
    env = {
        **os.environ,
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
        "KUBECONFIG": str(home / "no-kubeconfig"),
    }

    def one(args: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(binary), *args], capture_output=True, text=True, env=env, timeout=60
        )

    def run(*argvs: list[str]) -> list[subprocess.CompletedProcess[str]]:
        with ThreadPoolExecutor(max_workers=8) as pool:
            return list(pool.map(one, argvs))

    return run


def _template_args(*extra: str) -> list[str]:
    return [
        "template",
        RELEASE,
        str(CHART),
        "--namespace",
        NAMESPACE,
        "--kube-version",
        KUBE_VERSION,
        *extra,
    ]


def _values(scenario: str) -> list[str]:
    return ["--values", str(CHART / "ci" / f"{scenario}-values.yaml")]


@pytest.fixture(scope="module")
def rendered(helm: Helm) -> dict[str, str]:
    """Each scenario's ``helm template`` output."""
    results = helm(*(_template_args(*_values(s)) for s in SCENARIOS))
    out = {}
    for s, r in zip(SCENARIOS, results, strict=True):
        assert r.returncode == 0, f"helm template ({s}) failed:\n{r.stderr}"
        out[s] = r.stdout
    return out


@pytest.fixture(scope="module")
def docs(rendered: dict[str, str]) -> dict[str, Docs]:
    return {s: [d for d in yaml.safe_load_all(text) if d] for s, text in rendered.items()}


def _one(docs: Docs, kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
    return found[0]


def _kinds(docs: Docs) -> set[str]:
    return {f"{d['kind']}/{d['metadata']['name']}" for d in docs}


# ----------------------------------------------------------------------------------------------
# Lint and golden files


#: ``--strict`` (warnings fail too) for every scenario; plain lint once, for the defaults.
LINTS = [("default", False), *((s, True) for s in SCENARIOS)]


@pytest.fixture(scope="module")
def lint(helm: Helm) -> Lints:
    argvs = [
        [
            "lint",
            str(CHART),
            "--namespace",
            NAMESPACE,
            "--kube-version",
            KUBE_VERSION,
            *(["--strict"] if strict else []),
            *_values(s),
        ]
        for s, strict in LINTS
    ]
    return dict(zip(LINTS, helm(*argvs), strict=True))


@pytest.mark.parametrize(
    ("scenario", "strict"), LINTS, ids=[f"{s}-{'strict' if t else 'lint'}" for s, t in LINTS]
)
def test_lint(lint: Lints, scenario: str, strict: bool) -> None:
    r = lint[(scenario, strict)]
    assert r.returncode == 0, f"helm lint failed:\n{r.stdout}\n{r.stderr}"
    assert "[ERROR]" not in r.stdout and "[WARNING]" not in r.stdout, r.stdout


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_golden(rendered: dict[str, str], scenario: str) -> None:
    golden = GOLDEN / f"{scenario}.yaml"
    got = rendered[scenario]
    want = golden.read_text() if golden.exists() else None
    if got == want:
        return
    if os.environ.get("KVGATE_UPDATE_GOLDEN") == "1":
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(got)
        pytest.fail(f"{golden.relative_to(REPO)} rewritten: review and commit it")
    if want is None:
        pytest.fail(f"{golden.relative_to(REPO)} missing: run with KVGATE_UPDATE_GOLDEN=1")
    diff = "".join(
        difflib.unified_diff(
            want.splitlines(keepends=True),
            got.splitlines(keepends=True),
            str(golden.relative_to(REPO)),
            "helm template",
        )
    )
    pytest.fail(
        f"rendered chart differs from its golden file (KVGATE_UPDATE_GOLDEN=1 rewrites it):\n"
        f"{diff[:6000]}"
    )


def test_render_is_deterministic(helm: Helm, rendered: dict[str, str]) -> None:
    """No randomness, no clock, no generated certificates: a second render is identical."""
    (again,) = helm(_template_args(*_values("monitoring")))
    assert again.stdout == rendered["monitoring"]


# ----------------------------------------------------------------------------------------------
# Values and schema

BAD_VALUES = {
    "unknown top-level key": ["--set", "nope=1"],
    "unknown nested key": ["--set", "agent.nope=1"],
    "unknown deeply nested key": ["--set", "webhook.certManager.nope=1"],
    "unknown resources key": ["--set", "operator.resources.request.cpu=1"],
    "bad failurePolicy": ["--set", "webhook.failurePolicy=Sometimes"],
    "timeoutSeconds above 5": ["--set", "webhook.timeoutSeconds=10"],
    "timeoutSeconds below 1": ["--set", "webhook.timeoutSeconds=0"],
    "port above 65535": ["--set", "agent.port=70000"],
    "port 0": ["--set", "webhook.port=0"],
    "sidecar port": ["--set", "injector.sidecarPort=65536"],
    "plain-http webhook url": ["--set", "webhook.url=http://127.0.0.1:9443/inject-sidecar"],
    "caBundle not base64": ["--set", "webhook.caBundle=not base64!"],
    "bad log level": ["--set", "injector.logLevel=verbose"],
    "fractional drainSeconds": ["--set-json", "injector.drainSeconds=1.5"],
    "token expiry below 10 minutes": ["--set", "injector.tokenExpirationSeconds=60"],
    "issuerRef without name": ["--set", "webhook.certManager.issuerRef.kind=ClusterIssuer"],
    "store url not redis": ["--set", "store.url=http://redis:6379"],
    "shareSync negative": [
        "--set",
        "store.url=redis://r:6379/0",
        "--set-json",
        "store.shareSync=-1",
    ],
    "shareSync 5 or more": [
        "--set",
        "store.url=redis://r:6379/0",
        "--set-json",
        "store.shareSync=5",
    ],
    "shareSync not a number": [
        "--set",
        "store.url=redis://r:6379/0",
        "--set",
        "store.shareSync=on",
    ],
    "keys file key a path": ["--set", "injector.apiKeysKey=../keys.yaml"],
    "jwks key empty": ["--set", "injector.jwksKey="],
    # Cross-field checks (templates/validate.yaml).
    "cert-manager with caBundle": [
        "--set",
        "webhook.certManager.enabled=true",
        "--set",
        "webhook.caBundle=Zm9v",
    ],
    "cert-manager with url": [
        "--set",
        "webhook.certManager.enabled=true",
        "--set",
        "webhook.url=https://127.0.0.1:9443/inject-sidecar",
    ],
    "shareSync without a store": ["--set-json", "store.shareSync=0.5"],
    # Chart.yaml's kubeVersion: the default values' own-node policy needs 1.30.
    "Kubernetes 1.29": ["--kube-version", "1.29.0"],
    "Kubernetes 1.29, own-node policy off": [
        "--kube-version",
        "1.29.0",
        "--set",
        "agent.ownNodePolicy.enabled=false",
    ],
}


@pytest.fixture(scope="module")
def bad_renders(helm: Helm) -> dict[str, subprocess.CompletedProcess[str]]:
    return dict(
        zip(BAD_VALUES, helm(*(_template_args(*a) for a in BAD_VALUES.values())), strict=True)
    )


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_bad_values_rejected(
    bad_renders: dict[str, subprocess.CompletedProcess[str]], case: str
) -> None:
    r = bad_renders[case]
    assert r.returncode != 0, f"{case}: helm template accepted {BAD_VALUES[case]}"
    whys = ("schema", "exclude each other", "needs store.url", "incompatible with Kubernetes v1.29")
    assert any(why in r.stderr for why in whys), r.stderr


def _schema() -> dict[str, Any]:
    schema: dict[str, Any] = json.loads((CHART / "values.schema.json").read_text())
    return schema


def _walk_schema(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for key, sub in (node.get("properties") or {}).items():
        yield from _walk_schema(sub, f"{path}.{key}" if path else key)
    items = node.get("items")
    if isinstance(items, dict):
        yield from _walk_schema(items, f"{path}[]")


#: Kubernetes API objects inside values (env valueFrom, affinity terms, NetworkPolicy peers):
#: open here, validated by the API server against the real types.
KUBERNETES_OBJECTS = {
    "valueFrom",
    "nodeAffinity",
    "podAffinity",
    "podAntiAffinity",
    "ipBlock",
    "namespaceSelector",
    "podSelector",
}


def test_schema_closed_at_every_level() -> None:
    """Every object the chart defines rejects unknown keys; free-form maps (labels, resource
    quantities) type their values instead."""
    for path, node in _walk_schema(_schema(), ""):
        if node.get("type") != "object":
            continue
        extra = node.get("additionalProperties")
        if "properties" in node:
            assert extra is False, f"{path or '<root>'}: additionalProperties must be false"
        elif path.rsplit(".", 1)[-1] not in KUBERNETES_OBJECTS:
            assert isinstance(extra, dict) and extra, f"{path}: free-form map without a type"


def _is_free_form(path: str) -> bool:
    """Maps whose keys are the user's or Kubernetes' (labels, resources, affinity, ...)."""
    return path.rsplit(".", 1)[-1] in {
        "labels",
        "annotations",
        "podAnnotations",
        "nodeSelector",
        "resources",
        "affinity",
        "issuerRef",
    }


def _value_keys(values: dict[str, Any], path: str = "") -> Iterator[str]:
    for k, v in values.items():
        p = f"{path}.{k}" if path else k
        yield p
        if isinstance(v, dict) and not _is_free_form(p):
            yield from _value_keys(v, p)


def _schema_keys(node: dict[str, Any], path: str = "") -> Iterator[str]:
    for k, sub in (node.get("properties") or {}).items():
        p = f"{path}.{k}" if path else k
        yield p
        if not _is_free_form(p):
            yield from _schema_keys(sub, p)


def _load_values() -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
    return values


def test_values_and_schema_have_the_same_keys() -> None:
    assert set(_value_keys(_load_values())) == set(_schema_keys(_schema()))


def test_every_value_documented() -> None:
    """helm-docs style: every key of values.yaml that holds a value (not a group of keys) has a
    ``# --`` comment right above it, which may span lines."""
    leaves = _leaves()
    lines = (CHART / "values.yaml").read_text().splitlines()
    documented = set()
    stack: list[tuple[int, str]] = []
    for n, line in enumerate(lines):
        m = re.match(r"^( *)([A-Za-z_][\w.-]*):", line)
        if not m:
            continue
        indent = len(m.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, m.group(2)))
        j = n - 1
        while j >= 0 and lines[j].lstrip().startswith("#") and "# -- " not in lines[j]:
            j -= 1
        if j >= 0 and lines[j].lstrip().startswith("# -- "):
            documented.add(".".join(k for _, k in stack))
    assert leaves - documented == set(), "keys without a '# -- ' comment"


def _leaves() -> set[str]:
    """The keys of values.yaml that hold a value, not a group of keys."""
    values = _load_values()
    return {
        p
        for p in _value_keys(values)
        if not isinstance(_lookup(values, p), dict) or _is_free_form(p)
    }


def test_chart_readme_lists_every_value() -> None:
    readme = (CHART / "README.md").read_text()
    assert {k for k in _leaves() if f"| `{k}` |" not in readme} == set()


def _lookup(values: dict[str, Any], path: str) -> Any:
    node: Any = values
    for part in path.split("."):
        node = node[part]
    return node


# ----------------------------------------------------------------------------------------------
# CRDs


def test_crds_are_byte_identical_to_the_repository_ones() -> None:
    src = {p.name: p.read_bytes() for p in (REPO / "crds").glob("*.yaml")}
    chart = {p.name: p.read_bytes() for p in (CHART / "crds").iterdir()}
    assert src, "no CRDs in crds/"
    assert sorted(chart) == sorted(src), "charts/kvgate/crds/ must hold exactly crds/*.yaml"
    for name, body in src.items():
        assert chart[name] == body, f"charts/kvgate/crds/{name} differs from crds/{name}: copy it"


# ----------------------------------------------------------------------------------------------
# RBAC


def _rules(docs: Docs) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for d in docs:
        if d["kind"] in ("Role", "ClusterRole"):
            for rule in d.get("rules") or []:
                yield d, rule


def _rule_set(role: dict[str, Any]) -> set[tuple[str, str, frozenset[str], tuple[str, ...]]]:
    return {
        (group, res, frozenset(r["verbs"]), tuple(r.get("resourceNames") or ()))
        for r in role["rules"]
        for group in r["apiGroups"]
        for res in r["resources"]
    }


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_rbac_has_no_wildcards(docs: dict[str, Docs], scenario: str) -> None:
    for role, rule in _rules(docs[scenario]):
        for field in ("apiGroups", "resources", "verbs", "resourceNames", "nonResourceURLs"):
            for v in rule.get(field) or []:
                assert "*" not in v, f"{role['kind']}/{role['metadata']['name']}: {field} {v!r}"


def test_every_rbac_rule_says_why() -> None:
    for path in (CHART / "templates").glob("*role.yaml"):
        lines = path.read_text().splitlines()
        for n, line in enumerate(lines):
            if line.strip().startswith("- apiGroups:"):
                assert lines[n - 1].strip().startswith("#"), f"{path.name}:{n + 1}: no comment"


def test_agent_role_is_exactly_its_three_rules(docs: dict[str, Docs]) -> None:
    role = _one(docs["default"], "ClusterRole", "kvgate-agent")
    assert _rule_set(role) == {
        ("kvgate.io", "nodeadmissions", frozenset({"get", "list", "watch"}), ()),
        ("kvgate.io", "nodeadmissions/status", frozenset({"get", "patch"}), ()),
        ("authentication.k8s.io", "tokenreviews", frozenset({"create"}), ()),
    }
    assert not [
        d for d in docs["default"] if d["kind"] == "Role" and "agent" in d["metadata"]["name"]
    ]


def test_operator_cluster_role(docs: dict[str, Docs]) -> None:
    rules = _rule_set(_one(docs["default"], "ClusterRole", "kvgate-operator"))
    read = frozenset({"get", "list", "watch"})
    assert rules == {
        ("kvgate.io", "ratelimitpolicies", read, ()),
        ("kvgate.io", "ratelimitpolicies/status", frozenset({"get", "patch", "update"}), ()),
        (
            "kvgate.io",
            "nodeadmissions",
            frozenset({"get", "list", "watch", "create", "patch", "update", "delete"}),
            (),
        ),
        ("", "pods", read, ()),
        ("", "nodes", read, ()),
        ("", "namespaces", read, ()),
        ("", "events", frozenset({"create", "patch"}), ()),
        ("events.k8s.io", "events", frozenset({"create", "patch"}), ()),
        ("admissionregistration.k8s.io", "mutatingwebhookconfigurations", read, ()),
        (
            "admissionregistration.k8s.io",
            "mutatingwebhookconfigurations",
            frozenset({"patch", "update"}),
            ("kvgate-sidecar-injector",),
        ),
        ("apiextensions.k8s.io", "customresourcedefinitions", read, ()),
    }


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_secrets_only_through_the_operators_namespaced_role(
    docs: dict[str, Docs], scenario: str
) -> None:
    for role, rule in _rules(docs[scenario]):
        if "secrets" not in rule["resources"]:
            continue
        assert rule["apiGroups"] == [""]
        assert (role["kind"], role["metadata"]["name"]) == ("Role", "kvgate-operator")
        assert role["metadata"]["namespace"] == NAMESPACE
        # create cannot be restricted by name; everything else is, to the one Secret.
        if rule["verbs"] != ["create"]:
            assert rule["resourceNames"] == ["kvgate-webhook-tls"], rule


def test_secrets_role_only_when_the_operator_makes_its_certificate(docs: dict[str, Docs]) -> None:
    assert "Role/kvgate-operator" in _kinds(docs["default"])
    assert "Role/kvgate-operator" not in _kinds(docs["cert-manager"])
    assert "RoleBinding/kvgate-operator" not in _kinds(docs["cert-manager"])


def test_agent_own_node_policy(docs: dict[str, Docs], helm: Helm) -> None:
    """The ValidatingAdmissionPolicy that keeps each agent to its own node's NodeAdmission: for
    the agent's service account only, on every write of a NodeAdmission and its status, bound
    with Deny; off with agent.ownNodePolicy.enabled=false. (Its effect is tested on the API
    server: tests/integration/test_security.py.)"""
    d = docs["default"]
    vap = _one(d, "ValidatingAdmissionPolicy", "kvgate-agent-own-node")["spec"]
    assert vap["failurePolicy"] == "Fail"
    (rule,) = vap["matchConstraints"]["resourceRules"]
    assert rule["apiGroups"] == ["kvgate.io"]
    assert set(rule["resources"]) == {"nodeadmissions", "nodeadmissions/status"}
    assert set(rule["operations"]) == {"CREATE", "UPDATE", "DELETE"}
    (cond,) = vap["matchConditions"]
    assert cond["expression"] == (
        "request.userInfo.username == 'system:serviceaccount:kvgate-system:kvgate-agent'"
    )
    (check,) = vap["validations"]
    assert "request.name" in check["expression"]
    binding = _one(d, "ValidatingAdmissionPolicyBinding", "kvgate-agent-own-node")["spec"]
    assert binding == {"policyName": "kvgate-agent-own-node", "validationActions": ["Deny"]}
    (r,) = helm(_template_args("--set", "agent.ownNodePolicy.enabled=false"))
    assert r.returncode == 0 and "ValidatingAdmissionPolicy" not in r.stdout, r.stderr


def test_bindings_point_at_the_service_accounts(docs: dict[str, Docs]) -> None:
    d = docs["default"]
    for kind, name in [
        ("ClusterRoleBinding", "kvgate-operator"),
        ("ClusterRoleBinding", "kvgate-agent"),
        ("RoleBinding", "kvgate-operator"),
    ]:
        b = _one(d, kind, name)
        assert b["roleRef"]["name"] == name
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": name, "namespace": NAMESPACE}]
        _one(d, "ServiceAccount", name)


# ----------------------------------------------------------------------------------------------
# The operator


def _operator(docs: Docs) -> dict[str, Any]:
    return _one(docs, "Deployment", "kvgate-operator")


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


def _restricted_violations(pod: dict[str, Any]) -> set[str]:
    """What Pod Security "restricted" (which includes "baseline") would refuse in a pod spec,
    as field names; the checks of k8s.io/pod-security-admission/policy at v1.36."""
    bad: set[str] = set()
    psc = pod.get("securityContext") or {}
    bad |= {h for h in ("hostNetwork", "hostPID", "hostIPC") if pod.get(h)}
    if psc.get("runAsUser") == 0:
        bad.add("runAsUser")
    if psc.get("sysctls"):
        bad.add("sysctls")
    for v in pod.get("volumes") or []:
        if not set(v) - {"name"} <= RESTRICTED_VOLUMES:
            bad.add("volumes")
    for c in pod["containers"] + (pod.get("initContainers") or []):
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            bad.add("privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.add("allowPrivilegeEscalation")
        if (sc.get("runAsNonRoot", psc.get("runAsNonRoot"))) is not True:
            bad.add("runAsNonRoot")
        if sc.get("runAsUser") == 0:
            bad.add("runAsUser")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            bad.add("capabilities.drop")
        if not set(caps.get("add") or []) <= {"NET_BIND_SERVICE"}:
            bad.add("capabilities.add")
        seccomp = sc.get("seccompProfile") or psc.get("seccompProfile") or {}
        if seccomp.get("type") not in ("RuntimeDefault", "Localhost"):
            bad.add("seccompProfile")
        if sc.get("procMount") not in (None, "Default"):
            bad.add("procMount")
        if any(p.get("hostPort") for p in c.get("ports") or []):
            bad.add("hostPort")
    return bad


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_pod_security(docs: dict[str, Docs], scenario: str) -> None:
    """The operator meets "restricted" (and runs with a read-only root filesystem); the agent
    too, but for its two documented exceptions, which need the "privileged" level."""
    op = _operator(docs[scenario])["spec"]["template"]["spec"]
    assert _restricted_violations(op) == set()
    assert op["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    agent = _one(docs[scenario], "DaemonSet", "kvgate-agent")["spec"]["template"]["spec"]
    assert _restricted_violations(agent) == {"hostPID", "hostPort"}
    assert agent["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True


def test_pod_security_check_catches_violations() -> None:
    ok = {
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [
            {
                "name": "c",
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "capabilities": {"drop": ["ALL"]},
                },
            }
        ],
    }
    assert _restricted_violations(ok) == set()
    bad = yaml.safe_load(yaml.safe_dump(ok))
    bad["hostNetwork"] = True
    bad["volumes"] = [{"name": "h", "hostPath": {"path": "/"}}]
    sc = bad["containers"][0]["securityContext"]
    sc.update(privileged=True, runAsNonRoot=False, capabilities={"add": ["SYS_ADMIN"]})
    del sc["allowPrivilegeEscalation"]
    sc["seccompProfile"] = {"type": "Unconfined"}
    assert _restricted_violations(bad) == {
        "hostNetwork",
        "volumes",
        "privileged",
        "allowPrivilegeEscalation",
        "runAsNonRoot",
        "capabilities.drop",
        "capabilities.add",
        "seccompProfile",
    }


def test_operator_replicas_roll_with_a_disruption_budget(docs: dict[str, Docs], helm: Helm) -> None:
    """Two replicas (one leader writes; leader election), a rolling update that starts the new
    pod first, spread over nodes, and a PodDisruptionBudget keeping one; with one replica, no
    budget (it would block every drain)."""
    d = docs["default"]
    spec = _operator(d)["spec"]
    assert spec["replicas"] == 2
    assert spec["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    anti = spec["template"]["spec"]["affinity"]["podAntiAffinity"]
    term = anti["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["labelSelector"]["matchLabels"] == spec["selector"]["matchLabels"]
    pdb = _one(d, "PodDisruptionBudget", "kvgate-operator")
    assert pdb["spec"] == {"minAvailable": 1, "selector": spec["selector"]}
    (r,) = helm(_template_args(*_values("default"), "--set", "operator.replicas=1"))
    assert r.returncode == 0, r.stderr
    one = [x for x in yaml.safe_load_all(r.stdout) if x]
    assert "PodDisruptionBudget/kvgate-operator" not in _kinds(one)
    assert "affinity" not in _operator(one)["spec"]["template"]["spec"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_leader_election_role_is_the_one_lease(docs: dict[str, Docs], scenario: str) -> None:
    role = _one(docs[scenario], "Role", "kvgate-operator-leader-election")
    assert role["metadata"]["namespace"] == NAMESPACE
    assert _rule_set(role) == {
        ("coordination.k8s.io", "leases", frozenset({"get", "update"}), ("kvgate-operator",)),
        ("coordination.k8s.io", "leases", frozenset({"create"}), ()),
    }
    b = _one(docs[scenario], "RoleBinding", "kvgate-operator-leader-election")
    assert b["roleRef"]["name"] == "kvgate-operator-leader-election"
    assert b["subjects"] == [
        {"kind": "ServiceAccount", "name": "kvgate-operator", "namespace": NAMESPACE}
    ]
    env = _env(_operator(docs[scenario])["spec"]["template"]["spec"]["containers"][0])
    assert env["KVGATE_OPERATOR_LEADER_ELECTION_LEASE_NAME"] == "kvgate-operator"


def test_operator_container(docs: dict[str, Docs]) -> None:
    c = _operator(docs["default"])["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] == "ghcr.io/kvgate/kvgate-operator:0.1.0"
    assert c["command"] == ["kvgate-operator"]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": 8080, "webhook": 9443}
    c = _operator(docs["local-operator"])["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] == "localhost/kvgate-operator:dev"


#: The chart's bounds towards the API server (values ``operator.apiServer``, ``agent.apiServer``).
API_SERVER_OPERATOR_ENV = {
    "KVGATE_OPERATOR_WATCH_SERVER_TIMEOUT": "20",
    "KVGATE_OPERATOR_WATCH_CLIENT_TIMEOUT": "30",
    "KVGATE_OPERATOR_CONNECT_TIMEOUT": "10",
    "KVGATE_OPERATOR_REQUEST_TIMEOUT": "30",
    "KVGATE_OPERATOR_LIVENESS_STALE_SECONDS": "900",
}
API_SERVER_AGENT_ENV = {
    "KVGATE_WATCH_SERVER_TIMEOUT": "20",
    "KVGATE_WATCH_READ_TIMEOUT": "30",
    "KVGATE_API_LIVENESS_SECONDS": "120",
}


def test_api_server_bounds_in_the_chart_are_the_code_defaults() -> None:
    """The chart renders the code's defaults (what the partition test runs with), so neither
    can drift from the other."""
    import argparse

    from kvgate_agent.node.cli import add_node_parser
    from kvgate_operator.settings import OperatorSettings

    s = OperatorSettings()
    assert {k: float(v) for k, v in API_SERVER_OPERATOR_ENV.items()} == {
        "KVGATE_OPERATOR_WATCH_SERVER_TIMEOUT": s.watch_server_timeout,
        "KVGATE_OPERATOR_WATCH_CLIENT_TIMEOUT": s.watch_client_timeout,
        "KVGATE_OPERATOR_CONNECT_TIMEOUT": s.connect_timeout,
        "KVGATE_OPERATOR_REQUEST_TIMEOUT": s.request_timeout,
        "KVGATE_OPERATOR_LIVENESS_STALE_SECONDS": s.liveness_stale_seconds,
    }
    parser = argparse.ArgumentParser()
    add_node_parser(parser.add_subparsers(dest="role"))
    args = parser.parse_args(["node", "--node-name", "n"])
    assert {k: float(v) for k, v in API_SERVER_AGENT_ENV.items()} == {
        "KVGATE_WATCH_SERVER_TIMEOUT": args.watch_server_timeout,
        "KVGATE_WATCH_READ_TIMEOUT": args.watch_read_timeout,
        "KVGATE_API_LIVENESS_SECONDS": args.api_liveness_seconds,
    }


def test_operator_env_self_signed(docs: dict[str, Docs]) -> None:
    pod = _operator(docs["default"])["spec"]["template"]["spec"]
    env = _env(pod["containers"][0])
    assert env == {
        "KVGATE_OPERATOR_POD_NAMESPACE": {"fieldRef": {"fieldPath": "metadata.namespace"}},
        "KVGATE_OPERATOR_POD_NAME": {"fieldRef": {"fieldPath": "metadata.name"}},
        "KVGATE_OPERATOR_LEADER_ELECTION_LEASE_NAME": "kvgate-operator",
        "KVGATE_OPERATOR_LEADER_ELECTION_LEASE_DURATION": "15",
        "KVGATE_OPERATOR_LEADER_ELECTION_RENEW_DEADLINE": "10",
        "KVGATE_OPERATOR_LEADER_ELECTION_RETRY_PERIOD": "2",
        "KVGATE_OPERATOR_LIVENESS_PORT": "8080",
        "KVGATE_OPERATOR_WEBHOOK_PORT": "9443",
        "KVGATE_OPERATOR_WEBHOOK_HOST": "kvgate-webhook.kvgate-system.svc",
        "KVGATE_OPERATOR_WEBHOOK_CONFIG_NAME": "kvgate-sidecar-injector",
        "KVGATE_OPERATOR_WEBHOOK_SELF_SIGNED": "true",
        "KVGATE_OPERATOR_WEBHOOK_SECRET_NAME": "kvgate-webhook-tls",
        "KVGATE_OPERATOR_INJECTION": env["KVGATE_OPERATOR_INJECTION"],
        **API_SERVER_OPERATOR_ENV,
    }
    assert not [v for v in pod["volumes"] if "secret" in v]


def test_operator_env_cert_manager(docs: dict[str, Docs]) -> None:
    pod = _operator(docs["cert-manager"])["spec"]["template"]["spec"]
    c = pod["containers"][0]
    env = _env(c)
    assert env["KVGATE_OPERATOR_WEBHOOK_SELF_SIGNED"] == "false"
    assert env["KVGATE_OPERATOR_WEBHOOK_CERT_DIR"] == "/tls"
    assert "KVGATE_OPERATOR_WEBHOOK_SECRET_NAME" not in env
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/tls")
    vol = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert vol["secret"]["secretName"] == "kvgate-webhook-tls"
    assert mount["readOnly"] is True


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_operator_settings_read_the_environment(
    docs: dict[str, Docs], scenario: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every KVGATE_OPERATOR_* variable the chart sets is an OperatorSettings field (pydantic
    settings ignores unknown ones silently), and the operator accepts the values."""
    env = _env(_operator(docs[scenario])["spec"]["template"]["spec"]["containers"][0])
    assert set(env) <= {f"KVGATE_OPERATOR_{f.upper()}" for f in OperatorSettings.model_fields}
    for k in [k for k in os.environ if k.startswith("KVGATE_OPERATOR_")]:
        monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, NAMESPACE if isinstance(v, dict) else v)  # fieldRef: namespace
    s = OperatorSettings()
    assert s.pod_namespace == NAMESPACE
    assert s.webhook_hosts == ["kvgate-webhook.kvgate-system.svc"]
    assert s.webhook_config_name == "kvgate-sidecar-injector"
    assert s.webhook_self_signed is (scenario != "cert-manager")
    assert s.webhook_cert_dir == (Path("/tls") if scenario == "cert-manager" else None)
    assert s.injection.own_namespace == NAMESPACE


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_injection_settings(docs: dict[str, Docs], scenario: str) -> None:
    env = _env(_operator(docs[scenario])["spec"]["template"]["spec"]["containers"][0])
    inj = json.loads(env["KVGATE_OPERATOR_INJECTION"])
    assert set(inj) - {"store"} == INJECTION_KEYS
    assert ("store" in inj) is (scenario == "plain-container")  # only with store.url set
    ds = [d for d in docs[scenario] if d["kind"] == "DaemonSet"]
    agent = ds[0]["spec"]["template"]["spec"]["containers"][0]
    assert inj["sidecarImage"] == agent["image"]
    assert inj["agentPort"] == agent["ports"][0]["hostPort"]
    assert inj["tokenAudience"] == "kvgate-agent"
    assert inj["ownNamespace"] == NAMESPACE
    assert SYSTEM_NAMESPACES | {NAMESPACE} <= set(inj["excludedNamespaces"])
    assert inj["nativeSidecar"] is (scenario != "plain-container")
    assert isinstance(inj["sidecarPort"], int) and isinstance(inj["tokenExpirationSeconds"], int)
    assert inj["adminPort"] == 9471 != inj["sidecarPort"]
    assert set(inj["resources"]) <= {"requests", "limits"}
    # The operator's own model of these settings accepts them as rendered.
    cfg = InjectionConfig.model_validate(inj)
    assert cfg.own_namespace == NAMESPACE and cfg.agent_port == inj["agentPort"]
    # The keys file's Secret only where the values name one; an empty name is none.
    files = [f.variable for f in cfg.identity_files()]
    assert files == (["KVGATE_API_KEYS_FILE"] if scenario == "plain-container" else [])
    # The share exchange's period beside the store's URL (the scenario sets store.shareSync).
    if scenario == "plain-container":
        assert cfg.store is not None and cfg.store.share_sync == inj["store"]["shareSync"] == 0.5


def test_injection_tracks_values(helm: Helm) -> None:
    (r,) = helm(
        _template_args(
            "--show-only",
            "templates/operator-deployment.yaml",
            "--set",
            "agent.image.repository=reg/agent,agent.image.tag=t1,agent.port=9999",
            "--set",
            "injector.sidecarPort=8001,injector.adminPort=9090,injector.logLevel=DEBUG",
            "--set",
            "injector.drainSeconds=12,injector.headerTimeoutSeconds=5,"
            "injector.bodyTimeoutSeconds=0,injector.upstreamTimeoutSeconds=120",
            "--set",
            "injector.excludedNamespaces={monitoring,kube-system}",
            "--set",
            "injector.passthroughPaths={/v1/embeddings,/admin/*}",
            "--set",
            "injector.apiKeysSecret=keys,injector.jwksSecret=idp,injector.jwksKey=idp.json",
            "--set",
            "injector.eppEngineType=kvgate",
        )
    )
    assert r.returncode == 0, r.stderr
    (dep,) = [d for d in yaml.safe_load_all(r.stdout) if d]
    inj = json.loads(
        _env(dep["spec"]["template"]["spec"]["containers"][0])["KVGATE_OPERATOR_INJECTION"]
    )
    assert inj["sidecarImage"] == "reg/agent:t1"
    assert (inj["agentPort"], inj["sidecarPort"], inj["adminPort"]) == (9999, 8001, 9090)
    assert (inj["drainSeconds"], inj["logLevel"]) == (12, "DEBUG")
    timeouts = ("headerTimeoutSeconds", "bodyTimeoutSeconds", "upstreamTimeoutSeconds")
    assert tuple(inj[k] for k in timeouts) == (5, 0, 120)
    assert inj["excludedNamespaces"] == sorted(SYSTEM_NAMESPACES | {NAMESPACE, "monitoring"})
    assert inj["passthroughPaths"] == ["/v1/embeddings", "/admin/*"]
    assert (inj["apiKeysSecret"], inj["apiKeysKey"]) == ("keys", "keys.yaml")
    assert (inj["jwksSecret"], inj["jwksKey"]) == ("idp", "idp.json")
    assert InjectionConfig.model_validate(inj).epp_engine_type == "kvgate"


def test_share_sync_tracks_values_beside_the_store(helm: Helm) -> None:
    """``store.shareSync`` reaches the injection settings (and so the sidecar's
    KVGATE_SHARE_SYNC) only when on, beside ``store.url``; without a store it is refused by
    name."""
    show = ("--show-only", "templates/operator-deployment.yaml", "--set", "store.url=redis://r/0")
    on, off, integral, alone = helm(
        _template_args(*show, "--set-json", "store.shareSync=0.5"),
        _template_args(*show),
        _template_args(*show, "--set", "store.shareSync=2"),
        _template_args("--set-json", "store.shareSync=0.5"),
    )

    def store(r: subprocess.CompletedProcess[str]) -> dict[str, Any]:
        assert r.returncode == 0, r.stderr
        (dep,) = [d for d in yaml.safe_load_all(r.stdout) if d]
        env = _env(dep["spec"]["template"]["spec"]["containers"][0])
        inj = InjectionConfig.model_validate(json.loads(env["KVGATE_OPERATOR_INJECTION"]))
        assert inj.store is not None
        return {e["name"]: e.get("value") for e in store_env(inj.store)}

    assert store(on)["KVGATE_SHARE_SYNC"] == "0.5"
    assert store(integral)["KVGATE_SHARE_SYNC"] == "2"
    assert "KVGATE_SHARE_SYNC" not in store(off)  # the default: off, the sidecar's own default
    assert alone.returncode != 0
    assert "store.shareSync needs store.url" in alone.stderr, alone.stderr


# ----------------------------------------------------------------------------------------------
# The webhook


def _webhooks(docs: Docs) -> dict[str, dict[str, Any]]:
    cfg = _one(docs, "MutatingWebhookConfiguration", "kvgate-sidecar-injector")
    return {w["name"]: w for w in cfg["webhooks"]}


def _expr(selector: dict[str, Any]) -> dict[str, tuple[str, list[str]]]:
    assert set(selector) == {"matchExpressions"}
    return {e["key"]: (e["operator"], e["values"]) for e in selector["matchExpressions"]}


def test_webhook_selectors(docs: dict[str, Docs]) -> None:
    hooks = _webhooks(docs["default"])
    assert set(hooks) == {"ns.inject.kvgate.io", "pod.inject.kvgate.io"}
    excluded = ("NotIn", sorted(SYSTEM_NAMESPACES | {NAMESPACE}))
    ns, pod = hooks["ns.inject.kvgate.io"], hooks["pod.inject.kvgate.io"]
    assert _expr(ns["namespaceSelector"]) == {
        "kvgate.io/inject": ("In", ["true"]),
        "kubernetes.io/metadata.name": excluded,
    }
    assert _expr(ns["objectSelector"]) == {"kvgate.io/inject": ("NotIn", ["false"])}
    # Disjoint from the namespace webhook: a pod is never sent twice.
    assert _expr(pod["namespaceSelector"]) == {
        "kvgate.io/inject": ("NotIn", ["true"]),
        "kubernetes.io/metadata.name": excluded,
    }
    assert _expr(pod["objectSelector"]) == {"kvgate.io/inject": ("In", ["true"])}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_webhook_common_fields(docs: dict[str, Docs], scenario: str) -> None:
    plain = scenario == "plain-container"
    for w in _webhooks(docs[scenario]).values():
        assert w["rules"] == [
            {
                "operations": ["CREATE"],
                "apiGroups": [""],
                "apiVersions": ["v1"],
                "resources": ["pods"],
                "scope": "Namespaced",
            }
        ]
        assert w["sideEffects"] == "None"
        assert w["admissionReviewVersions"] == ["v1"]
        assert w["failurePolicy"] == ("Fail" if plain else "Ignore")
        assert w["timeoutSeconds"] == (3 if plain else 5)
        assert w["reinvocationPolicy"] == "IfNeeded"
        assert w["matchPolicy"] == "Equivalent"


def test_webhook_client_config(docs: dict[str, Docs]) -> None:
    for w in _webhooks(docs["default"]).values():
        assert w["clientConfig"] == {
            "service": {
                "name": "kvgate-webhook",
                "namespace": NAMESPACE,
                "path": "/inject-sidecar",
                "port": 443,
            }
        }
    local = yaml.safe_load((CHART / "ci" / "local-operator-values.yaml").read_text())["webhook"]
    for w in _webhooks(docs["local-operator"]).values():
        assert w["clientConfig"] == {"url": local["url"], "caBundle": local["caBundle"]}
    cfg = _one(docs["cert-manager"], "MutatingWebhookConfiguration", "kvgate-sidecar-injector")
    assert cfg["metadata"]["annotations"] == {
        "cert-manager.io/inject-ca-from": "kvgate-system/kvgate-webhook"
    }
    for w in cfg["webhooks"]:
        assert "caBundle" not in w["clientConfig"]


def test_webhook_service_targets_the_operator(docs: dict[str, Docs]) -> None:
    svc = _one(docs["default"], "Service", "kvgate-webhook")
    pod_labels = _operator(docs["default"])["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert svc["spec"]["ports"] == [
        {"name": "https", "port": 443, "targetPort": "webhook", "protocol": "TCP"}
    ]


def test_cert_manager_objects(docs: dict[str, Docs]) -> None:
    d = docs["cert-manager"]
    cert = _one(d, "Certificate", "kvgate-webhook")["spec"]
    assert cert["secretName"] == "kvgate-webhook-tls"
    assert cert["dnsNames"] == [
        "kvgate-webhook.kvgate-system.svc",
        "kvgate-webhook.kvgate-system.svc.cluster.local",
    ]
    assert cert["issuerRef"] == {
        "name": "kvgate-selfsigned",
        "kind": "Issuer",
        "group": "cert-manager.io",
    }
    assert _one(d, "Issuer", "kvgate-selfsigned")["spec"] == {"selfSigned": {}}
    assert not {"Certificate", "Issuer"} & {x["kind"] for x in docs["default"]}


# ----------------------------------------------------------------------------------------------
# The agent


def test_agent_daemonset(docs: dict[str, Docs]) -> None:
    ds = _one(docs["default"], "DaemonSet", "kvgate-agent")
    pod = ds["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert (c["command"], c["args"]) == (["kvgate-agent"], ["node"])
    assert c["image"] == "ghcr.io/kvgate/kvgate-agent:0.1.0"
    assert _env(c) == {
        "KVGATE_NODE_NAME": {"fieldRef": {"fieldPath": "spec.nodeName"}},
        "KVGATE_LISTEN": "0.0.0.0:9470",
        "KVGATE_GPU_BACKEND": "nvml",
        "KVGATE_LOG_LEVEL": "INFO",
        "NVIDIA_VISIBLE_DEVICES": "all",
        "NVIDIA_DRIVER_CAPABILITIES": "utility",
        **API_SERVER_AGENT_ENV,
    }
    assert c["ports"] == [
        {"name": "http", "containerPort": 9470, "hostPort": 9470, "protocol": "TCP"}
    ]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert pod["hostPID"] is True
    assert "hostNetwork" not in pod and "runtimeClassName" not in pod
    assert pod["serviceAccountName"] == "kvgate-agent"
    assert pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    term = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["nodeSelectorTerms"] == [
        {
            "matchExpressions": [
                {"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]}
            ]
        }
    ]
    # Its Pod Security exceptions are hostPID and the hostPort ("baseline"); nothing else.
    psc, sc = pod["securityContext"], c["securityContext"]
    assert psc["runAsNonRoot"] is True and psc["runAsUser"] == 65532
    assert psc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert sc["allowPrivilegeEscalation"] is False and not sc.get("privileged")
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["readOnlyRootFilesystem"] is True


def test_agent_values(docs: dict[str, Docs], helm: Helm) -> None:
    pod = _one(docs["local-operator"], "DaemonSet", "kvgate-agent")["spec"]["template"]["spec"]
    assert pod["runtimeClassName"] == "nvidia"
    assert _env(pod["containers"][0])["KVGATE_GPU_BACKEND"] == "fake:/var/run/kvgate/gpus.json"
    off, custom = helm(
        _template_args("--set", "agent.enabled=false"),
        _template_args(
            "--show-only",
            "templates/agent-daemonset.yaml",
            "--set",
            "agent.hostPID=false,agent.port=9000",
            "--set",
            "agent.affinity.nodeAffinity.x=1",
        ),
    )
    assert off.returncode == 0, off.stderr
    assert not [k for k in _kinds([d for d in yaml.safe_load_all(off.stdout) if d]) if "agent" in k]
    assert custom.returncode == 0, custom.stderr
    pod = yaml.safe_load(custom.stdout)["spec"]["template"]["spec"]
    assert pod["hostPID"] is False
    assert pod["affinity"] == {"nodeAffinity": {"x": 1}}
    assert pod["containers"][0]["ports"][0]["hostPort"] == 9000


# ----------------------------------------------------------------------------------------------
# Names and labels


def test_names_fit_63_characters(helm: Helm) -> None:
    (r,) = helm(_template_args(*_values("monitoring"), "--set", "fullnameOverride=" + "x" * 63))
    assert r.returncode == 0, r.stderr
    for d in (d for d in yaml.safe_load_all(r.stdout) if d):
        assert len(d["metadata"]["name"]) <= 63, d["metadata"]["name"]
        assert not d["metadata"]["name"].endswith("-")
        for v in d["metadata"]["labels"].values():
            assert len(v) <= 63


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_standard_labels(docs: dict[str, Docs], scenario: str) -> None:
    for d in docs[scenario]:
        labels = d["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "kvgate"
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/version"] == "0.1.0"
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["app.kubernetes.io/component"]
        if d["metadata"].get("namespace") is not None:
            assert d["metadata"]["namespace"] == NAMESPACE


# ----------------------------------------------------------------------------------------------
# Monitoring


def test_optional_objects_off_by_default(docs: dict[str, Docs]) -> None:
    kinds = {d["kind"] for d in docs["default"]}
    assert not kinds & {
        "ServiceMonitor",
        "PodMonitor",
        "PrometheusRule",
        "NetworkPolicy",
        "ConfigMap",
    }
    assert "Service/kvgate-agent" not in _kinds(docs["default"])


SIDECAR_APP = REPO / "agent" / "kvgate_agent" / "sidecar" / "app.py"


def test_monitoring_objects(docs: dict[str, Docs]) -> None:
    d = docs["monitoring"]
    for name, component in [("kvgate-operator", "operator"), ("kvgate-agent", "agent")]:
        sm = _one(d, "ServiceMonitor", name)
        assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        (ep,) = sm["spec"]["endpoints"]
        assert (ep["port"], ep["path"]) == ("http", "/metrics")
        # Exactly one Service matches the selector: the one exposing the metrics port.
        sel = sm["spec"]["selector"]["matchLabels"]
        services = [
            s
            for s in d
            if s["kind"] == "Service" and sel.items() <= s["metadata"]["labels"].items()
        ]
        assert len(services) == 1, [s["metadata"]["name"] for s in services]
        assert services[0]["spec"]["selector"]["app.kubernetes.io/component"] == component
    assert _one(d, "Service", "kvgate-agent")["spec"]["clusterIP"] == "None"
    # The sidecars: their admin port as the webhook names it, the path the admin listener
    # serves (the whole registry, every tenant's series included), every namespace.
    pm = _one(d, "PodMonitor", "kvgate-sidecars")["spec"]
    (ep,) = pm["podMetricsEndpoints"]
    assert ep["port"] == ADMIN_PORT_NAME and pm["namespaceSelector"] == {"any": True}
    admin_app = SIDECAR_APP.read_text().split("def admin_route", 1)[1].split("\n    def ", 1)
    assert f'"{ep["path"]}": _server_named(self.metrics_endpoint)' in admin_app[0]
    cm = _one(d, "ConfigMap", "kvgate-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["data"]["kvgate.json"] == (CHART / "dashboards" / "kvgate.json").read_text().rstrip(
        "\n"
    )


def test_network_policies(docs: dict[str, Docs]) -> None:
    d = docs["monitoring"]
    op = _one(d, "NetworkPolicy", "kvgate-operator")["spec"]
    assert op["policyTypes"] == ["Ingress"]
    webhook, metrics = op["ingress"]
    assert webhook == {
        "ports": [{"port": "webhook", "protocol": "TCP"}],
        "from": [{"ipBlock": {"cidr": "10.0.0.0/24"}}],
    }
    assert metrics["ports"] == [{"port": "http", "protocol": "TCP"}]
    assert metrics["from"][0]["namespaceSelector"]
    agent = _one(d, "NetworkPolicy", "kvgate-agent")["spec"]
    assert agent["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "agent"
    assert agent["policyTypes"] == ["Ingress"]
    (rule,) = agent["ingress"]
    assert rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    # The sidecars (the webhook's own selectors), the scrapers, the extra peers; nothing else.
    assert rule["from"] == [
        *_sidecar_peers(d),
        *metrics["from"],
        {"ipBlock": {"cidr": "192.168.0.0/16"}},
    ]


def _sidecar_peers(d: Docs) -> list[dict[str, Any]]:
    """The pods the webhook injects, as NetworkPolicy peers: each webhook's namespace and object
    selectors, less the namespace-name exclusion (a NetworkPolicy peer cannot exclude by name;
    the webhook never injects there, so no sidecar runs there)."""
    mwc = _one(d, "MutatingWebhookConfiguration", "kvgate-sidecar-injector")
    peers = []
    for w in mwc["webhooks"]:
        ns = [e for e in w["namespaceSelector"]["matchExpressions"] if e["key"] == LABEL]
        pod = w["objectSelector"]["matchExpressions"]
        assert len(ns) == 1 and [e["key"] for e in pod] == [LABEL]
        if ns[0]["operator"] == "In":  # the namespace opted in: every pod not opted out
            peers.append(
                {
                    "namespaceSelector": {"matchLabels": {LABEL: "true"}},
                    "podSelector": {"matchExpressions": pod},
                }
            )
        else:  # any namespace: pods opted in by their own label
            assert pod == [{"key": LABEL, "operator": "In", "values": ["true"]}]
            peers.insert(
                0, {"namespaceSelector": {}, "podSelector": {"matchLabels": {LABEL: "true"}}}
            )
    return peers


LABEL = "kvgate.io/inject"


def test_network_policies_without_scrapers(helm: Helm) -> None:
    """With networkPolicy.enabled and nothing else: the webhook port from anywhere (the API
    server's address is not known), no metrics rule, the agent's port from the sidecars only.
    No CNI runs in the tests, so nothing enforces these: the selectors are what is checked."""
    (r,) = helm(_template_args("--set", "networkPolicy.enabled=true"))
    assert r.returncode == 0, r.stderr
    d = [x for x in yaml.safe_load_all(r.stdout) if x]
    op = _one(d, "NetworkPolicy", "kvgate-operator")["spec"]
    assert op["ingress"] == [{"ports": [{"port": "webhook", "protocol": "TCP"}]}]
    (rule,) = _one(d, "NetworkPolicy", "kvgate-agent")["spec"]["ingress"]
    assert rule["from"] == _sidecar_peers(d) and len(rule["from"]) == 2
    assert all(peer["podSelector"] for peer in rule["from"])  # never a whole namespace


#: PromQL functions, keywords and Grafana's query helpers: not metric names.
PROMQL_WORDS = {
    "sum", "avg", "min", "max", "count", "rate", "irate", "increase", "histogram_quantile",
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
    "label_values", "absent", "clamp_min", "clamp_max", "topk", "bottomk", "offset", "bool",
}  # fmt: skip
#: Series Prometheus makes itself.
PROMETHEUS_SERIES = {"up"}


def _metric_names(expr: str) -> set[str]:
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # strings (label values, regexes)
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\$\{?\w+\}?", "", expr)  # Grafana variables
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    expr = re.sub(r"label_values\(\s*([\w:]+)\s*,[^)]*\)", r"\1", expr)
    words = set(re.findall(r"(?<![\w.])[A-Za-z_:][\w:]*", expr))
    return words - PROMQL_WORDS


def _code_metrics() -> set[str]:
    """Metric names the Python sources register (string literals), with the suffixes
    Prometheus clients add to counters and histograms."""
    names: set[str] = set()
    for root in ("agent", "operator"):
        for path in (REPO / root).rglob("*.py"):
            names |= set(re.findall(r"""["'](kvgate_[a-z0-9_]+)["']""", path.read_text()))
    return names | {n + s for n in names for s in ("_total", "_bucket", "_sum", "_count")}


def _dashboard_exprs(dash: dict[str, Any]) -> Iterator[str]:
    def panels(ps: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for p in ps:
            yield p
            yield from panels(p.get("panels") or [])

    for p in panels(dash["panels"]):
        for t in p.get("targets") or []:
            yield t["expr"]
    for v in dash["templating"]["list"]:
        q = v.get("query")
        if v["type"] == "query":
            yield q["query"] if isinstance(q, dict) else q


def test_dashboard_is_valid_and_queries_existing_metrics() -> None:
    dash = json.loads((CHART / "dashboards" / "kvgate.json").read_text())
    exprs = list(_dashboard_exprs(dash))
    assert len(exprs) >= 8
    known = _code_metrics() | PROMETHEUS_SERIES
    used: set[str] = set()
    for e in exprs:
        names = _metric_names(e)
        assert names, f"no metric in {e!r}"
        assert names <= known, f"{e!r}: unknown metrics {sorted(names - known)}"
        used |= names
    # The panels the chart promises.
    assert {
        "kvgate_admission_decisions_total",
        "kvgate_queue_wait_seconds_bucket",
        "kvgate_node_pod_kv_tokens",
        "kvgate_node_gpu_memory_bytes",
    } <= used
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_prometheus_rule_queries_existing_metrics(docs: dict[str, Docs]) -> None:
    rule = _one(docs["monitoring"], "PrometheusRule", "kvgate")
    known = _code_metrics() | PROMETHEUS_SERIES
    alerts = {}
    for group in rule["spec"]["groups"]:
        for r in group["rules"]:
            names = _metric_names(r["expr"])
            assert names and names <= known, f"{r['alert']}: unknown {sorted(names - known)}"
            assert r["labels"]["severity"] in ("warning", "critical")
            assert r["annotations"]["summary"] and r["annotations"]["description"]
            alerts[r["alert"]] = r
    assert set(alerts) == {
        "KvgateHighRejectionRatio",
        "KvgateThresholdsFallback",
        "KvgateAgentDown",
        "KvgateAgentGpuDataStale",
        "KvgateKvReservedNearCapacity",
        "KvgateWebhookMissedInjections",
    }
    assert alerts["KvgateHighRejectionRatio"]["for"] == "15m"
    assert alerts["KvgateKvReservedNearCapacity"]["for"] == "10m"
    # reserved / capacity differ only in their kind label: the division must ignore it.
    assert "ignoring (kind)" in alerts["KvgateKvReservedNearCapacity"]["expr"]
    assert 'up{job="kvgate-agent"}' in alerts["KvgateAgentDown"]["expr"]


def test_metric_name_extraction() -> None:
    assert _metric_names(
        'sum by (namespace, pod) (rate(kvgate_a_total{outcome="rejected"}[5m])) '
        "/ ignoring (kind) kvgate_b > 0.2"
    ) == {"kvgate_a_total", "kvgate_b"}
    assert _metric_names("label_values(kvgate_c, namespace)") == {"kvgate_c"}
    assert _metric_names(
        'histogram_quantile(0.5, sum by (le) (rate(x_bucket{a=~"$ns"}[$__rate_interval])))'
    ) == {"x_bucket"}
