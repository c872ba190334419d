"""The ``NodeAdmission`` object (cluster-scoped, one per node, named after the node).

``spec`` is written by the operator only: for every model pod on the node that a
RateLimitPolicy selects, the thresholds its sidecar enforces (rates and bursts already split for
``per: Global`` limits). ``status`` is written by the node agent only: GPU memory, per-pod KV
usage and in-flight counts, a heartbeat and conditions.

Units: tokens, bytes, seconds; rates per minute as in the policy.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from kvgate_agent.contract.base import ContractModel
from kvgate_agent.contract.policy import RateLimitPolicySpec


class PolicyRef(ContractModel):
    """The RateLimitPolicy a pod's thresholds come from, at the generation they were computed
    from (so a sidecar can tell whether it runs the newest policy)."""

    namespace: str
    name: str
    uid: str | None = None
    generation: int


class PodThresholds(RateLimitPolicySpec):
    """What one pod's sidecar enforces: the policy spec resolved for that pod.

    ``rateLimits`` hold this pod's own numbers: ``per: Global`` rates and bursts are already
    multiplied by ``globalShare`` (the pod's fraction of the cluster-wide budget).
    ``kvCapacityTokens`` is the capacity from the best source the operator knows (the engine's
    own report via the agent, else ``capacity.kvCacheTokens``); ``bytesPerToken`` comes from the
    model shape. ``selector`` is always absent here.
    """

    global_share: Annotated[float, Field(gt=0, le=1)] = 1.0
    kv_capacity_tokens: Annotated[int, Field(gt=0)] | None = None
    bytes_per_token: Annotated[int, Field(gt=0)] | None = None

    @model_validator(mode="after")
    def _bursts_admit_a_default_request(self) -> PodThresholds:
        """Overrides the policy's rule: a ``per: Global`` burst split across pods may fall
        below one default request's cost; the sidecar then answers 400 for such requests."""
        return self

    @model_validator(mode="after")
    def _no_selector(self) -> PodThresholds:
        if self.selector is not None:
            raise ValueError("thresholds carry no selector")
        return self


class PodAdmission(ContractModel):
    """One pod on the node and its thresholds."""

    namespace: str
    name: str
    uid: str
    policy: PolicyRef
    thresholds: PodThresholds


class NodeAdmissionSpec(ContractModel):
    """Written by the operator. ``pods`` is sorted by (namespace, name)."""

    node_name: str
    pods: list[PodAdmission] = Field(default_factory=list)


class GpuStatus(ContractModel):
    """One GPU or MIG slice as NVML reports it (bytes). Memory values are unset when the device
    cannot be read (``healthy`` False): unknown is never reported as 0."""

    uuid: str
    index: int | None = None
    name: str | None = None
    mig: bool = False
    parent_uuid: str | None = None
    total_bytes: Annotated[int, Field(ge=0)] | None = None
    used_bytes: Annotated[int, Field(ge=0)] | None = None
    free_bytes: Annotated[int, Field(ge=0)] | None = None
    reserved_bytes: Annotated[int, Field(ge=0)] | None = None
    utilization_percent: Annotated[int, Field(ge=0, le=100)] | None = None
    healthy: bool = True
    reason: str | None = None


class PodUsage(ContractModel):
    """What one pod's sidecar and engine report (tokens).

    ``gpuUuids`` are the GPUs the agent attributes to the pod (see ``gpuSource``);
    ``safetyNetOpen`` False means NVML free memory on one of them is below the policy's
    ``capacity.safetyMarginBytes`` and the sidecar admits nothing new.
    """

    namespace: str
    name: str
    uid: str | None = None
    in_flight: Annotated[int, Field(ge=0)] = 0
    queue_length: Annotated[int, Field(ge=0)] = 0
    kv_reserved_tokens: Annotated[int, Field(ge=0)] = 0
    kv_used_tokens: Annotated[int, Field(ge=0)] | None = None
    engine_kv_capacity_tokens: Annotated[int, Field(gt=0)] | None = None
    gpu_uuids: list[str] = Field(default_factory=list)
    gpu_source: Literal["reported", "nvml_processes", "all_gpus"] | None = None
    safety_net_open: bool = True


class Condition(ContractModel):
    """A Kubernetes-style condition."""

    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = ""
    message: str = ""
    last_transition_time: str | None = None


class NodeAdmissionStatus(ContractModel):
    """Written by the node agent."""

    gpus: list[GpuStatus] = Field(default_factory=list)
    pods: list[PodUsage] = Field(default_factory=list)
    heartbeat_time: str | None = None
    conditions: list[Condition] = Field(default_factory=list)


__all__ = [
    "Condition",
    "GpuStatus",
    "NodeAdmissionSpec",
    "NodeAdmissionStatus",
    "PodAdmission",
    "PodThresholds",
    "PodUsage",
    "PolicyRef",
]
