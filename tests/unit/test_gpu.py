"""GPU monitor driven through the scripted fake backend and the file-driven one; NVML on a
machine without a driver.

Fake clock for backoff; the only real waits are the short ``call_timeout``s for the hung calls
(1 s: long enough for a healthy read in a worker thread on a busy machine).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvgate_agent.gpu import (
    GpuBackend,
    GpuLibraryMissing,
    GpuLost,
    GpuMonitor,
    GpuNotSupported,
    GpuTimeout,
    GpuUnknownError,
    NvmlBackend,
    ProcessMemory,
    backend_from_spec,
)
from kvgate_agent.gpu.fake import FakeGpu, FakeGpuBackend, FileFakeGpuBackend, swapped_fields
from kvgate_agent.gpu.fake_scenario import GiB, write_scenario
from kvgate_agent.gpu.monitor import PID_MAX_LIMIT, read_pid_max
from kvgate_agent.gpu.nvml import map_nvml_error
from kvgate_bench.kit.toolkit import FakeClock, poll_until


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
    return FakeClock(1000.0)


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
    # NVML answers NotSupported on MIG (https://github.com/dask/distributed/issues/8739): None,
    # never reported as 0
    assert mig.utilization is None
    assert mig.total_bytes == 20 * GiB
    assert snap.errors_by_kind == {}


def test_gpu_lost_on_one_gpu_keeps_the_others(monitor: GpuMonitor, fake: FakeGpuBackend) -> None:
    assert monitor.poll().ready
    fake.fail("memory", "GPU-0", GpuLost, from_call=2)
    snap = monitor.poll()
    g0, g1 = snap.gpu("GPU-0"), snap.gpu("GPU-1")
    assert g0 is not None and not g0.healthy and g0.reason is not None
    assert g0.reason.startswith("lost")
    # no stale values after a failed read (https://github.com/rossumai/nvgpu/issues/6)
    assert g0.used_bytes is None and g0.utilization is None
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
    m = GpuMonitor(fake, clock=clock, call_timeout=1.0)
    try:
        started = time.monotonic()
        snap = m.poll()
        # Bounded by the 1 s call timeout, not the hang (until released): the bound is the
        # point, so it is generous (10 s) for a busy machine.
        assert time.monotonic() - started < 10
        g1 = snap.gpu("GPU-1")
        assert g1 is not None and not g1.healthy and g1.reason is not None
        assert g1.reason.startswith("timeout")
        g0 = snap.gpu("GPU-0")
        assert g0 is not None and g0.healthy and snap.ready
        assert snap.errors_by_kind == {"timeout": 1}

        # still hung: reported again without starting another call (no wait this time)
        started = time.monotonic()
        snap = m.poll()
        # Not another 1 s call timeout (expected: milliseconds): generous for a busy machine.
        assert time.monotonic() - started < 0.5
        g1 = snap.gpu("GPU-1")
        assert g1 is not None and not g1.healthy and g1.reason is not None
        assert g1.reason.startswith("timeout")
        assert fake.calls[("memory", "GPU-1")] == 1

        release.set()
        # the released call returns in the worker; then GPU-1 is read afresh
        g1 = poll_until(lambda: m.poll().gpu("GPU-1"), lambda g: g is None or g.healthy, 10, 0.005)
        assert g1 is not None
        assert g1.healthy and g1.total_bytes == 40 * GiB
        assert fake.calls[("memory", "GPU-1")] == 2
    finally:
        fake.release_all()
        m.close()


def test_implausible_process_values_dropped(
    fake: FakeGpuBackend, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    monitor = GpuMonitor(fake, clock=clock, call_timeout=0.5, pid_max=32768)
    fake.gpus["GPU-0"].processes = [
        ProcessMemory(0, GiB),  # pid 0
        ProcessMemory(-5, GiB),  # negative pid
        ProcessMemory(32768, GiB),  # pid_max itself is never allocated
        ProcessMemory(77, 81 * GiB),  # more than the device holds
        ProcessMemory(78, -1),  # negative usage
        ProcessMemory(88, 2 * GiB),
        ProcessMemory(32767, None),  # usage not available: pid still valid
    ]
    fake.gpus["GPU-1"].processes = [ProcessMemory(12, 10**15)]  # all dropped -> unknown
    try:
        with caplog.at_level(logging.WARNING, logger="kvgate_agent.gpu.monitor"):
            snap = monitor.poll()
            again = monitor.poll()
    finally:
        monitor.close()
    g0, g1 = snap.gpu("GPU-0"), snap.gpu("GPU-1")
    assert g0 is not None
    assert g0.processes == (ProcessMemory(88, 2 * GiB), ProcessMemory(32767, None))
    assert g1 is not None and g1.processes is None
    assert snap.errors_by_kind == {}  # not NVML call failures
    assert snap.dropped_processes == {
        ("GPU-0", "pid_out_of_range"): 3,
        ("GPU-0", "used_above_total"): 1,
        ("GPU-0", "used_negative"): 1,
        ("GPU-1", "used_above_total"): 1,
    }
    assert again.dropped_processes == {k: 2 * v for k, v in snap.dropped_processes.items()}
    # Logged once per (GPU, reason), however many entries and polls.
    assert sum("dropped process entry" in r.message for r in caplog.records) == 4


def test_swapped_pid_and_memory_fields_are_dropped_and_counted(
    monitor: GpuMonitor, fake: FakeGpuBackend
) -> None:
    """pid 4242 using 6 GiB, reported with the two fields exchanged (pid 6442450944, 4,242
    bytes: https://github.com/gpuopenanalytics/pynvml/issues/50), is dropped whatever the
    machine's pid_max: no 64-bit kernel allocates a pid above 4,194,304."""
    fake.gpus["GPU-0"].processes = [ProcessMemory(4242, 6 * GiB)]
    fake.gpus["GPU-0"].swapped_process_fields = True
    assert swapped_fields(ProcessMemory(4242, 6 * GiB)) == ProcessMemory(6442450944, 4242)
    snap = monitor.poll()
    g0 = snap.gpu("GPU-0")
    assert g0 is not None and g0.healthy and g0.processes is None  # unknown, not "pid 6442450944"
    assert snap.dropped_processes == {("GPU-0", "pid_out_of_range"): 1}
    fake.gpus["GPU-0"].swapped_process_fields = False  # a fixed driver: believed again
    g0 = monitor.poll().gpu("GPU-0")
    assert g0 is not None and g0.processes == (ProcessMemory(4242, 6 * GiB),)


def test_nvml_backend_passes_a_swapped_entry_on_and_the_monitor_drops_it(clock: FakeClock) -> None:
    """The real NVML backend on a stand-in ``pynvml`` whose compute-process structs have pid and
    usedGpuMemory exchanged (https://github.com/gpuopenanalytics/pynvml/issues/50)."""
    from types import SimpleNamespace

    procs = [
        SimpleNamespace(pid=6 * GiB, usedGpuMemory=4242),  # pid 4242 using 6 GiB, swapped
        SimpleNamespace(pid=4243, usedGpuMemory=GiB),  # read right
    ]
    stub = SimpleNamespace(
        NVMLError=RuntimeError,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda i: "h0",
        nvmlDeviceGetUUID=lambda h: b"GPU-0",
        nvmlDeviceGetName=lambda h: b"H200",
        nvmlDeviceGetMigMode=lambda h: [0, 0],
        nvmlDeviceGetMemoryInfo=lambda h, version=None: SimpleNamespace(
            total=140 * GiB, used=7 * GiB, free=133 * GiB, reserved=0
        ),
        nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=50),
        nvmlDeviceGetComputeRunningProcesses=lambda h: procs,
        nvmlMemory_v2=2,
    )
    backend = NvmlBackend(nvml=stub)  # type: ignore[arg-type]
    m = GpuMonitor(backend, clock=clock, call_timeout=2.0, pid_max=4194304)
    try:
        snap = m.poll()
    finally:
        m.close()
    g = snap.gpu("GPU-0")
    assert g is not None and g.healthy and g.processes == (ProcessMemory(4243, GiB),)
    assert snap.dropped_processes == {("GPU-0", "pid_out_of_range"): 1}


