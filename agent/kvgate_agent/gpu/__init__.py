"""GPU reading for the node agent: a backend interface (NVML, or fakes for tests: scripted in
memory, or driven by a JSON file), a monitor that bounds every call in time and isolates faults
per GPU, and :func:`backend_from_spec` to pick a backend from a command-line string."""

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
from kvgate_agent.gpu.select import backend_from_spec

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
    "backend_from_spec",
]
