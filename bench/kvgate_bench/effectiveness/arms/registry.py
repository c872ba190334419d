"""The arms of the effectiveness benchmark: what a platform team would put in front of the engine.

Each arm is faithful to the system it stands for and takes the knobs its users would tune;
:func:`candidates` lists the settings the benchmark sweeps for each (the best is reported per
workload and load, and the sweep with it):

``none``
    The engine alone: every request goes straight into vLLM's FCFS waiting queue.
``concurrency-cap``
    A cap on requests in flight with a FIFO queue in front and a queue timeout (an API
    gateway's or a client pool's semaphore; Envoy's circuit-breaker ``max_requests`` with
    pending requests). Swept: the cap (scaled to the engine's max_num_seqs) and the queue timeout.
``token-bucket``
    Per-tenant request and token buckets checked on arrival and charged the request's real
    usage (prompt + completion tokens) after the response, as LiteLLM's per-key ``rpm_limit``
    / ``tpm_limit`` (https://docs.litellm.ai/docs/proxy/users) and Envoy AI Gateway's
    usage-based rate limiting (the check happens on each request, the usage read from the
    response is deducted afterwards:
    https://aigateway.envoyproxy.io/docs/0.1/capabilities/usage-based-ratelimiting) do. A
    tenant whose bucket is empty (or in debt) is refused with 429. Each tenant's rates are its
    weighted share of the server's measured capacity times a swept factor; the burst is one
    window's worth (LiteLLM counts per minute).
``saturation-shed``
    llm-d's saturation detector in front of the engine: metrics scraped every 50 ms; the
    server is saturated when its waiting queue holds >= 5 requests or its KV usage is >= 0.8,
    or when the last scrape is older than 200 ms; a saturated server sheds (429) the arriving
    request. llm-d sheds only sheddable requests (negative priority); ``shed=sheddable`` does
    that with the batch tier as sheddable, ``shed=all`` sheds every request. Swept: the mode.
``kvgate-maxtokens``
    Today's kvgate: the real :class:`kvgate_agent.admission.AdmissionController` on the virtual
    clock, driven as the sidecar drives it (``submit`` on arrival, ``take_resolved`` after every
    call, ``pump`` on release and at ``next_wake``, ``release`` with the completion tokens the
    engine reported), enforcing one default policy (:meth:`KvgateMaxTokensArm.policy`): KV
    capacity = the engine's pool with reservations of prompt + max_tokens, a concurrency cap of
    max_num_seqs, per-tenant token buckets of half the server's capacity, a ShortestFirst queue
    of 100 for 10 s, Degrade to 128 tokens before queueing.

``kvgate``
    kvgate's default policy (:meth:`KvgateArm.policy`): the same, plus reservations of prompt +
    the predicted output length (``capacity.reservation: Predicted``, the 0.9 quantile) grown
    block by block as tokens stream, and the workload's SLOs (``slo.ttftSeconds`` 0.5,
    ``slo.tpotSeconds`` 0.05 for priority >= 1: interactive clients send priority 1, batch
    ones 0): the adaptive concurrency limit and shedding by expected queue wait. The arm feeds
    the controller every streamed token (``observe_tokens``) and, every second, the engine's
    KV usage (``observe_engine_kv``), as the sidecar does.
``kvgate-noisy``
    ``kvgate`` whose length prediction is the true length x a lognormal error of sigma 1.0
    (seeded per request): a much worse predictor than the learned one.
``oracle``
    ``kvgate`` told each request's true output length (capped by its max_tokens).
``flow-control``, ``vllm-queue-limit``, ``codel-gate``, ``dynamo-drr``, ``occupancy-budget``
    llm-d's flow control (:mod:`.flow_control`), vLLM's own queue caps
    (:mod:`.vllm_queue_limit`), NVIDIA Dynamo's CoDel admission gate (:mod:`.codel_gate`) and
    policy-class queues (:mod:`.dynamo_drr`: weighted DRR across classes, EDF within), and
    hivenet_router's token-weighted occupancy budget (:mod:`.occupancy_budget`), each in its
    own module with its sources and sweep.
``kvgate-slo-only``, ``kvgate-empty``, ``kvgate-classes``
    kvgate with what a platform engineer knows on day one: a spec with only ``slo``, an empty
    spec, and ``slo`` plus the workload's tenant classes (:mod:`.kvgate_defaults`).
``kvgate-no-kv``, ``kvgate-no-degrade``, ``kvgate-fifo``, ``kvgate-tenant-budgets``
    Ablations of ``kvgate``: no KV reservation (no ``capacity.kvCacheTokens``); no Degrade
    action; a FIFO queue instead of ShortestFirst; per-tenant token budgets of an equal share
    of the capacity x 1.5 (what a platform team that knows its tenants would set; the default
    policy's per-tenant limit is half the server).
``kvgate-prefix-blind``
    ``kvgate`` without the prompts' block hashes (the prefix-aware ablation: whole prompts
    reserved and charged, :mod:`.kvgate_defaults`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvgate_bench.effectiveness.arms import (
    codel_gate,
    dynamo_drr,
    flow_control,
    occupancy_budget,
    vllm_queue_limit,
)
from kvgate_bench.effectiveness.arms.baselines import (
    ConcurrencyCapArm,
    NoneArm,
    SaturationShedArm,
    TokenBucketArm,
)
from kvgate_bench.effectiveness.arms.context import ArmContext
from kvgate_bench.effectiveness.arms.kvgate_arms import (
    KvgateArm,
    KvgateMaxTokensArm,
    NoisyKvgateArm,
    OracleArm,
)
from kvgate_bench.effectiveness.arms.kvgate_defaults import KvgateDefaultsArm
from kvgate_bench.effectiveness.model.driver import MAX_NUM_SEQS
from kvgate_bench.effectiveness.model.gate import Arm
from kvgate_bench.effectiveness.model.schedule import BATCH, Tenant

#: Arms built now, in report order.
ARM_NAMES: tuple[str, ...] = (
    "none",
    "concurrency-cap",
    "token-bucket",
    "saturation-shed",
    "flow-control",
    "vllm-queue-limit",
    "codel-gate",
    "dynamo-drr",
    "occupancy-budget",
    "kvgate-maxtokens",
    "kvgate",
    "kvgate-slo-only",
    "kvgate-empty",
    "kvgate-bench-policy",
    "kvgate-noisy",
    "oracle",
)
#: Ablations of ``kvgate``: run when asked for by name (``--arms``).
ABLATIONS: tuple[str, ...] = (
    "kvgate-no-kv",
    "kvgate-no-degrade",
    "kvgate-fifo",
    "kvgate-tenant-budgets",
    "kvgate-prefix-blind",
)
#: The baselines kvgate is compared with.
BASELINES: tuple[str, ...] = (
    "concurrency-cap",
    "token-bucket",
    "saturation-shed",
    "flow-control",
    "vllm-queue-limit",
    "codel-gate",
    "dynamo-drr",
    "occupancy-budget",
)


ArmFactory = Callable[[ArmContext, dict[str, Any]], Arm]

#: Arm name -> factory(context, params).
ARM_FACTORIES: dict[str, ArmFactory] = {
    "none": lambda ctx, p: NoneArm(),
    "concurrency-cap": lambda ctx, p: ConcurrencyCapArm(int(p["cap"]), float(p["queue_timeout_s"])),
    "token-bucket": lambda ctx, p: TokenBucketArm(
        ctx, float(p["factor"]), float(p.get("burst_s", 60.0))
    ),
    "saturation-shed": lambda ctx, p: SaturationShedArm(str(p.get("shed", "all"))),
    "kvgate-maxtokens": lambda ctx, p: KvgateMaxTokensArm(ctx),
    "kvgate": lambda ctx, p: KvgateDefaultsArm(ctx, "recommended"),
    "kvgate-bench-policy": lambda ctx, p: KvgateArm(ctx),
    "kvgate-noisy": lambda ctx, p: NoisyKvgateArm(ctx),
    "oracle": lambda ctx, p: OracleArm(ctx),
    "kvgate-no-kv": lambda ctx, p: KvgateArm(ctx, "no-kv"),
    "kvgate-no-degrade": lambda ctx, p: KvgateArm(ctx, "no-degrade"),
    "kvgate-fifo": lambda ctx, p: KvgateArm(ctx, "fifo"),
    "kvgate-tenant-budgets": lambda ctx, p: KvgateArm(ctx, "tenant-budgets"),
    "flow-control": lambda ctx, p: flow_control.FlowControlArm(
        float(p.get("ttl_s", 60.0)),
        int(p.get("queue_threshold", 5)),
        float(p.get("kv_threshold", 0.8)),
    ),
    "vllm-queue-limit": lambda ctx, p: vllm_queue_limit.VllmQueueLimitArm(
        p.get("max_num_queued_reqs"), p.get("max_num_queued_tokens")
    ),
    "codel-gate": lambda ctx, p: codel_gate.CodelGateArm(
        int(p.get("cap", 384)), float(p.get("target_s", 0.25)), p.get("interval_s")
    ),
    "dynamo-drr": lambda ctx, p: dynamo_drr.DynamoDrrArm(
        ctx,
        str(p.get("classes", "tier")),
        int(p.get("quantum", 1024)),
        int(p.get("queue_limit", 64)),
        float(p.get("busy_frac", 4.0)),
        None if p.get("kv_frac") is None else float(p["kv_frac"]),
    ),
    "occupancy-budget": lambda ctx, p: occupancy_budget.OccupancyBudgetArm(
        ctx, float(p.get("budget_kv", 1.0))
    ),
    "kvgate-slo-only": lambda ctx, p: KvgateDefaultsArm(ctx, "slo-only"),
    "kvgate-prefix-blind": lambda ctx, p: KvgateDefaultsArm(ctx, "prefix-blind"),
    "kvgate-empty": lambda ctx, p: KvgateDefaultsArm(ctx, "empty"),
}


def make_arm(name: str, ctx: ArmContext, params: dict[str, Any]) -> Arm:
    """A fresh arm ``name`` with ``params``. Raises ``ValueError`` for an unknown arm."""
    factory = ARM_FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"unknown arm {name!r}; choose from {', '.join(ARM_NAMES + ABLATIONS)}")
    return factory(ctx, params)


def candidates(
    name: str, tenants: dict[str, Tenant], short: bool, max_num_seqs: int = MAX_NUM_SEQS
) -> list[dict[str, Any]]:
    """The parameter settings swept for arm ``name`` (one empty dict for untuned arms).
    ``short`` sweeps fewer settings. The concurrency caps are for an engine of 256 sequences,
    scaled to ``max_num_seqs`` (rounded, at least 1, repeats dropped: 1-4 for a 4-slot one)."""
    if name == "concurrency-cap":
        base = (32, 64, 96, 128, 192) if short else (16, 32, 48, 64, 96, 128, 160, 192, 256)
        caps = sorted({max(1, round(c * max_num_seqs / MAX_NUM_SEQS)) for c in base})
        timeouts = (0.25, 1.0, 30.0) if short else (0.1, 0.25, 0.5, 1.0, 5.0, 30.0)
        return [{"cap": c, "queue_timeout_s": q} for c in caps for q in timeouts]
    if name == "token-bucket":
        factors = (0.75, 1.0, 1.5) if short else (0.5, 0.75, 1.0, 1.25, 1.5, 2.0)
        return [{"factor": f, "burst_s": b} for f in factors for b in (10.0, 60.0)]
    if name == "saturation-shed":
        has_batch = any(t.tier == BATCH for t in tenants.values())
        return [{"shed": "all"}, {"shed": "sheddable"}] if has_batch else [{"shed": "all"}]
    sweeps = {
        "flow-control": flow_control.candidates,
        "vllm-queue-limit": vllm_queue_limit.candidates,
        "codel-gate": codel_gate.candidates,
        "dynamo-drr": dynamo_drr.candidates,
        "occupancy-budget": occupancy_budget.candidates,
    }
    if name in sweeps:
        return sweeps[name](short)
    return [{}]
