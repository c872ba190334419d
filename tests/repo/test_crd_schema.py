"""The CRDs in crds/ against the pydantic contract models, without a cluster.

The CRD schemas are generated from these models and the sources in crds/source/
(scripts/gen-crds, tests/repo/test_crdgen.py); these tests check the result against the models:

- every model field (by its camelCase alias, recursively) is a schema property and vice versa;
- types, enums, bounds, patterns, required fields and defaults agree, and defaulting an empty
  object the way the API server does gives what the model's defaults give;
- every schema property has a description (``kubectl explain`` reads them);
- NodeAdmission's ``thresholds`` repeats the RateLimitPolicy spec sub-schemas exactly.

Differences on purpose are listed here (``CRD_ONLY``, ``NOT_IN_CRD``, ``REQUIRED_IN_CRD_ONLY``),
each with its reason. What the API server does with the schemas (CEL rules, defaulting, status,
printer columns) is tested against a real kube-apiserver in tests/integration/test_crds.py.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from kvgate_agent.contract.api import GROUP as API_GROUP
from kvgate_agent.contract.api import RATE_LIMIT_POLICY_KIND as KIND
from kvgate_agent.contract.classes import TenantClassSpec
from kvgate_agent.contract.nodeadmission import (
    Condition,
    GpuStatus,
    NodeAdmissionSpec,
    NodeAdmissionStatus,
    PodAdmission,
    PodThresholds,
    PodUsage,
    PolicyRef,
)
from kvgate_agent.contract.policy import (
    LabelSelectorRequirement,
    PriorityTarget,
    RateLimitPolicySpec,
    RateLimitSpec,
)

REPO = Path(__file__).resolve().parents[2]
CRDS = REPO / "crds"

#: Keywords that constrain a value; compared between model and schema.
CONSTRAINTS = (
    "enum",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "format",
)

#: Constraints only the CRD has. maxLength/maxItems bound what the API server's CEL cost
#: estimator assumes (a rule over an unbounded list or string is refused at CRD creation) and
#: keep objects small; label-selector limits are Kubernetes' own (label values <= 63 chars,
#: qualified keys <= 317); object names and namespaces are Kubernetes names; timestamps are
#: RFC 3339 (the API server checks ``format: date-time``). Label keys and values: the model
#: checks their syntax in a validator (``_check_label_key`` / ``_check_label_value``), the CRD
#: with patterns and a CEL rule on the keys (tests/integration/test_policy_fuzz.py found the
#: CRD storing selectors the model refuses). Paths: ``[]`` is a list item, ``{}`` a map value.
CRD_ONLY: dict[str, set[str]] = {
    "rlp:spec.selector.matchLabels{}": {"maxLength", "pattern"},
    "rlp:spec.selector.matchExpressions": {"maxItems"},
    "rlp:spec.selector.matchExpressions[].key": {"maxLength", "pattern"},
    "rlp:spec.selector.matchExpressions[].values": {"maxItems"},
    "rlp:spec.selector.matchExpressions[].values[]": {"maxLength", "pattern"},
    "rlp:spec.tenants.header": {"maxLength"},
    "rlp:spec.priority.header": {"maxLength"},
    "rlp:spec.overload.degrade.fallbackModel": {"maxLength"},
    "na:spec.nodeName": {"minLength", "maxLength"},
    "na:spec.pods": {"maxItems"},
    "na:spec.pods[].namespace": {"maxLength"},
    "na:spec.pods[].name": {"maxLength"},
    "na:spec.pods[].uid": {"maxLength"},
    "na:spec.pods[].policy.namespace": {"maxLength"},
    "na:spec.pods[].policy.name": {"maxLength"},
    "na:spec.pods[].policy.uid": {"maxLength"},
    "na:status.heartbeatTime": {"format"},
    "na:status.conditions[].lastTransitionTime": {"format"},
}
for _prefix in ("tenants.header", "priority.header", "overload.degrade.fallbackModel"):
    CRD_ONLY[f"na:spec.pods[].thresholds.{_prefix}"] = CRD_ONLY[f"rlp:spec.{_prefix}"]

#: Model fields the CRD leaves out: the operator never writes a selector into thresholds
#: (PodThresholds inherits the field from RateLimitPolicySpec; its docstring says it is absent).
NOT_IN_CRD = {"na:spec.pods[].thresholds.selector"}

#: Required in the cluster, optional in the model (the standalone sidecar ignores it).
REQUIRED_IN_CRD_ONLY = {"rlp:spec": {"selector"}}


def load_crd(filename: str) -> dict[str, Any]:
    doc = yaml.safe_load((CRDS / filename).read_text())
    assert isinstance(doc, dict)
    return doc


def root_schema(crd: dict[str, Any]) -> dict[str, Any]:
    (version,) = crd["spec"]["versions"]
    schema = version["schema"]["openAPIV3Schema"]
    assert isinstance(schema, dict)
    return schema


RLP = load_crd("ratelimitpolicies.yaml")
NA = load_crd("nodeadmissions.yaml")
RLP_SPEC = root_schema(RLP)["properties"]["spec"]
RLP_STATUS = root_schema(RLP)["properties"]["status"]
NA_SPEC = root_schema(NA)["properties"]["spec"]
NA_STATUS = root_schema(NA)["properties"]["status"]
NA_POD = NA_SPEC["properties"]["pods"]["items"]
THRESHOLDS = NA_POD["properties"]["thresholds"]


# ----------------------------------------------------------------------------------------------
# Model JSON schema -> what the CRD must say


class ModelSchema:
    """A model's JSON schema (pydantic, by alias) with ``$ref`` and ``Optional`` resolved."""

    def __init__(self, model: type[BaseModel]) -> None:
        self.doc = model.model_json_schema(by_alias=True, mode="validation")
        self.defs: dict[str, Any] = self.doc.get("$defs", {})

    def resolve(self, node: dict[str, Any]) -> dict[str, Any]:
        """Follow ``$ref``, unwrap ``anyOf: [X, null]`` and ``allOf: [X]``; keep the outer
        node's default and constraints."""
        node = dict(node)
        while True:
            if "$ref" in node:
                target = self.defs[node.pop("$ref").rsplit("/", 1)[-1]]
                node = {**target, **node}
            elif "anyOf" in node:
                options = [o for o in node.pop("anyOf") if o.get("type") != "null"]
                assert len(options) == 1, f"unexpected union {options}"
                node = {**options[0], **node}
            elif "allOf" in node:
                (only,) = node.pop("allOf")
                node = {**only, **node}
            else:
                return node


