"""Admission decisions: outcome, reason, Retry-After, and what was reserved.

Outcomes and reasons are small closed enums so they can be metric labels (low cardinality), in
the spirit of the Gateway API Inference Extension's flow-control outcomes
(https://github.com/kubernetes-sigs/gateway-api-inference-extension/blob/main/pkg/epp/flowcontrol/types/outcomes.go).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Final, TypeAlias

from kvgate_agent.admission.bucket import Bucket
from kvgate_agent.admission.config import ResolvedLimit

#: One bucket reservation held by a ticket: (bucket, units reserved, is the cost bucket). A
#: plain tuple, not a NamedTuple: one is built per bucket on every admission.
BucketCharge: TypeAlias = tuple[Bucket, float, bool]


class Outcome(StrEnum):
    """Final outcome of one request's admission.

    admitted: admitted at once, unchanged. queued: admitted unchanged after waiting in the queue.
    degraded: admitted with max_tokens clamped or the model rewritten (possibly after waiting).
    rejected: refused (429, 400 or 503).
    """

    ADMITTED = "admitted"
    QUEUED = "queued"
    DEGRADED = "degraded"
    REJECTED = "rejected"


class Reason(StrEnum):
    """Why the outcome is what it is.

    ``fail_closed``: admission is held because its thresholds cannot be trusted (stale past
    their TTL, or the engine's KV capacity unknown) and ``failureMode`` is FailClosed.
    ``gpu_memory_low``: admission is held because the node agent's GPU safety net closed (NVML
    free memory on one of the pod's GPUs below the policy's margin).
    ``slo``: the expected queue wait already exceeds the request's TTFT SLO (``slo.ttftSeconds``),
    so it is refused at once rather than queued to miss it.
    ``lent_slot``: admitted on a slot lent above the adaptive concurrency limit (a quiet
    tenant's request that would otherwise be refused for its TTFT SLO while a tenant far above
    its share holds the slots: :func:`kvgate_agent.admission.fairqueue.reserve.slot_lent`), so
    ``kvgate_admission_decisions_total{outcome="admitted",reason="lent_slot"}`` counts them.
    """

    OK = "ok"
    RATE_LIMIT_REQUESTS = "rate_limit_requests"
    RATE_LIMIT_TOKENS = "rate_limit_tokens"
    CONCURRENCY = "concurrency"
    KV_CAPACITY = "kv_capacity"
    QUEUE_FULL = "queue_full"
    QUEUE_TIMEOUT = "queue_timeout"
    SHEDDABLE = "sheddable"
    SLO = "slo"
    EXCEEDS_CAPACITY = "exceeds_capacity"
    MAX_TOKENS_CLAMPED = "max_tokens_clamped"
    LENT_SLOT = "lent_slot"
    FALLBACK_MODEL = "fallback_model"
    FALLBACK_POOL = "fallback_pool"
    FAIL_CLOSED = "fail_closed"
    GPU_MEMORY_LOW = "gpu_memory_low"
    DRAINING = "draining"


@dataclass(slots=True)
class Blocker:
    """What stops a request now.

    Attributes:
        reason: the refusal reason it would give.
        limit: the rate limit's name, or ``concurrency`` / ``kv`` / ``queue``.
        tenant_scoped: only this tenant's own bucket blocks (others need not wait behind it).
        bucket: the blocking bucket, for rate limits.
        amount: units the request needs from ``bucket``.
        resolved: the blocking rate limit, for rate limits.
        pool_share: the pool's fair reserve blocks (the tenant is over its pool-wide share:
            ``fairqueue/pool.py``): the request is refused at once, not queued.
    """

    reason: Reason
    limit: str
    tenant_scoped: bool = False
    bucket: Bucket | None = None
    amount: float = 0.0
    resolved: ResolvedLimit | None = None
    pool_share: bool = False


@dataclass(slots=True)
class AdmissionRequest:
    """What admission needs to know about one request.

    Args:
        tenant: tenant key (already hashed where it came from a credential).
        prompt_tokens: prompt tokens (exact or a conservative estimate).
        max_tokens: output tokens the request may produce, per choice.
        priority: higher = more important; negative = sheddable (never queued).
        n: number of choices generated (output and KV scale with it).
        model: the model asked for (to know whether a fallback rewrite changes anything, and
            the length predictor's key).
        predicted_output_tokens: output tokens per choice to reserve for instead of the
            predictor's estimate (a benchmark's oracle; None in production).
        model_rewritable: the request's API names its model, so it may be degraded to the
            fallback model (False for APIs without a ``model`` field, e.g. TGI's ``/generate``).
        degraded: the request was already degraded by another pod's sidecar (it carries
            ``x-kvgate-degraded``), so it is never sent on to a fallback pool again.
        prompt_tokens_min: the lowest the prompt's count can be, tokens, when ``prompt_tokens``
            is a cautious estimate (None: exact): a request that would never fit at the
            estimate is decided on this count instead, never refused on a guess.
        weight: the tenant's fair-share weight (> 0; its class's ``weight``, 1 by default): the
            fair queue serves backlogged tenants in proportion to their weights.
        ttft_slo_seconds: this request's time-to-first-token SLO, seconds, from its tenant
            class; None: the policy's rule (``slo.ttftSeconds`` for priority >=
            ``slo.minPriority``); ``math.inf``: none (a batch class: never shed for its wait).
        prefix_blocks: the chained hashes of the prompt's leading full KV blocks (block ``i``:
            tokens ``[i*B, (i+1)*B)``, ``B`` the policy's block size), as the engine's prefix
            cache names them (:mod:`.prefix_index`); None: unknown, the whole prompt is
            reserved and charged as uncached.
        cached_prefix_tokens: prompt tokens expected in the engine's prefix cache, reserved and
            charged as not newly allocated (:mod:`.prefix_index`): set by
            :meth:`~kvgate_agent.admission.controller.AdmissionController.submit` from
            ``prefix_blocks`` when given, else the caller's own figure (0: none).
        prefix_run: tokens of the prompt's leading blocks the prefix index holds (set by
            ``submit`` with ``cached_prefix_tokens``; the engine's report confirms it).
        waited_seconds: seconds the client's request waited before it reached this pod (a
            retry after another replica refused it, timed by the proxy's ``X-Request-Start``),
            taken off its TTFT wait budget; 0: it arrived here first.
    """

    tenant: str
    prompt_tokens: int
    max_tokens: int
    priority: int = 0
    n: int = 1
    model: str | None = None
    predicted_output_tokens: int | None = None
    model_rewritable: bool = True
    degraded: bool = False
    prompt_tokens_min: int | None = None
    weight: float = 1.0
    ttft_slo_seconds: float | None = None
    prefix_blocks: list[int] | None = None
    cached_prefix_tokens: int = 0
    prefix_run: int = 0
    waited_seconds: float = 0.0


#: :class:`Ticket`'s fields in its constructor's order (its ``repr``).
_TICKET_FIELDS: Final = (
    "tenant",
    "prompt_tokens",
    "max_tokens",
    "n",
    "kv_tokens",
    "admitted_at",
    "holds",
    "released",
    "model",
    "kv_max",
    "kv_reserved_at_admission",
    "generated",
    "last_token_at",
    "first_token_at",
    "inflight_seconds",
    "weight",
    "fair_charged",
    "fair_output",
    "prefill_pending",
    "cached_tokens",
    "prefix_run",
)


class Ticket:
    """The reservations held by one admitted request, released exactly once.

    ``holds`` lists the bucket reservations (see :data:`BucketCharge`). ``kv_tokens``: the KV
    reservation now, tokens (block-rounded; live correction grows it);
    ``kv_reserved_at_admission``: what was reserved at admission; ``kv_max``: the worst case,
    prompt + n x max_tokens block-rounded (the reservation never grows past it).
    ``max_tokens``: output tokens admitted per choice; ``admitted_at``: clock seconds.
    ``generated``, ``last_token_at``: output tokens streamed so far (all choices) and when the
    last of them passed (clock seconds; None before the first); ``first_token_at``: when the
    first passed; ``inflight_seconds``: the requests in flight times the seconds, summed over
    its inter-token gaps (its mean concurrency x its decode time: :mod:`.slo`). ``weight``:
    the tenant's fair-share weight; ``fair_charged``, ``fair_output``: what its tenant's
    fair-share counter was charged for it so far (token-weighted units) and the output tokens
    that covers (:mod:`.fairqueue.share`); ``prefill_pending``: its prompt counts in the
    engine's prefill backlog (:mod:`.prefill`). ``cached_tokens``: prompt tokens expected in
    the engine's prefix cache at admission (not reserved, not charged: :mod:`.prefix_index`);
    ``prefix_run``: the prefix index's run for the prompt, tokens (what the engine's report
    confirms).

    A plain native class with its own ``__init__`` rather than a dataclass: under mypyc a
    dataclass's ``__init__`` is the one ``dataclasses`` generates at import, interpreted, and it
    cost about 0.8 µs of the compiled decision's ~3 µs (21 fields set through descriptors).
    """

    __slots__ = (
        "admitted_at",
        "cached_tokens",
        "fair_charged",
        "fair_output",
        "first_token_at",
        "generated",
        "holds",
        "inflight_seconds",
        "kv_max",
        "kv_reserved_at_admission",
        "kv_tokens",
        "last_token_at",
        "max_tokens",
        "model",
        "n",
        "prefill_pending",
        "prefix_run",
        "prompt_tokens",
        "released",
        "tenant",
        "weight",
    )

    def __init__(
        self,
        tenant: str,
        prompt_tokens: int,
        max_tokens: int,
        n: int,
        kv_tokens: int,
        admitted_at: float,
        holds: list[BucketCharge] | None = None,
        released: bool = False,
        model: str | None = None,
        kv_max: int = 0,
        kv_reserved_at_admission: int = 0,
        generated: int = 0,
        last_token_at: float | None = None,
        first_token_at: float | None = None,
        inflight_seconds: float = 0.0,
        weight: float = 1.0,
        fair_charged: float = 0.0,
        fair_output: int = 0,
        prefill_pending: bool = False,
        cached_tokens: int = 0,
        prefix_run: int = 0,
    ) -> None:
        self.tenant: str = tenant
        self.prompt_tokens: int = prompt_tokens
        self.max_tokens: int = max_tokens
        self.n: int = n
        self.kv_tokens: int = kv_tokens
        self.admitted_at: float = admitted_at
        self.holds: list[BucketCharge] = [] if holds is None else holds
        self.released: bool = released
        self.model: str | None = model
        self.kv_max: int = kv_max
        self.kv_reserved_at_admission: int = kv_reserved_at_admission
        self.generated: int = generated
        self.last_token_at: float | None = last_token_at
        self.first_token_at: float | None = first_token_at
        self.inflight_seconds: float = inflight_seconds
        self.weight: float = weight
        self.fair_charged: float = fair_charged
        self.fair_output: int = fair_output
        self.prefill_pending: bool = prefill_pending
        self.cached_tokens: int = cached_tokens
        self.prefix_run: int = prefix_run

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in _TICKET_FIELDS)
        return f"Ticket({fields})"

    @property
    def uncached_prompt_tokens(self) -> int:
        """Prompt tokens the engine computes and allocates anew: prompt less ``cached_tokens``."""
        return self.prompt_tokens - self.cached_tokens


@dataclass(slots=True, eq=False)
class Waiter:
    """A request waiting in the queue. ``decision`` is set once it leaves the queue."""

    request: AdmissionRequest
    seq: int
    enqueued_at: float
    deadline: float
    kv_tokens: int
    remaining_actions: tuple[str, ...]
    clamped: bool = False
    decision: Decision | None = None
    #: Requests admitted past this one while it waited at the head for a shared resource
    #: (the fair queue's bounded backfill).
    skips: int = 0


class Decision:
    """One admission decision.

    Attributes:
        outcome, reason: see :class:`Outcome`, :class:`Reason`.
        status: HTTP status the proxy should answer with when refused (429, 400, 503); 200 when
            admitted.
        retry_after: seconds (integer ≥ 1) until the refused request could fit, computed from the
            real refill or drain time; None unless refused with 429/503.
        ticket: the reservations, when admitted.
        max_tokens: output tokens admitted per choice (after any clamp).
        model: the model to send upstream when rewritten to the fallback, else None.
        waiter: set while outcome is ``queued`` and the request still waits.
        limit: name of the rate limit (or ``concurrency``/``kv``) that decided, if any.
        queue_seconds: time spent waiting in the queue, seconds.
        message: a human-readable explanation for error bodies and logs.
        param: for a 400, the request part to change: ``max_tokens`` or ``prompt``.
        bucket_remaining, bucket_capacity, bucket_window, unit: the refusing bucket's state, for
            the ``RateLimit`` headers (units left, capacity, seconds to refill, unit name).
        refusal: for a request sent to the fallback pool (reason ``fallback_pool``: no ticket,
            nothing reserved here, ``model`` the pool's), this pod's own refusal, answered
            when the pool refuses too or cannot be reached.
        fleet_wide: a refusal whose own blocker is this pod's slice of a fleet-wide budget
            (a ``shared`` limit, ``per: Tenant`` or ``per: Global``, held through the store)
            that the whole budget, as of the last sync, could not cover either: every replica
            draws on the same budget and would refuse it alike,
            so the sidecar marks it ``x-envoy-ratelimited`` and proxies do not retry it
            elsewhere. False for every other refusal ("this replica is full").

    A plain class with its own ``__init__`` rather than a dataclass: it is built on every
    request, and a dataclass's generated ``__init__`` runs interpreted even under mypyc (a
    16-field one cost about 0.8 µs here, a third of the whole decision budget). Every field but
    the first four is keyword-only, with the constructor's defaults; no class-level defaults
    (mypyc would set each twice).
    """

    outcome: Outcome
    reason: Reason
    status: int
    retry_after: int | None
    ticket: Ticket | None
    max_tokens: int
    model: str | None
    waiter: Waiter | None
    limit: str | None
    queue_seconds: float
    message: str
    param: str | None
    bucket_remaining: float | None
    bucket_capacity: float | None
    bucket_window: float | None
    unit: str | None
    refusal: Decision | None
    fleet_wide: bool

    def __init__(
        self,
        outcome: Outcome,
        reason: Reason,
        ticket: Ticket | None = None,
        max_tokens: int = 0,
        *,
        status: int = 200,
        retry_after: int | None = None,
        model: str | None = None,
        waiter: Waiter | None = None,
        limit: str | None = None,
        queue_seconds: float = 0.0,
        message: str = "",
        param: str | None = None,
        bucket_remaining: float | None = None,
        bucket_capacity: float | None = None,
        bucket_window: float | None = None,
        unit: str | None = None,
        refusal: Decision | None = None,
        fleet_wide: bool = False,
    ) -> None:
        self.outcome = outcome
        self.reason = reason
        self.ticket = ticket
        self.max_tokens = max_tokens
        self.status = status
        self.retry_after = retry_after
        self.model = model
        self.waiter = waiter
        self.limit = limit
        self.queue_seconds = queue_seconds
        self.message = message
        self.param = param
        self.bucket_remaining = bucket_remaining
        self.bucket_capacity = bucket_capacity
        self.bucket_window = bucket_window
        self.unit = unit
        self.refusal = refusal
        self.fleet_wide = fleet_wide

    @property
    def admitted(self) -> bool:
        """True when the request may go upstream (it holds a ticket)."""
        return self.ticket is not None

    def __repr__(self) -> str:
        return (
            f"Decision({self.outcome.value}, {self.reason.value}, status={self.status}, "
            f"retry_after={self.retry_after}, max_tokens={self.max_tokens})"
        )
