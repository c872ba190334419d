"""Fake GPU backends for tests: fakes, not simulators.

:class:`FakeGpuBackend` is scripted in memory (same process); :class:`FileFakeGpuBackend` reads
a JSON scenario file that tests rewrite (the agent as a separate process; see its docstring; the
file's models and writer are in :mod:`kvgate_agent.gpu.fake_scenario`).

For :class:`FakeGpuBackend`, configure GPUs (MIG slices included) and their values, then
script faults per call::

    fake = FakeGpuBackend([FakeGpu("GPU-0", 0, total_bytes=80 * GiB, used_bytes=GiB)])
    fake.fail("memory", "GPU-0", GpuLost, from_call=3)   # 3rd memory() call on GPU-0 on
    fake.fail_init(2)                                     # init() fails twice, then works
    release = fake.hang("memory", "GPU-0")                # blocks until release.set()

Both count calls per ``(method, uuid)`` in ``calls`` (uuid ``None`` for init/devices). As NVML
does, utilization on a MIG slice is not supported: :meth:`utilization` returns None. Both can
report process entries with pid and used memory exchanged, as some driver/binding pairs do
(``swapped_process_fields``, :func:`swapped_fields`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from kvgate_agent.gpu.backend import (
    GpuError,
    GpuInfo,
    GpuLibraryMissing,
    GpuLost,
    GpuTimeout,
    GpuUnknownError,
    MemoryInfo,
    ProcessMemory,
)
from kvgate_agent.gpu.fake_scenario import (
    FAULT_KINDS,
    GiB,
    GpuMethod,
    Scenario,
    ScenarioGpu,
    validation_problem,
)

log = logging.getLogger(__name__)


def swapped_fields(p: ProcessMemory) -> ProcessMemory:
    """``p`` with its pid and used memory exchanged, as some driver/binding pairs report
    compute processes (https://github.com/gpuopenanalytics/pynvml/issues/50): pid 4242 using
    6 GiB reads as pid 6442450944 using 4,242 bytes. Used memory "not available" becomes pid 0."""
    return ProcessMemory(pid=p.used_bytes or 0, used_bytes=p.pid)


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
    #: Report every process with pid and used memory exchanged (:func:`swapped_fields`).
    swapped_process_fields: bool = False

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
        g = self._gpu(uuid)
        return (
            [swapped_fields(p) for p in g.processes]
            if g.swapped_process_fields
            else list(g.processes)
        )


class FileFakeGpuBackend:
    """:class:`~kvgate_agent.gpu.backend.GpuBackend` fake driven by a JSON file, for running the
    agent as a separate process in tests (``kvgate-agent node --gpu-backend fake:<path>``):
    tests change values and inject faults by rewriting the file
    (:func:`~kvgate_agent.gpu.fake_scenario.write_scenario`).

    The file is re-read on every :meth:`init` and :meth:`devices` call (the monitor calls
    ``devices()`` once per poll); :meth:`memory`, :meth:`utilization` and :meth:`processes`
    answer from the scenario read last. A file that cannot be read or does not match the schema
    keeps the previous scenario (a warning is logged once per distinct problem); with no
    previous scenario, :meth:`init` raises ``GpuLibraryMissing``, as on a node without a driver.

    The file's keys, its fault kinds and :func:`~kvgate_agent.gpu.fake_scenario.write_scenario`:
    :mod:`kvgate_agent.gpu.fake_scenario`. Free bytes = total − used − reserved, values taken as
    written (implausible ones included: dropping them is the monitor's job).

    A hung ``memory()`` re-reads the file every ``hang_poll_seconds`` and answers (with the new
    values) once the GPU no longer says ``"hang": true``; after ``hang_cap_seconds`` it raises
    ``GpuTimeout``; :meth:`release_all` ends every hang at once (test teardown: a blocked
    worker thread delays interpreter exit).

    Args:
        path: the scenario file.
        hang_poll_seconds: how often a hung call re-reads the file (seconds).
        hang_cap_seconds: the longest a call stays hung (seconds).
    """

    def __init__(
        self,
        path: str | Path,
        *,
        hang_poll_seconds: float = 0.05,
        hang_cap_seconds: float = 60.0,
    ) -> None:
        self.path = Path(path)
        self.hang_poll_seconds = hang_poll_seconds
        self.hang_cap_seconds = hang_cap_seconds
        self.initialized = False
        self.calls: Counter[tuple[str, str | None]] = Counter()
        self._scenario: Scenario | None = None
        self._last_problem: str | None = None
        self._released = threading.Event()
        self._lock = threading.Lock()

    @property
    def scenario(self) -> Scenario | None:
        """The scenario in use (the last one read successfully)."""
        return self._scenario

    def reload(self) -> bool:
        """Re-read the file. Returns True when it was read, False when the previous scenario
        is kept (the problem is logged). Never raises."""
        try:
            scenario = Scenario.model_validate_json(self.path.read_bytes())
        except ValidationError as exc:
            problem = validation_problem(exc)
        except OSError as exc:
            problem = f"{type(exc).__name__}: {exc.strerror or exc}"
        else:
            with self._lock:
                self._scenario = scenario
                self._last_problem = None
            return True
        with self._lock:
            repeated = problem == self._last_problem
            self._last_problem = problem
            kept = self._scenario is not None
        if not repeated:
            log.warning(
                "fake GPU scenario %s unreadable (%s); %s",
                self.path,
                problem,
                "keeping the previous one" if kept else "no scenario yet",
            )
        return False

    def release_all(self) -> None:
        """End every hang now (and ignore ``hang`` from now on)."""
        self._released.set()

    # -- GpuBackend ------------------------------------------------------------------------

    def init(self) -> None:
        """Read the file; raise its ``init_error``, or ``GpuLibraryMissing`` with no
        readable scenario yet."""
        self._count("init", None)
        self.reload()
        scenario = self._scenario
        if scenario is None:
            raise GpuLibraryMissing(f"fake: no readable scenario at {self.path}")
        if scenario.init_error is not None:
            raise FAULT_KINDS[scenario.init_error](f"fake: scripted {scenario.init_error} on init")
        self.initialized = True

    def shutdown(self) -> None:
        self._count("shutdown", None)
        self.initialized = False

    def devices(self) -> list[GpuInfo]:
        """Re-read the file; the GPUs it lists, by index (physical before MIG)."""
        scenario = self._ready("devices", None)
        self.reload()
        scenario = self._scenario or scenario
        if scenario.devices_error is not None:
            kind = scenario.devices_error
            raise FAULT_KINDS[kind](f"fake: scripted {kind} on devices")
        gpus = sorted(scenario.gpus, key=lambda g: (g.index, g.mig))
        return [GpuInfo(g.uuid, g.index, g.name, g.mig, g.parent_uuid) for g in gpus]

    def memory(self, uuid: str) -> MemoryInfo:
        g = self._gpu("memory", uuid)
        if g.hang and not self._released.is_set():
            g = self._wait_unhung(uuid)
        self._raise_fault(g, "memory")
        free = g.total_bytes - g.used_bytes - (g.reserved_bytes or 0)
        return MemoryInfo(g.total_bytes, g.used_bytes, free, g.reserved_bytes)

    def utilization(self, uuid: str) -> int | None:
        g = self._gpu("utilization", uuid)
        self._raise_fault(g, "utilization")
        return None if g.mig else g.utilization

    def processes(self, uuid: str) -> list[ProcessMemory]:
        g = self._gpu("processes", uuid)
        self._raise_fault(g, "processes")
        out = [ProcessMemory(p.pid, p.used_bytes) for p in g.processes]
        return [swapped_fields(p) for p in out] if g.swapped_process_fields else out

    # -- internals -------------------------------------------------------------------------

    def _count(self, method: str, uuid: str | None) -> None:
        with self._lock:
            self.calls[(method, uuid)] += 1

    def _ready(self, method: str, uuid: str | None) -> Scenario:
        self._count(method, uuid)
        scenario = self._scenario
        if not self.initialized or scenario is None:
            raise GpuUnknownError("fake: not initialised", uuid=uuid)
        return scenario

    def _gpu(self, method: str, uuid: str) -> ScenarioGpu:
        scenario = self._ready(method, uuid)
        gpu = next((g for g in scenario.gpus if g.uuid == uuid), None)
        if gpu is None:
            raise GpuUnknownError("fake: no such device", uuid=uuid)
        return gpu

    @staticmethod
    def _raise_fault(g: ScenarioGpu, method: GpuMethod) -> None:
        kind = g.fault(method)
        if kind is not None:
            raise FAULT_KINDS[kind](f"scripted {kind} on {method}", uuid=g.uuid)

    def _wait_unhung(self, uuid: str) -> ScenarioGpu:
        deadline = time.monotonic() + self.hang_cap_seconds
        while time.monotonic() < deadline:
            if self._released.wait(self.hang_poll_seconds):
                break
            self.reload()
            g = self._gpu_now(uuid)
            if not g.hang:
                return g
        else:
            raise GpuTimeout(f"fake: still hung after {self.hang_cap_seconds:g}s", uuid=uuid)
        return self._gpu_now(uuid)

    def _gpu_now(self, uuid: str) -> ScenarioGpu:
        scenario = self._scenario
        gpu = next((g for g in scenario.gpus if g.uuid == uuid), None) if scenario else None
        if gpu is None:
            raise GpuLost("fake: device gone while hung", uuid=uuid)
        return gpu
