"""The `RateLimitPolicy` manifest (``apiVersion`` :data:`~kvgate_agent.contract.api.API_VERSION`):
kvgate's one policy format.

The same document is applied with ``kubectl`` (the operator reads it from the API server) or read
from a file by the standalone sidecar. Field names are camelCase as in the manifest; Python
attributes are snake_case. These names are kvgate's public API: keep them.

Units: token counts are model tokens, byte counts are bytes, durations are seconds, rates are per
minute as named (``requestsPerMinute``, ``tokensPerMinute``).

Errors: :func:`load_policy` and :func:`parse_policy` raise :class:`PolicyError` whose message names
each offending field by its manifest path (``spec.rateLimits[0].burstTokens: ...``).
"""

from __future__ import annotations

import math
import re
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import (
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from kvgate_agent.contract.api import API_VERSION
from kvgate_agent.contract.api import RATE_LIMIT_POLICY_KIND as KIND
from kvgate_agent.contract.base import ContractModel
from kvgate_agent.contract.classes import MAX_PRIORITY as MAX_PRIORITY  # re-exported
from kvgate_agent.contract.classes import MIN_PRIORITY as MIN_PRIORITY  # re-exported
from kvgate_agent.contract.classes import TenantClassesSpec
from kvgate_agent.contract.identity import JwtField, UnknownKeys
from kvgate_agent.contract.queue import FairnessSpec as FairnessSpec  # re-exported
from kvgate_agent.contract.queue import QueueOrder as QueueOrder  # re-exported
from kvgate_agent.contract.queue import QueueSpec

#: The manifest's ``apiVersion`` and ``kind`` as pydantic checks them: a ``Literal`` must spell
#: its value, so it is checked against :mod:`kvgate_agent.contract.api` at import.
ApiVersionLiteral = Literal["kvgate.io/v1alpha1"]
KindLiteral = Literal["RateLimitPolicy"]
if get_args(ApiVersionLiteral) != (API_VERSION,) or get_args(KindLiteral) != (KIND,):
    raise ImportError("RateLimitPolicy literals disagree with kvgate_agent.contract.api")

PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegativeFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class PolicyError(ValueError):
    """A policy document that cannot be used; the message names every bad field."""


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


class TenantsSpec(TenantClassesSpec):
    """How a request is attributed to a tenant: ``header`` names it, trusted as sent (missing =
    ``anonymous``); ``authorization``: the bearer token's (:mod:`kvgate_agent.contract.identity`).
    ``defaultMaxTokens`` is charged and sent upstream when a request omits max_tokens;
    ``maxTokensCap`` clamps any larger max_tokens before admission.
    ``classes``, ``defaultClass``: each tenant's class (:class:`TenantClassesSpec`).
    """

    header: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9-]+$")] = "x-kvgate-tenant"
    default_max_tokens: PositiveInt = 1024
    max_tokens_cap: PositiveInt | None = None
    unknown_keys: UnknownKeys = UnknownKeys.POOL
    jwt: JwtField = None

    @model_validator(mode="after")
    def _cap_above_default(self) -> TenantsSpec:
        if self.max_tokens_cap is not None and self.default_max_tokens > self.max_tokens_cap:
            raise ValueError("defaultMaxTokens must not exceed maxTokensCap")
        return self


class LimitScope(StrEnum):
    """Which requests share one bucket: one per tenant, one per pod, or one cluster-wide budget
    split across the matched pods (standalone: the pod has the whole budget)."""

    TENANT = "Tenant"
    POD = "Pod"
    GLOBAL = "Global"


