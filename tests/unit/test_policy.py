"""The RateLimitPolicy model: valid examples load, invalid ones name the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvgate_agent.contract.policy import (
    PolicyError,
    PriorityTarget,
    ReservationMode,
    load_policy,
    parse_policy,
)
from tests.conftest import REPO, policy_doc


def test_every_example_is_valid() -> None:
    examples = sorted((REPO / "examples").glob("*.yaml"))
    assert examples
    for path in examples:
        p = load_policy(path)
        assert p.metadata.name


def test_defaults() -> None:
    s = parse_policy(policy_doc({})).spec
    assert s.model.block_size == 16
    assert s.tenants.header == "x-kvgate-tenant" and s.tenants.default_max_tokens == 1024
    assert s.priority.header == "x-kvgate-priority"
    assert s.priority.forward_to is PriorityTarget.NONE
    assert [a.value for a in s.overload.actions] == ["Queue", "Reject"]
    assert s.cost.per_request == 0 and s.cost.prompt_token_weight == 1
    assert s.failure_mode.value == "FailOpen"
    assert s.capacity.reservation is ReservationMode.PREDICTED
    assert s.capacity.reservation_quantile == 0.9
    assert s.slo.ttft_seconds is None and s.slo.tpot_seconds is None
    assert s.slo.min_priority == 0


def test_reservation_and_slo_by_their_manifest_names() -> None:
    spec = {
        "capacity": {"reservation": "MaxTokens", "reservationQuantile": 0.99},
        "slo": {"ttftSeconds": 0.5, "tpotSeconds": 0.05, "minPriority": 1},
    }
    s = parse_policy(policy_doc(spec)).spec
    assert s.capacity.reservation is ReservationMode.MAX_TOKENS
    assert s.capacity.reservation_quantile == 0.99
    assert (s.slo.ttft_seconds, s.slo.tpot_seconds, s.slo.min_priority) == (0.5, 0.05, 1)
    # The bounds are inclusive where the manifest says so.
    edges = {
        "capacity": {"reservationQuantile": 0.5},
        "slo": {"ttftSeconds": 3600, "tpotSeconds": 10, "minPriority": -1000},
    }
    e = parse_policy(policy_doc(edges)).spec
    assert e.capacity.reservation_quantile == 0.5 and e.slo.min_priority == -1000
    assert parse_policy(policy_doc({"slo": {"minPriority": 1000}})).spec.slo.min_priority == 1000
    assert parse_policy(policy_doc({"capacity": {"reservationQuantile": 0.999}}))


def test_reservation_and_slo_round_trip() -> None:
    """Dumped by alias, the new fields read back to the same policy (what the operator writes
    into thresholds is what the sidecar reads)."""
    spec = {
        "capacity": {"reservation": "MaxTokens", "reservationQuantile": 0.75},
        "slo": {"ttftSeconds": 2, "minPriority": -5},
    }
    first = parse_policy(policy_doc(spec))
    dumped = first.model_dump(by_alias=True, exclude_none=True, mode="json")
    assert dumped["spec"]["capacity"]["reservation"] == "MaxTokens"
    assert dumped["spec"]["capacity"]["reservationQuantile"] == 0.75
    assert dumped["spec"]["slo"] == {"ttftSeconds": 2.0, "minPriority": -5}
    assert parse_policy(dumped) == first


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"model": {"numLayers": 0}}, "spec.model.numLayers"),
        ({"model": {"kvCacheDtype": "int4"}}, "spec.model.kvCacheDtype"),
        ({"model": {"numLayers": 32}}, "spec.model"),
        ({"capacity": {"kvCacheTokens": -1}}, "spec.capacity.kvCacheTokens"),
        ({"capacity": {"gpuMemoryUtilization": 1.5}}, "spec.capacity.gpuMemoryUtilization"),
        ({"concurrency": {"maxRequests": 0}}, "spec.concurrency.maxRequests"),
        ({"tenants": {"header": "bad header"}}, "spec.tenants.header"),
        ({"rateLimits": [{"name": "a"}]}, "spec.rateLimits[0]"),
        (
            {"rateLimits": [{"name": "a", "tokensPerMinute": -5}]},
            "spec.rateLimits[0].tokensPerMinute",
        ),
        (
            {"rateLimits": [{"name": "a", "per": "Namespace", "requestsPerMinute": 1}]},
            "spec.rateLimits[0].per",
        ),
        ({"rateLimits": [{"name": "Bad_Name", "requestsPerMinute": 1}]}, "spec.rateLimits[0].name"),
        (
            {
                "rateLimits": [
                    {"name": "a", "requestsPerMinute": 1},
                    {"name": "a", "requestsPerMinute": 2},
                ]
            },
            "spec",
        ),
        ({"queue": {"order": "LIFO"}}, "spec.queue.order"),
        ({"queue": {"maxWaitSeconds": 0}}, "spec.queue.maxWaitSeconds"),
        ({"overload": {"actions": ["Degrade"]}}, "spec.overload"),
        ({"overload": {"actions": ["Queue", "Queue"]}}, "spec.overload"),
        ({"overload": {"actions": ["Panic"]}}, "spec.overload.actions[0]"),
        ({"failureMode": "FailSometimes"}, "spec.failureMode"),
        ({"rateLimit": []}, "spec.rateLimit"),  # a typo must not be silently ignored
        ({"selector": {"matchLabels": {"bad key!": "a"}}}, "spec.selector"),
        ({"selector": {"matchLabels": {"app": "a b"}}}, "spec.selector"),
        (
            {"selector": {"matchExpressions": [{"key": "-x", "operator": "Exists"}]}},
            "spec.selector",
        ),
        ({"cost": {"promptTokenWeight": float("nan")}}, "spec.cost.promptTokenWeight"),
        ({"capacity": {"reservation": "Foo"}}, "spec.capacity.reservation"),
        ({"capacity": {"reservation": "predicted"}}, "spec.capacity.reservation"),
        ({"capacity": {"reservationQuantile": 1.5}}, "spec.capacity.reservationQuantile"),
        ({"capacity": {"reservationQuantile": 1.0}}, "spec.capacity.reservationQuantile"),
        ({"capacity": {"reservationQuantile": 0.49}}, "spec.capacity.reservationQuantile"),
        (
            {"capacity": {"reservationQuantile": float("nan")}},
            "spec.capacity.reservationQuantile",
        ),
        ({"capacity": {"reservation_quantile": 0.9}}, "spec.capacity.reservation_quantile"),
        ({"slo": {"ttftSeconds": 0}}, "spec.slo.ttftSeconds"),
        ({"slo": {"ttftSeconds": -1}}, "spec.slo.ttftSeconds"),
        ({"slo": {"ttftSeconds": 3601}}, "spec.slo.ttftSeconds"),
        ({"slo": {"tpotSeconds": 0}}, "spec.slo.tpotSeconds"),
        ({"slo": {"tpotSeconds": 10.5}}, "spec.slo.tpotSeconds"),
        ({"slo": {"tpotSeconds": float("inf")}}, "spec.slo.tpotSeconds"),
        ({"slo": {"minPriority": 1001}}, "spec.slo.minPriority"),
        ({"slo": {"minPriority": -1001}}, "spec.slo.minPriority"),
        ({"slo": {"minPriority": 0.5}}, "spec.slo.minPriority"),
        ({"slo": {"ttft": 0.5}}, "spec.slo.ttft"),
        ({"priority": {"forwardTo": "vllm"}}, "spec.priority.forwardTo"),
        ({"priority": {"forwardTo": None}}, "spec.priority.forwardTo"),
    ],
)
def test_invalid_policies_name_the_field(spec: dict[str, Any], field: str) -> None:
    with pytest.raises(PolicyError) as e:
        parse_policy(policy_doc(spec))
    assert f"\n  {field}:" in str(e.value)


def test_wrong_kind_and_api_version_are_refused() -> None:
    with pytest.raises(PolicyError, match="apiVersion"):
        parse_policy({**policy_doc({}), "apiVersion": "v1"})
    with pytest.raises(PolicyError, match="kind"):
        parse_policy({**policy_doc({}), "kind": "Pod"})


def test_load_policy_reports_file_problems(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="cannot read"):
        load_policy(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("spec: [unclosed\n")
    with pytest.raises(PolicyError, match="not valid YAML"):
        load_policy(bad)
    two = tmp_path / "two.yaml"
    two.write_text(
        "apiVersion: kvgate.io/v1alpha1\nkind: RateLimitPolicy\nmetadata: {name: a}\n"
        "---\napiVersion: kvgate.io/v1alpha1\nkind: RateLimitPolicy\n"
        "metadata: {name: b}\n"
    )
    with pytest.raises(PolicyError, match="exactly one"):
        load_policy(two)