def model_constraints(node: dict[str, Any]) -> dict[str, Any]:
    """A model node's constraints in CRD (OpenAPI v3.0) terms: ``exclusiveMinimum: x`` becomes
    ``minimum: x, exclusiveMinimum: true`` (for integers ``minimum: x + 1``), ``const`` an
    enum."""
    out = {k: node[k] for k in CONSTRAINTS if k in node and not k.startswith("exclusive")}
    if "const" in node:
        out["enum"] = [node["const"]]
    for bound, key in (("Minimum", "minimum"), ("Maximum", "maximum")):
        if f"exclusive{bound}" in node:
            value = node[f"exclusive{bound}"]
            if node.get("type") == "integer":
                out[key] = math.floor(value) + 1 if key == "minimum" else math.ceil(value) - 1
            else:
                out[key] = value
                out[f"exclusive{bound}"] = True
    return out


def crd_constraints(node: dict[str, Any]) -> dict[str, Any]:
    out = {k: node[k] for k in CONSTRAINTS if k in node}
    for k in ("exclusiveMinimum", "exclusiveMaximum"):
        if out.get(k) is False:
            del out[k]
    return out


def compare(
    ms: ModelSchema, mnode: dict[str, Any], cnode: dict[str, Any], path: str, errors: list[str]
) -> None:
    """Append to ``errors`` every way the CRD node ``cnode`` differs from the model node."""
    mnode = ms.resolve(mnode)
    mtype, ctype = mnode.get("type"), cnode.get("type")
    if mtype != ctype:
        errors.append(f"{path}: type {ctype!r} in the CRD, {mtype!r} in the model")
        return

    want, got = model_constraints(mnode), crd_constraints(cnode)
    allowed_extra = CRD_ONLY.get(path, set())
    for key in sorted(set(want) | set(got)):
        if key in want and key in got:
            if want[key] != got[key]:
                errors.append(f"{path}: {key} {got[key]!r} in the CRD, {want[key]!r} in the model")
        elif key in want:
            errors.append(f"{path}: {key} {want[key]!r} missing from the CRD")
        elif key == "maxLength" and "enum" in got and got[key] >= max(map(len, got["enum"])):
            pass  # an enum's strings are bounded anyway; the bound only informs the CEL cost
        elif key not in allowed_extra:
            errors.append(
                f"{path}: {key} {got[key]!r} only in the CRD (not a documented exception)"
            )

    if "default" in mnode and mnode["default"] is not None:
        if "default" not in cnode:
            errors.append(f"{path}: default {mnode['default']!r} missing from the CRD")
        elif cnode["default"] != mnode["default"]:
            errors.append(f"{path}: default {cnode['default']!r} in the CRD, {mnode['default']!r}")
    elif "default" in mnode and "default" in cnode:
        errors.append(f"{path}: default {cnode['default']!r} in the CRD, none in the model")
    elif "default" in cnode and ctype not in ("object", "array"):
        # Object and list defaults from a default_factory are not in the JSON schema:
        # test_defaulting_matches_the_model checks those.
        errors.append(f"{path}: default {cnode['default']!r} in the CRD, none in the model")

    if mtype == "array":
        compare(ms, mnode["items"], cnode["items"], f"{path}[]", errors)
    elif mtype == "object" and "properties" in mnode:
        mprops = {k for k in mnode["properties"] if f"{path}.{k}" not in NOT_IN_CRD}
        cprops = set(cnode.get("properties", {}))
        for k in sorted(mprops - cprops):
            errors.append(f"{path}.{k}: in the model, missing from the CRD")
        for k in sorted(cprops - mprops):
            errors.append(f"{path}.{k}: in the CRD, not in the model")
        mreq = set(mnode.get("required", [])) | REQUIRED_IN_CRD_ONLY.get(path, set())
        creq = set(cnode.get("required", []))
        if mreq != creq:
            errors.append(f"{path}: required {sorted(creq)} in the CRD, {sorted(mreq)} expected")
        for k in sorted(mprops & cprops):
            compare(ms, mnode["properties"][k], cnode["properties"][k], f"{path}.{k}", errors)
    elif mtype == "object":
        if "additionalProperties" not in mnode or "additionalProperties" not in cnode:
            errors.append(f"{path}: a map in one, not in the other")
        else:
            compare(
                ms,
                mnode["additionalProperties"],
                cnode["additionalProperties"],
                f"{path}{{}}",
                errors,
            )


