"""The wait queue's part of a ``RateLimitPolicy`` spec (``spec.queue``): its bound, its order
within a tenant, and what the fair queue charges tenants (``queue.fairness``). Re-exported by
:mod:`kvgate_agent.contract.policy`."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import Field, NonNegativeInt

from kvgate_agent.contract.base import ContractModel


class QueueOrder(StrEnum):
    """Order in which waiting requests are admitted."""

    FIFO = "FIFO"
    PRIORITY = "Priority"
    SHORTEST_FIRST = "ShortestFirst"


class FairnessSpec(ContractModel):
    """What the fair queue charges a tenant per prompt and per output token, divided by its
    class's ``weight``. Defaults 1 and 2, VTC's (Sheng et al., "Fairness in Serving Large
    Language Models", OSDI 2024, https://www.usenix.org/conference/osdi24/presentation/sheng)."""

    prompt_token_weight: Annotated[float, Field(ge=0, le=1000, allow_inf_nan=False)] = 1.0
    output_token_weight: Annotated[float, Field(ge=0, le=1000, allow_inf_nan=False)] = 2.0


class QueueSpec(ContractModel):
    """Bounded wait queue for requests that do not fit now.

    Waiting requests leave it by priority first (higher first), then fairly between tenants
    (the backlogged tenant that received the least service, weighted, goes first: ``fairness``),
    then within one tenant in ``order``."""

    max_length: NonNegativeInt = 100
    max_wait_seconds: Annotated[float, Field(gt=0, le=3600, allow_inf_nan=False)] = 30.0
    order: QueueOrder = QueueOrder.FIFO
    fairness: FairnessSpec = Field(default_factory=FairnessSpec)