class RateLimitSpec(ContractModel):
    """One token-bucket limit.

    ``requestsPerMinute`` refills a request bucket of ``burstRequests`` (default: one minute's
    worth); ``tokensPerMinute`` refills a cost bucket of ``burstTokens`` (default: one minute's
    worth), where cost is defined by :class:`CostSpec`. ``warmupSeconds``: capacity ramps linearly
    from a quarter to full over this time after the pod starts, so a fresh pod does not absorb a
    full burst. ``shared``: one budget across every pod the policy governs (``per: Tenant`` or
    ``per: Global``; refused with ``per: Pod``), held in the sidecars' store (``--store``, a
    Redis) through leases; without a store, the limit falls back to the per-pod behaviour.
    """

    name: Annotated[
        str, Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    ]
    per: LimitScope = LimitScope.TENANT
    requests_per_minute: PositiveFloat | None = None
    tokens_per_minute: PositiveFloat | None = None
    burst_requests: PositiveInt | None = None
    burst_tokens: PositiveInt | None = None
    warmup_seconds: NonNegativeFloat = 0.0
    shared: bool = False

    @field_validator("shared")
    @classmethod
    def _shared_scope(cls, v: bool, info: ValidationInfo) -> bool:
        if v and info.data.get("per") is LimitScope.POD:
            raise ValueError("shared needs per Tenant or per Global (per: Pod is one pod's limit)")
        return v

    @model_validator(mode="after")
    def _has_a_rate(self) -> RateLimitSpec:
        if self.requests_per_minute is None and self.tokens_per_minute is None:
            raise ValueError("a rate limit needs requestsPerMinute or tokensPerMinute")
        if self.burst_requests is not None and self.requests_per_minute is None:
            raise ValueError("burstRequests needs requestsPerMinute")
        if self.burst_tokens is not None and self.tokens_per_minute is None:
            raise ValueError("burstTokens needs tokensPerMinute")
        return self

    @property
    def request_capacity(self) -> float | None:
        """Request bucket capacity (requests), or None without a request rate."""
        if self.requests_per_minute is None:
            return None
        if self.burst_requests is not None:
            return float(self.burst_requests)
        return max(1.0, float(math.ceil(self.requests_per_minute)))

    @property
    def token_capacity(self) -> float | None:
        """Cost bucket capacity (cost units), or None without a token rate."""
        if self.tokens_per_minute is None:
            return None
        if self.burst_tokens is not None:
            return float(self.burst_tokens)
        return max(1.0, float(math.ceil(self.tokens_per_minute)))


class CostSpec(ContractModel):
    """Cost of one request in bucket units.

    cost = perRequest + prompt_tokens × promptTokenWeight + max_tokens × outputTokenWeight,
    reserved at admission and settled to the tokens actually produced when the response ends.
    Counting the prompt matters: a quota on output alone lets huge prompts through
    (https://github.com/BerriAI/litellm/issues/17664).
    """

    per_request: NonNegativeFloat = 0.0
    prompt_token_weight: NonNegativeFloat = 1.0
    output_token_weight: NonNegativeFloat = 1.0

    def of(self, prompt_tokens: int, output_tokens: int) -> float:
        """Cost units of a request with these token counts."""
        return (
            self.per_request
            + prompt_tokens * self.prompt_token_weight
            + output_tokens * self.output_token_weight
        )


class PriorityTarget(StrEnum):
    """The engine a request's priority is written into the forwarded body for (its own
    ``priority`` field), so the engine's queue and preemption order follow kvgate's.

    ``vLLM``: served with ``--scheduling-policy priority``, lower value first, so kvgate's
    priority is sent negated
    (https://docs.vllm.ai/en/latest/serving/openai_compatible_server.html#extra-parameters); a
    vLLM without that flag refuses a non-zero priority ("Got priority ... but Priority
    scheduling is not enabled").
    ``SGLang``: served with ``--enable-priority-scheduling``, higher value first by default
    (unless ``--schedule-low-priority-values-first``), so it is sent as is
    (https://docs.sglang.ai/advanced_features/server_arguments.html). ``None``: no priority
    field is sent.
    """

    VLLM = "vLLM"
    SGLANG = "SGLang"
    NONE = "None"


class PrioritySpec(ContractModel):
    """Request priority header: an integer, higher = more important, negative = sheddable
    (never queued under overload). ``forwardTo``: the engine that also gets it in the body
    (:class:`PriorityTarget`; default ``None``, nothing sent). ``trusted`` (default false): the
    header is set by a trusted gateway and taken as is; untrusted, it may only lower a request's
    priority below its tenant class's (``tenants.classes[].priority``, 0 by default), never
    raise it."""

    header: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9-]+$")] = "x-kvgate-priority"
    forward_to: PriorityTarget = PriorityTarget.NONE
    trusted: bool = False