@pytest.mark.parametrize(
    ("model", "schema", "path"),
    [
        (RateLimitPolicySpec, RLP_SPEC, "rlp:spec"),
        (NodeAdmissionSpec, NA_SPEC, "na:spec"),
        (NodeAdmissionStatus, NA_STATUS, "na:status"),
    ],
    ids=["RateLimitPolicy.spec", "NodeAdmission.spec", "NodeAdmission.status"],
)
def test_schema_mirrors_the_model(
    model: type[BaseModel], schema: dict[str, Any], path: str
) -> None:
    ms = ModelSchema(model)
    errors: list[str] = []
    compare(ms, ms.doc, schema, path, errors)
    assert not errors, "CRD schema and model differ:\n  " + "\n  ".join(errors)


def test_the_comparison_catches_drift() -> None:
    """The comparison is not vacuous: a renamed field, a changed default, a dropped bound and
    an extra property are all reported."""
    broken = copy.deepcopy(RLP_SPEC)
    props = broken["properties"]
    props["tenants"]["properties"]["defaultMaxTokens"]["default"] = 512
    props["model"]["properties"]["blockSize"].pop("maximum")
    props["queue"]["properties"]["ordr"] = props["queue"]["properties"].pop("order")
    props["cost"]["properties"]["perToken"] = {"type": "number", "description": "x"}
    ms = ModelSchema(RateLimitPolicySpec)
    errors: list[str] = []
    compare(ms, ms.doc, broken, "rlp:spec", errors)
    text = "\n".join(errors)
    assert "rlp:spec.tenants.defaultMaxTokens: default 512" in text
    assert "rlp:spec.model.blockSize: maximum 4096 missing" in text
    assert "rlp:spec.queue.order: in the model, missing" in text
    assert "rlp:spec.queue.ordr: in the CRD, not in the model" in text
    assert "rlp:spec.cost.perToken: in the CRD, not in the model" in text


# ----------------------------------------------------------------------------------------------
# Defaulting: what the API server stores for an object that gives only the required fields


