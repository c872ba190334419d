"""What becomes of a request that does not fit now: ``spec.overload`` of a ``RateLimitPolicy``,
its ordered actions (:class:`OverloadAction`: Degrade, Queue, Reject) and how to degrade
(:class:`DegradeSpec`: clamp max_tokens, another model on the same server, or another pool,
:class:`FallbackPoolSpec`). :class:`OverloadAction` is re-exported by
:mod:`kvgate_agent.contract.policy`, which holds the rest of the manifest and the rules across
parts (``degrade.minMaxTokens`` against ``tenants.maxTokensCap``).

Units: ``minMaxTokens`` is model tokens; names and URLs are bounded strings. Errors are raised as
``ValueError`` from pydantic validators; :func:`~kvgate_agent.contract.policy.parse_policy`
reports them by manifest path (``spec.overload: ...``).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import Field, model_validator

from kvgate_agent.contract.base import ContractModel, PositiveInt


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