class SloSpec(ContractModel):
    """Latency targets (seconds). Unset targets are not enforced.

    ``ttftSeconds``: time-to-first-token SLO, in (0, 3600], for requests with priority >=
    ``minPriority``. Such a request waits in the queue at most the SLO less the observed
    admission-to-first-token time (its wait budget); one whose expected queue wait exceeds twice
    that is refused at once with the expected wait as its Retry-After, instead of queued to fail.
    ``tpotSeconds``: target time per output token, in (0, 10], measured from streamed tokens
    of every request (whatever its priority; non-streamed responses are not measured): kvgate
    lowers its concurrency limit by 5 % per half second while the smoothed inter-token time is
    above it, and raises it by 5 % while below 0.85 x it and the limit was reached (adaptive
    concurrency in the style of Netflix's concurrency-limits,
    https://github.com/Netflix/concurrency-limits); never below 4 nor above
    ``concurrency.maxRequests``. Unset, the concurrency limit follows a gradient on the
    inter-token time instead (Gradient2, https://github.com/Netflix/concurrency-limits: it
    falls while the smoothed inter-token time exceeds 2.5 x the lowest one seen;
    :mod:`kvgate_agent.admission.slo`), and with ``ttftSeconds`` unset too a request waits at
    most 0.5 s in the queue unless ``queue.maxWaitSeconds`` says otherwise
    (:class:`~kvgate_agent.contract.queue.QueueSpec`). ``minPriority``: in [-1000, 1000], the
    priority header's range;
    default 0. Negative priorities are sheddable and never queued, so they get no TTFT budget
    whatever ``minPriority`` says.
    """

    ttft_seconds: Annotated[float, Field(gt=0, le=3600, allow_inf_nan=False)] | None = None
    tpot_seconds: Annotated[float, Field(gt=0, le=10, allow_inf_nan=False)] | None = None
    min_priority: Annotated[int, Field(ge=MIN_PRIORITY, le=MAX_PRIORITY)] = 0


class OverloadAction(StrEnum):
    """What to do with a request that does not fit now."""

    DEGRADE = "Degrade"
    QUEUE = "Queue"
    REJECT = "Reject"


#: An http(s) URL of a Service: scheme, host, optional port, no path, query or credentials.
FALLBACK_UPSTREAM_PATTERN = r"^https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?/?$"


class FallbackPoolSpec(ContractModel):
    """Another pool to send a request this pod cannot take: a Service serving a smaller or
    quantized model, with its own kvgate sidecar and admission.

    ``model``: the name the request's ``model`` is rewritten to; ``upstream``: the pool's base
    URL (``http://NAME.NAMESPACE.svc:PORT``), the request's path kept; ``PORT`` must reach the
    pool's kvgate sidecar (its ``kvgate-http`` port), not its engine, else the pool's requests
    pass no admission.
    """

    model: Annotated[str, Field(min_length=1, max_length=256)]
    upstream: Annotated[str, Field(max_length=512, pattern=FALLBACK_UPSTREAM_PATTERN)]


class DegradeSpec(ContractModel):
    """How to degrade: clamp max_tokens to what fits (not below ``minMaxTokens``), rewrite the
    request's model to ``fallbackModel`` (same server), or send it to another pool
    (``fallback``: a smaller model's Service)."""

    min_max_tokens: PositiveInt | None = None
    fallback_model: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    fallback: FallbackPoolSpec | None = None


