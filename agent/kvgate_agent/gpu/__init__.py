"""GPU reading for the node agent: a backend interface (NVML, or a scripted fake for tests)
and a monitor that bounds every call in time and isolates faults per GPU."""

from kvgate_agent.gpu.backend import (
    GpuBackend,
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
from kvgate_agent.gpu.monitor import GpuMonitor, GpuSnapshot, GpuStatus
from kvgate_agent.gpu.nvml import NvmlBackend

__all__ = [
    "GpuBackend",
    "GpuError",
    "GpuInfo",
    "GpuLibraryMissing",
    "GpuLost",
    "GpuMonitor",
    "GpuNotSupported",
    "GpuSnapshot",
    "GpuStatus",
    "GpuTimeout",
    "GpuUnknownError",
    "MemoryInfo",
    "NvmlBackend",
    "ProcessMemory",
]
