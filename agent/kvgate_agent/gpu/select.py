"""Choose a GPU backend from a command-line string (``kvgate-agent node --gpu-backend``)."""

from __future__ import annotations

from pathlib import Path

from kvgate_agent.gpu.backend import GpuBackend
from kvgate_agent.gpu.fake import FileFakeGpuBackend
from kvgate_agent.gpu.nvml import NvmlBackend

BACKEND_SPECS = "'nvml' or 'fake:<path to a scenario JSON file>'"


def backend_from_spec(spec: str) -> GpuBackend:
    """The backend a spec names.

    Args:
        spec: ``"nvml"`` (:class:`~kvgate_agent.gpu.nvml.NvmlBackend`, the real driver) or
            ``"fake:<path>"`` (:class:`~kvgate_agent.gpu.fake.FileFakeGpuBackend` on that
            scenario file, for tests). Surrounding blanks are ignored.

    Returns:
        A backend, not initialised: nothing is loaded or read here (a missing driver or
        scenario file shows at ``init()``, which the monitor retries with backoff).

    Raises:
        ValueError: any other spec, or ``"fake:"`` without a path.
    """
    s = spec.strip()
    if s == "nvml":
        return NvmlBackend()
    if s.startswith("fake:"):
        path = s.removeprefix("fake:").strip()
        if not path:
            raise ValueError(f"GPU backend {spec!r}: 'fake:' needs a scenario file path")
        return FileFakeGpuBackend(Path(path))
    raise ValueError(f"unknown GPU backend {spec!r}: expected {BACKEND_SPECS}")
