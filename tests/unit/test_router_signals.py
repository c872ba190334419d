"""Signals for routers, pure: the two gauges appended to the engine's ``/metrics`` (their values,
the exposition they make with the engine's, read back with prometheus_client's parsers) and the
header choice per refusal (``x-envoy-ratelimited`` only for a fleet-wide budget)."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_families
from prometheus_client.parser import text_string_to_metric_families

from kvgate_agent.admission import (
    AdmissionConfig,
    AdmissionController,
    AdmissionRequest,
    AdmissionStats,
    Decision,
    Reason,
)
from kvgate_agent.admission.bucket import SharedBucket
from kvgate_agent.contract.policy import parse_policy
from kvgate_agent.engines.scrape import EngineSample, parse_engine_metrics
from kvgate_agent.sidecar.engine.router_signals import (
    KV_RESERVED_FRACTION,
    QUEUE_DEPTH,
    RouterGauges,
    core_lines,
    router_gauges,
    with_gauges,
)
from kvgate_agent.sidecar.reading.responses import ENVOY_RATELIMITED_HEADER, refusal
from kvgate_bench.kit.toolkit import FakeClock
from tests.unit.test_engine_scrape import vllm_text


def stats(
    queue: int = 0, in_flight: int = 0, reserved: int = 0, capacity: int | None = None
) -> AdmissionStats:
    return AdmissionStats(
        in_flight=in_flight,
        queue_length=queue,
        kv_reserved_tokens=reserved,
        kv_capacity_tokens=capacity,
        kv_headroom_tokens=0,
        concurrency_limit=None,
        engine_concurrency=None,
        seconds_per_token=0.01,
        inter_token_seconds=None,
    )


def families(text: str) -> dict[str, list[float]]:
    """Each family's sample values, as prometheus_client's text parser reads ``text`` (it raises
    on invalid text); a family seen twice fails."""
    out: dict[str, list[float]] = {}
    for f in text_string_to_metric_families(text):
        assert f.name not in out, f"family {f.name} twice"
        out[f.name] = [s.value for s in f.samples]
    return out


# ------------------------------------------------------------------------------ gauge values


def test_queue_depth_is_kvgate_queue_plus_the_engines_waiting() -> None:
    engine = EngineSample(ok=True, engine="vllm", waiting=5, running=2)
    # kvgate's 3 admitted requests not running are among the engine's 5 waiting: counted once.
    g = router_gauges(stats(queue=4, in_flight=5), engine, last_engine_waiting=9)
    assert g.queue_depth == 4 + 5


def test_queue_depth_without_the_engines_figure_uses_the_last_read() -> None:
    assert router_gauges(stats(queue=4), None, last_engine_waiting=2).queue_depth == 6
    no_waiting = EngineSample(ok=False, reason="no known engine metrics")
    assert router_gauges(stats(queue=4), no_waiting, last_engine_waiting=0).queue_depth == 4


@pytest.mark.parametrize(
    ("reserved", "capacity", "usage", "fraction"),
    [
        (250, 1000, 0.9, 0.25),  # a known capacity: reservations, not the engine's usage
        (0, 1000, None, 0.0),
        (1500, 1000, None, 1.0),  # a capacity lowered below what is reserved: clamped
        (100, None, 0.4, 0.4),  # no capacity known: the engine's own usage
        (100, None, None, 0.0),  # ... and none reported: 0, never NaN
        (100, 0, None, 0.0),
    ],
)
def test_kv_reserved_fraction(
    reserved: int, capacity: int | None, usage: float | None, fraction: float
) -> None:
    engine = EngineSample(ok=True, engine="vllm", kv_usage=usage)
    g = router_gauges(stats(reserved=reserved, capacity=capacity), engine, 0)
    assert g.kv_reserved_fraction == pytest.approx(fraction)


# ------------------------------------------------------------------------------ exposition


def test_the_gauges_are_appended_to_the_engines_exposition() -> None:
    engine = vllm_text(waiting="2.0")
    body = with_gauges(engine, RouterGauges(7, 0.5))
    got = families(body)
    assert got[QUEUE_DEPTH] == [7] and got[KV_RESERVED_FRACTION] == [0.5]
    assert got["vllm:num_requests_waiting"] == [2.0]  # the engine's, untouched
    assert body.startswith(engine)
    assert body.count(f"# HELP {QUEUE_DEPTH} ") == body.count(f"# TYPE {QUEUE_DEPTH} ") == 1


def test_an_engine_text_with_the_gauges_already_keeps_one_family_each() -> None:
    inner = with_gauges(vllm_text(), RouterGauges(1, 0.1))  # a sidecar in front of a sidecar
    got = families(with_gauges(inner, RouterGauges(3, 0.3)))
    assert got[QUEUE_DEPTH] == [3] and got[KV_RESERVED_FRACTION] == [0.3]


def test_openmetrics_keeps_eof_last() -> None:
    engine = "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 2.0\n# EOF\n"
    body = with_gauges(engine, RouterGauges(2, 0.0))
    assert body.endswith(f"{KV_RESERVED_FRACTION} 0.0\n# EOF\n")
    names = {f.name for f in om_families(body)}  # type: ignore[no-untyped-call]
    assert {QUEUE_DEPTH, KV_RESERVED_FRACTION, "vllm:num_requests_waiting"} <= names


def test_without_the_engines_text_the_gauges_alone_with_a_comment() -> None:
    body = with_gauges("", RouterGauges(0, 0.0), "the model server's /metrics answered 503")
    assert body.startswith("# kvgate: the model server's /metrics answered 503\n")
    assert families(body) == {QUEUE_DEPTH: [0], KV_RESERVED_FRACTION: [0.0]}


def test_an_engine_text_without_a_final_newline() -> None:
    got = families(with_gauges("vllm:num_requests_waiting 1", RouterGauges(1, 0.0)))
    assert got["vllm:num_requests_waiting"] == [1.0] and got[QUEUE_DEPTH] == [1]


def test_core_lines_read_the_same_figures_as_the_whole_exposition() -> None:
    text = vllm_text(running="3.0", waiting="4.0", usage="0.5") + (
        "# HELP vllm:e2e_request_latency_seconds Histogram\n"
        "# TYPE vllm:e2e_request_latency_seconds histogram\n"
        'vllm:e2e_request_latency_seconds_bucket{le="1.0"} 3.0\n'
        'vllm:e2e_request_latency_seconds_bucket{le="+Inf"} 4.0\n'
        "vllm:e2e_request_latency_seconds_count 4.0\n"
        "vllm:e2e_request_latency_seconds_sum 2.5\n"
    )
    whole, core = parse_engine_metrics(text), parse_engine_metrics(core_lines(text))
    assert core.ok and core.engine == "vllm"
    assert (core.waiting, core.running, core.kv_usage) == (whole.waiting, whole.running, 0.5)
    assert "e2e_request_latency" not in core_lines(text)


# ------------------------------------------------------------------------------ refusals


def controller(spec: dict[str, Any], *, store: bool = False) -> AdmissionController:
    doc = {
        "apiVersion": "kvgate.io/v1alpha1",
        "kind": "RateLimitPolicy",
        "metadata": {"name": "t"},
        "spec": {"tenants": {"defaultMaxTokens": 16}, **spec},
    }
    c = AdmissionController(AdmissionConfig.from_policy(parse_policy(doc).spec), FakeClock())
    if store:
        c.attach_store()
    return c


def refuse(c: AdmissionController, n: int = 3) -> Decision:
    """Submit ``n`` requests of tenant ``a`` (never released); the last one's decision."""
    d = None
    for _ in range(n):
        d = c.submit(AdmissionRequest("a", 10, 16))
    assert d is not None and d.ticket is None and d.waiter is None, d
    return d