def test_pid_max_is_read_from_proc_and_capped(tmp_path: Path) -> None:
    f = tmp_path / "pid_max"
    f.write_text("32768\n")
    assert read_pid_max(f) == 32768
    f.write_text("99999999\n")  # beyond what a 64-bit kernel accepts
    assert read_pid_max(f) == PID_MAX_LIMIT == 4194304
    f.write_text("garbage")
    assert read_pid_max(f) == PID_MAX_LIMIT
    assert read_pid_max(tmp_path / "absent") == PID_MAX_LIMIT
    assert 1 < read_pid_max() <= PID_MAX_LIMIT  # this machine's


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


# -- file-driven fake (the agent as a separate process in integration tests) -----------------------


def scenario(**gpu0: Any) -> dict[str, Any]:
    """Two GPUs; ``gpu0`` overrides fields of the first."""
    return {
        "init_error": None,
        "gpus": [
            {"uuid": "GPU-0", "index": 0, "name": "Fake H100", "total_bytes": 80 * GiB,
             "used_bytes": GiB, "reserved_bytes": None, "utilization": 30, "mig": False,
             "parent_uuid": None, "processes": [{"pid": 1234, "used_bytes": 1000}],
             "error": None, **gpu0},
            {"uuid": "GPU-1", "index": 1, "total_bytes": 40 * GiB, "used_bytes": 2 * GiB},
        ],
    }  # fmt: skip


