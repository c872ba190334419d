"""A governed pod's KV capacity (tokens), merged from its sources: the engine's own report, the
policy's explicit ``capacity.kvCacheTokens``, or an estimate from NVML's GPU memory.

Invariant: pure, and a wrong engine figure is never used: one below the model's context, beyond
the pod's GPU memory or beyond 2^40 tokens is ignored (and recorded as implausible), so it can
neither switch KV protection off nor refuse every request. Unknown is never a capacity: without
the figures an estimate needs, there is none.
"""

from __future__ import annotations

from collections.abc import Container

from kvgate_agent.contract.nodeadmission import PodAdmission
from kvgate_agent.gpu.monitor import GpuSnapshot
from kvgate_agent.node.podgpu import PodGpus

PodKey = tuple[str, str]  # (namespace, name)

#: Above this a reported KV figure (tokens) is beyond any GPU.
MAX_TOKENS = 1 << 40


def bytes_per_token(pod: PodAdmission) -> int | None:
    """KV bytes per token of a governed pod's model, from its thresholds."""
    return pod.thresholds.bytes_per_token or pod.thresholds.model.bytes_per_token


def gpu_memory(gpus: GpuSnapshot | None, uuids: frozenset[str]) -> tuple[int, int] | None:
    """(total bytes, number of GPUs) of the GPUs ``uuids``; None when any of them is unread."""
    if gpus is None:
        return None
    read = [gpus.gpu(u) for u in uuids]
    totals = [g.total_bytes for g in read if g is not None and g.total_bytes is not None]
    if not read or len(totals) != len(read):
        return None
    return sum(totals), len(totals)


def with_capacity(
    pod: PodAdmission, engine_kv: int | None, gpus: GpuSnapshot | None, attributed: PodGpus
) -> PodAdmission:
    """``pod`` with its thresholds' ``kv_capacity_tokens`` from the best source:

    1. the engine's own report (``engine_kv``, tokens, already found plausible by
       :meth:`KvCapacity.engine_kv`: vLLM ``vllm:cache_config_info`` num_gpu_blocks ×
       block_size) when the policy says ``capacity.fromEngineMetrics``; otherwise the engine's
       report still overrides estimates, but not an explicit ``capacity.kvCacheTokens``;
    2. the explicit ``capacity.kvCacheTokens`` (already in the thresholds the operator wrote);
    3. an NVML estimate, when the policy gives ``gpuMemoryUtilization`` and the model shape:
       ``(Σ total × gpuMemoryUtilization − weightsBytes − safetyMarginBytes × GPUs) /
       bytesPerToken`` over the pod's GPUs (``attributed``), only when the agent knows which
       GPUs are the pod's (or the node has one).
    """
    th = pod.thresholds
    cap = th.capacity
    kv = th.kv_capacity_tokens if th.kv_capacity_tokens is not None else cap.kv_cache_tokens
    if engine_kv is not None and (cap.from_engine_metrics or cap.kv_cache_tokens is None):
        kv = engine_kv
    elif kv is None:
        kv = _nvml_estimate(pod, gpus, attributed)
    if kv == th.kv_capacity_tokens:
        return pod
    return pod.model_copy(update={"thresholds": th.model_copy(update={"kv_capacity_tokens": kv})})


class KvCapacity:
    """Judges the engines' KV capacity reports (:func:`with_capacity` merges the sources).

    Holds :attr:`implausible`: the pods whose engine reports a KV capacity that is ignored, and
    why (a sentence). Pure: every input comes with the call.
    """

    def __init__(self) -> None:
        self.implausible: dict[PodKey, str] = {}

    def keep(self, pods: Container[PodKey]) -> None:
        """Only ``pods`` are governed now: forget the others."""
        self.implausible = {k: v for k, v in self.implausible.items() if k in pods}

    def forget(self, key: PodKey) -> None:
        """The pod's sidecar is gone."""
        self.implausible.pop(key, None)

    def engine_kv(
        self,
        key: PodKey,
        pod: PodAdmission | None,
        reported: int | None,
        gpus: GpuSnapshot | None,
        attributed: PodGpus,
    ) -> int | None:
        """The engine's reported KV capacity (tokens) if it is plausible, else None (recorded
        in :attr:`implausible`). A value is implausible when it is below the policy's
        ``model.maxModelLen`` (vLLM refuses to start unless its KV cache holds one sequence of
        max_model_len), or when its bytes (× bytesPerToken) exceed the memory of the pod's
        GPUs, or above 2^40 tokens."""
        kv = reported
        if kv is None:
            self.implausible.pop(key, None)
            return None
        why: str | None = None
        if kv > MAX_TOKENS:
            why = f"{kv} tokens is beyond any GPU"
        elif pod is not None:
            mml = pod.thresholds.model.max_model_len
            bpt = bytes_per_token(pod)
            memory = gpu_memory(gpus, attributed.uuids)
            if mml is not None and kv < mml:
                why = f"{kv} tokens is below model.maxModelLen {mml}"
            elif bpt is not None and memory is not None and kv * bpt > memory[0]:
                why = f"{kv} tokens × {bpt} bytes exceeds the pod's GPU memory ({memory[0]} bytes)"
        if why is None:
            self.implausible.pop(key, None)
            return kv
        self.implausible[key] = why
        return None


def _nvml_estimate(pod: PodAdmission, gpus: GpuSnapshot | None, attributed: PodGpus) -> int | None:
    """The KV capacity (tokens) the pod's GPU memory leaves after weights and margins, or None
    when a figure is missing or which GPUs are the pod's is unknown."""
    th = pod.thresholds
    util = th.capacity.gpu_memory_utilization
    bpt = bytes_per_token(pod)
    if attributed.source == "all_gpus" and len(attributed.uuids) != 1:
        return None  # which GPUs are the pod's is unknown: no estimate beats a wrong one
    memory = gpu_memory(gpus, attributed.uuids)
    if util is None or bpt is None or memory is None:
        return None
    total, count = memory
    margin = (th.capacity.safety_margin_bytes or 0) * count
    room = int(total * util) - (th.capacity.weights_bytes or 0) - margin
    tokens = room // bpt
    return tokens if tokens > 0 else None