REJECT: dict[str, Any] = {"overload": {"actions": ["Reject"]}}


def limit(shared: bool, per: str = "Tenant") -> dict[str, Any]:
    rule = {"name": "r", "per": per, "requestsPerMinute": 60, "burstRequests": 1}
    return {"rateLimits": [{**rule, "shared": shared}], **REJECT}


def synced(c: AdmissionController, level: float, shared_level: float) -> SharedBucket:
    """Tenant ``a``'s slice of the shared limit, as a sync with the store left it."""
    (_, _, buckets), *_ = c.shared_maps()
    ((_, b),) = buckets.items()  # the one slice the first request asked for
    assert isinstance(b, SharedBucket)
    b.level, b.shared_level, b.synced = level, shared_level, True
    return b


@pytest.mark.parametrize("per", ["Tenant", "Global"])
def test_a_spent_fleet_wide_budget_refuses_with_x_envoy_ratelimited(per: str) -> None:
    c = controller(limit(True, per), store=True)
    refuse(c, 1)  # before any sync: an empty slice
    synced(c, 0.0, 0.4)  # less than one request left in the whole budget
    d = refuse(c, 1)
    assert (d.status, d.reason, d.fleet_wide) == (429, Reason.RATE_LIMIT_REQUESTS, True)
    resp = refusal(d)
    assert resp.headers[ENVOY_RATELIMITED_HEADER] == "true"
    assert "Retry-After" in resp.headers


def test_a_short_slice_of_a_budget_not_spent_is_this_replicas_refusal() -> None:
    """Only this pod's slice is short (the store still holds units), or no sync has answered
    yet: another replica's slice may hold it, so a proxy may retry there."""
    c = controller(limit(True), store=True)
    assert not refuse(c, 1).fleet_wide  # before any sync: unknown
    synced(c, 0.0, 2.0)
    assert not refuse(c, 1).fleet_wide


QUEUE_OF_ONE: dict[str, Any] = {
    "concurrency": {"maxRequests": 1},
    "overload": {"actions": ["Queue", "Reject"]},
    "queue": {"maxLength": 1},
}


@pytest.mark.parametrize(
    ("spec", "store", "reason"),
    [
        (limit(False), False, Reason.RATE_LIMIT_REQUESTS),  # a per-pod bucket
        (limit(True), False, Reason.RATE_LIMIT_REQUESTS),  # shared without a store: per pod
        ({"concurrency": {"maxRequests": 1}, **REJECT}, False, Reason.CONCURRENCY),
        ({"capacity": {"kvCacheTokens": 64}, **REJECT}, False, Reason.KV_CAPACITY),
        (QUEUE_OF_ONE, False, Reason.QUEUE_FULL),
    ],
)
def test_this_replica_is_full_is_a_429_without_x_envoy_ratelimited(
    spec: dict[str, Any], store: bool, reason: Reason
) -> None:
    d = refuse(controller(spec, store=store))
    assert (d.status, d.reason, d.fleet_wide) == (429, reason, False)
    resp = refusal(d)
    assert ENVOY_RATELIMITED_HEADER not in resp.headers
    assert int(resp.headers["Retry-After"]) >= 1
