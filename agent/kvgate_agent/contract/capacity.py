"""The KV capacity parts of a ``RateLimitPolicy`` spec: ``spec.model`` (the served model's shape,
for KV arithmetic: :class:`ModelSpec`), ``spec.capacity`` (where the pod's KV capacity comes from
and how much of it a request reserves: :class:`CapacitySpec`) and ``spec.concurrency`` (a cap on
requests in flight: :class:`ConcurrencySpec`). :class:`ReservationMode` is re-exported by
:mod:`kvgate_agent.contract.policy`, which holds the rest of the manifest.

Units: token counts are model tokens, byte counts are bytes. Errors are raised as ``ValueError``
from pydantic validators; :func:`~kvgate_agent.contract.policy.parse_policy` reports them by
manifest path (``spec.model: ...``).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import Field, model_validator

from kvgate_agent.contract.base import ContractModel, NonNegativeInt, PositiveInt


class KVCacheDtype(StrEnum):
    """Element type of the KV cache. ``fp8`` is 1 byte per element
    (vLLM ``--kv-cache-dtype fp8``)."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    FP8 = "fp8"

    @property
    def nbytes(self) -> int:
        """Bytes per element."""
        return {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}[self.value]


class ModelSpec(ContractModel):
    """Shape of the served model, for KV arithmetic.

    Bytes per token = 2 (K and V) × numLayers × numKVHeads × headDim × dtype bytes
    (the standard decoder KV layout; see vLLM's ``get_kv_cache_spec`` / the PagedAttention paper,
    Kwon et al. 2023). ``numKVHeads`` is the number of key/value heads (GQA/MQA), not attention
    heads. Models with compressed KV (MLA) or sliding-window layers need their own formula: give
    ``capacity.kvCacheTokens`` directly instead of a shape for them.
    """

    num_layers: PositiveInt | None = Field(default=None, alias="numLayers")
    num_kv_heads: PositiveInt | None = Field(default=None, alias="numKVHeads")
    head_dim: PositiveInt | None = None
    kv_cache_dtype: KVCacheDtype = KVCacheDtype.FP16
    block_size: Annotated[int, Field(gt=0, le=4096)] = 16
    max_model_len: PositiveInt | None = None

    @model_validator(mode="after")
    def _shape_complete(self) -> ModelSpec:
        shape = (self.num_layers, self.num_kv_heads, self.head_dim)
        if any(v is not None for v in shape) and any(v is None for v in shape):
            raise ValueError("numLayers, numKVHeads and headDim must be given together")
        return self

    @property
    def bytes_per_token(self) -> int | None:
        """KV bytes one token holds, or None when the shape is not given."""
        if self.num_layers is None or self.num_kv_heads is None or self.head_dim is None:
            return None
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_cache_dtype.nbytes


class ReservationMode(StrEnum):
    """How much KV cache an admitted request reserves (see :class:`CapacitySpec`)."""

    PREDICTED = "Predicted"
    MAX_TOKENS = "MaxTokens"


class CapacitySpec(ContractModel):
    """Where the pod's KV capacity comes from, best source first, and how much of it a request
    reserves.

    ``fromEngineMetrics``: the engine's own report (vLLM ``vllm:cache_config_info``
    num_gpu_blocks × block_size). ``kvCacheTokens``: an explicit capacity. The NVML estimate
    (total × ``gpuMemoryUtilization`` − ``weightsBytes`` − ``safetyMarginBytes``) is computed by
    the node agent.

    ``reservation``: ``Predicted`` (default) reserves prompt + min(max_tokens, L) tokens rounded up
    to whole KV blocks, where L is a decaying high quantile (``reservationQuantile``, a fraction in
    [0.5, 0.999]) of the output lengths this pod's engine reported for the same tenant, model and
    max_tokens band (all tenants' pooled while the tenant's has too few), learned online; max_tokens
    until that band has enough samples. Sizing by predicted rather than maximum output length is
    S3's idea (Jin et al., 2023, "S3: Increasing GPU Utilization during Generative Inference for
    Higher Throughput", https://arxiv.org/abs/2306.06000). ``MaxTokens`` reserves prompt +
    max_tokens: the worst case, never outgrown.
    """

    kv_cache_tokens: PositiveInt | None = None
    from_engine_metrics: bool = False
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] | None = None
    weights_bytes: NonNegativeInt | None = None
    safety_margin_bytes: NonNegativeInt | None = None
    reservation: ReservationMode = ReservationMode.PREDICTED
    reservation_quantile: Annotated[float, Field(ge=0.5, le=0.999, allow_inf_nan=False)] = 0.9


class ConcurrencySpec(ContractModel):
    """Per-pod cap on requests in flight at the model server."""

    max_requests: PositiveInt | None = None
