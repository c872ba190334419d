"""GPU monitor driven through the scripted fake backend; NVML on a machine without a driver.

Fake clock for backoff; the only real wait is one tiny ``call_timeout`` for the hung call.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest

from kvgate_agent.gpu import (
    GpuLibraryMissing,
    GpuLost,
    GpuMonitor,
    GpuNotSupported,
    NvmlBackend,
    ProcessMemory,
)
from kvgate_agent.gpu.fake import FakeGpu, FakeGpuBackend, GiB
from kvgate_agent.gpu.nvml import map_nvml_error


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def two_gpus_one_mig() -> list[FakeGpu]:
    return [
        FakeGpu("GPU-0", 0, "H100", used_bytes=10 * GiB, reserved_bytes=GiB, utilization=37,
                processes=[ProcessMemory(4242, 9 * GiB)]),
        FakeGpu("GPU-1", 1, "A100", total_bytes=40 * GiB, utilization=0),
        FakeGpu("MIG-1a", 1, "A100 MIG 3g.20gb", total_bytes=20 * GiB, used_bytes=5 * GiB,
                mig=True, parent_uuid="GPU-1", processes=[ProcessMemory(7, GiB)]),
    ]  # fmt: skip


@pytest.fixture
def fake() -> Iterator[FakeGpuBackend]:
    backend = FakeGpuBackend(two_gpus_one_mig())
    yield backend
    backend.release_all()  # never leave a worker thread blocked


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def monitor(fake: FakeGpuBackend, clock: FakeClock) -> Iterator[GpuMonitor]:
    m = GpuMonitor(fake, clock=clock, call_timeout=0.5)
    yield m
    fake.release_all()
    m.close()


def test_healthy_multi_gpu_and_mig(monitor: GpuMonitor) -> None:
    snap = monitor.poll()
    assert snap.ready and snap.reason is None
    assert [g.uuid for g in snap.gpus] == ["GPU-0", "GPU-1", "MIG-1a"]
    g0 = snap.gpu("GPU-0")
    assert g0 is not None and g0.healthy
    assert (g0.total_bytes, g0.used_bytes, g0.reserved_bytes) == (80 * GiB, 10 * GiB, GiB)
    assert g0.free_bytes == 69 * GiB
    assert g0.utilization == 37
    assert g0.processes == (ProcessMemory(4242, 9 * GiB),)
    g1 = snap.gpu("GPU-1")
    assert g1 is not None and g1.utilization == 0  # a real 0 stays 0
    mig = snap.gpu("MIG-1a")
    assert mig is not None and mig.healthy and mig.mig and mig.parent_uuid == "GPU-1"
    assert mig.utilization is None  # L11: unsupported on MIG, never reported as 0
    assert mig.total_bytes == 20 * GiB
    assert snap.errors_by_kind == {}


def test_gpu_lost_on_one_gpu_keeps_the_others(monitor: GpuMonitor, fake: FakeGpuBackend) -> None:
    assert monitor.poll().ready
    fake.fail("memory", "GPU-0", GpuLost, from_call=2)
    snap = monitor.poll()
    g0, g1 = snap.gpu("GPU-0"), snap.gpu("GPU-1")
    assert g0 is not None and not g0.healthy and g0.reason is not None
    assert g0.reason.startswith("lost")
    assert g0.used_bytes is None and g0.utilization is None  # no stale values (L12)
    assert g1 is not None and g1.healthy and g1.total_bytes == 40 * GiB
    assert snap.ready and snap.reason is not None and snap.reason.startswith("degraded")
    assert "GPU-0" in snap.reason
    assert snap.errors_by_kind == {"lost": 1}
    # lost during utilization too (not just memory) isolates the same way
    fake.fail("utilization", "GPU-1", GpuLost)
    snap = monitor.poll()
    assert [g.healthy for g in snap.gpus] == [False, False, True]
    assert snap.errors_by_kind == {"lost": 3}


def test_gpu_disappearing_from_enumeration_is_reported_lost(
    monitor: GpuMonitor, fake: FakeGpuBackend
) -> None:
    monitor.poll()
    del fake.gpus["GPU-0"]
    snap = monitor.poll()
    g0 = snap.gpu("GPU-0")
    assert g0 is not None and not g0.healthy and g0.reason is not None and "lost" in g0.reason
    assert snap.ready


def test_not_supported(monitor: GpuMonitor, fake: FakeGpuBackend) -> None:
    fake.fail("utilization", "GPU-0", GpuNotSupported)
    fake.fail("processes", "GPU-0", GpuNotSupported)
    fake.fail("memory", "GPU-1", GpuNotSupported)
    snap = monitor.poll()
    g0, g1 = snap.gpu("GPU-0"), snap.gpu("GPU-1")
    assert g0 is not None and g0.healthy
    assert g0.utilization is None and g0.processes is None and g0.used_bytes == 10 * GiB
    # without memory a GPU cannot be used for admission
    assert (
        g1 is not None
        and not g1.healthy
        and g1.reason == "not_supported: scripted not_supported on memory"
    )
    assert snap.errors_by_kind == {"not_supported": 3}


def test_library_missing_at_init_then_recovery_after_backoff(
    fake: FakeGpuBackend, clock: FakeClock
) -> None:
    fake.fail_init(2)
    m = GpuMonitor(fake, clock=clock, call_timeout=0.5, init_backoff=1.0, init_backoff_max=8.0)
    try:
        snap = m.poll()
        assert not snap.ready and snap.gpus == ()
        assert snap.reason is not None and "library_missing" in snap.reason
        assert fake.calls[("init", None)] == 1
        assert m.next_init_at == clock.now + 1.0

        clock.now += 0.5  # before the deadline: no retry
        assert not m.poll().ready
        assert fake.calls[("init", None)] == 1

        clock.now += 0.5  # deadline reached: retry, fails again, backoff doubles
        assert not m.poll().ready
        assert fake.calls[("init", None)] == 2
        assert m.next_init_at == clock.now + 2.0

        clock.now += 1.9
        m.poll()
        assert fake.calls[("init", None)] == 2
        clock.now += 0.1
        snap = m.poll()
        assert fake.calls[("init", None)] == 3
        assert snap.ready and snap.reason is None and len(snap.gpus) == 3
        assert snap.errors_by_kind == {"library_missing": 2}
    finally:
        m.close()


def test_init_backoff_is_capped(fake: FakeGpuBackend, clock: FakeClock) -> None:
    fake.fail_init(100)
    m = GpuMonitor(fake, clock=clock, init_backoff=1.0, init_backoff_max=4.0)
    try:
        for _ in range(6):
            clock.now = max(clock.now, m.next_init_at)
            m.poll()
        assert m.next_init_at - clock.now == 4.0
    finally:
        m.close()


def test_hung_call_is_bounded_and_not_resubmitted(fake: FakeGpuBackend, clock: FakeClock) -> None:
    release = fake.hang("memory", "GPU-1")
    m = GpuMonitor(fake, clock=clock, call_timeout=0.05)
    try:
        started = time.monotonic()
        snap = m.poll()
        assert time.monotonic() - started < 0.5
        g1 = snap.gpu("GPU-1")
        assert g1 is not None and not g1.healthy and g1.reason is not None
        assert g1.reason.startswith("timeout")
        g0 = snap.gpu("GPU-0")
        assert g0 is not None and g0.healthy and snap.ready
        assert snap.errors_by_kind == {"timeout": 1}

        # still hung: reported again without starting another call (no wait this time)
        started = time.monotonic()
        snap = m.poll()
        assert time.monotonic() - started < 0.04
        g1 = snap.gpu("GPU-1")
        assert g1 is not None and not g1.healthy and g1.reason is not None
        assert g1.reason.startswith("timeout")
        assert fake.calls[("memory", "GPU-1")] == 1

        release.set()
        deadline = time.monotonic() + 0.5
        while True:  # the released call returns in the worker; then GPU-1 is read afresh
            g1 = m.poll().gpu("GPU-1")
            assert g1 is not None
            if g1.healthy or time.monotonic() > deadline:
                break
            time.sleep(0.005)
        assert g1.healthy and g1.total_bytes == 40 * GiB
        assert fake.calls[("memory", "GPU-1")] == 2
    finally:
        fake.release_all()
        m.close()


def test_implausible_process_values_dropped(
    monitor: GpuMonitor, fake: FakeGpuBackend, caplog: pytest.LogCaptureFixture
) -> None:
    fake.gpus["GPU-0"].processes = [
        ProcessMemory(0, GiB),  # pid 0
        ProcessMemory(-5, GiB),  # negative pid
        ProcessMemory(77, 81 * GiB),  # more than the device holds (swapped fields)
        ProcessMemory(88, 2 * GiB),
        ProcessMemory(99, None),  # usage not available: pid still valid
    ]
    fake.gpus["GPU-1"].processes = [ProcessMemory(12, 10**15)]  # all dropped -> unknown
    with caplog.at_level(logging.WARNING, logger="kvgate_agent.gpu.monitor"):
        snap = monitor.poll()
    g0, g1 = snap.gpu("GPU-0"), snap.gpu("GPU-1")
    assert g0 is not None and g0.processes == (ProcessMemory(88, 2 * GiB), ProcessMemory(99, None))
    assert g1 is not None and g1.processes is None
    assert snap.errors_by_kind == {"implausible_process": 4}
    assert sum("dropped process" in r.message for r in caplog.records) == 4


def test_empty_process_list_is_unknown(monitor: GpuMonitor) -> None:
    g1 = monitor.poll().gpu("GPU-1")
    assert g1 is not None and g1.healthy and g1.processes is None  # not "no usage"


def test_no_usable_gpu_degrades_readiness(monitor: GpuMonitor, fake: FakeGpuBackend) -> None:
    fake.fail("memory", None, GpuLost)
    snap = monitor.poll()
    assert not snap.ready
    assert snap.reason is not None and snap.reason.startswith("no usable GPU")
    assert all(not g.healthy for g in snap.gpus) and len(snap.gpus) == 3


def test_no_gpus_at_all_is_not_ready(clock: FakeClock) -> None:
    m = GpuMonitor(FakeGpuBackend([]), clock=clock)
    try:
        snap = m.poll()
        assert not snap.ready and snap.reason == "no GPUs found"
    finally:
        m.close()


def test_backend_bug_is_contained(monitor: GpuMonitor, fake: FakeGpuBackend) -> None:
    def broken(uuid: str) -> int:
        raise ZeroDivisionError("oops")

    fake.utilization = broken  # type: ignore[method-assign]
    snap = monitor.poll()
    assert not snap.ready and snap.errors_by_kind == {"unknown": 3}


def test_nvml_error_mapping() -> None:
    import pynvml

    cases = {
        pynvml.NVML_ERROR_GPU_IS_LOST: "lost",
        pynvml.NVML_ERROR_NOT_SUPPORTED: "not_supported",
        pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: "library_missing",
        pynvml.NVML_ERROR_DRIVER_NOT_LOADED: "library_missing",
        pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH: "library_missing",
        pynvml.NVML_ERROR_UNKNOWN: "unknown",
        pynvml.NVML_ERROR_NO_PERMISSION: "unknown",
    }
    for code, kind in cases.items():
        err = map_nvml_error(pynvml.NVMLError(code), uuid="GPU-x")
        assert err.kind == kind and err.uuid == "GPU-x"


def test_nvml_backend_without_driver(clock: FakeClock) -> None:
    backend = NvmlBackend()
    try:
        backend.init()
    except GpuLibraryMissing as exc:
        assert exc.kind == "library_missing"
    else:  # pragma: no cover - only on a machine with an NVIDIA driver: read it for real
        try:
            snap = GpuMonitor(backend, call_timeout=5.0).poll()
            assert snap.ready and snap.gpus, snap.reason
            assert all(g.total_bytes and g.total_bytes > 0 for g in snap.gpus if g.healthy)
        finally:
            backend.shutdown()
        return
    backend.shutdown()  # safe when never initialised

    m = GpuMonitor(backend, clock=clock, call_timeout=2.0)
    try:
        snap = m.poll()  # never raises
        assert not snap.ready and snap.gpus == ()
        assert snap.reason is not None
        assert snap.reason.startswith("GPU library init failed (library_missing")
        assert "retry in 1.0s" in snap.reason
        assert snap.errors_by_kind == {"library_missing": 1}
    finally:
        m.close()


def test_nvml_backend_mig_and_memory_v1_fallback() -> None:
    """NvmlBackend against a stand-in pynvml module (no driver here)."""
    from types import SimpleNamespace

    import pynvml

    err = pynvml.NVMLError
    handles = {"g0": "GPU-0", "g1": "GPU-1", "m0": "MIG-1a"}

    def mem(handle: str, version: int | None = None) -> SimpleNamespace:
        if version is not None:
            raise err(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)  # old driver: v1 only
        if handle == "g0":
            raise err(pynvml.NVML_ERROR_GPU_IS_LOST)
        return SimpleNamespace(total=40 * GiB, used=GiB, free=39 * GiB)

    def util(handle: str) -> SimpleNamespace:
        if handle == "m0":
            raise err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return SimpleNamespace(gpu=12)

    def mig_handle(handle: str, slot: int) -> str:
        if slot:
            raise err(pynvml.NVML_ERROR_NOT_FOUND)  # empty slot
        return "m0"

    stub = SimpleNamespace(
        NVMLError=err,
        nvmlMemory_v2=pynvml.nvmlMemory_v2,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: f"g{i}",
        nvmlDeviceGetUUID=lambda h: handles[h].encode(),
        nvmlDeviceGetName=lambda h: "A100",
        nvmlDeviceGetMigMode=lambda h: [1, 1] if h == "g1" else [0, 0],
        nvmlDeviceGetMaxMigDeviceCount=lambda h: 7,
        nvmlDeviceGetMigDeviceHandleByIndex=mig_handle,
        nvmlDeviceGetMemoryInfo=mem,
        nvmlDeviceGetUtilizationRates=util,
        nvmlDeviceGetComputeRunningProcesses=lambda h: [SimpleNamespace(pid=5, usedGpuMemory=None)],
    )
    backend = NvmlBackend(nvml=stub)  # type: ignore[arg-type]
    backend.init()
    devices = backend.devices()
    assert [(d.uuid, d.index, d.mig, d.parent_uuid) for d in devices] == [
        ("GPU-0", 0, False, None),
        ("GPU-1", 1, False, None),
        ("MIG-1a", 1, True, "GPU-1"),
    ]
    with pytest.raises(GpuLost) as lost:
        backend.memory("GPU-0")
    assert lost.value.uuid == "GPU-0"
    assert backend.memory("MIG-1a").reserved_bytes is None  # v1 fallback
    assert backend.utilization("MIG-1a") is None
    assert backend.utilization("GPU-1") == 12
    assert backend.processes("GPU-1") == [ProcessMemory(5, None)]
