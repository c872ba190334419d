"""A scripted, in-memory GPU backend for tests: a fake, not a simulator.

Configure GPUs (MIG slices included) and their values, then script faults per call::

    fake = FakeGpuBackend([FakeGpu("GPU-0", 0, total_bytes=80 * GiB, used_bytes=GiB)])
    fake.fail("memory", "GPU-0", GpuLost, from_call=3)   # 3rd memory() call on GPU-0 on
    fake.fail_init(2)                                     # init() fails twice, then works
    release = fake.hang("memory", "GPU-0")                # blocks until release.set()

Calls are counted per ``(method, uuid)`` in :attr:`calls` (uuid ``None`` for init/devices).
As NVML does, utilization on a MIG slice is not supported: :meth:`utilization` returns None.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

from kvgate_agent.gpu.backend import (
    GpuError,
    GpuInfo,
    GpuLibraryMissing,
    GpuUnknownError,
    MemoryInfo,
    ProcessMemory,
)

GiB = 1 << 30


@dataclass
class FakeGpu:
    """One configured device; mutate fields between polls to change what is read."""

    uuid: str
    index: int
    name: str = "Fake GPU"
    total_bytes: int = 80 * GiB
    used_bytes: int = 0
    reserved_bytes: int | None = None
    utilization: int | None = 0
    processes: list[ProcessMemory] = field(default_factory=list)
    mig: bool = False
    parent_uuid: str | None = None

    def info(self) -> GpuInfo:
        return GpuInfo(self.uuid, self.index, self.name, self.mig, self.parent_uuid)


@dataclass
class _Fault:
    method: str
    uuid: str | None
    error: type[GpuError] | GpuError
    from_call: int
    times: int | None

    def applies(self, method: str, uuid: str | None, n: int) -> bool:
        if self.method != method or (self.uuid is not None and self.uuid != uuid):
            return False
        if n < self.from_call:
            return False
        return self.times is None or n < self.from_call + self.times


class FakeGpuBackend:
    """:class:`~kvgate_agent.gpu.backend.GpuBackend` fake, scripted (see module docstring)."""

    def __init__(self, gpus: list[FakeGpu] | None = None) -> None:
        self.gpus: dict[str, FakeGpu] = {g.uuid: g for g in gpus or []}
        self.calls: Counter[tuple[str, str | None]] = Counter()
        self.initialized = False
        self._faults: list[_Fault] = []
        self._hangs: dict[tuple[str, str | None], threading.Event] = {}
        self._lock = threading.Lock()

    # -- scripting -------------------------------------------------------------------------

    def fail(
        self,
        method: str,
        uuid: str | None,
        error: type[GpuError] | GpuError,
        *,
        from_call: int = 1,
        times: int | None = None,
    ) -> None:
        """Raise ``error`` from ``method`` (on ``uuid``; ``None`` = any) from its
        ``from_call``-th call on, for ``times`` calls (``None`` = forever)."""
        self._faults.append(_Fault(method, uuid, error, from_call, times))

    def fail_init(self, times: int, error: type[GpuError] = GpuLibraryMissing) -> None:
        """init() fails ``times`` times, then succeeds."""
        self.fail("init", None, error, times=times)

    def clear_faults(self) -> None:
        self._faults.clear()

    def hang(self, method: str, uuid: str | None) -> threading.Event:
        """Make ``method`` on ``uuid`` block until the returned event is set (then it
        answers normally). Tests must set it (or call :meth:`release_all`) before exiting:
        a blocked worker thread keeps the interpreter from exiting."""
        event = threading.Event()
        self._hangs[(method, uuid)] = event
        return event

    def release_all(self) -> None:
        for event in self._hangs.values():
            event.set()

    # -- GpuBackend ------------------------------------------------------------------------

    def _enter(self, method: str, uuid: str | None) -> None:
        with self._lock:
            self.calls[(method, uuid)] += 1
            n = self.calls[(method, uuid)]
            hang = self._hangs.get((method, uuid))
        if hang is not None and not hang.is_set():
            hang.wait()
        for fault in self._faults:
            if fault.applies(method, uuid, n):
                err = fault.error
                if isinstance(err, GpuError):
                    raise err
                raise err(f"scripted {err.kind} on {method}", uuid=uuid)
        if method not in ("init", "shutdown") and not self.initialized:
            raise GpuUnknownError("fake: not initialised", uuid=uuid)

    def _gpu(self, uuid: str) -> FakeGpu:
        gpu = self.gpus.get(uuid)
        if gpu is None:
            raise GpuUnknownError("fake: no such device", uuid=uuid)
        return gpu

    def init(self) -> None:
        self._enter("init", None)
        self.initialized = True

    def shutdown(self) -> None:
        self._enter("shutdown", None)
        self.initialized = False

    def devices(self) -> list[GpuInfo]:
        self._enter("devices", None)
        return [g.info() for g in sorted(self.gpus.values(), key=lambda g: (g.index, g.mig))]

    def memory(self, uuid: str) -> MemoryInfo:
        self._enter("memory", uuid)
        g = self._gpu(uuid)
        free = g.total_bytes - g.used_bytes - (g.reserved_bytes or 0)
        return MemoryInfo(g.total_bytes, g.used_bytes, free, g.reserved_bytes)

    def utilization(self, uuid: str) -> int | None:
        self._enter("utilization", uuid)
        g = self._gpu(uuid)
        return None if g.mig else g.utilization

    def processes(self, uuid: str) -> list[ProcessMemory]:
        self._enter("processes", uuid)
        return list(self._gpu(uuid).processes)