@pytest.fixture
def scenario_file(tmp_path: Path) -> Path:
    path = tmp_path / "gpus.json"
    write_scenario(path, scenario())
    return path


@pytest.fixture
def file_fake(scenario_file: Path) -> Iterator[FileFakeGpuBackend]:
    backend = FileFakeGpuBackend(scenario_file, hang_poll_seconds=0.01)
    yield backend
    backend.release_all()  # never leave a worker thread blocked


@pytest.fixture
def file_monitor(file_fake: FileFakeGpuBackend, clock: FakeClock) -> Iterator[GpuMonitor]:
    m = GpuMonitor(file_fake, clock=clock, call_timeout=0.5)
    yield m
    file_fake.release_all()
    m.close()


def test_file_fake_values_follow_the_file(file_monitor: GpuMonitor, scenario_file: Path) -> None:
    snap = file_monitor.poll()
    assert snap.ready and snap.reason is None
    g0 = snap.gpu("GPU-0")
    assert g0 is not None and g0.healthy and g0.name == "Fake H100"
    assert (g0.total_bytes, g0.used_bytes, g0.free_bytes) == (80 * GiB, GiB, 79 * GiB)
    assert g0.utilization == 30 and g0.processes == (ProcessMemory(1234, 1000),)
    g1 = snap.gpu("GPU-1")
    assert g1 is not None and g1.name == "Fake GPU" and g1.utilization == 0  # defaults
    assert g1.processes is None  # none listed: unknown

    write_scenario(scenario_file, scenario(used_bytes=50 * GiB, reserved_bytes=GiB, utilization=99))
    g0 = file_monitor.poll().gpu("GPU-0")
    assert g0 is not None and (g0.used_bytes, g0.free_bytes, g0.utilization) == (
        50 * GiB,
        29 * GiB,
        99,
    )

    doc = scenario()  # a MIG slice appears; GPU-1 disappears
    doc["gpus"] = [
        doc["gpus"][0],
        {"uuid": "MIG-0a", "index": 0, "mig": True, "parent_uuid": "GPU-0",
         "total_bytes": 20 * GiB, "utilization": 50},
    ]  # fmt: skip
    write_scenario(scenario_file, doc)
    snap = file_monitor.poll()
    assert [g.uuid for g in snap.gpus] == ["GPU-0", "MIG-0a", "GPU-1"]
    mig, g1 = snap.gpu("MIG-0a"), snap.gpu("GPU-1")
    assert mig is not None and mig.healthy and mig.utilization is None  # never 0
    assert g1 is not None and not g1.healthy and g1.reason == "lost: no longer enumerated"


def test_file_fake_reports_swapped_process_fields(
    file_monitor: GpuMonitor, scenario_file: Path
) -> None:
    write_scenario(
        scenario_file,
        scenario(processes=[{"pid": 4242, "used_bytes": 6 * GiB}], swapped_process_fields=True),
    )
    snap = file_monitor.poll()
    g0 = snap.gpu("GPU-0")
    assert g0 is not None and g0.healthy and g0.processes is None
    assert snap.dropped_processes == {("GPU-0", "pid_out_of_range"): 1}


