"""Poll every GPU through a backend, each call bounded in time, faults isolated per GPU.

Invariant: :meth:`GpuMonitor.poll` never raises for backend failures and never serves a late or
failed read as fresh data: the snapshot says, per GPU, what is wrong; what NVML does not support
(utilization on MIG) or hides (processes) is ``None``, never 0.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from kvgate_agent.gpu.backend import (
    GpuBackend,
    GpuError,
    GpuInfo,
    GpuLibraryMissing,
    GpuNotSupported,
    GpuTimeout,
    MemoryInfo,
    ProcessMemory,
)
from kvgate_agent.gpu.calls import BoundedCalls

log = logging.getLogger(__name__)

Clock = Callable[[], float]

_INIT_KEY = "__init__"
_DEVICES_KEY = "__devices__"

PID_MAX_LIMIT = 4 * 1024 * 1024
"""The largest ``pid_max`` a 64-bit Linux kernel accepts (``PID_MAX_LIMIT``, 4,194,304, in
``include/linux/threads.h``): no process id is ever this large."""

PID_MAX_PATH = Path("/proc/sys/kernel/pid_max")

DropReason = Literal["pid_out_of_range", "used_negative", "used_above_total"]
"""Why a process entry was dropped: its pid is not in ``1 .. pid_max - 1``, or its used memory
is negative or above the device's total."""


def read_pid_max(path: Path = PID_MAX_PATH) -> int:
    """The kernel's ``pid_max`` (PIDs of that value or larger are never allocated:
    https://www.kernel.org/doc/html/latest/admin-guide/sysctl/kernel.html#pid-max), capped at
    :data:`PID_MAX_LIMIT`; :data:`PID_MAX_LIMIT` when the file cannot be read or parsed (not
    Linux, a restricted ``/proc``). Never raises."""
    try:
        value = int(path.read_text().strip())
    except (OSError, ValueError):
        return PID_MAX_LIMIT
    return value if 1 < value <= PID_MAX_LIMIT else PID_MAX_LIMIT


@dataclass(frozen=True, slots=True)
class GpuStatus:
    """One device in a snapshot. Values are ``None`` when unknown or unhealthy."""

    uuid: str
    index: int
    name: str
    mig: bool
    parent_uuid: str | None
    healthy: bool
    reason: str | None = None
    total_bytes: int | None = None
    used_bytes: int | None = None
    free_bytes: int | None = None
    reserved_bytes: int | None = None
    utilization: int | None = None
    processes: tuple[ProcessMemory, ...] | None = None


@dataclass(frozen=True, slots=True)
class GpuSnapshot:
    """The result of one :meth:`GpuMonitor.poll`.

    ``ready`` is True when at least one GPU is usable; ``reason`` says why not (or, when
    ready, which GPUs are unhealthy); ``errors_by_kind`` are cumulative counters since the
    monitor started (kind -> count), for metrics; ``dropped_processes`` likewise counts the
    process entries dropped as implausible, by ``(gpu uuid, reason)`` (:data:`DropReason`).
    """

    gpus: tuple[GpuStatus, ...]
    ready: bool
    reason: str | None
    errors_by_kind: dict[str, int] = field(default_factory=dict)
    taken_at: float = 0.0
    dropped_processes: dict[tuple[str, str], int] = field(default_factory=dict)

    def gpu(self, uuid: str) -> GpuStatus | None:
        return next((g for g in self.gpus if g.uuid == uuid), None)


@dataclass(slots=True)
class _Reading:
    memory: MemoryInfo
    utilization: int | None
    processes: list[ProcessMemory] | None
    soft_errors: list[GpuError]


