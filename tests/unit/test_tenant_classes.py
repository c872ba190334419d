"""Tenant classes: the policy's validation (``tenants.classes``, ``tenants.defaultClass``), the
resolution of a tenant name to its class, the priority header's trust rule, the identity the
sidecar builds per request, the pod's TPOT target, and the operator's status for a bad class."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate_agent.admission import AdmissionConfig
from kvgate_agent.contract.classes import DEFAULT_CLASS
from kvgate_agent.contract.policy import PolicyError, RateLimitPolicySpec, TenantsSpec, parse_policy
from kvgate_agent.sidecar.identity.classes import IMPLICIT_DEFAULT, ClassResolver, TenantClass
from kvgate_agent.sidecar.identity.tenants import Identifier, priority_of, request_priority
from kvgate_agent.sidecar.reading.openai_errors import RequestError
from kvgate_operator.desired import Policy, compute
from tests.conftest import policy_doc
from tests.unit.test_operator_desired import entries, pod, snap


def spec_of(tenants: dict[str, Any], **more: Any) -> RateLimitPolicySpec:
    return parse_policy(policy_doc({"tenants": tenants, **more})).spec


def refusal(tenants: dict[str, Any]) -> str:
    with pytest.raises(PolicyError) as err:
        spec_of(tenants)
    return str(err.value)


# ---------------------------------------------------------------------------- the contract


def test_a_class_by_its_manifest_names_and_defaults() -> None:
    s = spec_of(
        {
            "classes": [
                {
                    "name": "interactive",
                    "match": {"tenants": ["a", "b"], "prefixes": ["team-x-"]},
                    "weight": 2.5,
                    "priority": 1,
                    "slo": {"ttftSeconds": 0.5, "tpotSeconds": 0.05},
                },
                {"name": "batch", "batch": True},
            ],
            "defaultClass": "batch",
        }
    )
    inter, batch = s.tenants.classes
    assert inter.match.tenants == ["a", "b"] and inter.match.prefixes == ["team-x-"]
    assert (inter.weight, inter.priority) == (2.5, 1)
    assert inter.slo is not None and (inter.slo.ttft_seconds, inter.slo.tpot_seconds) == (
        0.5,
        0.05,
    )
    assert (batch.weight, batch.priority, batch.slo, batch.batch) == (1.0, 0, None, True)
    assert batch.match.tenants == [] and batch.match.prefixes == []
    assert s.tenants.default_class == "batch"
    # No classes: none, and no default class named.
    empty = spec_of({})
    assert empty.tenants.classes == [] and empty.tenants.default_class is None
    assert empty.priority.trusted is False


def test_round_trip_by_alias() -> None:
    """What the operator writes into thresholds reads back to the same spec."""
    doc = policy_doc(
        {
            "tenants": {
                "classes": [{"name": "a", "match": {"prefixes": ["p-"]}, "batch": True}],
                "defaultClass": "a",
            },
            "priority": {"trusted": True},
        }
    )
    first = parse_policy(doc)
    dumped = first.model_dump(by_alias=True, exclude_none=True, mode="json")
    assert dumped["spec"]["tenants"]["defaultClass"] == "a"
    assert dumped["spec"]["tenants"]["classes"][0]["batch"] is True
    assert dumped["spec"]["priority"]["trusted"] is True
    assert parse_policy(dumped) == first


@pytest.mark.parametrize(
    ("tenants", "words"),
    [
        ({"classes": [{"name": "a"}, {"name": "a"}]}, "classes names must be unique: 'a'"),
        (
            {
                "classes": [
                    {"name": "a", "match": {"tenants": ["x"]}},
                    {"name": "b", "match": {"tenants": ["y", "x"]}},
                ]
            },
            "tenant 'x' is claimed by classes a and b",
        ),
        (
            {
                "classes": [
                    {"name": "a", "match": {"prefixes": ["t-"]}},
                    {"name": "b", "match": {"prefixes": ["t-"]}},
                ]
            },
            "prefix 't-' is claimed by classes a and b",
        ),
        ({"classes": [{"name": "a"}], "defaultClass": "b"}, "defaultClass 'b' names no class"),
        (
            {"classes": [{"name": "a", "batch": True, "slo": {"ttftSeconds": 1}}]},
            "a class is batch (no latency SLO) or has an slo, not both",
        ),
        (
            {"classes": [{"name": "a", "match": {"tenants": ["x", "x"]}}]},
            "tenant 'x' is listed twice",
        ),
        (
            {"classes": [{"name": "a", "match": {"prefixes": ["x", "x"]}}]},
            "prefix 'x' is listed twice",
        ),
    ],
    ids=[
        "duplicate-names",
        "tenant-in-two",
        "prefix-in-two",
        "default-undeclared",
        "batch-and-slo",
        "tenant-twice",
        "prefix-twice",
    ],
)
def test_cross_class_rules_are_refused_with_a_clear_message(
    tenants: dict[str, Any], words: str
) -> None:
    msg = refusal(tenants)
    assert "spec.tenants" in msg and words in msg, msg


@pytest.mark.parametrize(
    ("cls", "field"),
    [
        ({"name": "a", "weight": 0}, "spec.tenants.classes[0].weight"),
        ({"name": "a", "weight": -1}, "spec.tenants.classes[0].weight"),
        ({"name": "a", "weight": 1001}, "spec.tenants.classes[0].weight"),
        ({"name": "a", "priority": 1001}, "spec.tenants.classes[0].priority"),
        ({"name": "a", "priority": -1001}, "spec.tenants.classes[0].priority"),
        ({"name": "Not-A-Label"}, "spec.tenants.classes[0].name"),
        ({"name": "a", "slo": {"ttftSeconds": 0}}, "spec.tenants.classes[0].slo.ttftSeconds"),
        ({"name": "a", "slo": {"tpotSeconds": 11}}, "spec.tenants.classes[0].slo.tpotSeconds"),
        ({"name": "a", "slo": {"minPriority": 1}}, "spec.tenants.classes[0].slo.minPriority"),
        ({"name": "a", "match": {"tenants": [" x"]}}, "spec.tenants.classes[0].match.tenants[0]"),
        ({"name": "a", "match": {"tenants": [""]}}, "spec.tenants.classes[0].match.tenants[0]"),
        ({"name": "a", "match": {"prefixes": ["x" * 129]}}, "classes[0].match.prefixes[0]"),
        ({"name": "a", "match": {"names": ["x"]}}, "spec.tenants.classes[0].match.names"),
        ({"weight": 1}, "spec.tenants.classes[0].name"),
    ],
)
def test_bad_class_fields_name_the_field(cls: dict[str, Any], field: str) -> None:
    msg = refusal({"classes": [cls]})
    assert field in msg, msg


def test_bounds_are_inclusive_where_stated() -> None:
    s = spec_of(
        {
            "classes": [
                {"name": "a", "weight": 1000, "priority": 1000, "slo": {"ttftSeconds": 3600}},
                {"name": "b", "weight": 0.001, "priority": -1000, "slo": {"tpotSeconds": 10}},
            ]
        }
    )
    assert [c.weight for c in s.tenants.classes] == [1000, 0.001]
    many = [
        {"name": f"c{i}", "match": {"tenants": [f"t{i}-{j}" for j in range(32)]}} for i in range(16)
    ]
    assert len(spec_of({"classes": many}).tenants.classes) == 16
    assert "at most 16" in refusal({"classes": [*many, {"name": "c16"}]})


def test_default_class_may_name_the_implicit_default() -> None:
    assert spec_of({"defaultClass": DEFAULT_CLASS}).tenants.default_class == "default"


# ---------------------------------------------------------------------------- resolution


def resolver(classes: list[dict[str, Any]], default: str | None = None) -> ClassResolver:
    tenants: dict[str, Any] = {"classes": classes}
    if default is not None:
        tenants["defaultClass"] = default
    return ClassResolver(spec_of(tenants).tenants)


CLASSES: list[dict[str, Any]] = [
    {"name": "exact", "match": {"tenants": ["team-x-boss"]}, "priority": 5, "weight": 3},
    {"name": "short", "match": {"prefixes": ["team-"]}, "priority": 1},
    {"name": "long", "match": {"prefixes": ["team-x-"]}, "priority": 2, "batch": True},
    {"name": "ttft", "match": {"tenants": ["t"]}, "slo": {"tpotSeconds": 0.1}},
    {"name": "fast", "match": {"tenants": ["f"]}, "slo": {"ttftSeconds": 0.25}},
]


def test_exact_name_over_prefix_and_longest_prefix_over_shorter() -> None:
    r = resolver(CLASSES)
    assert r("team-x-boss").name == "exact"  # listed by name, though two prefixes match
    assert r("team-x-worker").name == "long"  # the longer of two matching prefixes
    assert r("team-y").name == "short"
    assert r("team-").name == "short"  # a prefix matches the name equal to it
    assert r("team").name == DEFAULT_CLASS  # shorter than every prefix
    assert r("other") is IMPLICIT_DEFAULT
    assert r("").name == DEFAULT_CLASS


def test_the_resolved_class_carries_weight_priority_and_ttft() -> None:
    r = resolver(CLASSES)
    assert r("team-x-boss") == TenantClass("exact", 3.0, 5, None)
    assert r("team-x-a") == TenantClass("long", 1.0, 2, math.inf)  # batch: no TTFT SLO
    assert r("t").ttft_slo_seconds is None  # an slo without ttftSeconds: the policy's rule
    assert r("f").ttft_slo_seconds == 0.25
    assert TenantClass("default", 1.0, 0, None) == IMPLICIT_DEFAULT


def test_default_class_declared_named_or_implicit() -> None:
    assert resolver(CLASSES, default="short")("nobody").name == "short"
    declared = resolver([*CLASSES, {"name": "default", "priority": -3}])
    assert declared("nobody") == TenantClass("default", 1.0, -3, None)
    assert [c.name for c in declared.classes] == [c["name"] for c in CLASSES] + ["default"]
    assert [c.name for c in resolver(CLASSES).classes][-1] == "default"
    assert resolver([]).classes == (IMPLICIT_DEFAULT,)


def test_the_cache_is_bounded() -> None:
    r = ClassResolver(spec_of({"classes": CLASSES}).tenants, cache_size=8)
    for i in range(100):
        assert r(f"team-x-{i}").name == "long"
        assert len(r._cache) <= 8


def reference(classes: list[dict[str, Any]], tenant: str) -> str:
    """The matching rule spelled out: exact name, else longest prefix, else default."""
    for c in classes:
        if tenant in c.get("match", {}).get("tenants", []):
            return str(c["name"])
    best = max(
        (
            (len(p), c["name"])
            for c in classes
            for p in c.get("match", {}).get("prefixes", [])
            if tenant.startswith(p)
        ),
        default=None,
    )
    return DEFAULT_CLASS if best is None else str(best[1])


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.text(max_size=40),
        st.sampled_from(["team-", "team-x-", "team-x-boss", "t", "f", "teamx"]),
        st.builds(lambda a, b: a + b, st.sampled_from(["team-", "team-x-", "te"]), st.text()),
    )
)
def test_resolution_never_raises_and_is_always_a_declared_class(tenant: str) -> None:
    r = resolver(CLASSES)
    got = r(tenant)
    assert got in r.classes
    assert got.name == reference(CLASSES, tenant)
    assert r(tenant) is got  # cached, the same answer


# ---------------------------------------------------------------------------- priority trust


@pytest.mark.parametrize(
    ("header", "cls", "trusted", "want"),
    [
        (None, 5, False, 5),  # no header: the class's priority
        (None, 5, True, 5),
        (9, 5, False, 5),  # untrusted: never above the class's
        (9, 5, True, 9),  # trusted: the gateway's value
        (2, 5, False, 2),  # lowered
        (-1, 0, False, -1),  # a client marking itself sheddable
        (-1, 5, True, -1),
        (3, -2, True, 3),
        (3, -2, False, -2),
    ],
)
def test_the_header_may_only_lower_an_untrusted_priority(
    header: int | None, cls: int, trusted: bool, want: int
) -> None:
    assert request_priority(header, cls, trusted) == want


def test_priority_header_absent_or_empty_is_none_and_bad_is_400() -> None:
    assert priority_of({}, "x-p") is None and priority_of({"x-p": " "}, "x-p") is None
    assert priority_of({"x-p": " -7 "}, "x-p") == -7
    with pytest.raises(RequestError):
        priority_of({"x-p": "1001"}, "x-p")


# ---------------------------------------------------------------------------- the identity


def test_identity_per_request_and_rebuilt_with_a_new_policy() -> None:
    identify = Identifier()
    spec = spec_of({"classes": CLASSES}, priority={"header": "x-p"})
    who = identify({"x-kvgate-tenant": "team-x-boss", "x-p": "9"}, spec, "team-x-boss")
    assert (who.tenant, who.tenant_class.name, who.priority) == ("team-x-boss", "exact", 5)
    req = who.admission_request(10, 20, 2, "m", degraded=True, prompt_tokens_min=8)
    assert (req.tenant, req.prompt_tokens, req.max_tokens, req.n, req.model) == (
        "team-x-boss",
        10,
        20,
        2,
        "m",
    )
    assert (req.priority, req.weight, req.ttft_slo_seconds) == (5, 3.0, None)
    assert req.degraded and req.prompt_tokens_min == 8 and req.model_rewritable
    batch = identify({"x-kvgate-tenant": "team-x-1"}, spec, "team-x-1").admission_request(1, 1)
    assert (batch.weight, batch.ttft_slo_seconds, batch.priority) == (1.0, math.inf, 2)
    # New thresholds: the class table follows them.
    other = spec_of({"classes": [{"name": "vip", "match": {"tenants": ["team-x-boss"]}}]})
    assert (
        identify({"x-kvgate-tenant": "team-x-boss"}, other, "team-x-boss").tenant_class.name
        == "vip"
    )
    assert (
        identify({"x-kvgate-tenant": "team-x-1"}, other, "team-x-1").tenant_class
        is IMPLICIT_DEFAULT
    )
    # The default policy: everyone in the implicit default class, the header untrusted.
    anon = identify({"x-kvgate-priority": "4"}, spec_of({}), "anonymous")
    assert (anon.tenant, anon.tenant_class, anon.priority) == ("anonymous", IMPLICIT_DEFAULT, 0)


def test_identifier_starts_with_no_classes() -> None:
    identify = Identifier()
    who = identify({"x-kvgate-tenant": "a", "x-kvgate-priority": "-2"}, RateLimitPolicySpec(), "a")
    assert who.tenant_class is IMPLICIT_DEFAULT and who.priority == -2
    assert ClassResolver(TenantsSpec())("a") is IMPLICIT_DEFAULT


# ---------------------------------------------------------------------------- thresholds


def test_the_pod_steers_by_the_tightest_tpot_target() -> None:
    classes = [
        {"name": "a", "slo": {"tpotSeconds": 0.08}},
        {"name": "b", "slo": {"tpotSeconds": 0.03, "ttftSeconds": 1}},
        {"name": "c", "batch": True},
    ]
    tpot = AdmissionConfig.from_policy(spec_of({"classes": classes}, slo={"tpotSeconds": 0.05}))
    assert tpot.tpot_slo_seconds == 0.03
    assert (
        AdmissionConfig.from_policy(spec_of({}, slo={"tpotSeconds": 0.05})).tpot_slo_seconds == 0.05
    )
    assert AdmissionConfig.from_policy(spec_of({"classes": classes[2:]})).tpot_slo_seconds is None
    # The policy-wide TTFT rule is unchanged by classes (a class's TTFT rides on its requests).
    assert AdmissionConfig.from_policy(spec_of({"classes": classes})).ttft_slo_seconds is None


# ---------------------------------------------------------------------------- the operator


def test_operator_reports_a_bad_class_in_the_accepted_condition() -> None:
    """A policy stored past the schema (an older CRD, a client skipping validation) with a
    tenant claimed by two classes is not accepted, the message says why, and it governs
    nothing."""
    spec = {
        "selector": {"matchLabels": {"app": "llm"}},
        "tenants": {
            "classes": [
                {"name": "a", "match": {"tenants": ["x"]}},
                {"name": "b", "match": {"tenants": ["x"]}},
            ]
        },
    }
    doc = policy_doc(spec, "bad")
    doc["metadata"].update(namespace="m", generation=3, uid="uid-bad")
    d = compute(snap([Policy.from_object(doc)], [pod("a")]))
    accepted = d.policies[("m", "bad")].status()["conditions"][0]
    assert (accepted["type"], accepted["status"], accepted["reason"]) == (
        "Accepted",
        "False",
        "InvalidSpec",
    )
    assert "spec.tenants" in accepted["message"]
    assert "tenant 'x' is claimed by classes a and b" in accepted["message"]
    assert entries(d, "n1") == {}