@pytest.mark.parametrize("kind", ["lost", "not_supported", "library_missing", "timeout", "unknown"])
def test_file_fake_fault_kinds_isolated_per_gpu(
    file_monitor: GpuMonitor, scenario_file: Path, kind: str
) -> None:
    assert file_monitor.poll().ready
    write_scenario(scenario_file, scenario(error=kind))
    snap = file_monitor.poll()
    g0, g1 = snap.gpu("GPU-0"), snap.gpu("GPU-1")
    assert g0 is not None and not g0.healthy
    assert g0.reason == f"{kind}: scripted {kind} on memory"
    assert g0.used_bytes is None  # no stale values
    assert g1 is not None and g1.healthy and g1.total_bytes == 40 * GiB
    assert snap.ready and snap.errors_by_kind == {kind: 1}

    write_scenario(scenario_file, scenario())  # the fault clears
    g0 = file_monitor.poll().gpu("GPU-0")
    assert g0 is not None and g0.healthy


def test_file_fake_fault_per_call(file_monitor: GpuMonitor, scenario_file: Path) -> None:
    write_scenario(
        scenario_file,
        scenario(error={"utilization": "not_supported", "processes": "not_supported"}),
    )
    snap = file_monitor.poll()
    g0 = snap.gpu("GPU-0")
    assert g0 is not None and g0.healthy and g0.used_bytes == GiB
    assert g0.utilization is None and g0.processes is None  # unknown, never 0
    assert snap.errors_by_kind == {"not_supported": 2}
    write_scenario(scenario_file, scenario(error={"utilization": "lost"}))
    g0 = file_monitor.poll().gpu("GPU-0")
    assert g0 is not None and not g0.healthy and g0.reason is not None
    assert g0.reason.startswith("lost")


def test_file_fake_init_error_then_recovery(scenario_file: Path, clock: FakeClock) -> None:
    write_scenario(scenario_file, {**scenario(), "init_error": "library_missing"})
    backend = FileFakeGpuBackend(scenario_file)
    m = GpuMonitor(backend, clock=clock, call_timeout=0.5, init_backoff=1.0)
    try:
        snap = m.poll()
        assert not snap.ready and snap.gpus == ()
        assert snap.reason is not None and "library_missing" in snap.reason
        write_scenario(scenario_file, scenario())
        assert not m.poll().ready  # backoff: init() not retried yet
        assert backend.calls[("init", None)] == 1
        clock.now += 1.0
        snap = m.poll()
        assert snap.ready and len(snap.gpus) == 2
        assert snap.errors_by_kind == {"library_missing": 1}
    finally:
        m.close()


def test_file_fake_devices_error_library_missing_goes_back_to_init(
    file_monitor: GpuMonitor, scenario_file: Path, file_fake: FileFakeGpuBackend
) -> None:
    assert file_monitor.poll().ready
    write_scenario(scenario_file, {**scenario(), "devices_error": "library_missing"})
    snap = file_monitor.poll()  # the driver went away under us
    assert not snap.ready and not file_monitor.initialized
    assert all(not g.healthy for g in snap.gpus)


def test_file_fake_missing_file_at_start(tmp_path: Path, clock: FakeClock) -> None:
    path = tmp_path / "later.json"
    backend = FileFakeGpuBackend(path)
    m = GpuMonitor(backend, clock=clock, init_backoff=1.0)
    try:
        snap = m.poll()
        assert not snap.ready and snap.reason is not None and "library_missing" in snap.reason
        write_scenario(path, scenario())
        clock.now += 1.0
        assert m.poll().ready
    finally:
        m.close()


