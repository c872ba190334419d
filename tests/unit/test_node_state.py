"""The node agent's pure parts: answers, capacity sources, safety net, status gate, auth."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import pytest

from kvgate_agent.contract.nodeadmission import NodeAdmissionSpec, PodAdmission
from kvgate_agent.contract.sync import SyncReport
from kvgate_agent.gpu.monitor import GpuSnapshot, GpuStatus
from kvgate_agent.node.auth import (
    POD_NAME_EXTRA,
    POD_UID_EXTRA,
    Authenticator,
    AuthError,
    Review,
    review_from_status,
    token_expiry,
)
from kvgate_agent.node.podgpu import attribute_gpus
from kvgate_agent.node.safety import SAFETY_HYSTERESIS
from kvgate_agent.node.scrape import metrics_url_allowed
from kvgate_agent.node.state import EngineFacts, NodeState, StatusGate
from kvgate_bench.kit.toolkit import FakeClock

GiB = 1 << 30


def pod(name: str, capacity: dict[str, Any] | None = None, **thresholds: Any) -> PodAdmission:
    return PodAdmission.model_validate(
        {
            "namespace": "models",
            "name": name,
            "uid": f"uid-{name}",
            "policy": {"namespace": "models", "name": "p", "generation": 3},
            "thresholds": {
                "rateLimits": [{"name": "t", "per": "Tenant", "tokensPerMinute": 6000}],
                "capacity": capacity or {},
                **thresholds,
            },
        }
    )


def gpu(uuid: str, free: int | None, total: int = 80 * GiB, healthy: bool = True) -> GpuStatus:
    return GpuStatus(
        uuid=uuid,
        index=0,
        name="H100",
        mig=False,
        parent_uuid=None,
        healthy=healthy,
        reason=None if healthy else "lost",
        total_bytes=total if healthy else None,
        used_bytes=None if free is None else total - free,
        free_bytes=free,
    )


def snapshot(*gpus: GpuStatus) -> GpuSnapshot:
    return GpuSnapshot(
        tuple(gpus), any(g.healthy for g in gpus), None if any(g.healthy for g in gpus) else "x"
    )


def state_with(*pods: PodAdmission) -> NodeState:
    st = NodeState("n1", ttl_seconds=20, sync_interval_seconds=1)
    st.set_spec(NodeAdmissionSpec(node_name="n1", pods=list(pods)), now=0.0)
    return st


def report(name: str, **kw: Any) -> SyncReport:
    return SyncReport(namespace="models", name=name, uid=f"uid-{name}", **kw)


# ---------------------------------------------------------------------------- answers


def test_answer_carries_thresholds_and_a_stable_etag() -> None:
    st = state_with(pod("a"), pod("b"))
    a1 = st.answer(("models", "a"))
    assert a1.pod is not None and a1.pod.policy.generation == 3
    assert a1.ttl_seconds == 20 and a1.safety_net.open
    assert st.answer(("models", "a")).etag == a1.etag  # unchanged input, same ETag
    assert st.answer(("models", "b")).etag != a1.etag  # another pod, another answer
    st.set_spec(NodeAdmissionSpec(node_name="n1", pods=[pod("a")]), now=1.0)
    assert st.answer(("models", "a")).etag == a1.etag  # same content after a re-read
    changed = pod("a", concurrency={"maxRequests": 4})
    st.set_spec(NodeAdmissionSpec(node_name="n1", pods=[changed]), now=2.0)
    a2 = st.answer(("models", "a"))
    assert a2.etag != a1.etag and a2.pod is not None
    assert a2.pod.thresholds.concurrency.max_requests == 4


def test_ungoverned_pod_gets_no_thresholds() -> None:
    st = state_with(pod("a"))
    ans = st.answer(("models", "stranger"))
    assert ans.pod is None and ans.safety_net.open
    st.set_spec(None, now=1.0)
    assert st.answer(("models", "a")).pod is None


def test_engine_capacity_overrides_estimates_and_explicit_only_when_asked() -> None:
    explicit = pod("a", capacity={"kvCacheTokens": 1000})
    from_engine = pod("b", capacity={"fromEngineMetrics": True, "kvCacheTokens": 1000})
    st = state_with(explicit, from_engine)
    for name in ("a", "b"):
        st.set_engine(("models", name), EngineFacts(kv_capacity_tokens=32768, kv_used_tokens=10))
    assert st.kv_capacity(("models", "a")) == 1000  # explicit beats the engine unless asked
    assert st.kv_capacity(("models", "b")) == 32768
    before = st.answer(("models", "b")).etag
    st.set_engine(("models", "b"), None)  # stale engine data: back to the operator's value
    assert st.kv_capacity(("models", "b")) == 1000
    assert st.answer(("models", "b")).etag != before


def test_nvml_estimate_only_when_the_pods_gpus_are_known() -> None:
    cap = {"gpuMemoryUtilization": 0.9, "weightsBytes": 16 * GiB, "safetyMarginBytes": GiB}
    model = {"numLayers": 32, "numKVHeads": 8, "headDim": 128}  # 131072 bytes per token
    st = state_with(pod("a", capacity=cap, model=model))
    st.set_gpus(snapshot(gpu("GPU-0", 40 * GiB), gpu("GPU-1", 40 * GiB)), {})
    assert st.kv_capacity(("models", "a")) is None  # two GPUs, which one is unknown
    st.set_gpus(snapshot(gpu("GPU-0", 40 * GiB), gpu("GPU-1", 40 * GiB)), {"uid-a": {"GPU-1"}})
    expected = (int(80 * GiB * 0.9) - 16 * GiB - GiB) // 131072
    assert st.kv_capacity(("models", "a")) == expected
    assert st.status().pods[0].gpu_source == "nvml_processes"


# ---------------------------------------------------------------------------- safety net


def test_safety_net_closes_below_margin_and_reopens_with_hysteresis() -> None:
    margin = 2 * GiB
    st = state_with(pod("a", capacity={"safetyMarginBytes": margin}), pod("b"))
    key = ("models", "a")
    st.set_gpus(snapshot(gpu("GPU-0", 10 * GiB)), {})
    assert st.answer(key).safety_net.open
    st.set_gpus(snapshot(gpu("GPU-0", margin - 1)), {})
    net = st.answer(key).safety_net
    assert not net.open and net.gpu_uuid == "GPU-0" and net.free_bytes == margin - 1
    assert "below the safety margin" in (net.reason or "")
    assert st.answer(("models", "b")).safety_net.open  # no margin in b's policy: no net
    assert [c.status for c in st.conditions() if c.type == "GpuMemoryLow"] == ["True"]
    st.set_gpus(snapshot(gpu("GPU-0", margin + 1)), {})  # just above: still closed
    assert not st.answer(key).safety_net.open
    st.set_gpus(snapshot(gpu("GPU-0", int(margin * (1 + SAFETY_HYSTERESIS)) + 1)), {})
    assert st.answer(key).safety_net.open
    assert [c.status for c in st.conditions() if c.type == "GpuMemoryLow"] == ["False"]


def test_safety_net_uses_the_pods_gpus_and_ignores_unreadable_ones() -> None:
    st = state_with(pod("a", capacity={"safetyMarginBytes": GiB}))
    key = ("models", "a")
    low, fine = gpu("GPU-0", GiB // 2), gpu("GPU-1", 30 * GiB)
    st.set_gpus(snapshot(low, fine), {})
    assert not st.answer(key).safety_net.open  # GPUs unknown: every GPU counts
    st.record(report("a", gpu_uuids=["GPU-1"]), now=1.0)
    assert st.answer(key).safety_net.open  # the sidecar says it uses GPU-1 only
    st.set_gpus(snapshot(gpu("GPU-0", None, healthy=False), gpu("GPU-1", None, healthy=False)), {})
    assert st.answer(key).safety_net.open  # unknown is not "full"


def test_gpu_attribution_order() -> None:
    node = ["GPU-0", "GPU-1"]
    assert attribute_gpus("u", ["GPU-1"], {"u": {"GPU-0"}}, node).source == "reported"
    got = attribute_gpus("u", ["GPU-9"], {"u": {"GPU-0"}}, node)  # not on this node: ignored
    assert (got.source, set(got.uuids)) == ("nvml_processes", {"GPU-0"})
    got = attribute_gpus("u", [], {}, node)
    assert (got.source, set(got.uuids)) == ("all_gpus", set(node))


# ---------------------------------------------------------------------------- status


def test_status_lists_pods_gpus_and_usage() -> None:
    st = state_with(pod("a"))
    st.set_gpus(snapshot(gpu("GPU-0", 10 * GiB), gpu("GPU-1", None, healthy=False)), {})
    st.record(report("a", in_flight=3, kv_reserved_tokens=4096), now=1.0)
    # A sidecar of a pod not in the spec (ungoverned, or on another node): never in the status.
    st.record(report("extra", in_flight=7, kv_reserved_tokens=12345), now=1.0)
    st.set_engine(("models", "a"), EngineFacts(kv_capacity_tokens=50000, kv_used_tokens=3000))
    s = st.status()
    assert [(p.name, p.in_flight, p.kv_reserved_tokens) for p in s.pods] == [("a", 3, 4096)]
    assert s.pods[0].engine_kv_capacity_tokens == 50000 and s.pods[0].kv_used_tokens == 3000
    bad = next(g for g in s.gpus if g.uuid == "GPU-1")
    assert not bad.healthy and bad.free_bytes is None  # unknown, never 0
    ready = next(c for c in s.conditions if c.type == "Ready")
    assert (ready.status, ready.reason) == ("True", "SomeGpusUnhealthy")
    assert st.expire(now=100.0) == [("models", "a"), ("models", "extra")]
    assert st.connected(100.0) == 0


def test_no_usable_gpu_makes_ready_false() -> None:
    st = state_with()
    st.set_gpus(snapshot(gpu("GPU-0", None, healthy=False)), {})
    ready = next(c for c in st.conditions() if c.type == "Ready")
    assert (ready.status, ready.reason) == ("False", "NoUsableGpu")


def test_status_gate_writes_on_meaningful_change_at_a_bounded_rate() -> None:
    st = state_with(pod("a", capacity={"kvCacheTokens": 10000}))
    st.set_gpus(snapshot(gpu("GPU-0", 40 * GiB)), {})
    caps = {("models", "a"): 10000}
    gate = StatusGate(min_interval=5, heartbeat_interval=60)
    s = st.status()
    assert gate.due(s, caps, now=0.0)
    gate.wrote(s, now=0.0)
    st.record(report("a", in_flight=1, kv_reserved_tokens=5000), now=1.0)
    s = st.status()
    assert not gate.due(s, caps, now=1.0)  # meaningful, but too soon
    assert gate.due(s, caps, now=5.0)
    gate.wrote(s, now=5.0)
    st.record(report("a", in_flight=2, kv_reserved_tokens=5500), now=6.0)  # < 10% of capacity
    st.set_gpus(snapshot(gpu("GPU-0", 40 * GiB - GiB)), {})  # < 5% of 80 GiB
    s = st.status()
    assert not gate.due(s, caps, now=20.0)  # nothing meaningful
    assert gate.due(s, caps, now=65.0)  # heartbeat
    st.set_gpus(snapshot(gpu("GPU-0", None, healthy=False)), {})
    assert gate.due(st.status(), caps, now=11.0)  # health changed


# ---------------------------------------------------------------------------- auth


def status_for(ns: str, name: str, uid: str, audiences: list[str] | None = None) -> dict[str, Any]:
    return {
        "authenticated": True,
        "audiences": audiences or ["kvgate-agent"],
        "user": {
            "username": f"system:serviceaccount:{ns}:model",
            "extra": {POD_NAME_EXTRA: [name], POD_UID_EXTRA: [uid]},
        },
    }


def test_review_interpretation() -> None:
    ok = review_from_status(status_for("models", "a", "uid-a"))
    assert ok.identity is not None and ok.identity.name == "a"
    assert review_from_status({"authenticated": False, "error": "expired"}).status == 401
    assert review_from_status(status_for("m", "a", "u", ["other"])).code == "wrong_audience"
    unbound = status_for("m", "a", "u")
    unbound["user"]["extra"] = {}
    assert review_from_status(unbound).status == 403
    assert review_from_status({"authenticated": True, "user": {"username": "alice"}}).status == 403


async def _inline(fn: Any) -> Review:
    return fn()  # type: ignore[no-any-return]


async def test_authenticator_matches_the_pod_and_caches() -> None:
    calls: list[str] = []

    def reviewer(token: str) -> Review:
        calls.append(token)
        if token == "bad":
            return review_from_status({"authenticated": False})
        if token == "boom":
            raise RuntimeError("apiserver down")
        return review_from_status(status_for("models", "a", "uid-a"))

    clock = FakeClock()
    auth = Authenticator(reviewer, clock, ok_ttl=60, refused_ttl=5, run=_inline)
    ident = await auth.verify("Bearer good", "models", "a", "uid-a")
    assert ident.uid == "uid-a"
    await auth.verify("Bearer good", "models", "a", None)
    assert calls == ["good"]  # cached
    with pytest.raises(AuthError) as e:
        await auth.verify("Bearer good", "models", "b", None)  # a's token claiming b
    assert e.value.status == 403 and "models/a" in e.value.message
    with pytest.raises(AuthError) as e:
        await auth.verify("Bearer good", "models", "a", "uid-other")
    assert e.value.status == 403
    for header in (None, "", "Basic abc", "Bearer "):
        with pytest.raises(AuthError) as e:
            await auth.verify(header, "models", "a", None)
        assert e.value.status == 401
    with pytest.raises(AuthError):
        await auth.verify("Bearer bad", "models", "a", None)
    with pytest.raises(AuthError):
        await auth.verify("Bearer bad", "models", "a", None)
    assert calls.count("bad") == 1  # refusals are cached too
    with pytest.raises(AuthError) as e:
        await auth.verify("Bearer boom", "models", "a", None)
    assert (e.value.status, e.value.code) == (503, "review_unavailable")  # not the token's fault
    clock.now = 61
    await auth.verify("Bearer good", "models", "a", None)
    assert calls.count("good") == 2  # expired from the cache


async def test_an_api_server_outage_keeps_recently_accepted_tokens() -> None:
    down = False

    def reviewer(token: str) -> Review:
        if down:
            raise ConnectionRefusedError("apiserver down")
        return review_from_status(status_for("models", "a", "uid-a"))

    clock = FakeClock()
    auth = Authenticator(reviewer, clock, ok_ttl=60, stale_ttl=600, run=_inline)
    await auth.verify("Bearer good", "models", "a", None)
    down = True
    clock.now = 300  # cache expired, API server unreachable: the earlier acceptance holds
    assert (await auth.verify("Bearer good", "models", "a", None)).name == "a"
    assert (auth.review_errors, auth.stale_uses) == (1, 1)
    with pytest.raises(AuthError) as e:  # but it still belongs to pod a only
        await auth.verify("Bearer good", "models", "b", None)
    assert e.value.status == 403
    with pytest.raises(AuthError) as e:  # a token never seen cannot be checked now
        await auth.verify("Bearer new", "models", "a", None)
    assert e.value.status == 503
    clock.now = 700  # beyond stale_ttl: no longer trusted without asking
    with pytest.raises(AuthError) as e:
        await auth.verify("Bearer good", "models", "a", None)
    assert e.value.status == 503


def _jwt(claims: dict[str, Any]) -> str:
    """An unsigned JWT-shaped token with ``claims`` (the reviewer below accepts it anyway)."""

    def part(obj: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).decode().rstrip("=")

    return f"{part({'alg': 'RS256'})}.{part(claims)}.c2ln"


def test_token_expiry_reads_exp_or_nothing() -> None:
    assert token_expiry(_jwt({"exp": 1700000000})) == 1700000000.0
    for token in ("opaque", "a.b.c", _jwt({"exp": "soon"}), _jwt({"exp": True}), _jwt({})):
        assert token_expiry(token) is None, token


async def test_no_acceptance_outlives_the_tokens_exp() -> None:
    """An accepted token is trusted for ok_ttl (60 s), and for stale_ttl (600 s) while the API
    server is down, but never past its own exp: here 30 s after it was first accepted."""
    down = False

    def reviewer(token: str) -> Review:
        if down:
            raise ConnectionRefusedError("apiserver down")
        return review_from_status(status_for("models", "a", "uid-a"))

    clock, wall = FakeClock(), FakeClock(1_000_000.0)
    auth = Authenticator(reviewer, clock, ok_ttl=60, stale_ttl=600, run=_inline, wall=wall)
    token = "Bearer " + _jwt({"exp": wall.now + 30})
    await auth.verify(token, "models", "a", None)
    clock.now, wall.now = 29, wall.now + 29
    await auth.verify(token, "models", "a", None)
    assert auth.reviews == 1  # still cached, before exp
    down = True
    clock.now, wall.now = 31, wall.now + 2  # past exp: the cache no longer vouches for it
    with pytest.raises(AuthError) as e:
        await auth.verify(token, "models", "a", None)
    assert e.value.status == 503 and auth.stale_uses == 0
    down, clock.now = False, 40  # past retry_after_failure (5 s)
    opaque = "Bearer not-a-jwt"  # no exp to read: the plain TTLs apply
    await auth.verify(opaque, "models", "a", None)
    clock.now += 59
    await auth.verify(opaque, "models", "a", None)
    assert auth.reviews == 3


async def test_concurrent_checks_of_one_token_share_a_review() -> None:
    calls: list[str] = []
    gate = asyncio.Event()

    async def run(fn: Any) -> Review:
        await gate.wait()
        return fn()  # type: ignore[no-any-return]

    def reviewer(token: str) -> Review:
        calls.append(token)
        return review_from_status(status_for("models", "a", "uid-a"))

    auth = Authenticator(reviewer, FakeClock(), run=run)
    tasks = [asyncio.create_task(auth.verify("Bearer t", "models", "a", None)) for _ in range(20)]
    await asyncio.sleep(0)
    gate.set()
    assert {i.uid for i in await asyncio.gather(*tasks)} == {"uid-a"}
    assert calls == ["t"] and auth.reviews == 1


def test_implausible_engine_capacity_is_ignored() -> None:
    model = {"numLayers": 32, "numKVHeads": 8, "headDim": 128, "maxModelLen": 8192}
    st = state_with(
        pod("a", capacity={"fromEngineMetrics": True, "kvCacheTokens": 20000}, model=model)
    )
    st.set_gpus(snapshot(gpu("GPU-0", 40 * GiB)), {})
    key = ("models", "a")
    for absurd in (16, 10**19, (80 * GiB) // 131072 + 1):  # < maxModelLen, huge, > GPU memory
        st.set_engine(key, EngineFacts(kv_capacity_tokens=absurd))
        assert st.kv_capacity(key) == 20000, absurd  # the policy's explicit value instead
        assert (
            key in st.capacity.implausible and st.status().pods[0].engine_kv_capacity_tokens is None
        )
    st.set_engine(key, EngineFacts(kv_capacity_tokens=100_000))
    assert st.kv_capacity(key) == 100_000 and key not in st.capacity.implausible


def test_a_stopped_agent_says_so() -> None:
    st = state_with(pod("a"))
    st.set_gpus(snapshot(gpu("GPU-0", 40 * GiB)), {})
    st.stopped = True
    ready = next(c for c in st.conditions() if c.type == "Ready")
    assert (ready.status, ready.reason) == ("False", "AgentStopped")


async def test_authenticator_cache_is_bounded() -> None:
    auth = Authenticator(
        lambda t: review_from_status({"authenticated": False}),
        FakeClock(),
        max_entries=3,
        run=_inline,
    )
    for i in range(10):
        with pytest.raises(AuthError):
            await auth.verify(f"Bearer t{i}", "m", "a", None)
    assert len(auth._cache) == 3
    await asyncio.sleep(0)


def test_metrics_url_only_to_the_sidecars_own_address() -> None:
    assert metrics_url_allowed("http://10.0.0.7:8080/metrics", "10.0.0.7")
    assert metrics_url_allowed("http://127.0.0.1:8080/metrics", "127.0.0.1")
    assert not metrics_url_allowed("http://10.0.0.8:8080/metrics", "10.0.0.7")
    assert not metrics_url_allowed("http://169.254.169.254/latest", "10.0.0.7")
    assert not metrics_url_allowed("http://kubernetes.default/metrics", "10.0.0.7")
    assert not metrics_url_allowed("file:///etc/passwd", "10.0.0.7")
    assert not metrics_url_allowed("http://10.0.0.7/metrics", None)


@pytest.mark.parametrize(
    "field, value",
    [
        ("inFlight", True),
        ("inFlight", "3"),
        ("kvReservedTokens", 10**30),
        ("queueLength", -1),
        ("kvCapacityTokens", 0),
        ("metricsUrl", "file:///etc/passwd"),
    ],
)
def test_sync_reports_are_strict(field: str, value: Any) -> None:
    from pydantic import ValidationError

    body = {"namespace": "models", "name": "a", field: value}
    with pytest.raises(ValidationError):
        SyncReport.model_validate_json(__import__("json").dumps(body))


async def test_a_cancelled_caller_does_not_cancel_the_shared_review() -> None:
    gate = asyncio.Event()
    calls: list[str] = []

    async def run(fn: Any) -> Review:
        await gate.wait()
        return fn()  # type: ignore[no-any-return]

    def reviewer(token: str) -> Review:
        calls.append(token)
        return review_from_status(status_for("models", "a", "uid-a"))

    auth = Authenticator(reviewer, FakeClock(), run=run)
    first = asyncio.create_task(auth.verify("Bearer t", "models", "a", None))
    second = asyncio.create_task(auth.verify("Bearer t", "models", "a", None))
    await asyncio.sleep(0)
    first.cancel()
    gate.set()
    assert (await second).uid == "uid-a"
    await auth.verify("Bearer t", "models", "a", None)  # cached: no second review
    assert calls == ["t"]


async def test_after_a_failed_review_none_is_tried_for_a_while() -> None:
    calls: list[str] = []

    def reviewer(token: str) -> Review:
        calls.append(token)
        raise TimeoutError("apiserver hangs")

    clock = FakeClock()
    auth = Authenticator(reviewer, clock, retry_after_failure=5, run=_inline)
    for _ in range(3):
        with pytest.raises(AuthError) as e:
            await auth.verify("Bearer t", "models", "a", None)
        assert e.value.status == 503
    assert calls == ["t"]  # one slow review, then immediate answers
    clock.now = 6
    with pytest.raises(AuthError):
        await auth.verify("Bearer t", "models", "a", None)
    assert calls == ["t", "t"]


def test_an_unread_gpu_does_not_make_an_engine_capacity_implausible() -> None:
    model = {"numLayers": 32, "numKVHeads": 8, "headDim": 128}  # 131072 bytes per token
    st = state_with(pod("a", capacity={"fromEngineMetrics": True}, model=model))
    key = ("models", "a")
    st.record(report("a", gpu_uuids=["GPU-0", "GPU-1"]), now=0.0)  # tensor parallel over two
    st.set_gpus(snapshot(gpu("GPU-0", 40 * GiB), gpu("GPU-1", None, healthy=False)), {})
    one_gpu_plus = (80 * GiB) // 131072 + 1  # more than one GPU holds, within two
    st.set_engine(key, EngineFacts(kv_capacity_tokens=one_gpu_plus))
    assert st.kv_capacity(key) == one_gpu_plus and key not in st.capacity.implausible
