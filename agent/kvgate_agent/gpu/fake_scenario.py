"""The scenario file of the fake GPU backend (:class:`~kvgate_agent.gpu.fake.FileFakeGpuBackend`,
``kvgate-agent node --gpu-backend fake:<path>``): its pydantic models, the fault kinds it may
name, and :func:`write_scenario`, with which tests rewrite it atomically. A test fixture's format,
not a simulator's: nothing here reads a GPU.

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
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from kvgate_agent.gpu.backend import (
    GpuError,
    GpuLibraryMissing,
    GpuLost,
    GpuNotSupported,
    GpuTimeout,
    GpuUnknownError,
)

GiB = 1 << 30


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
    """One device of a scenario file (its keys: the module docstring)."""

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
    """A whole scenario file (its keys: the module docstring)."""

    init_error: FaultKind | None = None
    devices_error: FaultKind | None = None
    gpus: tuple[ScenarioGpu, ...] = ()

    @model_validator(mode="after")
    def _unique_uuids(self) -> Scenario:
        uuids = [g.uuid for g in self.gpus]
        if len(set(uuids)) != len(uuids):
            raise ValueError("GPU uuids must be unique")
        return self


def validation_problem(exc: ValidationError) -> str:
    """The first three of ``exc``'s errors as ``loc: message`` joined by ``; ``, and how many
    more there are: one line for a log or an exception."""
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
        scenario: the JSON document (its keys: the module docstring).
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
            raise ValueError(f"invalid GPU scenario: {validation_problem(exc)}") from None
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