def apiserver_default(schema: dict[str, Any], value: Any) -> Any:
    """Structural-schema defaulting as kube-apiserver does it: a missing property with a
    ``default`` gets it, recursively (so ``default: {}`` picks up its children's defaults)."""
    if isinstance(value, dict) and schema.get("type") == "object":
        out = dict(value)
        props = schema.get("properties", {})
        for key, sub in props.items():
            if key not in out and "default" in sub:
                out[key] = copy.deepcopy(sub["default"])
            if key in out:
                out[key] = apiserver_default(sub, out[key])
        if "additionalProperties" in schema and isinstance(schema["additionalProperties"], dict):
            for key in set(out) - set(props):
                out[key] = apiserver_default(schema["additionalProperties"], out[key])
        return out
    if isinstance(value, list) and "items" in schema:
        return [apiserver_default(schema["items"], v) for v in value]
    return value


def drop_empty_lists(value: Any) -> Any:
    """An empty list is what an absent list means (the CRD gives lists no ``default: []``)."""
    if isinstance(value, dict):
        return {k: drop_empty_lists(v) for k, v in value.items() if v != []}
    if isinstance(value, list):
        return [drop_empty_lists(v) for v in value]
    return value


def sub(schema: dict[str, Any], *path: str) -> dict[str, Any]:
    for key in path:
        schema = schema["items"] if key == "[]" else schema["properties"][key]
    return schema


POD = {
    "namespace": "ns",
    "name": "p",
    "uid": "u",
    "policy": {"namespace": "ns", "name": "pol", "generation": 1},
    "thresholds": {},
}

DEFAULT_CASES = [
    (RateLimitPolicySpec, RLP_SPEC, {}),
    (RateLimitSpec, sub(RLP_SPEC, "rateLimits", "[]"), {"name": "a", "tokensPerMinute": 1}),
    (TenantClassSpec, sub(RLP_SPEC, "tenants", "classes", "[]"), {"name": "a"}),
    (
        TenantClassSpec,
        sub(RLP_SPEC, "tenants", "classes", "[]"),
        {"name": "b", "match": {"prefixes": ["b-"]}, "slo": {"ttftSeconds": 1}},
    ),
    (
        LabelSelectorRequirement,
        sub(RLP_SPEC, "selector", "matchExpressions", "[]"),
        {"key": "k", "operator": "Exists"},
    ),
    (PodThresholds, THRESHOLDS, {}),
    (PolicyRef, sub(NA_POD, "policy"), POD["policy"]),
    (PodAdmission, NA_POD, POD),
    (NodeAdmissionSpec, NA_SPEC, {"nodeName": "n", "pods": [POD]}),
    (NodeAdmissionStatus, NA_STATUS, {}),
    (
        GpuStatus,
        sub(NA_STATUS, "gpus", "[]"),
        {"uuid": "GPU-1", "totalBytes": 2, "usedBytes": 1, "freeBytes": 1},
    ),
    (PodUsage, sub(NA_STATUS, "pods", "[]"), {"namespace": "ns", "name": "p"}),
    (Condition, sub(NA_STATUS, "conditions", "[]"), {"type": "Ready", "status": "True"}),
]


@pytest.mark.parametrize(
    ("model", "schema", "given"), DEFAULT_CASES, ids=[c[0].__name__ for c in DEFAULT_CASES]
)
def test_defaulting_matches_the_model(
    model: type[BaseModel], schema: dict[str, Any], given: dict[str, Any]
) -> None:
    from_model = model.model_validate(given).model_dump(
        by_alias=True, exclude_none=True, mode="json"
    )
    from_crd = apiserver_default(schema, given)
    assert drop_empty_lists(from_crd) == drop_empty_lists(from_model)


