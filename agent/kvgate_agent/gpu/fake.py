"""Fake GPU backends for tests: fakes, not simulators.

:class:`FakeGpuBackend` is scripted in memory (same process); :class:`FileFakeGpuBackend` reads
a JSON scenario file that tests rewrite (the agent as a separate process; see its docstring).

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

import contextlib
import json
import logging
import os
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from kvgate_agent.gpu.backend import (
    GpuError,
    GpuInfo,
    GpuLibraryMissing,
    GpuLost,
    GpuNotSupported,
    GpuTimeout,
    GpuUnknownError,
    MemoryInfo,
    ProcessMemory,
)

log = logging.getLogger(__name__)

GiB = 1 << 30


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


# -- file-driven fake ------------------------------------------------------------------------------

FAULT_KINDS: dict[str, type[GpuError]] = {
    "lost": GpuLost,
    "not_supported": GpuNotSupported,
    "library_missing": GpuLibraryMissing,
    "timeout": GpuTimeout,
    "unknown": GpuUnknownError,
}
"""Fault kind names a scenario file may use -> the error raised (``GpuError.kind`` values)."""

FaultKind = Literal["lost", "not_supported", "library_missing", "timeout", "unknown"]
GpuMethod = Literal["memory", "utilization", "processes"]


class _ScenarioModel(BaseModel):
    """Base of a scenario file's parts: snake_case names as in the file, unknown fields refused
    (a typo must not silently do nothing), no coercion (``"3"`` is not a number)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ScenarioProcess(_ScenarioModel):
    """One process on a GPU: ``pid``, ``used_bytes`` (null: "not available")."""

    pid: int
    used_bytes: int | None = None


class ScenarioGpu(_ScenarioModel):
    """One device of a scenario file (see :class:`FileFakeGpuBackend`)."""

    uuid: str
    index: int
    name: str = "Fake GPU"
    total_bytes: int = 80 * GiB
    used_bytes: int = 0
    reserved_bytes: int | None = None
    utilization: int | None = 0
    mig: bool = False
    parent_uuid: str | None = None
    processes: tuple[ScenarioProcess, ...] = ()
    swapped_process_fields: bool = False
    error: FaultKind | dict[GpuMethod, FaultKind] | None = None
    hang: bool = False

    def fault(self, method: GpuMethod) -> FaultKind | None:
        if isinstance(self.error, dict):
            return self.error.get(method)
        return self.error


class Scenario(_ScenarioModel):
    """A whole scenario file (see :class:`FileFakeGpuBackend`)."""

    init_error: FaultKind | None = None
    devices_error: FaultKind | None = None
    gpus: tuple[ScenarioGpu, ...] = ()

    @model_validator(mode="after")
    def _unique_uuids(self) -> Scenario:
        uuids = [g.uuid for g in self.gpus]
        if len(set(uuids)) != len(uuids):
            raise ValueError("GPU uuids must be unique")
        return self


def _problem(exc: ValidationError) -> str:
    errors = exc.errors()
    first = "; ".join(
        f"{'.'.join(str(x) for x in e['loc']) or '<root>'}: {e['msg']}" for e in errors[:3]
    )
    return first + (f" (+{len(errors) - 3} more)" if len(errors) > 3 else "")


def write_scenario(path: str | Path, scenario: Mapping[str, Any], *, validate: bool = True) -> None:
    """Write a scenario file atomically (a temporary file in the same folder, then rename), so a
    reader never sees half of it.

    Args:
        path: the scenario file.
        scenario: the JSON document (see :class:`FileFakeGpuBackend`).
        validate: check ``scenario`` against the schema first (catches typos in tests; pass
            False to write an invalid one on purpose).

    Raises:
        ValueError: ``scenario`` does not match the schema (nothing written).
        OSError: the file cannot be written.
    """
    if validate:
        try:
            Scenario.model_validate_json(json.dumps(scenario))
        except ValidationError as exc:
            raise ValueError(f"invalid GPU scenario: {_problem(exc)}") from None
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        os.fchmod(fd, 0o644)  # readable by an agent running as another user, as a plain write
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(scenario, f, indent=1)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class FileFakeGpuBackend:
    """:class:`~kvgate_agent.gpu.backend.GpuBackend` fake driven by a JSON file, for running the
    agent as a separate process in tests (``kvgate-agent node --gpu-backend fake:<path>``):
    tests change values and inject faults by rewriting the file (:func:`write_scenario`).

    The file is re-read on every :meth:`init` and :meth:`devices` call (the monitor calls
    ``devices()`` once per poll); :meth:`memory`, :meth:`utilization` and :meth:`processes`
    answer from the scenario read last. A file that cannot be read or does not match the schema
    keeps the previous scenario (a warning is logged once per distinct problem); with no
    previous scenario, :meth:`init` raises ``GpuLibraryMissing``, as on a node without a driver.

    Scenario schema (unknown keys are refused; sizes in bytes, utilization in percent)::

        {"init_error": null,          # a fault kind: init() raises it
         "devices_error": null,       # a fault kind: devices() raises it
         "gpus": [
           {"uuid": "GPU-aaaa...",    # required, unique
            "index": 0,               # required; a MIG slice has its parent's index
            "name": "Fake H100",      # default "Fake GPU"
            "total_bytes": 85899345920, "used_bytes": 1073741824,   # default 80 GiB, 0
            "reserved_bytes": null,   # null: not reported (NVML memory v1)
            "utilization": 30,        # null: not supported; always null on a MIG slice
            "mig": false, "parent_uuid": null,
            "processes": [{"pid": 1234, "used_bytes": 1000}],       # used_bytes null: n/a
            "swapped_process_fields": false,  # true: pid and used_bytes reported exchanged
            "error": null,            # a fault kind raised by memory, utilization and
                                      # processes on this GPU, or per call:
                                      # {"utilization": "not_supported"}
            "hang": false}]}          # true: memory() blocks while the file says so

    Fault kinds: ``"lost"``, ``"not_supported"``, ``"library_missing"``, ``"timeout"``,
    ``"unknown"`` (:data:`FAULT_KINDS`). Free bytes = total − used − reserved. Values are not
    checked for plausibility: that is the monitor's job, and tests may want implausible ones.

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
            problem = _problem(exc)
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
