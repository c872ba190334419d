"""The wait queue's part of a ``RateLimitPolicy`` spec (``spec.queue``): its bound, its order
within a tenant, and what the fair queue charges tenants (``queue.fairness``). Re-exported by
:mod:`kvgate_agent.contract.policy`."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import Field, NonNegativeInt

from kvgate_agent.contract.base import ContractModel

#: The queue wait bound of a request under no TTFT SLO when neither ``slo.ttftSeconds`` nor
#: ``queue.maxWaitSeconds`` is stated, seconds. An overloaded server whose admitted requests
#: wait longer serves them past any interactive time-to-first-token: on the effectiveness
#: benchmark (docs/benchmarks.md, "Issue 22: defaults"; bounds of 0.5, 0.75, 1 and 2 s tried on
#: seed 1) an empty policy's goodput at 2x load was 0.86x the tuned concurrency cap's with
#: 0.5 s, 0.54x with 0.75 s and 0.35x with 1 s on the ``conversation`` workload.
DEFAULT_WAIT_SECONDS = 0.5
#: The longest a request under a TTFT SLO or of a ``batch`` class waits when
#: ``queue.maxWaitSeconds`` is unset, seconds (the field's default before the bound above).
MAX_WAIT_CAP_SECONDS = 30.0


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
    then within one tenant in ``order`` (default ShortestFirst: the smallest reservation first,
    aged so a long request outranks any new one after half the maximum wait; on the
    effectiveness benchmark it lifts a policy of only the SLO from 0.66-0.90x to 0.96-1.01x the
    goodput of one that sets it, seed 1, docs/benchmarks.md, issue 22).

    ``maxWaitSeconds``: the longest any request waits in the queue, seconds, in (0, 3600]; then
    it is degraded if allowed, else refused with 429 and Retry-After. Unset (the default):
    :data:`DEFAULT_WAIT_SECONDS` (0.5 s) for a request under no TTFT SLO while the policy states
    no ``slo.ttftSeconds``, or 2.5x the lowest admission-to-first-token time measured where
    that is longer (an engine whose own first token takes seconds, such as llama.cpp on a CPU:
    :meth:`kvgate_agent.admission.slo.SloState.default_wait`); one expected to wait more than
    twice that is refused at once, with its expected wait as Retry-After, as under a TTFT SLO; a
    request under a TTFT SLO waits at most its wait budget, and a ``batch`` class's request at
    most :data:`MAX_WAIT_CAP_SECONDS` (30 s), as every request did before the default bound. Set, it
    applies to every request as stated (a TTFT budget below it still ends the wait sooner).
    """

    max_length: NonNegativeInt = 100
    max_wait_seconds: Annotated[float, Field(gt=0, le=3600, allow_inf_nan=False)] | None = None
    order: QueueOrder = QueueOrder.SHORTEST_FIRST
    fairness: FairnessSpec = Field(default_factory=FairnessSpec)
