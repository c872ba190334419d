"""Resolved admission thresholds: what one pod's admission core enforces.

A :class:`AdmissionConfig` is computed from a ``RateLimitPolicySpec`` (standalone, or by the
operator after splitting ``per: Global`` budgets across pods) plus the pod's KV capacity. Rates are
converted to per-second here once, so the hot path does no unit conversion.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgate_agent.contract.policy import (
    FailureMode,
    LimitScope,
    OverloadAction,
    QueueOrder,
    RateLimitPolicySpec,
    ReservationMode,
)
from kvgate_agent.contract.queue import DEFAULT_WAIT_SECONDS, MAX_WAIT_CAP_SECONDS


def tightest_tpot_seconds(spec: RateLimitPolicySpec) -> float | None:
    """The time-per-output-token target, seconds, the pod's adaptive concurrency limit steers
    by: the smallest of the policy's ``slo.tpotSeconds`` and its tenant classes'
    ``tenants.classes[].slo.tpotSeconds`` (one limit serves every class, so the strictest wins;
    a batch class states none). None when none is stated."""
    targets = [c.slo.tpot_seconds for c in spec.tenants.classes if c.slo is not None]
    stated = [t for t in (spec.slo.tpot_seconds, *targets) if t is not None]
    return min(stated, default=None)


@dataclass(frozen=True, slots=True)
class ResolvedLimit:
    """One rate limit after resolution.

    ``request_rate``/``cost_rate`` are units per second; capacities are units. Either pair may be
    None (the limit does not count that unit). ``shared``: the budget is fleet-wide, held
    through leases from the store when the sidecar has one (:mod:`.lease`).
    """

    name: str
    per: LimitScope
    request_rate: float | None
    request_capacity: float | None
    cost_rate: float | None
    cost_capacity: float | None
    warmup_seconds: float
    shared: bool = False


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """Everything the admission core needs, in tokens, seconds and cost units.

    ``kv_capacity_tokens`` None means no KV reservation is enforced (capacity unknown);
    ``max_concurrency`` None means no concurrency cap. ``reservation`` and
    ``reservation_quantile``: how KV reservations are sized (:mod:`.predictor`);
    ``ttft_slo_seconds``/``tpot_slo_seconds``: the latency SLOs of requests with priority >=
    ``slo_min_priority`` (:mod:`.slo`), None = not served; ``tpot_slo_seconds`` drives the
    pod's one adaptive concurrency limit, so it is the tightest target any class states
    (:func:`tightest_tpot_seconds`). ``fallback_pool_model``: the model
    of the other pool (``overload.degrade.fallback``) a request this pod cannot take may be
    sent to; its upstream URL stays with the sidecar (the core does no I/O).
    ``fair_prompt_weight``/``fair_output_weight``: the fair queue's charge per prompt and per
    output token (``queue.fairness``, :mod:`.fairqueue.share`). ``default_wait_seconds``: the wait
    budget, seconds, of a request under no TTFT SLO (``DEFAULT_WAIT_SECONDS`` of
    :mod:`kvgate_agent.contract.queue` when the policy states neither ``slo.ttftSeconds`` nor
    ``queue.maxWaitSeconds``, else None: no budget). ``queue_max_wait_seconds``: the policy's
    ``queue.maxWaitSeconds``, 30 s when unset. ``fleet_share``: this pod's fraction
    (0, 1] of the policy's pods, as the operator split
    ``per: Global`` budgets (``globalShare`` of its thresholds; 1 standalone): the local share of
    a shared limit while the store is down before any peer count was seen.
    """

    limits: tuple[ResolvedLimit, ...] = ()
    cost_per_request: float = 0.0
    prompt_token_weight: float = 1.0
    output_token_weight: float = 1.0
    max_concurrency: int | None = None
    kv_capacity_tokens: int | None = None
    block_size: int = 16
    bytes_per_token: int | None = None
    max_model_len: int | None = None
    queue_max_length: int = 100
    queue_max_wait_seconds: float = 30.0
    queue_order: QueueOrder = QueueOrder.SHORTEST_FIRST
    actions: tuple[OverloadAction, ...] = (OverloadAction.QUEUE, OverloadAction.REJECT)
    min_max_tokens: int | None = None
    fallback_model: str | None = None
    fallback_pool_model: str | None = None
    failure_mode: FailureMode = FailureMode.FAIL_OPEN
    reservation: ReservationMode = ReservationMode.PREDICTED
    reservation_quantile: float = 0.9
    ttft_slo_seconds: float | None = None
    tpot_slo_seconds: float | None = None
    slo_min_priority: int = 0
    fleet_share: float = 1.0
    fair_prompt_weight: float = 1.0
    fair_output_weight: float = 2.0
    default_wait_seconds: float | None = None

    def cost(self, prompt_tokens: int, output_tokens: int) -> float:
        """Cost units: perRequest + prompt × promptTokenWeight + output × outputTokenWeight."""
        return (
            self.cost_per_request
            + prompt_tokens * self.prompt_token_weight
            + output_tokens * self.output_token_weight
        )

    @classmethod
    def from_policy(
        cls,
        spec: RateLimitPolicySpec,
        *,
        kv_capacity_tokens: int | None = None,
        global_share: float = 1.0,
    ) -> AdmissionConfig:
        """Resolve a policy spec for one pod.

        Args:
            spec: the policy.
            kv_capacity_tokens: the pod's KV capacity from a better source (the engine's own
                report); defaults to ``spec.capacity.kvCacheTokens``.
            global_share: this pod's fraction (0, 1] of every ``per: Global`` budget (1 standalone).

        Raises:
            ValueError: ``global_share`` outside (0, 1].
        """
        if not 0 < global_share <= 1:
            raise ValueError(f"global_share must be in (0, 1], got {global_share}")
        limits = []
        for rl in spec.rate_limits:
            share = global_share if rl.per is LimitScope.GLOBAL else 1.0
            req_cap, cost_cap = rl.request_capacity, rl.token_capacity
            limits.append(
                ResolvedLimit(
                    name=rl.name,
                    per=rl.per,
                    request_rate=None
                    if rl.requests_per_minute is None
                    else rl.requests_per_minute * share / 60.0,
                    request_capacity=None if req_cap is None else max(1.0, req_cap * share),
                    cost_rate=None
                    if rl.tokens_per_minute is None
                    else rl.tokens_per_minute * share / 60.0,
                    cost_capacity=None if cost_cap is None else max(1.0, cost_cap * share),
                    warmup_seconds=rl.warmup_seconds,
                    shared=rl.shared,
                )
            )
        actions = tuple(spec.overload.actions)
        if OverloadAction.REJECT not in actions:
            actions = (*actions, OverloadAction.REJECT)
        degrade = spec.overload.degrade
        max_wait = spec.queue.max_wait_seconds
        return cls(
            limits=tuple(limits),
            cost_per_request=spec.cost.per_request,
            prompt_token_weight=spec.cost.prompt_token_weight,
            output_token_weight=spec.cost.output_token_weight,
            max_concurrency=spec.concurrency.max_requests,
            kv_capacity_tokens=kv_capacity_tokens
            if kv_capacity_tokens is not None
            else spec.capacity.kv_cache_tokens,
            block_size=spec.model.block_size,
            bytes_per_token=spec.model.bytes_per_token,
            max_model_len=spec.model.max_model_len,
            queue_max_length=spec.queue.max_length,
            queue_max_wait_seconds=MAX_WAIT_CAP_SECONDS if max_wait is None else max_wait,
            queue_order=spec.queue.order,
            fair_prompt_weight=spec.queue.fairness.prompt_token_weight,
            fair_output_weight=spec.queue.fairness.output_token_weight,
            actions=actions,
            min_max_tokens=None if degrade is None else degrade.min_max_tokens,
            fallback_model=None if degrade is None else degrade.fallback_model,
            fallback_pool_model=None
            if degrade is None or degrade.fallback is None
            else degrade.fallback.model,
            failure_mode=spec.failure_mode,
            reservation=spec.capacity.reservation,
            reservation_quantile=spec.capacity.reservation_quantile,
            ttft_slo_seconds=spec.slo.ttft_seconds,
            tpot_slo_seconds=tightest_tpot_seconds(spec),
            slo_min_priority=spec.slo.min_priority,
            default_wait_seconds=DEFAULT_WAIT_SECONDS
            if max_wait is None and spec.slo.ttft_seconds is None
            else None,
            # the operator's thresholds (PodThresholds) carry the split it made
            fleet_share=float(getattr(spec, "global_share", global_share)),
        )
