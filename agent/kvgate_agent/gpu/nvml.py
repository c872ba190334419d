"""NVML backend, on the ``pynvml`` module of the ``nvidia-ml-py`` package.

``pynvml`` is imported in :meth:`NvmlBackend.init`, so this module imports on machines
without it; ``libnvidia-ml.so`` is loaded by ``nvmlInit``. Every NVML exception is turned
into a :class:`~kvgate_agent.gpu.backend.GpuError` subclass.

NVML calls used: ``nvmlInit``, ``nvmlShutdown``, ``nvmlDeviceGetCount``,
``nvmlDeviceGetHandleByIndex``, ``nvmlDeviceGetUUID``, ``nvmlDeviceGetName``,
``nvmlDeviceGetMigMode``, ``nvmlDeviceGetMaxMigDeviceCount``,
``nvmlDeviceGetMigDeviceHandleByIndex``, ``nvmlDeviceGetHandleByUUID``,
``nvmlDeviceGetMemoryInfo`` (``nvmlMemory_v2`` when available, else v1),
``nvmlDeviceGetUtilizationRates``, ``nvmlDeviceGetComputeRunningProcesses``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

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

# NVML return codes (nvml.h); fixed by the C API, so no need to read them from the binding.
_NOT_SUPPORTED = 3
_NOT_FOUND = 6
_DRIVER_NOT_LOADED = 9
_TIMEOUT = 10
_LIBRARY_NOT_FOUND = 12
_FUNCTION_NOT_FOUND = 13
_GPU_IS_LOST = 15
_LIB_RM_VERSION_MISMATCH = 18
_ARGUMENT_VERSION_MISMATCH = 25
_MIG_ENABLE = 1  # NVML_DEVICE_MIG_ENABLE

_ERROR_BY_CODE: dict[int, type[GpuError]] = {
    _GPU_IS_LOST: GpuLost,
    _NOT_SUPPORTED: GpuNotSupported,
    _FUNCTION_NOT_FOUND: GpuNotSupported,  # older driver without the entry point
    _LIBRARY_NOT_FOUND: GpuLibraryMissing,
    _DRIVER_NOT_LOADED: GpuLibraryMissing,
    _LIB_RM_VERSION_MISMATCH: GpuLibraryMissing,
    _TIMEOUT: GpuTimeout,
}


def map_nvml_error(exc: BaseException, uuid: str | None = None) -> GpuError:
    """Turn a ``pynvml.NVMLError`` (or anything else) into the GpuError hierarchy."""
    code = getattr(exc, "value", None)
    cls = _ERROR_BY_CODE.get(code, GpuUnknownError) if isinstance(code, int) else GpuUnknownError
    err = cls(f"NVML: {exc}", uuid=uuid)
    err.nvml_code = code  # type: ignore[attr-defined]
    return err


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class NvmlBackend:
    """:class:`~kvgate_agent.gpu.backend.GpuBackend` on NVML.

    Handles are cached by UUID at :meth:`devices`; a UUID not seen yet is looked up with
    ``nvmlDeviceGetHandleByUUID``. ``nvml`` may be given a stand-in module (tests).
    """

    def __init__(self, nvml: ModuleType | None = None) -> None:
        self._nvml: Any = nvml
        self._handles: dict[str, Any] = {}
        self._memory_v2 = True  # until the driver says otherwise

    # -- helpers ---------------------------------------------------------------------------

    @contextmanager
    def _mapped(self, uuid: str | None = None) -> Iterator[None]:
        nvml = self._nvml
        error_base = getattr(nvml, "NVMLError", None) if nvml is not None else None
        try:
            yield
        except GpuError:
            raise
        except Exception as exc:
            if error_base is not None and isinstance(exc, error_base):
                raise map_nvml_error(exc, uuid) from exc
            raise GpuUnknownError(f"{type(exc).__name__}: {exc}", uuid=uuid) from exc

    def _lib(self) -> Any:
        if self._nvml is None:
            raise GpuUnknownError("NVML not initialised: call init() first")
        return self._nvml

    def _handle(self, uuid: str) -> Any:
        handle = self._handles.get(uuid)
        if handle is None:
            nvml = self._lib()
            with self._mapped(uuid):
                handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
            self._handles[uuid] = handle
        return handle

    def _call(self, uuid: str, fn: Callable[[Any], Any]) -> Any:
        handle = self._handle(uuid)
        with self._mapped(uuid):
            return fn(handle)

    # -- GpuBackend ------------------------------------------------------------------------

    def init(self) -> None:
        """``nvmlInit``. Raises GpuLibraryMissing when pynvml or libnvidia-ml is absent."""
        if self._nvml is None:
            try:
                import pynvml  # type: ignore[import-untyped,unused-ignore]
            except ImportError as exc:
                raise GpuLibraryMissing("pynvml is not installed (pip: nvidia-ml-py)") from exc
            self._nvml = pynvml
        with self._mapped():
            self._nvml.nvmlInit()

    def shutdown(self) -> None:
        """``nvmlShutdown``; errors (e.g. never initialised) are logged, not raised."""
        self._handles.clear()
        if self._nvml is None:
            return
        try:
            with self._mapped():
                self._nvml.nvmlShutdown()
        except GpuError as exc:
            log.debug("nvmlShutdown: %s", exc)

    def devices(self) -> list[GpuInfo]:
        """``nvmlDeviceGetCount`` + ``nvmlDeviceGetHandleByIndex`` per GPU, and for each GPU
        with ``nvmlDeviceGetMigMode`` current == NVML_DEVICE_MIG_ENABLE its slices via
        ``nvmlDeviceGetMaxMigDeviceCount`` / ``nvmlDeviceGetMigDeviceHandleByIndex``.

        A GPU whose handle lookup fails (e.g. GpuIsLost) is skipped with a warning so the
        others are still listed; if every GPU fails, the first error is raised.
        """
        nvml = self._lib()
        with self._mapped():
            count = int(nvml.nvmlDeviceGetCount())
        found: list[GpuInfo] = []
        first_error: GpuError | None = None
        for index in range(count):
            try:
                found.extend(self._enumerate(index))
            except GpuError as exc:
                log.warning("GPU index %d could not be enumerated: %s", index, exc)
                first_error = first_error or exc
        if count and not found and first_error is not None:
            raise first_error
        return found

    def _enumerate(self, index: int) -> list[GpuInfo]:
        nvml = self._nvml
        with self._mapped():
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        with self._mapped(uuid):
            name = _text(nvml.nvmlDeviceGetName(handle))
        self._handles[uuid] = handle
        out = [GpuInfo(uuid=uuid, index=index, name=name, mig=False, parent_uuid=None)]
        try:
            with self._mapped(uuid):
                current, _pending = nvml.nvmlDeviceGetMigMode(handle)
        except GpuNotSupported:
            return out  # not a MIG-capable GPU
        if current != _MIG_ENABLE:
            return out
        with self._mapped(uuid):
            slots = int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle))
        for slot in range(slots):
            try:
                with self._mapped(uuid):
                    mig_handle = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except GpuError as exc:
                if getattr(exc, "nvml_code", None) != _NOT_FOUND:
                    log.warning("MIG slot %d of %s: %s", slot, uuid, exc)
                continue  # empty slot
            with self._mapped(uuid):
                mig_uuid = _text(nvml.nvmlDeviceGetUUID(mig_handle))
            with self._mapped(mig_uuid):
                mig_name = _text(nvml.nvmlDeviceGetName(mig_handle))
            self._handles[mig_uuid] = mig_handle
            out.append(GpuInfo(mig_uuid, index, mig_name, mig=True, parent_uuid=uuid))
        return out

    def memory(self, uuid: str) -> MemoryInfo:
        """``nvmlDeviceGetMemoryInfo(handle, version=nvmlMemory_v2)`` (has ``reserved``),
        falling back to v1 on NVMLError_FunctionNotFound / NotSupported / version mismatch /
        TypeError (older binding)."""
        nvml = self._lib()
        handle = self._handle(uuid)
        version = getattr(nvml, "nvmlMemory_v2", None)
        if self._memory_v2 and version is not None:
            try:
                with self._mapped(uuid):
                    try:
                        mem = nvml.nvmlDeviceGetMemoryInfo(handle, version=version)
                    except TypeError as exc:
                        raise GpuNotSupported(f"binding: {exc}", uuid) from exc
                return MemoryInfo(
                    total_bytes=int(mem.total),
                    used_bytes=int(mem.used),
                    free_bytes=int(mem.free),
                    reserved_bytes=int(mem.reserved),
                )
            except GpuError as exc:
                code = getattr(exc, "nvml_code", None)
                if not isinstance(exc, GpuNotSupported) and code != _ARGUMENT_VERSION_MISMATCH:
                    raise
                log.info("nvmlMemory_v2 unavailable (%s); using v1", exc)
                self._memory_v2 = False
        with self._mapped(uuid):
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
        return MemoryInfo(int(mem.total), int(mem.used), int(mem.free), None)

    def utilization(self, uuid: str) -> int | None:
        """``nvmlDeviceGetUtilizationRates(handle).gpu``; ``None`` on NotSupported (MIG)."""
        nvml = self._lib()
        try:
            rates = self._call(uuid, nvml.nvmlDeviceGetUtilizationRates)
        except GpuNotSupported:
            return None
        return int(rates.gpu)

    def processes(self, uuid: str) -> list[ProcessMemory]:
        """``nvmlDeviceGetComputeRunningProcesses`` (pynvml picks v3/v2); ``usedGpuMemory``
        None (NVML_VALUE_NOT_AVAILABLE) is kept as ``used_bytes=None``. Entries are returned as
        read, implausible ones included (a pid and a used memory exchanged by some
        driver/binding pairs: https://github.com/gpuopenanalytics/pynvml/issues/50): the
        monitor drops and counts them."""
        nvml = self._lib()
        procs = self._call(uuid, nvml.nvmlDeviceGetComputeRunningProcesses)
        out: list[ProcessMemory] = []
        for p in procs:
            used = getattr(p, "usedGpuMemory", None)
            used_bytes = None if used is None else int(used)
            out.append(ProcessMemory(pid=int(p.pid), used_bytes=used_bytes))
        return out