def test_policy_defaults_spelled_out() -> None:
    """The defaults the issue names, read from the CRD the way the API server applies them."""
    spec = apiserver_default(RLP_SPEC, {"selector": {}, "rateLimits": [{"name": "a"}]})
    assert spec["model"] == {"blockSize": 16, "kvCacheDtype": "fp16"}
    assert spec["tenants"] == {
        "header": "x-kvgate-tenant",
        "defaultMaxTokens": 1024,
        "unknownKeys": "Pool",
    }
    assert spec["overload"] == {"actions": ["Queue", "Reject"]}
    assert spec["failureMode"] == "FailOpen"
    assert spec["queue"] == {
        "maxLength": 100,
        "order": "ShortestFirst",
        "fairness": {"promptTokenWeight": 1, "outputTokenWeight": 2},
    }
    assert spec["cost"] == {"perRequest": 0, "promptTokenWeight": 1, "outputTokenWeight": 1}
    assert spec["priority"] == {
        "header": "x-kvgate-priority",
        "forwardTo": "None",
        "trusted": False,
    }
    assert spec["rateLimits"] == [
        {"name": "a", "per": "Tenant", "warmupSeconds": 0, "shared": False}
    ]


def test_priority_forward_to_names_the_engines_as_strings() -> None:
    """``forwardTo``'s enum is the engines' names, ``None`` a string (YAML would read a bare
    ``null`` or ``~`` as no value, which the API server's defaulting would drop), in both CRDs."""
    for schema in (RLP_SPEC, THRESHOLDS):
        node = schema["properties"]["priority"]["properties"]["forwardTo"]
        assert node["type"] == "string"
        assert node["enum"] == [t.value for t in PriorityTarget] == ["vLLM", "SGLang", "None"]
        assert node["default"] == "None"


# ----------------------------------------------------------------------------------------------
# Descriptions, the thresholds copy, CEL rules, names, status, printer columns


def walk(schema: dict[str, Any], path: str) -> list[tuple[str, dict[str, Any]]]:
    """Every property (and list item / map value) schema below ``schema`` with its path."""
    out = []
    for key, node in schema.get("properties", {}).items():
        out.append((f"{path}.{key}", node))
        out.extend(walk(node, f"{path}.{key}"))
    if "items" in schema:
        out.append((f"{path}[]", schema["items"]))
        out.extend(walk(schema["items"], f"{path}[]"))
    if isinstance(schema.get("additionalProperties"), dict):
        out.extend(walk(schema["additionalProperties"], f"{path}{{}}"))
    return out


@pytest.mark.parametrize("crd", [RLP, NA], ids=["RateLimitPolicy", "NodeAdmission"])
def test_every_property_has_a_description(crd: dict[str, Any]) -> None:
    kind = crd["spec"]["names"]["kind"]
    root = root_schema(crd)
    assert root.get("description")
    missing = []
    for path, node in walk(root, kind):
        if path == f"{kind}.metadata":  # the API server publishes ObjectMeta's own docs
            continue
        is_scalar_item = path.endswith("[]") and node.get("type") != "object"
        if not is_scalar_item and not str(node.get("description", "")).strip():
            missing.append(path)
    assert not missing, f"no description: {missing}"


@pytest.mark.parametrize("crd", [RLP, NA], ids=["RateLimitPolicy", "NodeAdmission"])
def test_descriptions_state_the_defaults(crd: dict[str, Any]) -> None:
    """``kubectl explain`` does not print ``default``: the description says it."""
    kind = crd["spec"]["names"]["kind"]
    missing = [
        path
        for path, node in walk(root_schema(crd), kind)
        if "default" in node
        and node["default"] != {}
        and "Default: " not in str(node.get("description"))
    ]
    assert not missing, f"default not in the description: {missing}"


def test_the_fallback_pool_upstream_names_the_sidecar_port() -> None:
    """A fallback pool reached at its engine's port has no admission: the CRD says to use the
    sidecar's port (``kvgate-http``), and so does the README's policy table."""
    node = sub(RLP_SPEC, "overload", "degrade", "fallback", "upstream")
    assert "kvgate-http" in node["description"]
    (row,) = [
        line
        for line in (REPO / "README.md").read_text().splitlines()
        if line.startswith("| `overload.degrade.fallback` ")
    ]
    assert "kvgate-http" in row


def test_thresholds_repeat_the_policy_spec_schemas() -> None:
    """NodeAdmission's thresholds and the policy spec share every sub-schema, byte for byte
    (descriptions, defaults, bounds, CEL rules), so one cannot drift from the other."""
    policy = {k: v for k, v in RLP_SPEC["properties"].items() if k != "selector"}
    extra = {"globalShare", "kvCapacityTokens", "bytesPerToken"}
    thresholds = THRESHOLDS["properties"]
    assert set(thresholds) == set(policy) | extra
    for key, schema in policy.items():
        assert thresholds[key] == schema, f"thresholds.{key} differs from spec.{key}"
    # Object-level rules: the policy's, except the burstTokens floor (a per: Global burst split
    # across pods may legitimately fall below it) and the classes' claims (quadratic in the
    # classes' names: times the 256 pods of a NodeAdmission past the API server's CEL cost
    # budget; the operator writes only policies the model validated, claims included).
    policy_rules = [
        r
        for r in RLP_SPEC["x-kubernetes-validations"]
        if r["fieldPath"] not in (".rateLimits", ".tenants.classes")
    ]
    assert THRESHOLDS["x-kubernetes-validations"] == policy_rules


