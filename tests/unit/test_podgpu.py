"""Which GPUs a pod uses: /proc/<pid>/cgroup parsing on fake proc trees (cgroup v1 and v2, the
cgroupfs and systemd drivers, several runtimes), and the source order reported > NVML > all."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgate_agent.node.podgpu import (
    gpus_by_pod,
    gpus_for_pod,
    pod_uid_from_cgroup,
    pod_uid_of_pid,
)

UID_A = "0b6f5f3c-1f1e-4a5b-9c8d-2e3f4a5b6c7d"
UID_B = "7d1e2f3a-4b5c-4d6e-8f90-a1b2c3d4e5f6"
CID = "3f9a1c2b" * 8  # 64 hex: a container id


def underscored(uid: str) -> str:
    return uid.replace("-", "_")


# cgroup v2, systemd driver, containerd
V2_SYSTEMD_CONTAINERD = (
    "0::/kubepods.slice/kubepods-burstable.slice/"
    f"kubepods-burstable-pod{underscored(UID_A)}.slice/cri-containerd-{CID}.scope\n"
)
# cgroup v2, systemd driver, cri-o, guaranteed QoS (no QoS level in the path)
V2_SYSTEMD_CRIO_GUARANTEED = (
    f"0::/kubepods.slice/kubepods-pod{underscored(UID_B)}.slice/crio-{CID}.scope\n"
)
# cgroup v2, cgroupfs driver, containerd
V2_CGROUPFS = f"0::/kubepods/besteffort/pod{UID_A}/{CID}\n"
# cgroup v1, cgroupfs driver (docker), one line per hierarchy
V1_CGROUPFS = (
    "".join(
        f"{n}:{ctrl}:/kubepods/burstable/pod{UID_A}/{CID}\n"
        for n, ctrl in [
            (12, "memory"),
            (11, "cpu,cpuacct"),
            (10, "devices"),
            (9, "pids"),
            (1, "name=systemd"),
        ]
    )
    + "0::/system.slice/containerd.service\n"
)  # hybrid hierarchy
# cgroup v1, systemd driver, docker
V1_SYSTEMD_DOCKER = (
    f"12:memory:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{underscored(UID_B)}"
    f".slice/docker-{CID}.scope\n"
    f"11:devices:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{underscored(UID_B)}"
    f".slice/docker-{CID}.scope\n"
    "1:name=systemd:/kubepods.slice/kubepods-besteffort.slice/"
    f"kubepods-besteffort-pod{underscored(UID_B)}.slice/docker-{CID}.scope\n"
)
# kind: the node is a container; kubelet's slices are prefixed "kubelet-"
KIND = (
    f"0::/system.slice/docker-{CID}.scope/kubelet.slice/kubelet-kubepods.slice/"
    f"kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod{underscored(UID_A)}.slice/"
    f"cri-containerd-{CID}.scope\n"
)
# seen from inside the agent's private cgroup namespace: relative to its own cgroup
RELATIVE = f"0::/../../pod{UID_B}/{CID}\n"
# not in a pod: a host service, a system process, the init scope
HOST = "0::/system.slice/nvidia-persistenced.service\n"
INIT = "0::/init.scope\n"


@pytest.mark.parametrize(
    ("text", "uid"),
    [
        (V2_SYSTEMD_CONTAINERD, UID_A),
        (V2_SYSTEMD_CRIO_GUARANTEED, UID_B),
        (V2_CGROUPFS, UID_A),
        (V1_CGROUPFS, UID_A),
        (V1_SYSTEMD_DOCKER, UID_B),
        (KIND, UID_A),
        (RELATIVE, UID_B),
        (f"0::/kubepods/besteffort/pod{UID_A.upper()}/{CID}\n", UID_A),  # lowered
        (HOST, None),
        (INIT, None),
        ("", None),
        ("garbage without colons\n", None),
        ("0::/kubepods/burstable/podnot-a-uid/x\n", None),
        (f"0::/kubepods/burstable/mypod{UID_A}/x\n", None),  # "pod" must start the segment
        (f"12:memory:/kubepods/pod{UID_A}/x\n11:cpu:/kubepods/pod{UID_B}/x\n", None),  # ambiguous
    ],
)
def test_pod_uid_from_cgroup(text: str, uid: str | None) -> None:
    assert pod_uid_from_cgroup(text) == uid


def make_proc(root: Path, pid: int, cgroup: str) -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    (d / "cgroup").write_text(cgroup)


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    root = tmp_path / "proc"
    make_proc(root, 1234, V2_SYSTEMD_CONTAINERD)  # pod A, GPU 0
    make_proc(root, 1235, V1_CGROUPFS)  # pod A as well (another process), GPU 1
    make_proc(root, 2001, V2_SYSTEMD_CRIO_GUARANTEED)  # pod B, MIG slice
    make_proc(root, 77, HOST)  # not a pod
    (root / "self").mkdir()
    return root


def test_pod_uid_of_pid(proc: Path) -> None:
    assert pod_uid_of_pid(1234, proc) == UID_A
    assert pod_uid_of_pid(2001, proc) == UID_B
    assert pod_uid_of_pid(77, proc) is None  # not in a pod
    assert pod_uid_of_pid(999, proc) is None  # vanished
    assert pod_uid_of_pid(0, proc) is None
    assert pod_uid_of_pid(-4, proc) is None
    assert pod_uid_of_pid(1, proc / "missing") is None


def test_unreadable_cgroup_file(proc: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def denied(self: Path, *args: object, **kwargs: object) -> str:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_text", denied)  # as a non-root agent would see it
    assert pod_uid_of_pid(1234, proc) is None


def test_cgroup_is_a_directory_or_binary(proc: Path) -> None:
    (proc / "3000" / "cgroup").mkdir(parents=True)
    assert pod_uid_of_pid(3000, proc) is None
    (proc / "3001").mkdir()
    (proc / "3001" / "cgroup").write_bytes(b"\xff\xfe\x00\x80garbage\n")
    assert pod_uid_of_pid(3001, proc) is None
    (proc / "3002").mkdir()  # undecodable bytes around an intact path: still read
    (proc / "3002" / "cgroup").write_bytes(b"\xff0::/kubepods/pod" + UID_A.encode() + b"/x\n")
    assert pod_uid_of_pid(3002, proc) == UID_A


def test_gpus_by_pod(proc: Path) -> None:
    by_pod = gpus_by_pod(
        {
            "GPU-0": [1234, 77],
            "GPU-1": [1235, 999],  # 999 vanished between NVML and /proc
            "MIG-1a": (2001,),
            "GPU-2": [],
        },
        proc,
    )
    assert by_pod == {UID_A: {"GPU-0", "GPU-1"}, UID_B: {"MIG-1a"}}
    assert gpus_by_pod({}, proc) == {}


def test_gpus_for_pod_sources() -> None:
    node = {"GPU-0", "GPU-1", "GPU-2"}
    by_pod = {UID_A: {"GPU-1"}}
    assert gpus_for_pod(UID_A, ["GPU-0"], by_pod, node) == ({"GPU-0"}, "reported")
    # reported but not on this node: ignored, falls back
    assert gpus_for_pod(UID_A, ["GPU-elsewhere"], by_pod, node) == ({"GPU-1"}, "nvml_processes")
    # partly on this node: the ones that are
    assert gpus_for_pod(UID_A, ["GPU-2", "GPU-x"], by_pod, node) == ({"GPU-2"}, "reported")
    assert gpus_for_pod(UID_A.upper(), [], by_pod, node) == ({"GPU-1"}, "nvml_processes")
    # unknown everywhere: every GPU (conservative)
    assert gpus_for_pod(UID_B, [], by_pod, node) == (node, "all_gpus")
    assert gpus_for_pod(None, (), by_pod, node) == (node, "all_gpus")
    # NVML saw a GPU that is no longer on the node's list
    assert gpus_for_pod(UID_A, [], {UID_A: {"GPU-gone"}}, node) == (node, "all_gpus")
    assert gpus_for_pod(UID_A, ["GPU-0"], by_pod, []) == (set(), "all_gpus")


def test_result_is_a_fresh_set() -> None:
    by_pod = {UID_A: {"GPU-1"}}
    uuids, _ = gpus_for_pod(UID_A, [], by_pod, ["GPU-1"])
    uuids.add("x")
    assert by_pod == {UID_A: {"GPU-1"}}