class OverloadSpec(ContractModel):
    """Ordered overload actions, tried in turn (default: Queue, then Reject)."""

    actions: Annotated[list[OverloadAction], Field(min_length=1, max_length=3)] = Field(
        default_factory=lambda: [OverloadAction.QUEUE, OverloadAction.REJECT]
    )
    degrade: DegradeSpec | None = None

    @model_validator(mode="after")
    def _check(self) -> OverloadSpec:
        if len(set(self.actions)) != len(self.actions):
            raise ValueError("actions must not repeat")
        if OverloadAction.DEGRADE in self.actions and (
            self.degrade is None
            or (
                self.degrade.min_max_tokens is None
                and self.degrade.fallback_model is None
                and self.degrade.fallback is None
            )
        ):
            raise ValueError(
                "Degrade needs degrade.minMaxTokens, degrade.fallbackModel or degrade.fallback"
            )
        return self


class FailureMode(StrEnum):
    """What the sidecar does once its thresholds are stale (agent unreachable past the TTL):
    FailOpen keeps local caps only; FailClosed answers 503 with Retry-After."""

    FAIL_OPEN = "FailOpen"
    FAIL_CLOSED = "FailClosed"


class LabelSelectorRequirement(ContractModel):
    """A Kubernetes label selector requirement."""

    key: Annotated[str, Field(min_length=1)]
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _values_match_operator(self) -> LabelSelectorRequirement:
        if (self.operator in ("In", "NotIn")) != bool(self.values):
            raise ValueError(
                "values must be non-empty for operator In or NotIn and empty for Exists or "
                "DoesNotExist"
            )
        return self


_LABEL_NAME = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def _check_label_key(key: str) -> None:
    """A Kubernetes label key: ``[prefix/]name``, name ≤ 63 characters of
    ``[A-Za-z0-9-_.]`` starting and ending alphanumeric, prefix a DNS subdomain ≤ 253."""
    prefix, _, name = key.rpartition("/")
    if (
        not name
        or not _LABEL_NAME.match(name)
        or (prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)))
    ):
        raise ValueError(f"invalid label key {key!r}")


def _check_label_value(value: str) -> None:
    if not _LABEL_NAME.match(value):
        raise ValueError(f"invalid label value {value!r}")


class LabelSelector(ContractModel):
    """A Kubernetes label selector (``matchLabels`` and ``matchExpressions``). Keys and values
    must be valid label keys and values (a selector with any other can never match)."""

    match_labels: Annotated[dict[str, str], Field(max_length=64)] = Field(default_factory=dict)
    match_expressions: list[LabelSelectorRequirement] = Field(default_factory=list)

    @model_validator(mode="after")
    def _valid_labels(self) -> LabelSelector:
        for k, v in self.match_labels.items():
            _check_label_key(k)
            _check_label_value(v)
        for req in self.match_expressions:
            _check_label_key(req.key)
            for v in req.values:
                _check_label_value(v)
        return self


class RateLimitPolicySpec(ContractModel):
    """``spec`` of a RateLimitPolicy. Every field is optional (``selector`` is required in the
    cluster and ignored standalone)."""

    selector: LabelSelector | None = None
    model: ModelSpec = Field(default_factory=ModelSpec)
    capacity: CapacitySpec = Field(default_factory=CapacitySpec)
    concurrency: ConcurrencySpec = Field(default_factory=ConcurrencySpec)
    tenants: TenantsSpec = Field(default_factory=TenantsSpec)
    rate_limits: Annotated[list[RateLimitSpec], Field(max_length=16)] = Field(default_factory=list)
    cost: CostSpec = Field(default_factory=CostSpec)
    queue: QueueSpec = Field(default_factory=QueueSpec)
    priority: PrioritySpec = Field(default_factory=PrioritySpec)
    overload: OverloadSpec = Field(default_factory=OverloadSpec)
    slo: SloSpec = Field(default_factory=SloSpec)
    failure_mode: FailureMode = FailureMode.FAIL_OPEN

    @model_validator(mode="after")
    def _cross_field(self) -> RateLimitPolicySpec:
        names = [r.name for r in self.rate_limits]
        if len(set(names)) != len(names):
            raise ValueError("rateLimits names must be unique")
        cap = self.tenants.max_tokens_cap
        mml = self.model.max_model_len
        if cap is not None and mml is not None and cap >= mml:
            raise ValueError("tenants.maxTokensCap must be below model.maxModelLen")
        floor = None if self.overload.degrade is None else self.overload.degrade.min_max_tokens
        if floor is not None and cap is not None and floor > cap:
            raise ValueError("overload.degrade.minMaxTokens must not exceed tenants.maxTokensCap")
        return self

    @model_validator(mode="after")
    def _bursts_admit_a_default_request(self) -> RateLimitPolicySpec:
        """burstTokens ≥ the cost of a default request's output (perRequest +
        outputTokenWeight × defaultMaxTokens, or × minMaxTokens when Degrade may clamp to it):
        a smaller bucket could never admit an ordinary request. Same rule as the CRD's."""
        out = self.tenants.default_max_tokens
        dg = self.overload.degrade
        if OverloadAction.DEGRADE in self.overload.actions and dg and dg.min_max_tokens:
            out = min(out, dg.min_max_tokens)
        need = self.cost.per_request + self.cost.output_token_weight * out
        for rl in self.rate_limits:
            if rl.burst_tokens is not None and rl.burst_tokens < need:
                raise ValueError(
                    f"rateLimits[].burstTokens must be at least {need:g} (perRequest + "
                    "outputTokenWeight × defaultMaxTokens, or × minMaxTokens with Degrade) "
                    f"so a default request can ever be admitted; {rl.name} has {rl.burst_tokens}"
                )
        return self


