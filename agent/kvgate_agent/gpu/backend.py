"""The GPU-reading interface the node agent depends on, and its plain value types.

A backend reads one node's GPUs: physical devices and, when MIG mode is on, their MIG slices,
all keyed by UUID. It does no retrying, no timing and no caching of values; the
:class:`~kvgate_agent.gpu.monitor.GpuMonitor` adds time bounds, fault isolation and backoff.

Every failure is a :class:`GpuError` subclass, carrying the UUID when known, so callers never
see a binding's own exception types.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """One readable device: a physical GPU, or a MIG slice of one (``mig=True``).

    ``index`` is the physical GPU's index (for a MIG slice, its parent's); the UUID is the key.
    ``parent_uuid`` is the physical GPU's UUID for a MIG slice, ``None`` otherwise.
    """

    uuid: str
    index: int
    name: str
    mig: bool = False
    parent_uuid: str | None = None


@dataclass(frozen=True, slots=True)
class MemoryInfo:
    """Device memory in bytes. ``reserved_bytes`` is ``None`` when the driver cannot report it
    (NVML ``nvmlMemory_v1``)."""

    total_bytes: int
    used_bytes: int
    free_bytes: int
    reserved_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class ProcessMemory:
    """One process's device memory. ``used_bytes`` is ``None`` when the driver says "not
    available" (NVML_VALUE_NOT_AVAILABLE). Values as the driver reported them, unchecked: the
    monitor drops implausible entries (a pid beyond ``pid_max``, used memory negative or above
    the device's total)."""

    pid: int
    used_bytes: int | None


class GpuError(Exception):
    """Base of every backend failure. ``kind`` is a stable label for metrics."""

    kind: str = "unknown"

    def __init__(self, message: str = "", uuid: str | None = None) -> None:
        self.uuid = uuid
        self.message = message or self.kind
        super().__init__(f"{self.message} (gpu {uuid})" if uuid else self.message)


class GpuLost(GpuError):
    """The GPU fell off the bus or needs a reset (NVML_ERROR_GPU_IS_LOST)."""

    kind = "lost"


class GpuNotSupported(GpuError):
    """The query is not supported on this device (NVML_ERROR_NOT_SUPPORTED), e.g. utilization
    on a MIG slice. Never to be reported as a zero value."""

    kind = "not_supported"


class GpuLibraryMissing(GpuError):
    """The management library or driver is absent or mismatched (NVML_ERROR_LIBRARY_NOT_FOUND,
    NVML_ERROR_DRIVER_NOT_LOADED, NVML_ERROR_LIB_RM_VERSION_MISMATCH, binding not installed)."""

    kind = "library_missing"


class GpuTimeout(GpuError):
    """The call did not return in time (NVML_ERROR_TIMEOUT, or the monitor's own deadline)."""

    kind = "timeout"


class GpuUnknownError(GpuError):
    """Any other failure (NVML_ERROR_UNKNOWN and the rest)."""

    kind = "unknown"


@runtime_checkable
class GpuBackend(Protocol):
    """What the monitor needs from a GPU library. Calls may block; all may raise
    :class:`GpuError`."""

    def init(self) -> None:
        """Load and initialise the library. Raises GpuLibraryMissing when absent."""
        ...

    def shutdown(self) -> None:
        """Release the library. Safe to call when not initialised."""
        ...

    def devices(self) -> list[GpuInfo]:
        """Physical GPUs and, for each in MIG mode, its MIG slices."""
        ...

    def memory(self, uuid: str) -> MemoryInfo:
        """Memory of one device."""
        ...

    def utilization(self, uuid: str) -> int | None:
        """GPU utilization in percent, or ``None`` when not supported (MIG): never 0 for
        "unknown"."""
        ...

    def processes(self, uuid: str) -> list[ProcessMemory]:
        """Compute processes the driver can see on the device. An empty list means "none
        visible" (PID namespaces hide processes), not "no usage"."""
        ...
