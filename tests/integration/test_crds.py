"""The CRDs in crds/ against a real kube-apiserver (the session fixture ``kube``).

- Both CRDs are accepted (structural, CEL rules within the cost budget) and become Established.
- Invalid policies are refused by the API server with an error naming the field, one rule each:
  schema types, bounds, enums, required fields, unknown fields, and every CEL rule. Where the
  pydantic model has the same rule, the standalone sidecar refuses the same document too.
- Every example in examples/ is accepted, and what the API server stores (its defaults filled
  in) is exactly what the model makes of the example.
- ``kubectl explain`` shows the descriptions; the status subresources work; the printer columns
  and the ``kvgate`` category show in ``kubectl get``.
- NodeAdmission: the operator's thresholds are stored exactly as written (no defaults added, so
  its compare-then-write loop stays quiet); the agent's status round-trips.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvgate_agent.contract.api import API_VERSION
from kvgate_agent.contract.nodeadmission import (
    Condition,
    GpuStatus,
    NodeAdmissionSpec,
    NodeAdmissionStatus,
    PodAdmission,
    PodUsage,
    PolicyRef,
)
from kvgate_agent.contract.policy import PolicyError, load_policy, parse_policy
from kvgate_operator.desired import PolicyOutcome, resolve_thresholds

pytestmark = pytest.mark.k8s

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
DELETE = object()
TEST_LABEL = "kvgate.io/test=crds"


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def kv(kube: Any) -> Iterator[Any]:
    """The control plane with the repo's CRDs applied (server-side, as the operator tests and
    Helm do) and established. The NodeAdmissions made here are deleted afterwards, so tests of
    the operator that share the API server do not find them."""
    kube.apply_crds(REPO / "crds")
    yield kube
    kube.kubectl("delete", "nodeadmissions", "-l", TEST_LABEL, "--wait=false", check=False)


@pytest.fixture(scope="module")
def ns(kv: Any) -> Iterator[str]:
    """A namespace for this module's policies, emptied afterwards (namespaces never finish
    deleting on this API server: nothing runs the namespace controller)."""
    name = unique("crds")
    kv.kubectl("create", "namespace", name)
    yield name
    kv.kubectl("delete", "ratelimitpolicies", "--all", "-n", name, "--wait=false", check=False)


def policy(name: str, ns: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "RateLimitPolicy",
        "metadata": {"name": name, "namespace": ns},
        "spec": spec,
    }


def apply(kube: Any, doc: dict[str, Any], *flags: str) -> subprocess.CompletedProcess[str]:
    done: subprocess.CompletedProcess[str] = kube.kubectl(
        "apply", *flags, "-f", "-", input=yaml.safe_dump(doc), check=False
    )
    return done


def get(kube: Any, *args: str) -> Any:
    return json.loads(kube.kubectl("get", *args, "-o", "json").stdout)


def drop_empty_lists(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: drop_empty_lists(v) for k, v in value.items() if v != []}
    if isinstance(value, list):
        return [drop_empty_lists(v) for v in value]
    return value


def edited(spec: dict[str, Any], edits: dict[str, Any]) -> dict[str, Any]:
    """``spec`` with each dotted path (``a.b[0].c``) set to its value, or removed (DELETE)."""
    out = copy.deepcopy(spec)
    for path, value in edits.items():
        keys: list[str | int] = [
            int(k) if k.isdigit() else k for k in re.findall(r"[^.\[\]]+", path)
        ]
        node: Any = out
        for k in keys[:-1]:
            if isinstance(k, str) and k not in node:
                node[k] = {}
            node = node[k]
        last = keys[-1]
        if value is DELETE:
            del node[last]
        elif isinstance(node, list) and last == len(node):
            node.append(value)
        else:
            node[last] = value
    return out


#: Valid, and close to every rule below: each case changes one thing.
BASE: dict[str, Any] = {
    "selector": {"matchLabels": {"app": "llama"}},
    "model": {"numLayers": 32, "numKVHeads": 8, "headDim": 128, "maxModelLen": 8192},
    "tenants": {"defaultMaxTokens": 512, "maxTokensCap": 2048},
    "rateLimits": [
        {
            "name": "per-tenant",
            "requestsPerMinute": 600,
            "tokensPerMinute": 60000,
            "burstTokens": 8192,
        }
    ],
    "cost": {"perRequest": 16},
    "overload": {"actions": ["Queue", "Reject"]},
}


def bad(id: str, edits: dict[str, Any], field: str, words: str, standalone_too: bool = True) -> Any:
    """One invalid spec: ``edits`` to BASE, the field path the error must name, words it must
    contain, and whether the pydantic model (the standalone sidecar) refuses it too."""
    return pytest.param(edits, field, words, standalone_too, id=id)


INVALID = [
    # -- schema: types, bounds, enums, patterns, required, sizes
    bad(
        "layers-zero", {"model.numLayers": 0}, "spec.model.numLayers", "greater than or equal to 1"
    ),
    bad(
        "dtype-enum", {"model.kvCacheDtype": "int4"}, "spec.model.kvCacheDtype", "Unsupported value"
    ),
    bad(
        "block-size-max",
        {"model.blockSize": 8192},
        "spec.model.blockSize",
        "less than or equal to 4096",
    ),
    bad(
        "util-above-one",
        {"capacity.gpuMemoryUtilization": 1.5},
        "spec.capacity.gpuMemoryUtilization",
        "less than or equal to 1",
    ),
    bad(
        "util-zero",
        {"capacity.gpuMemoryUtilization": 0},
        "spec.capacity.gpuMemoryUtilization",
        "greater than 0",
    ),
    bad(
        "weights-negative",
        {"capacity.weightsBytes": -1},
        "spec.capacity.weightsBytes",
        "greater than or equal to 0",
    ),
    bad(
        "reservation-enum",
        {"capacity.reservation": "Foo"},
        "spec.capacity.reservation",
        "Unsupported value",
    ),
    bad(
        "reservation-quantile-max",
        {"capacity.reservationQuantile": 1.5},
        "spec.capacity.reservationQuantile",
        "less than or equal to 0.999",
    ),
    bad(
        "reservation-quantile-min",
        {"capacity.reservationQuantile": 0.25},
        "spec.capacity.reservationQuantile",
        "greater than or equal to 0.5",
    ),
    bad("ttft-zero", {"slo.ttftSeconds": 0}, "spec.slo.ttftSeconds", "greater than 0"),
    bad(
        "ttft-max", {"slo.ttftSeconds": 7200}, "spec.slo.ttftSeconds", "less than or equal to 3600"
    ),
    bad("tpot-zero", {"slo.tpotSeconds": 0}, "spec.slo.tpotSeconds", "greater than 0"),
    bad("tpot-max", {"slo.tpotSeconds": 11}, "spec.slo.tpotSeconds", "less than or equal to 10"),
    bad(
        "slo-min-priority-range",
        {"slo.minPriority": 1001},
        "spec.slo.minPriority",
        "less than or equal to 1000",
    ),
    bad(
        "max-requests-type",
        {"concurrency.maxRequests": "many"},
        "spec.concurrency.maxRequests",
        "integer",
    ),
    bad(
        "tenant-header-pattern",
        {"tenants.header": "x tenant"},
        "spec.tenants.header",
        "should match",
    ),
    bad(
        "default-max-tokens-zero",
        {"tenants.defaultMaxTokens": 0},
        "spec.tenants.defaultMaxTokens",
        "greater than or equal to 1",
    ),
    bad(
        "limit-name-pattern",
        {"rateLimits[0].name": "Per_Tenant"},
        "spec.rateLimits[0].name",
        "should match",
    ),
    bad(
        "limit-name-missing",
        {"rateLimits[0].name": DELETE},
        "spec.rateLimits[0].name",
        "Required value",
    ),
    bad(
        "limit-scope-enum",
        {"rateLimits[0].per": "Namespace"},
        "spec.rateLimits[0].per",
        "Unsupported value",
    ),
    bad(
        "rate-zero",
        {"rateLimits[0].tokensPerMinute": 0},
        "spec.rateLimits[0].tokensPerMinute",
        "greater than 0",
    ),
    bad(
        "warmup-negative",
        {"rateLimits[0].warmupSeconds": -1},
        "spec.rateLimits[0].warmupSeconds",
        "greater than or equal to 0",
    ),
    bad(
        "too-many-limits",
        {"rateLimits": [{"name": f"l{i}", "requestsPerMinute": 1} for i in range(17)]},
        "spec.rateLimits",
        "Too many",
    ),
    bad(
        "weight-negative",
        {"cost.promptTokenWeight": -0.5},
        "spec.cost.promptTokenWeight",
        "greater than or equal to 0",
    ),
    bad(
        "queue-wait-max",
        {"queue.maxWaitSeconds": 7200},
        "spec.queue.maxWaitSeconds",
        "less than or equal to 3600",
    ),
    bad("queue-order-enum", {"queue.order": "LIFO"}, "spec.queue.order", "Unsupported value"),
    bad(
        "priority-header-empty",
        {"priority.header": ""},
        "spec.priority.header",
        "at least 1 chars long",
    ),
    bad(
        "priority-forward-to-enum",
        {"priority.forwardTo": "vllm"},
        "spec.priority.forwardTo",
        "Unsupported value",
    ),
    bad(
        "priority-trusted-type",
        {"priority.trusted": "yes"},
        "spec.priority.trusted",
        "boolean",
        standalone_too=False,  # pydantic reads "yes" as true
    ),
    # -- tenant classes
    bad(
        "class-names-unique",
        {"tenants.classes": [{"name": "a"}, {"name": "b"}, {"name": "a"}]},
        "spec.tenants.classes[2]",
        "Duplicate value",
    ),
    bad(
        "class-tenant-in-two-classes",
        {
            "tenants.classes": [
                {"name": "a", "match": {"tenants": ["alice", "bob"]}},
                {"name": "b", "match": {"tenants": ["bob"]}},
            ]
        },
        "spec.tenants.classes",
        "a tenant name may be claimed by one class only",
    ),
    bad(
        "class-prefix-in-two-classes",
        {
            "tenants.classes": [
                {"name": "a", "match": {"prefixes": ["t-"]}},
                {"name": "b", "match": {"prefixes": ["u-", "t-"]}},
            ]
        },
        "spec.tenants.classes",
        "a tenant-name prefix may be claimed by one class only",
    ),
    bad(
        "class-tenant-twice-in-one",
        {"tenants.classes": [{"name": "a", "match": {"tenants": ["x", "x"]}}]},
        "spec.tenants.classes[0].match.tenants[1]",
        "Duplicate value",
    ),
    bad(
        "class-weight-zero",
        {"tenants.classes": [{"name": "a", "weight": 0}]},
        "spec.tenants.classes[0].weight",
        "greater than 0",
    ),
    bad(
        "class-weight-max",
        {"tenants.classes": [{"name": "a", "weight": 1001}]},
        "spec.tenants.classes[0].weight",
        "less than or equal to 1000",
    ),
    bad(
        "class-priority-range",
        {"tenants.classes": [{"name": "a", "priority": -1001}]},
        "spec.tenants.classes[0].priority",
        "greater than or equal to -1000",
    ),
    bad(
        "class-name-pattern",
        {"tenants.classes": [{"name": "Interactive"}]},
        "spec.tenants.classes[0].name",
        "should match",
    ),
    bad(
        "class-name-missing",
        {"tenants.classes": [{"weight": 2}]},
        "spec.tenants.classes[0].name",
        "Required value",
    ),
    bad(
        "class-batch-and-slo",
        {"tenants.classes": [{"name": "a", "batch": True, "slo": {"ttftSeconds": 1}}]},
        "spec.tenants.classes[0].slo",
        "a class is batch (no latency SLO) or has an slo, not both",
    ),
    bad(
        "class-ttft-zero",
        {"tenants.classes": [{"name": "a", "slo": {"ttftSeconds": 0}}]},
        "spec.tenants.classes[0].slo.ttftSeconds",
        "greater than 0",
    ),
    bad(
        "class-tenant-whitespace",
        {"tenants.classes": [{"name": "a", "match": {"tenants": ["x "]}}]},
        "spec.tenants.classes[0].match.tenants[0]",
        "should match",
    ),
    bad(
        "class-too-many-tenants",
        {"tenants.classes": [{"name": "a", "match": {"tenants": [f"t{i}" for i in range(33)]}}]},
        "spec.tenants.classes[0].match.tenants",
        "Too many",
    ),
    bad(
        "too-many-classes",
        {"tenants.classes": [{"name": f"c{i}"} for i in range(17)]},
        "spec.tenants.classes",
        "Too many",
    ),
    bad(
        "default-class-undeclared",
        {"tenants.classes": [{"name": "a"}], "tenants.defaultClass": "b"},
        "spec.tenants.defaultClass",
        "defaultClass must name a class in classes",
    ),
    bad("actions-empty", {"overload.actions": []}, "spec.overload.actions", "at least 1 items"),
    bad(
        "action-enum",
        {"overload.actions": ["Retry"]},
        "spec.overload.actions[0]",
        "Unsupported value",
    ),
    bad("failure-mode-enum", {"failureMode": "FailSafe"}, "spec.failureMode", "Unsupported value"),
    bad(
        "selector-operator-enum",
        {"selector.matchExpressions": [{"key": "a", "operator": "Has"}]},
        "spec.selector.matchExpressions[0].operator",
        "Unsupported value",
    ),
    bad("unknown-field", {"tenants.maxTokenCap": 100}, "spec.tenants.maxTokenCap", "unknown field"),
    # selector is optional for the standalone sidecar, required in a cluster
    bad(
        "selector-missing",
        {"selector": DELETE},
        "spec.selector",
        "Required value",
        standalone_too=False,
    ),
    # -- CEL rules
    bad(
        "limit-without-rate",
        {
            "rateLimits[0].requestsPerMinute": DELETE,
            "rateLimits[0].tokensPerMinute": DELETE,
            "rateLimits[0].burstTokens": DELETE,
        },
        "spec.rateLimits[0]",
        "a rate limit needs requestsPerMinute or tokensPerMinute",
    ),
    bad(
        "burst-requests-without-rate",
        {"rateLimits[0].requestsPerMinute": DELETE, "rateLimits[0].burstRequests": 10},
        "spec.rateLimits[0].burstRequests",
        "burstRequests needs requestsPerMinute",
    ),
    bad(
        "burst-tokens-without-rate",
        {"rateLimits[0].tokensPerMinute": DELETE},
        "spec.rateLimits[0].burstTokens",
        "burstTokens needs tokensPerMinute",
    ),
    bad(
        "shared-per-pod",
        {"rateLimits[0].per": "Pod", "rateLimits[0].shared": True},
        "spec.rateLimits[0].shared",
        "shared needs per",
    ),
    bad(
        "limit-names-repeat",
        {"rateLimits[1]": {"name": "per-tenant", "requestsPerMinute": 1}},
        "spec.rateLimits",
        "rateLimits names must be unique",
    ),
    bad(
        "actions-repeat",
        {"overload.actions": ["Queue", "Reject", "Queue"]},
        "spec.overload.actions",
        "actions must not repeat",
    ),
    bad(
        "degrade-without-how",
        {"overload.actions": ["Degrade", "Reject"]},
        "spec.overload.degrade",
        "Degrade needs degrade.minMaxTokens, degrade.fallbackModel or degrade.fallback",
    ),
    bad(
        "degrade-empty",
        {"overload.actions": ["Degrade"], "overload.degrade": {}},
        "spec.overload.degrade",
        "Degrade needs degrade.minMaxTokens, degrade.fallbackModel or degrade.fallback",
    ),
    bad(
        "fallback-pool-upstream-with-path",
        {
            "overload.actions": ["Degrade"],
            "overload.degrade": {"fallback": {"model": "small", "upstream": "http://small/v1"}},
        },
        "spec.overload.degrade.fallback.upstream",
        "should match",
    ),
    bad(
        "shape-partial",
        {"model.headDim": DELETE},
        "spec.model",
        "numLayers, numKVHeads and headDim must be given together",
    ),
    bad(
        "default-above-cap",
        {"tenants.defaultMaxTokens": 4096},
        "spec.tenants.defaultMaxTokens",
        "defaultMaxTokens must not exceed maxTokensCap",
    ),
    bad(
        "cap-not-below-context",
        {"tenants.maxTokensCap": 8192},
        "spec.tenants.maxTokensCap",
        "tenants.maxTokensCap must be below model.maxModelLen",
    ),
    bad(
        "unknown-keys-enum",
        {"tenants.unknownKeys": "Allow"},
        "spec.tenants.unknownKeys",
        "Unsupported value",
    ),
    bad(
        "jwt-without-audience",
        {"tenants.header": "authorization", "tenants.jwt": {"issuer": "https://idp.example"}},
        "spec.tenants.jwt.audience",
        "Required value",
    ),
    bad(
        "jwt-needs-authorization",
        {"tenants.jwt": {"issuer": "https://idp.example", "audience": "kvgate"}},
        "spec.tenants.jwt",
        "jwt needs header: authorization",
    ),
    bad(
        "degrade-floor-above-cap",
        {"overload.actions": ["Degrade"], "overload.degrade.minMaxTokens": 4096},
        "spec.overload.degrade.minMaxTokens",
        "overload.degrade.minMaxTokens must not exceed tenants.maxTokensCap",
    ),
    # CRD only: a bucket that can never hold one default request (16 + 1 × 512 = 528 > 527)
    bad(
        "burst-below-one-request",
        {"rateLimits[0].burstTokens": 527},
        "spec.rateLimits",
        "burstTokens must be at least",
        standalone_too=False,
    ),
    bad(
        "burst-below-weighted-request",
        {"cost.outputTokenWeight": 20},
        "spec.rateLimits",
        "burstTokens must be at least",
        standalone_too=False,
    ),
    # CRD only: Kubernetes label-selector semantics
    bad(
        "selector-in-without-values",
        {"selector.matchExpressions": [{"key": "a", "operator": "In"}]},
        "spec.selector.matchExpressions[0].values",
        "values must be non-empty for operator In",
        standalone_too=False,
    ),
    bad(
        "selector-exists-with-values",
        {"selector.matchExpressions": [{"key": "a", "operator": "Exists", "values": ["x"]}]},
        "spec.selector.matchExpressions[0].values",
        "empty for Exists",
        standalone_too=False,
    ),
    # Label syntax: the model's validators, the CRD's patterns and CEL (found by the policy fuzz)
    bad(
        "selector-label-value-syntax",
        {"selector.matchLabels": {"app": "has space"}},
        "spec.selector.matchLabels.app",
        "should match",
    ),
    bad(
        "selector-label-key-syntax",
        {"selector.matchLabels": {"bad key": "x"}},
        "spec.selector.matchLabels",
        "keys must be label keys",
    ),
    bad(
        "selector-label-key-prefix-length",
        {"selector.matchLabels": {"a" * 254 + "/x": "x"}},
        "spec.selector.matchLabels",
        "keys must be label keys",
    ),
    bad(
        "selector-expression-key-syntax",
        {"selector.matchExpressions": [{"key": "-x", "operator": "Exists"}]},
        "spec.selector.matchExpressions[0].key",
        "should match",
    ),
    bad(
        "selector-expression-value-syntax",
        {"selector.matchExpressions": [{"key": "a", "operator": "In", "values": ["_x"]}]},
        "spec.selector.matchExpressions[0].values[0]",
        "should match",
    ),
]


@pytest.mark.parametrize(("edits", "field", "words", "standalone_too"), INVALID)
def test_invalid_policy_is_refused_naming_the_field(
    kv: Any, ns: str, edits: dict[str, Any], field: str, words: str, standalone_too: bool
) -> None:
    spec = edited(BASE, edits)
    name = unique("bad")
    result = apply(kv, policy(name, ns, spec))
    assert result.returncode != 0, f"accepted: {spec}"
    # "spec.x.y: Invalid value: ..." or 'unknown field "spec.x.y"'
    assert re.search(rf'(^|[\s"]){re.escape(field)}(:|")', result.stderr), result.stderr
    assert words in result.stderr, result.stderr
    assert kv.kubectl("get", "rlp", name, "-n", ns, check=False).returncode != 0
    if standalone_too:
        with pytest.raises(PolicyError):
            parse_policy(policy(name, ns, spec))


# Valid edges: each is on the accepted side of a rule above.
VALID_EDGES = [
    pytest.param({}, id="base"),
    pytest.param({"rateLimits[0].burstTokens": 528}, id="burst-exactly-one-request"),
    pytest.param(
        {
            "tenants.header": "Authorization",
            "tenants.unknownKeys": "Refuse",
            "tenants.jwt": {"issuer": "https://idp.example", "audience": "kvgate"},
        },
        id="jwt-with-authorization-any-case",
    ),
    pytest.param(
        {
            "rateLimits[0].burstTokens": 200,
            "overload.actions": ["Degrade", "Reject"],
            "overload.degrade.minMaxTokens": 128,
        },
        id="burst-below-default-but-degradable",
    ),
    pytest.param(
        {"rateLimits[0]": {"name": "r", "requestsPerMinute": 0.5, "burstRequests": 1}},
        id="requests-only",
    ),
    pytest.param(
        {"rateLimits[0]": {"name": "t", "per": "Global", "tokensPerMinute": 100}},
        id="tokens-only-default-burst",
    ),
    pytest.param({"tenants.maxTokensCap": 8191}, id="cap-just-below-context"),
    pytest.param({"tenants.defaultMaxTokens": 2048}, id="default-equals-cap"),
    pytest.param(
        {"overload.actions": ["Degrade"], "overload.degrade.fallbackModel": "small"},
        id="degrade-by-fallback-only",
    ),
    pytest.param({"model": {"maxModelLen": 8192}}, id="no-shape"),
    pytest.param(
        {
            "model.blockSize": 4096,
            "capacity.gpuMemoryUtilization": 1,
            "queue.maxLength": 0,
            "queue.maxWaitSeconds": 3600,
        },
        id="bounds",
    ),
    pytest.param(
        {
            "capacity.reservation": "MaxTokens",
            "capacity.reservationQuantile": 0.999,
            "slo": {"ttftSeconds": 3600, "tpotSeconds": 10, "minPriority": -1000},
        },
        id="reservation-and-slo-bounds",
    ),
    pytest.param(
        {"capacity.reservationQuantile": 0.5, "slo": {"ttftSeconds": 0.001, "minPriority": 1000}},
        id="reservation-and-slo-low-bounds",
    ),
    pytest.param(
        {
            "selector": {
                "matchExpressions": [
                    {"key": "a", "operator": "NotIn", "values": ["b"]},
                    {"key": "c", "operator": "DoesNotExist"},
                ]
            }
        },
        id="empty-selector-and-expressions",
    ),
    pytest.param(
        {"overload.actions": ["Degrade", "Queue", "Reject"], "overload.degrade.minMaxTokens": 2048},
        id="all-actions",
    ),
    pytest.param(
        {
            "tenants.classes": [
                {"name": "a", "match": {"tenants": ["x"], "prefixes": ["x"]}, "weight": 1000},
                {"name": "b", "match": {"prefixes": ["x-"]}, "weight": 0.001, "priority": 1000},
                {"name": "default", "priority": -1000, "batch": False, "slo": {"tpotSeconds": 10}},
            ],
            "priority.trusted": True,
        },
        id="classes-edges-and-a-declared-default",
    ),
    pytest.param({"tenants.defaultClass": "default"}, id="the-implicit-default-class"),
    pytest.param(
        {"tenants.classes": [{"name": "b", "batch": True}], "tenants.defaultClass": "b"},
        id="a-batch-default-class",
    ),
    # Every list at its bound, every string at its longest: the claims' CEL rules (quadratic in
    # the names) stay within the API server's runtime cost budget.
    pytest.param(
        {
            "tenants.classes": [
                {
                    "name": f"c{i}-" + "x" * 59,
                    "match": {
                        "tenants": [f"{i}-{j}-".ljust(128, "t") for j in range(32)],
                        "prefixes": [f"{i}-{j}-".ljust(128, "p") for j in range(16)],
                    },
                }
                for i in range(16)
            ]
        },
        id="classes-at-every-bound",
    ),
]


@pytest.mark.parametrize("edits", VALID_EDGES)
def test_valid_edges_are_accepted(kv: Any, ns: str, edits: dict[str, Any]) -> None:
    doc = policy(unique("edge"), ns, edited(BASE, edits))
    parse_policy(doc)  # the model agrees
    result = apply(kv, doc, "--dry-run=server")
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_is_accepted_and_stored_with_the_model_defaults(
    kv: Any, ns: str, path: Path
) -> None:
    doc = yaml.safe_load(path.read_text())
    doc["metadata"]["namespace"] = ns
    result = apply(kv, doc, "--server-side")
    assert result.returncode == 0, result.stderr
    stored = get(kv, "rlp", doc["metadata"]["name"], "-n", ns)
    model = load_policy(path).spec.model_dump(by_alias=True, exclude_none=True, mode="json")
    assert drop_empty_lists(stored["spec"]) == drop_empty_lists(model)
    # ... and the operator reads it back as the same policy.
    assert parse_policy(stored).spec == load_policy(path).spec


def test_defaults_are_filled_in(kv: Any, ns: str) -> None:
    name = unique("defaults")
    spec = {
        "selector": {"matchLabels": {"app": "x"}},
        "rateLimits": [{"name": "a", "requestsPerMinute": 60}],
    }
    assert apply(kv, policy(name, ns, spec)).returncode == 0
    stored = get(kv, "rlp", name, "-n", ns)["spec"]
    assert stored["model"] == {"blockSize": 16, "kvCacheDtype": "fp16"}
    assert stored["tenants"] == {
        "header": "x-kvgate-tenant",
        "defaultMaxTokens": 1024,
        "unknownKeys": "Pool",
    }
    assert stored["overload"] == {"actions": ["Queue", "Reject"]}
    assert stored["failureMode"] == "FailOpen"
    assert stored["capacity"] == {
        "fromEngineMetrics": False,
        "reservation": "Predicted",
        "reservationQuantile": 0.9,
    }
    assert stored["slo"] == {"minPriority": 0}
    assert stored["queue"] == {
        "maxLength": 100,
        "order": "ShortestFirst",
        "fairness": {"promptTokenWeight": 1, "outputTokenWeight": 2},
    }
    assert stored["cost"] == {"perRequest": 0, "promptTokenWeight": 1, "outputTokenWeight": 1}
    assert stored["rateLimits"] == [
        {"name": "a", "per": "Tenant", "requestsPerMinute": 60, "warmupSeconds": 0, "shared": False}
    ]


def test_unknown_fields_are_pruned_when_not_refused(kv: Any, ns: str) -> None:
    """kubectl's default strict field validation refuses a typo (test above); with warnings
    only (``--validate=warn``, or a client that does not ask for strict) the API server
    answers with a warning and prunes the field: it is never stored."""
    name = unique("pruned")
    spec = edited(BASE, {"tenants.maxTokenCap": 100})
    result = apply(kv, policy(name, ns, spec), "--validate=warn")
    assert result.returncode == 0, result.stderr
    assert 'unknown field "spec.tenants.maxTokenCap"' in result.stderr
    assert "maxTokenCap" not in get(kv, "rlp", name, "-n", ns)["spec"]["tenants"]


def test_kubectl_explain_shows_the_descriptions(kv: Any) -> None:
    out = kv.kubectl("explain", "ratelimitpolicy.spec.rateLimits").stdout
    assert "Token-bucket limits; a request must fit every one of them" in out
    for field in ("burstRequests", "burstTokens", "name", "per", "requestsPerMinute"):
        assert re.search(rf"^\s+{field}\s+<", out, re.MULTILINE), field
    text = " ".join(out.split())  # explain wraps lines
    assert "Capacity of the cost bucket, cost units" in text
    assert "Default: Tenant." in text
    out = kv.kubectl("explain", "rlp.spec.model.numKVHeads").stdout
    assert "with GQA/MQA the KV heads, not the attention heads" in " ".join(out.split())
    out = kv.kubectl("explain", "nodeadmission.spec.pods.thresholds.globalShare").stdout
    assert "fraction (0, 1] of every per: Global budget" in " ".join(out.split())


def test_kubectl_explain_shows_the_tenant_classes(kv: Any) -> None:
    out = kv.kubectl("explain", "rlp.spec.tenants.classes").stdout
    for field in ("batch", "match", "name", "priority", "slo", "weight"):
        assert re.search(rf"^\s+{field}\s+<", out, re.MULTILINE), field
    text = " ".join(out.split())
    assert "A tenant belongs to the class listing its name in match.tenants" in text
    text = " ".join(kv.kubectl("explain", "rlp.spec.priority.trusted").stdout.split())
    assert "may only lower its request's priority below its tenant class's" in text
    text = " ".join(kv.kubectl("explain", "rlp.spec.tenants.defaultClass").stdout.split())
    assert "The class of tenants no class matches" in text


def status_of(outcome: PolicyOutcome, now: str) -> dict[str, Any]:
    status = outcome.status()
    for c in status["conditions"]:
        c["lastTransitionTime"] = now
    return status


def test_policy_status_subresource_and_printer_columns(kv: Any, ns: str) -> None:
    name = unique("status")
    assert apply(kv, policy(name, ns, BASE)).returncode == 0
    outcome = PolicyOutcome(1, True, "Valid", "the policy is valid")
    outcome.matched = [(ns, "llama-0"), (ns, "llama-1")]
    outcome.conflicts = [f"{ns}/llama-1: also selected by other"]
    status = status_of(outcome, "2025-01-02T03:04:05Z")
    kv.kubectl(
        "patch",
        "rlp",
        name,
        "-n",
        ns,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": status}),
    )
    obj = get(kv, "rlp", name, "-n", ns)
    assert obj["status"] == status
    assert obj["spec"]["rateLimits"] == get(kv, "rlp", name, "-n", ns)["spec"]["rateLimits"]

    # The main resource ignores status; the status subresource ignores spec.
    kv.kubectl(
        "patch",
        "rlp",
        name,
        "-n",
        ns,
        "--type=merge",
        "-p",
        json.dumps({"status": {"matchedPods": 99}}),
    )
    kv.kubectl(
        "patch",
        "rlp",
        name,
        "-n",
        ns,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"spec": {"failureMode": "FailClosed"}}),
    )
    obj = get(kv, "rlp", name, "-n", ns)
    assert obj["status"]["matchedPods"] == 2 and obj["spec"]["failureMode"] == "FailOpen"
    assert obj["metadata"]["generation"] == 1

    table = kv.kubectl("get", "rlp", name, "-n", ns).stdout.splitlines()
    assert re.split(r"\s{2,}", table[0].strip()) == [
        "NAME",
        "ACCEPTED",
        "READY",
        "MATCHED PODS",
        "AGE",
    ]
    assert re.split(r"\s{2,}", table[1].strip())[:4] == [name, "True", "True", "2"]
    # The kvgate category and the short name.
    assert name in kv.kubectl("get", "kvgate", "-n", ns).stdout

    # The status schema is enforced too.
    for bad, field in (
        ({"matchedPods": -1}, "status.matchedPods"),
        ({"conditions": [{"type": "Ready", "status": "Maybe"}]}, "status.conditions[0].status"),
        ({"conditions": [{"type": "Ready"}]}, "status.conditions[0].status"),
        ({"observedGeneration": "one"}, "status.observedGeneration"),
    ):
        result = kv.kubectl(
            "patch",
            "rlp",
            name,
            "-n",
            ns,
            "--subresource=status",
            "--type=merge",
            "-p",
            json.dumps({"status": bad}),
            check=False,
        )
        assert result.returncode != 0 and field in result.stderr, result.stderr


def node_admission(node: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "NodeAdmission",
        "metadata": {"name": node, "labels": dict([TEST_LABEL.split("=")])},
        "spec": spec,
    }


def operator_spec(node: str, share: float) -> dict[str, Any]:
    """A NodeAdmission spec as the operator writes it, from the Global example split ``share``
    ways (Global bursts fall below the policy's burstTokens floor: allowed here)."""
    pol = load_policy(REPO / "examples" / "ratelimitpolicy-global.yaml")
    thresholds = resolve_thresholds(pol.spec, share, engine_kv_capacity=120000)
    pods = [
        PodAdmission(
            namespace="models",
            name=f"qwen-{i}",
            uid=f"uid-{i}",
            policy=PolicyRef(namespace="models", name=pol.metadata.name, uid="p", generation=3),
            thresholds=thresholds,
        )
        for i in range(2)
    ]
    return NodeAdmissionSpec(node_name=node, pods=pods).model_dump(
        by_alias=True, exclude_none=True, mode="json"
    )


def test_node_admission_stores_the_operator_spec_and_the_agent_status(kv: Any) -> None:
    node = unique("gpu-node")
    spec = operator_spec(node, share=1 / 1000)
    assert spec["pods"][0]["thresholds"]["rateLimits"][0]["burstTokens"] == 600
    result = apply(kv, node_admission(node, spec), "--server-side")
    assert result.returncode == 0, result.stderr
    assert get(kv, "na", node)["spec"] == spec  # nothing added: no write loop for the operator

    status = NodeAdmissionStatus(
        gpus=[
            GpuStatus(
                uuid="GPU-0",
                index=0,
                name="NVIDIA H200",
                total_bytes=150,
                used_bytes=140,
                free_bytes=10,
            ),
            GpuStatus(
                uuid="MIG-1",
                mig=True,
                parent_uuid="GPU-0",
                healthy=False,
                reason="NVML: Unknown Error",
            ),
        ],
        pods=[
            PodUsage(
                namespace="models",
                name="qwen-0",
                uid="uid-0",
                in_flight=3,
                kv_reserved_tokens=4096,
                kv_used_tokens=3000,
                engine_kv_capacity_tokens=120000,
            )
        ],
        heartbeat_time="2025-01-02T03:04:05.123456+00:00",
        conditions=[
            Condition(
                type="Ready",
                status="True",
                reason="Reporting",
                last_transition_time="2025-01-02T03:04:05Z",
            )
        ],
    ).model_dump(by_alias=True, exclude_none=True, mode="json")
    kv.kubectl(
        "patch",
        "na",
        node,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": status}),
    )
    stored = get(kv, "na", node)
    assert stored["status"] == status
    assert NodeAdmissionStatus.model_validate(stored["status"]) is not None
    assert NodeAdmissionSpec.model_validate(stored["spec"]).node_name == node

    table = kv.kubectl("get", "na", node).stdout.splitlines()
    assert re.split(r"\s{2,}", table[0].strip()) == ["NAME", "HEARTBEAT", "AGE"]
    assert table[1].split()[0] == node
    assert node in kv.kubectl("get", "kvgate").stdout


@pytest.mark.parametrize(
    ("edit", "field", "words"),
    [
        ({"nodeName": "another-node"}, "spec.nodeName", "must equal metadata.name"),
        (
            {"pods[0].thresholds.globalShare": 0},
            "spec.pods[0].thresholds.globalShare",
            "greater than 0",
        ),
        (
            {"pods[0].thresholds.rateLimits[0].tokensPerMinute": DELETE},
            "spec.pods[0].thresholds.rateLimits[0].burstTokens",
            "burstTokens needs tokensPerMinute",
        ),
        (
            {"pods[0].thresholds.tenants.maxTokensCap": 40000},
            "spec.pods[0].thresholds.tenants.maxTokensCap",
            "below model.maxModelLen",
        ),
        ({"pods[0].thresholds.selector": {}}, "spec.pods[0].thresholds.selector", "unknown field"),
        ({"pods[0].policy.generation": DELETE}, "spec.pods[0].policy.generation", "Required value"),
        ({"pods[1].name": "qwen-0"}, "spec.pods[1]", "Duplicate value"),
    ],
    ids=[
        "name-mismatch",
        "share-zero",
        "cel-in-thresholds",
        "cap-vs-context",
        "no-selector",
        "ref-generation",
        "pods-unique",
    ],
)
def test_invalid_node_admission_is_refused(
    kv: Any, edit: dict[str, Any], field: str, words: str
) -> None:
    node = unique("bad-node")
    spec = edited(operator_spec(node, share=0.5), edit)
    result = apply(kv, node_admission(node, spec))
    assert result.returncode != 0, "accepted"
    assert field in result.stderr and words in result.stderr, result.stderr