def test_file_fake_corrupt_file_keeps_previous_scenario(
    file_monitor: GpuMonitor,
    scenario_file: Path,
    file_fake: FileFakeGpuBackend,
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert file_monitor.poll().ready
    with caplog.at_level(logging.WARNING, logger="kvgate_agent.gpu.fake"):
        scenario_file.write_text('{"gpus": [{"uuid": "GPU-0", "ind')  # half written
        snap = file_monitor.poll()
        file_monitor.poll()  # the same problem is logged once
        write_scenario(
            scenario_file, {"gpus": [{"uuid": "GPU-0", "index": "zero"}]}, validate=False
        )
        file_monitor.poll()
        write_scenario(scenario_file, {"gpus": [], "typo_key": 1}, validate=False)
        assert not file_fake.reload()
    assert snap.ready and len(snap.gpus) == 2
    g0 = snap.gpu("GPU-0")
    assert g0 is not None and g0.healthy and g0.used_bytes == GiB
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 3 and all("keeping the previous one" in w for w in warnings)
    assert "gpus.0.index" in warnings[1] and "typo_key" in warnings[2]

    write_scenario(scenario_file, scenario(used_bytes=3 * GiB))  # a good file again
    g0 = file_monitor.poll().gpu("GPU-0")
    assert g0 is not None and g0.used_bytes == 3 * GiB


def test_file_fake_hang_exercises_the_call_timeout(
    scenario_file: Path, file_fake: FileFakeGpuBackend, clock: FakeClock
) -> None:
    write_scenario(scenario_file, scenario(hang=True))
    m = GpuMonitor(file_fake, clock=clock, call_timeout=1.0)
    try:
        started = time.monotonic()
        snap = m.poll()
        # Bounded by the 1 s call timeout, not the hang (until the file changes): the bound is
        # the point, so it is generous (10 s) for a busy machine.
        assert time.monotonic() - started < 10
        g0, g1 = snap.gpu("GPU-0"), snap.gpu("GPU-1")
        assert g0 is not None and not g0.healthy and g0.reason is not None
        assert g0.reason.startswith("timeout")
        assert g1 is not None and g1.healthy

        write_scenario(scenario_file, scenario(hang=False, used_bytes=7 * GiB))
        # the hung call notices the file within hang_poll_seconds
        g0 = poll_until(lambda: m.poll().gpu("GPU-0"), lambda g: g is None or g.healthy, 10, 0.01)
        assert g0 is not None
        assert g0.healthy and g0.used_bytes == 7 * GiB
    finally:
        file_fake.release_all()
        m.close()


def test_file_fake_hang_cap_and_release(scenario_file: Path) -> None:
    write_scenario(scenario_file, scenario(hang=True))
    backend = FileFakeGpuBackend(scenario_file, hang_poll_seconds=0.005, hang_cap_seconds=0.03)
    backend.init()
    with pytest.raises(GpuTimeout):
        backend.memory("GPU-0")
    backend.release_all()
    assert backend.memory("GPU-0").used_bytes == GiB  # hangs ignored once released


def test_file_fake_direct_calls(scenario_file: Path) -> None:
    backend = FileFakeGpuBackend(scenario_file)
    with pytest.raises(GpuUnknownError):
        backend.devices()  # not initialised
    backend.init()
    assert isinstance(backend, GpuBackend)
    assert [d.uuid for d in backend.devices()] == ["GPU-0", "GPU-1"]
    assert backend.processes("GPU-0") == [ProcessMemory(1234, 1000)]
    with pytest.raises(GpuUnknownError):
        backend.memory("GPU-nope")
    assert backend.scenario is not None and backend.scenario.gpus[0].name == "Fake H100"
    backend.shutdown()
    with pytest.raises(GpuUnknownError):
        backend.memory("GPU-0")


def test_write_scenario_is_atomic_and_validated(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    write_scenario(path, scenario())
    with pytest.raises(ValueError, match=r"gpus\.0\.error"):
        write_scenario(path, scenario(error="melted"))
    with pytest.raises(ValueError, match="unique"):
        write_scenario(path, {"gpus": [{"uuid": "A", "index": 0}, {"uuid": "A", "index": 1}]})
    assert [p.name for p in tmp_path.iterdir()] == ["s.json"]  # no temporary files left
    assert json.loads(path.read_text()) == scenario()
    assert path.stat().st_mode & 0o777 == 0o644


def test_backend_from_spec(tmp_path: Path) -> None:
    assert isinstance(backend_from_spec("nvml"), NvmlBackend)
    fake = backend_from_spec(f"fake:{tmp_path}/s.json")
    assert isinstance(fake, FileFakeGpuBackend) and fake.path == tmp_path / "s.json"
    assert isinstance(backend_from_spec(" nvml "), NvmlBackend)
    for bad in ("", "NVML", "fake:", "fake: ", "cuda", "fake"):
        with pytest.raises(ValueError, match="GPU backend"):
            backend_from_spec(bad)