class GpuMonitor:
    """Reads a :class:`GpuBackend` safely. ``poll()`` is thread-safe (serialised).

    - Each GPU is read (memory, utilization, processes) as one task on a thread pool; all GPUs in
      parallel, waited on until ``call_timeout`` (real seconds). A read still running then marks
      that GPU unhealthy with reason ``"timeout"`` and is not started again for that GPU until the
      hung call returns (:class:`~kvgate_agent.gpu.calls.BoundedCalls`): a wedged driver call
      never piles up threads, and its late answer is discarded (never served as fresh data).
    - One GPU's error never hides the others; unhealthy GPUs are reported with their reason.
    - ``init()`` failures are retried with exponential backoff on the injected clock: ``poll()``
      calls ``init()`` again only once the backoff deadline has passed.
    - Utilization not supported (MIG) is ``None``, never 0. An empty process list is ``None``
      ("unknown": PID namespaces hide processes), never "no usage". Implausible process entries
      are dropped: a pid outside ``1 .. pid_max - 1`` (e.g. pid 6442450944 with 4,242 bytes used,
      the two fields swapped as some driver/binding pairs report them:
      https://github.com/gpuopenanalytics/pynvml/issues/50,
      https://github.com/NVIDIA/go-nvml/issues/21), used memory negative or above the device's
      total. Each drop is counted by ``(gpu, reason)`` in the snapshot's ``dropped_processes``
      and logged once per ``(gpu, reason)``.
    - ``poll()`` never raises for backend failures; the snapshot says what is wrong.

    Known limit: a backend call that hangs forever keeps a worker thread, and
    ``concurrent.futures`` joins worker threads at interpreter exit; the agent should exit with
    ``os._exit`` after its graceful shutdown if a GPU call is still hung.

    Args:
        backend: the GPU library (``NvmlBackend``, or ``FakeGpuBackend`` in tests).
        clock: monotonic seconds, for init backoff and ``taken_at`` (injected).
        call_timeout: real seconds one backend call (or one GPU's read) may take.
        executor: where backend calls run; a private thread pool by default.
        init_backoff: first delay after a failed ``init()``; doubles per failure...
        init_backoff_max: ...up to this.
        pid_max: process ids must be below this; default :func:`read_pid_max` (read once).
    """

    def __init__(
        self,
        backend: GpuBackend,
        clock: Clock = time.monotonic,
        call_timeout: float = 2.0,
        executor: Executor | None = None,
        *,
        init_backoff: float = 1.0,
        init_backoff_max: float = 60.0,
        pid_max: int | None = None,
    ) -> None:
        self.calls = BoundedCalls(call_timeout, executor)
        self.pid_max = read_pid_max() if pid_max is None else pid_max
        self.backend = backend
        self.clock = clock
        self.call_timeout = call_timeout
        self.init_backoff = init_backoff
        self.init_backoff_max = init_backoff_max
        self._lock = threading.Lock()
        self._initialized = False
        self._init_failures = 0
        self._next_init_at = float("-inf")
        self._init_reason: str | None = None
        self._known: dict[str, GpuInfo] = {}
        self._errors: Counter[str] = Counter()
        self._dropped: Counter[tuple[str, str]] = Counter()
        self._warned: set[tuple[str, str]] = set()

    # -- public ----------------------------------------------------------------------------

    @property
    def initialized(self) -> bool:
        return self._initialized

    @property
    def next_init_at(self) -> float:
        """Clock time from which ``poll()`` retries ``init()`` (``-inf`` when due now)."""
        return self._next_init_at

    def poll(self) -> GpuSnapshot:
        """Read every device once. Never raises for backend failures."""
        with self._lock:
            now = self.clock()
            if not self._initialized:
                if now < self._next_init_at:
                    return self._not_initialized(now)
                self._try_init(now)
                if not self._initialized:
                    return self._not_initialized(now)
            return self._poll_devices(now)

    def close(self) -> None:
        """Shut the backend down (bounded by ``call_timeout``) and the private pool."""
        with self._lock:
            if self._initialized and self.calls.idle():
                try:
                    self.calls.call(self.backend.shutdown)
                except GpuError as exc:
                    log.warning("GPU backend shutdown: %s", exc)
            self._initialized = False
            self.calls.shutdown()

    # -- init ------------------------------------------------------------------------------

    def _try_init(self, now: float) -> None:
        pending = self.calls.late(_INIT_KEY)
        if pending is not None:
            if not pending.done():
                self._init_failed(GpuTimeout("init() still blocked"), now)
                return
            self.calls.discard(_INIT_KEY)
            if pending.exception() is None:  # a timed-out init finished after all
                self._init_succeeded()
                return
        try:
            self.calls.run(_INIT_KEY, self.backend.init)
        except GpuError as exc:
            self._init_failed(exc, now)
            return
        self._init_succeeded()

    def _init_succeeded(self) -> None:
        if self._init_failures:
            log.info("GPU library initialised after %d failed attempts", self._init_failures)
        self._initialized = True
        self._init_failures = 0
        self._next_init_at = float("-inf")
        self._init_reason = None

    def _init_failed(self, exc: GpuError, now: float) -> None:
        self._record(exc)
        self._initialized = False
        self._init_failures += 1
        delay = min(self.init_backoff * 2 ** (self._init_failures - 1), self.init_backoff_max)
        self._next_init_at = now + delay
        self._init_reason = f"GPU library init failed ({exc.kind}: {exc})"
        log.warning("%s; attempt %d, retry in %.1fs", self._init_reason, self._init_failures, delay)

    def _not_initialized(self, now: float) -> GpuSnapshot:
        base = self._init_reason or "GPU library not initialised"
        reason = f"{base}; retry in {max(0.0, self._next_init_at - now):.1f}s"
        gpus = tuple(_unhealthy(info, base) for info in self._known.values())
        return GpuSnapshot(gpus, False, reason, dict(self._errors), now, dict(self._dropped))

    # -- devices ---------------------------------------------------------------------------

    def _poll_devices(self, now: float) -> GpuSnapshot:
        enum_error: GpuError | None = None
        try:
            infos = self.calls.run(_DEVICES_KEY, self.backend.devices)
        except GpuLibraryMissing as exc:  # driver unloaded under us: back to init
            self._init_failed(exc, now)
            return self._not_initialized(now)
        except GpuError as exc:
            self._record(exc)
            enum_error = exc
            infos = None
        missing: set[str] = set()
        if infos is not None:
            current = {i.uuid: i for i in infos}
            for uuid, info in list(self._known.items()):
                if uuid in current:
                    continue
                if info.mig:  # MIG reconfigured: the slice is gone, not broken
                    del self._known[uuid]
                else:
                    missing.add(uuid)
            self._known.update(current)

        to_read = [i for i in self._known.values() if i.uuid not in missing]
        futures: dict[str, Future[_Reading] | None] = {}
        for info in to_read:
            futures[info.uuid] = self.calls.submit(info.uuid, self._reader(info.uuid))
        deadline = time.monotonic() + self.call_timeout
        statuses: list[GpuStatus] = []
        for info in self._known.values():
            if info.uuid in missing:
                statuses.append(_unhealthy(info, "lost: no longer enumerated"))
                continue
            fut = futures[info.uuid]
            try:
                if fut is None:
                    raise GpuTimeout("previous call still blocked", uuid=info.uuid)
                reading = self.calls.wait(fut, deadline, key=info.uuid)
            except GpuError as exc:
                self._record(exc)
                statuses.append(_unhealthy(info, _reason(exc)))
                continue
            for soft in reading.soft_errors:
                self._record(soft)
            statuses.append(self._status(info, reading))

        statuses.sort(key=lambda s: (s.index, s.mig, s.uuid))
        return self._snapshot(tuple(statuses), enum_error, now)

    def _reader(self, uuid: str) -> Callable[[], _Reading]:
        backend = self.backend

        def read() -> _Reading:
            soft: list[GpuError] = []
            memory = backend.memory(uuid)
            utilization: int | None
            processes: list[ProcessMemory] | None
            try:
                utilization = backend.utilization(uuid)
            except GpuNotSupported as exc:
                soft.append(exc)
                utilization = None
            try:
                processes = backend.processes(uuid)
            except GpuNotSupported as exc:
                soft.append(exc)
                processes = None
            return _Reading(memory, utilization, processes, soft)

        return read

    def _status(self, info: GpuInfo, r: _Reading) -> GpuStatus:
        m = r.memory
        if m.total_bytes <= 0 or not 0 <= m.used_bytes <= m.total_bytes or m.free_bytes < 0:
            self._errors["implausible_memory"] += 1
            log.warning("GPU %s: implausible memory values %s", info.uuid, m)
            return _unhealthy(info, f"implausible memory values (total={m.total_bytes})")
        utilization = r.utilization
        if utilization is not None and not 0 <= utilization <= 100:
            log.warning("GPU %s: implausible utilization %r dropped", info.uuid, utilization)
            utilization = None
        return GpuStatus(
            uuid=info.uuid,
            index=info.index,
            name=info.name,
            mig=info.mig,
            parent_uuid=info.parent_uuid,
            healthy=True,
            reason=None,
            total_bytes=m.total_bytes,
            used_bytes=m.used_bytes,
            free_bytes=m.free_bytes,
            reserved_bytes=m.reserved_bytes,
            utilization=utilization,
            processes=self._sane_processes(info.uuid, r.processes, m.total_bytes),
        )

    def _sane_processes(
        self, uuid: str, procs: list[ProcessMemory] | None, total: int
    ) -> tuple[ProcessMemory, ...] | None:
        if not procs:
            return None  # unknown: an empty list is not "no usage"
        kept: list[ProcessMemory] = []
        for p in procs:
            reason = self._implausible(p, total)
            if reason is None:
                kept.append(p)
                continue
            self._dropped[(uuid, reason)] += 1
            if (uuid, reason) not in self._warned:  # bounded: GPUs x reasons
                self._warned.add((uuid, reason))
                log.warning(
                    "GPU %s: dropped process entry pid=%d used_bytes=%s (%s; pid_max %d); "
                    "further drops for this reason are only counted",
                    uuid,
                    p.pid,
                    p.used_bytes,
                    reason,
                    self.pid_max,
                )
        return tuple(kept) or None

    def _implausible(self, p: ProcessMemory, total: int) -> DropReason | None:
        if not 1 <= p.pid < self.pid_max:
            return "pid_out_of_range"
        if p.used_bytes is not None and p.used_bytes < 0:
            return "used_negative"
        if p.used_bytes is not None and p.used_bytes > total:
            return "used_above_total"
        return None

    def _snapshot(
        self, gpus: tuple[GpuStatus, ...], enum_error: GpuError | None, now: float
    ) -> GpuSnapshot:
        bad = [g for g in gpus if not g.healthy]
        ready = len(bad) < len(gpus)
        detail = "; ".join(f"{g.uuid}: {g.reason}" for g in bad)
        if not gpus:
            why = f" ({_reason(enum_error)})" if enum_error else ""
            reason: str | None = f"no GPUs found{why}"
        elif not ready:
            reason = f"no usable GPU: {detail}"
        elif bad:
            reason = f"degraded: {len(bad)} of {len(gpus)} GPUs unhealthy: {detail}"
        elif enum_error is not None:
            reason = f"device enumeration failed ({_reason(enum_error)}); using last known list"
        else:
            reason = None
        return GpuSnapshot(gpus, ready, reason, dict(self._errors), now, dict(self._dropped))

    # -- errors ----------------------------------------------------------------------------

    def _record(self, exc: GpuError) -> None:
        self._errors[exc.kind] += 1


def _reason(exc: GpuError) -> str:
    return exc.kind if exc.message == exc.kind else f"{exc.kind}: {exc.message}"


def _unhealthy(info: GpuInfo, reason: str) -> GpuStatus:
    return GpuStatus(
        uuid=info.uuid,
        index=info.index,
        name=info.name,
        mig=info.mig,
        parent_uuid=info.parent_uuid,
        healthy=False,
        reason=reason,
    )
