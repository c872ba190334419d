"""The `RateLimitPolicy` manifest (``apiVersion`` :data:`~kvgate_agent.contract.api.API_VERSION`):
kvgate's one policy format.

The same document is applied with ``kubectl`` (the operator reads it from the API server) or read
from a file by the standalone sidecar. Field names are camelCase as in the manifest; Python
attributes are snake_case. These names are kvgate's public API: keep them.

The spec's parts each have a module: ``model``, ``capacity`` and ``concurrency`` in
:mod:`~kvgate_agent.contract.capacity`; ``rateLimits`` and ``cost`` in
:mod:`~kvgate_agent.contract.ratelimits`; ``queue`` in :mod:`~kvgate_agent.contract.queue`;
``overload`` in :mod:`~kvgate_agent.contract.overload`; the tenants' classes and identity in
:mod:`~kvgate_agent.contract.classes` and :mod:`~kvgate_agent.contract.identity`. This module
holds the rest (``tenants``, ``priority``, ``slo``, ``failureMode``, ``selector``), the rules
across parts, the whole manifest and its parsing; the names its importers use from the parts are
re-exported here.

Units: token counts are model tokens, byte counts are bytes, durations are seconds, rates are per
minute as named (``requestsPerMinute``, ``tokensPerMinute``).

Errors: :func:`load_policy` and :func:`parse_policy` raise :class:`PolicyError` whose message names
each offending field by its manifest path (``spec.rateLimits[0].burstTokens: ...``).
"""

from __future__ import annotations

import re
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from kvgate_agent.contract import yamlfile
from kvgate_agent.contract.api import API_VERSION
from kvgate_agent.contract.api import RATE_LIMIT_POLICY_KIND as KIND
from kvgate_agent.contract.base import ContractModel, PositiveInt
from kvgate_agent.contract.capacity import CapacitySpec, ConcurrencySpec, ModelSpec
from kvgate_agent.contract.capacity import ReservationMode as ReservationMode  # re-exported
from kvgate_agent.contract.classes import MAX_PRIORITY as MAX_PRIORITY  # re-exported
from kvgate_agent.contract.classes import MIN_PRIORITY as MIN_PRIORITY  # re-exported
from kvgate_agent.contract.classes import TenantClassesSpec
from kvgate_agent.contract.identity import JwtField, UnknownKeys
from kvgate_agent.contract.overload import OverloadAction as OverloadAction  # re-exported
from kvgate_agent.contract.overload import OverloadSpec
from kvgate_agent.contract.queue import FairnessSpec as FairnessSpec  # re-exported
from kvgate_agent.contract.queue import QueueOrder as QueueOrder  # re-exported
from kvgate_agent.contract.queue import QueueSpec
from kvgate_agent.contract.ratelimits import CostSpec
from kvgate_agent.contract.ratelimits import LimitScope as LimitScope  # re-exported
from kvgate_agent.contract.ratelimits import RateLimitSpec as RateLimitSpec  # re-exported

#: The manifest's ``apiVersion`` and ``kind`` as pydantic checks them: a ``Literal`` must spell
#: its value, so it is checked against :mod:`kvgate_agent.contract.api` at import.
ApiVersionLiteral = Literal["kvgate.io/v1alpha1"]
KindLiteral = Literal["RateLimitPolicy"]
if get_args(ApiVersionLiteral) != (API_VERSION,) or get_args(KindLiteral) != (KIND,):
    raise ImportError("RateLimitPolicy literals disagree with kvgate_agent.contract.api")


class PolicyError(ValueError):
    """A policy document that cannot be used; the message names every bad field."""


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
    learns each completed request's TPOT against the requests in flight beside it and keeps its
    concurrency limit at the most requests in flight whose requests' 90th-percentile TPOT meets
    it (lowered at once where a level is measured too slow, raised at most a quarter per
    service time where the limit stops requests; :mod:`kvgate_agent.admission.concurrency_limit`);
    never below 1 nor above ``concurrency.maxRequests`` or the engine's slots. Unset, the limit
    is the knee of throughput against concurrency instead: the most requests in flight whose
    inter-token time stays within 2.5 x the fastest measured, and with ``ttftSeconds`` unset
    too a request waits at most 0.5 s in the queue (or 2.5x the engine's lowest measured
    admission-to-first-token time, where longer) unless ``queue.maxWaitSeconds`` says
    otherwise
    (:class:`~kvgate_agent.contract.queue.QueueSpec`). ``minPriority``: in [-1000, 1000], the
    priority header's range;
    default 0. Negative priorities are sheddable and never queued, so they get no TTFT budget
    whatever ``minPriority`` says.
    """

    ttft_seconds: Annotated[float, Field(gt=0, le=3600, allow_inf_nan=False)] | None = None
    tpot_seconds: Annotated[float, Field(gt=0, le=10, allow_inf_nan=False)] | None = None
    min_priority: Annotated[int, Field(ge=MIN_PRIORITY, le=MAX_PRIORITY)] = 0


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
            # pydantic names its model class for a value that is not a mapping.
            msg = "expected a mapping" if err["type"] == "model_type" else err["msg"]
            lines.append(f"{_field_path(loc)}: {msg}")
        raise PolicyError("invalid RateLimitPolicy:\n  " + "\n  ".join(lines)) from None


def load_policy(path: str | Path) -> RateLimitPolicy:
    """Read one RateLimitPolicy from a YAML or JSON file.

    A multi-document file must hold exactly one RateLimitPolicy. Raises :class:`PolicyError` on
    unreadable files, YAML errors (a mapping that repeats a key among them: YAML keeps one of
    the two silently, :mod:`~kvgate_agent.contract.yamlfile`) or invalid fields; the message
    starts with the file name.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyError(f"{p}: cannot read policy file: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise PolicyError(f"{p}: not a text file (expected UTF-8 YAML or JSON)") from None
    try:
        docs = [d for d in yamlfile.load_all(text) if d is not None]
    except yamlfile.DuplicateKeyError as exc:
        raise PolicyError(f"{p}: {exc}") from None
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
