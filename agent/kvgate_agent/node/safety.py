"""The GPU safety net of each governed pod: closed (the pod admits nothing new) while free memory
on one of its GPUs is below the policy's ``capacity.safetyMarginBytes``, reopened once it is back
above the margin by :data:`SAFETY_HYSTERESIS` of it.

vLLM preallocates its KV pool, so NVML "used" does not move with load: NVML is the safety net,
not the KV meter. Invariant: pure, and unknown is never full: a GPU whose memory cannot be read
(or that is unhealthy) does not close a net.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvgate_agent.contract.sync import SafetyNet
from kvgate_agent.gpu.monitor import GpuSnapshot

#: Reopen the safety net only once free memory is this fraction of the margin above it (a value
#: hovering at the margin does not flap).
SAFETY_HYSTERESIS = 0.1

PodKey = tuple[str, str]  # (namespace, name)


@dataclass(slots=True)
class _Net:
    open: bool = True
    gpu_uuid: str | None = None
    free_bytes: int | None = None
    margin_bytes: int | None = None


class SafetyNets:
    """The safety nets of the pods that have one (a margin, and GPUs read).

    Holds, per such pod, whether its net is open and, when closed, the GPU that closed it, that
    GPU's free memory and the margin (bytes); a pod without an entry is open. Pure.
    """

    def __init__(self) -> None:
        self._nets: dict[PodKey, _Net] = {}

    def pods(self) -> set[PodKey]:
        """The pods with a net now."""
        return set(self._nets)

    def drop(self, key: PodKey) -> None:
        """The pod has no net any more (not governed, no margin, or no GPU read)."""
        self._nets.pop(key, None)

    def update(self, key: PodKey, margin: int, gpus: GpuSnapshot, uuids: Iterable[str]) -> None:
        """Re-evaluate the pod's net over its GPUs ``uuids`` against ``margin`` (bytes): it
        closes on the GPU with the least free memory below the margin; a GPU that closed it
        keeps it closed until its free memory is back above the margin by the hysteresis."""
        prev = self._nets.get(key) or _Net()
        now = _Net(margin_bytes=margin)
        for uuid in sorted(uuids):
            g = gpus.gpu(uuid)
            if g is None or g.free_bytes is None or not g.healthy:
                continue  # unknown is not "full"
            reopen_at = margin + margin * SAFETY_HYSTERESIS
            was_closed_here = not prev.open and prev.gpu_uuid == uuid
            low = g.free_bytes < margin or (was_closed_here and g.free_bytes < reopen_at)
            if low and (now.open or g.free_bytes < (now.free_bytes or 0)):
                now.open, now.gpu_uuid, now.free_bytes = False, uuid, g.free_bytes
        self._nets[key] = now

    def is_open(self, key: PodKey) -> bool:
        """Whether the pod's net lets it admit new requests."""
        net = self._nets.get(key)
        return net is None or net.open

    def closed(self) -> list[PodKey]:
        """The pods whose net is closed now."""
        return [k for k, n in self._nets.items() if not n.open]

    def answer(self, key: PodKey, retry_after_seconds: float) -> SafetyNet:
        """The pod's net as its sidecar is told it (the reason, GPU and figures when closed)."""
        n = self._nets.get(key) or _Net()
        return SafetyNet(
            open=n.open,
            reason=None
            if n.open
            else f"GPU {n.gpu_uuid} has {n.free_bytes} bytes free, below the safety margin "
            f"of {n.margin_bytes} bytes",
            gpu_uuid=None if n.open else n.gpu_uuid,
            free_bytes=None if n.open else n.free_bytes,
            margin_bytes=None if n.open else n.margin_bytes,
            retry_after_seconds=retry_after_seconds,
        )
