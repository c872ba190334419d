"""Which GPUs a pod uses, for the node agent's safety net (free GPU memory below the margin
stops admission for the pods on that GPU).

Invariant: when it is not known, a pod is counted on every GPU of the node, never on none: a pod
counted on a GPU it does not use may be throttled needlessly, while a pod missed on a GPU it uses
could push that GPU out of memory. An empty NVML process list (PID namespaces, driver limits)
means "unknown".
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

GpuSource = Literal["reported", "nvml_processes", "all_gpus"]

# One path segment naming a pod, in the two kubelet cgroup drivers:
#   cgroupfs: ".../kubepods/burstable/pod0b6f5f3c-1f1e-4a5b-9c8d-2e3f4a5b6c7d/<container id>"
#   systemd:  ".../kubepods-burstable-pod0b6f5f3c_1f1e_4a5b_9c8d_2e3f4a5b6c7d.slice/<scope>"
# (guaranteed pods have no QoS level: "kubepods/pod<uid>", "kubepods-pod<uid>.slice"; kind
# nests them as "kubelet-kubepods-...-pod<uid>.slice"). The UID is an RFC 4122 UUID, dashes
# turned into underscores by the systemd driver. Matched per segment, without requiring
# "kubepods" in the path: inside a private cgroup namespace the agent sees other pods'
# paths relative to its own, e.g. "0::/../../pod<uid>/<container id>".
_POD_SEGMENT = re.compile(
    r"^(?:[A-Za-z0-9_.-]*-)?pod"
    r"([0-9a-fA-F]{8}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{12})"
    r"(?:\.slice)?$"
)


def pod_uid_from_cgroup(text: str) -> str | None:
    """The pod UID named in the contents of a ``/proc/<pid>/cgroup`` file, or None.

    Args:
        text: lines ``hierarchy-id:controllers:path`` (cgroup v1: one per hierarchy, e.g.
            ``12:memory:/kubepods/burstable/pod<uid>/<64 hex>``; v2: ``0::/<path>``, e.g.
            ``0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid with
            underscores>.slice/cri-containerd-<64 hex>.scope``). Container runtimes differ
            only in the last segment (``cri-containerd-``, ``crio-``, ``docker-``... or a bare
            id), which is not read.

    Returns:
        The UID, lower case with dashes (as in ``metadata.uid``); None when no line names a pod
        or when lines name different pods (ambiguous: the caller falls back to a conservative
        answer). Within one path the outermost pod segment counts (the pod this node's kubelet
        runs, should a pod nest a cluster of its own).
    """
    found: set[str] = set()
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        for segment in parts[2].split("/"):
            m = _POD_SEGMENT.match(segment)
            if m:
                found.add(m.group(1).replace("_", "-").lower())
                break
    return found.pop() if len(found) == 1 else None


def pod_uid_of_pid(pid: int, proc_root: Path = Path("/proc")) -> str | None:
    """The UID of the pod a process belongs to, from ``<proc_root>/<pid>/cgroup``.

    Args:
        pid: a process ID in the agent's PID namespace (the host's, with ``hostPID: true``; NVML
            reports host PIDs).
        proc_root: the proc file system (a fake tree in tests).

    Returns:
        The pod UID (see :func:`pod_uid_from_cgroup`), or None for a process outside any pod,
        a pid <= 0, or a file that cannot be read (the process exited, no permission...).
        Never raises.
    """
    if pid <= 0:
        return None
    try:
        text = (proc_root / str(pid) / "cgroup").read_text(encoding="utf-8", errors="replace")
    except (OSError, ValueError):
        return None
    return pod_uid_from_cgroup(text)


def gpus_by_pod(
    processes: Mapping[str, Iterable[int]], proc_root: Path = Path("/proc")
) -> dict[str, set[str]]:
    """Group GPUs by the pods whose processes run on them.

    Args:
        processes: GPU UUID -> PIDs NVML lists on it (physical GPUs and MIG slices alike).
        proc_root: the proc file system.

    Returns:
        pod UID -> set of GPU UUIDs. Processes outside pods, or gone, are left out. Reads each
        PID's cgroup file once. Never raises.
    """
    uid_of: dict[int, str | None] = {}
    out: dict[str, set[str]] = {}
    for uuid, pids in processes.items():
        for pid in pids:
            if pid not in uid_of:
                uid_of[pid] = pod_uid_of_pid(pid, proc_root)
            uid = uid_of[pid]
            if uid is not None:
                out.setdefault(uid, set()).add(uuid)
    return out


def gpus_for_pod(
    pod_uid: str | None,
    reported_uuids: Iterable[str],
    by_pod: Mapping[str, Iterable[str]],
    all_gpus: Iterable[str],
) -> tuple[set[str], GpuSource]:
    """The GPUs a pod uses, and where that came from, best source first:

    1. ``"reported"``: the GPU UUIDs the pod's sidecar reports (it reads them in the pod);
    2. ``"nvml_processes"``: the GPUs NVML lists the pod's processes on (the agent runs with
       ``hostPID: true``, and each PID's ``/proc/<pid>/cgroup`` names its pod:
       :func:`pod_uid_of_pid`, :func:`gpus_by_pod`);
    3. ``"all_gpus"``: unknown, so every GPU on the node.

    Args:
        pod_uid: the pod's ``metadata.uid`` (None when unknown: skips the NVML source).
        reported_uuids: GPU UUIDs its sidecar reported (may be empty).
        by_pod: from :func:`gpus_by_pod`.
        all_gpus: every GPU UUID on this node (physical and MIG), e.g. from the GPU snapshot.

    Returns:
        ``(uuids, source)``, source ``"reported"`` | ``"nvml_processes"`` | ``"all_gpus"``.
        Reported UUIDs not on this node are ignored; when none is left the next source is used.
        The NVML source is also limited to this node's GPUs. ``"all_gpus"`` returns every GPU
        (empty only when the node has none).
    """
    node = set(all_gpus)
    reported = {u for u in reported_uuids if u in node}
    if reported:
        return reported, "reported"
    if pod_uid is not None:
        seen = set(by_pod.get(pod_uid.lower(), ())) & node
        if seen:
            return seen, "nvml_processes"
    return node, "all_gpus"


@dataclass(slots=True)
class PodGpus:
    """The GPUs attributed to a pod and how they were found."""

    uuids: frozenset[str]
    source: GpuSource


def attribute_gpus(
    pod_uid: str | None,
    reported: Iterable[str],
    by_pod: Mapping[str, set[str]],
    node_gpus: Iterable[str],
) -> PodGpus:
    """The GPUs a pod uses (see :func:`gpus_for_pod`)."""
    uuids, source = gpus_for_pod(pod_uid, reported, by_pod, node_gpus)
    return PodGpus(frozenset(uuids), source)