def rules(schema: dict[str, Any]) -> list[dict[str, Any]]:
    found = list(schema.get("x-kubernetes-validations", []))
    for _, node in walk(schema, ""):
        found.extend(node.get("x-kubernetes-validations", []))
    return found


def test_cel_rules_have_messages() -> None:
    """Every rule says in words what is wrong, naming the field (the API server's error adds the
    path); the model's own cross-field checks all have a rule."""
    all_rules = rules(root_schema(RLP)) + rules(root_schema(NA))
    for r in all_rules:
        assert r.get("message"), r
    messages = {r["message"] for r in rules(RLP_SPEC)}
    assert {
        "a rate limit needs requestsPerMinute or tokensPerMinute",
        "burstRequests needs requestsPerMinute",
        "burstTokens needs tokensPerMinute",
        "rateLimits names must be unique",
        "actions must not repeat",
        "Degrade needs degrade.minMaxTokens, degrade.fallbackModel or degrade.fallback",
        "numLayers, numKVHeads and headDim must be given together",
        "defaultMaxTokens must not exceed maxTokensCap",
        "tenants.maxTokensCap must be below model.maxModelLen",
        "jwt needs header: authorization (the token is the bearer token)",
        "overload.degrade.minMaxTokens must not exceed tenants.maxTokensCap",
        "a tenant name may be claimed by one class only (tenants.classes[].match.tenants)",
        "a tenant-name prefix may be claimed by one class only (tenants.classes[].match.prefixes)",
        "a class is batch (no latency SLO) or has an slo, not both",
        "defaultClass must name a class in classes (or be default, the implicit class)",
    } <= messages
    assert any(m.startswith("rateLimits[].burstTokens must be at least") for m in messages)


def test_names_scope_and_subresources() -> None:
    for crd, plural, scope, short in (
        (RLP, "ratelimitpolicies", "Namespaced", "rlp"),
        (NA, "nodeadmissions", "Cluster", "na"),
    ):
        spec = crd["spec"]
        assert crd["metadata"]["name"] == f"{plural}.{API_GROUP}"
        assert spec["group"] == API_GROUP and spec["scope"] == scope
        assert spec["names"]["plural"] == plural and spec["names"]["shortNames"] == [short]
        assert spec["names"]["categories"] == ["kvgate"]
        (version,) = spec["versions"]
        assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
        assert version["subresources"] == {"status": {}}
        assert root_schema(crd)["required"] == ["spec"]
    assert RLP["spec"]["names"]["kind"] == KIND
    assert NA["spec"]["names"]["kind"] == "NodeAdmission"


def test_policy_status_schema() -> None:
    props = RLP_STATUS["properties"]
    assert set(props) == {"observedGeneration", "conditions", "matchedPods", "conflicts"}
    cond = props["conditions"]["items"]["properties"]
    assert set(cond) == {
        "type",
        "status",
        "reason",
        "message",
        "lastTransitionTime",
        "observedGeneration",
    }
    assert props["conditions"]["x-kubernetes-list-map-keys"] == ["type"]
    assert props["conflicts"]["items"]["type"] == "string"


def test_printer_columns() -> None:
    (rlp,) = RLP["spec"]["versions"]
    assert [(c["name"], c["jsonPath"]) for c in rlp["additionalPrinterColumns"]] == [
        ("Accepted", '.status.conditions[?(@.type=="Accepted")].status'),
        ("Ready", '.status.conditions[?(@.type=="Ready")].status'),
        ("Matched Pods", ".status.matchedPods"),
        ("Age", ".metadata.creationTimestamp"),
    ]
    (na,) = NA["spec"]["versions"]
    assert [c["name"] for c in na["additionalPrinterColumns"]] == ["Heartbeat", "Age"]