class ObjectMeta(ContractModel):
    """The parts of Kubernetes metadata kvgate reads; the rest is accepted and ignored."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="allow", frozen=True
    )

    name: Annotated[str, Field(min_length=1, max_length=253)]
    namespace: str | None = None
    generation: int | None = None
    labels: dict[str, str] = Field(default_factory=dict)


class RateLimitPolicy(ContractModel):
    """A whole RateLimitPolicy manifest. ``status`` (written by the operator) is ignored here."""

    api_version: ApiVersionLiteral
    kind: KindLiteral
    metadata: ObjectMeta
    spec: RateLimitPolicySpec = Field(default_factory=RateLimitPolicySpec)
    status: dict[str, Any] | None = None


def _field_path(loc: tuple[int | str, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            parts.append(("." if parts else "") + item)
    return "".join(parts) or "(document)"


def parse_policy(document: Any) -> RateLimitPolicy:
    """Validate a decoded manifest (a dict) into a :class:`RateLimitPolicy`.

    Raises :class:`PolicyError` naming each bad field by its manifest path.
    """
    if not isinstance(document, dict):
        raise PolicyError("policy: expected a RateLimitPolicy mapping at the top level")
    try:
        # By alias only: the manifest's camelCase names, exactly what the CRD accepts.
        return RateLimitPolicy.model_validate(document, by_alias=True, by_name=False)
    except ValidationError as exc:
        lines = []
        for err in exc.errors(include_url=False):
            loc = tuple(
                p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-"))
            )
            lines.append(f"{_field_path(loc)}: {err['msg']}")
        raise PolicyError("invalid RateLimitPolicy:\n  " + "\n  ".join(lines)) from None


def load_policy(path: str | Path) -> RateLimitPolicy:
    """Read one RateLimitPolicy from a YAML or JSON file.

    A multi-document file must hold exactly one RateLimitPolicy. Raises :class:`PolicyError` on
    unreadable files, YAML errors or invalid fields; the message starts with the file name.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyError(f"{p}: cannot read policy file: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise PolicyError(f"{p}: not a text file (expected UTF-8 YAML or JSON)") from None
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise PolicyError(f"{p}: not valid YAML: {exc}") from None
    kinds = [d.get("kind") for d in docs if isinstance(d, dict)]
    docs = [d for d in docs if not (isinstance(d, dict) and d.get("kind") not in (None, KIND))]
    if len(docs) != 1:
        other = sorted({str(k) for k in kinds if k not in (None, KIND)})
        hint = f" (other kinds in the file: {', '.join(other)})" if other else ""
        raise PolicyError(
            f"{p}: expected exactly one RateLimitPolicy document, found {len(docs)}{hint}"
        )
    try:
        return parse_policy(docs[0])
    except PolicyError as exc:
        raise PolicyError(f"{p}: {exc}") from None
