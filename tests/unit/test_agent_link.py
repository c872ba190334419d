"""The sidecar's link to its node agent, pure parts: what the report says and when it is sent
at once."""

from __future__ import annotations

from kvgate_agent.contract.sync import SyncReport
from kvgate_agent.sidecar.node_link.agent_link import (
    gpu_uuids_from_env,
    material_change,
    sidecar_metrics_url,
)


def test_material_changes_of_the_report() -> None:
    base = SyncReport(namespace="ns", name="model-0", kv_capacity_tokens=1000, in_flight=2)
    same = base.model_copy(update={"decisions": {"admitted": 9}, "in_flight": 5})
    assert not material_change(base, same)  # counters and busy -> busier ride along
    for update in (
        {"in_flight": 0},  # went idle
        {"queue_length": 3},  # began queueing
        {"kv_reserved_tokens": 101},  # moved by > 10 % of the capacity
        {"kv_capacity_tokens": 2000},
        {"thresholds_etag": "e2"},
        {"metrics_url": "http://10.0.0.1:8080/metrics"},
        {"gpu_uuids": ["GPU-1"]},
    ):
        assert material_change(base, base.model_copy(update=update)), update
    assert not material_change(base, base.model_copy(update={"kv_reserved_tokens": 100}))
    no_cap = SyncReport(namespace="ns", name="model-0")
    assert material_change(no_cap, no_cap.model_copy(update={"kv_reserved_tokens": 1}))


def test_gpu_uuids_only_when_they_look_like_uuids() -> None:
    uuid = "GPU-5e1b2c3d-0000-1111-2222-333344445555"
    mig = "MIG-9f8e7d6c-aaaa-bbbb-cccc-ddddeeeeffff"
    assert gpu_uuids_from_env({"NVIDIA_VISIBLE_DEVICES": f"{uuid}, {mig}"}) == (uuid, mig)
    assert gpu_uuids_from_env({"KVGATE_GPU_UUIDS": mig, "NVIDIA_VISIBLE_DEVICES": uuid}) == (mig,)
    for value in ("all", "0,1", "none", "void", "", f"{uuid},0"):
        assert gpu_uuids_from_env({"NVIDIA_VISIBLE_DEVICES": value}) == ()
    assert gpu_uuids_from_env({}) == ()


def test_metrics_url_needs_a_pod_ip_reachable_listener() -> None:
    assert sidecar_metrics_url("10.0.3.7", "0.0.0.0", 8081) == "http://10.0.3.7:8081/metrics"
    assert sidecar_metrics_url("fd00::7", "::", 8081) == "http://[fd00::7]:8081/metrics"
    assert sidecar_metrics_url(None, "0.0.0.0", 8081) is None
    assert sidecar_metrics_url("10.0.3.7", "127.0.0.1", 8081) is None  # loopback only
