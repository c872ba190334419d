"""The token buckets of a ``RateLimitPolicy`` spec: ``spec.rateLimits[]`` (one limit each, per
tenant, per pod or cluster-wide: :class:`RateLimitSpec`, :class:`LimitScope`) and ``spec.cost``
(what one request costs in a token bucket: :class:`CostSpec`). :class:`LimitScope` and
:class:`RateLimitSpec` are re-exported by :mod:`kvgate_agent.contract.policy`, which holds the
rest of the manifest and the rules across parts (unique names, a burst that admits a default
request).

Units: rates are per minute as named (``requestsPerMinute``, ``tokensPerMinute``), bursts are
requests or cost units, durations are seconds, token weights are cost units per token. Errors
are raised as ``ValueError`` from pydantic validators;
:func:`~kvgate_agent.contract.policy.parse_policy` reports them by manifest path
(``spec.rateLimits[0].burstTokens: ...``).
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Annotated

from pydantic import Field, ValidationInfo, field_validator, model_validator

from kvgate_agent.contract.base import ContractModel, NonNegativeFloat, PositiveFloat, PositiveInt


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
