"""kvgate arms that know only what a platform engineer knows on day one.

Each runs the real admission core as
:class:`~kvgate_bench.effectiveness.arms.kvgate_arms.KvgateArm` does
(every streamed token and, each second, the engine's KV usage fed back), but with a policy that
takes nothing from the benchmark's measured capacity, and clients that send no priority header
(priority 0 for everyone):

``kvgate-slo-only``
    The spec holds only the workload's ``slo`` stanza (``ttftSeconds`` 0.5, ``tpotSeconds``
    0.05); everything else takes its default (``minPriority`` 0, so every request has the TTFT
    budget, the batch tier's too).
``kvgate-empty``
    An empty spec, ``RateLimitPolicySpec()``.
``kvgate``
    The README's recommended policy (:func:`recommended_policy`: the ``slo`` stanza, a
    ShortestFirst queue with Degrade before it, and the workload's tenant classes: interactive
    with the SLO, batch with none), each request's weight, priority and TTFT SLO resolved from
    its tenant's class by the sidecar's own
    :class:`~kvgate_agent.sidecar.identity.classes.ClassResolver`.
    Prefix-aware: a request with content keys (``multi-turn``) carries its prompt's block hashes
    and settles with the engine's reported cached tokens (``AdmissionRequest.prefix_blocks``).
``kvgate-prefix-blind``
    ``kvgate`` without the block hashes (the ablation): whole prompts reserved and charged.

What the sidecar learns from the engine itself (and nothing else) completes the resolved
configuration, as ``AdmissionConfig.from_policy(spec, kv_capacity_tokens=...)`` in
``kvgate_agent.sidecar.node_link.agent_enforcement`` does: the engine's KV pool (``num_gpu_blocks x
block_size`` tokens, vLLM's ``vllm:cache_config_info``) and, where the spec sets no
``concurrency.maxRequests``, the engine's ``max_num_seqs`` as the concurrency cap; a client's
unset max_tokens becomes ``tenants.defaultMaxTokens`` (1024) within the engine's context.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvgate_agent.admission import AdmissionConfig, AdmissionRequest
from kvgate_agent.sidecar.identity.classes import ClassResolver
from kvgate_bench.effectiveness.arms.context import ArmContext
from kvgate_bench.effectiveness.arms.kvgate_arms import KvgateArm
from kvgate_bench.effectiveness.model.metrics import TPOT_SLO_S, TTFT_SLO_S
from kvgate_bench.effectiveness.model.schedule import BATCH, Request

#: The arms of this module, by mode.
MODES: tuple[str, ...] = ("slo-only", "empty", "recommended", "prefix-blind")


class KvgateDefaultsArm(KvgateArm):
    """kvgate with the spec of ``mode`` (``slo-only``, ``empty``, ``recommended``: the arm
    ``kvgate``, or ``prefix-blind``; see the module
    docstring), the engine's KV pool and max_num_seqs, and priority-0 clients."""

    def __init__(self, ctx: ArmContext, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
        self.mode = mode
        self._resolver: ClassResolver | None = None
        super().__init__(ctx)
        self.name = "kvgate" if mode == "recommended" else f"kvgate-{mode}"
        self.prefix_aware = mode == "recommended"

    def policy(self) -> dict[str, Any]:
        if self.mode == "empty":
            return {}
        slo = slo_stanza(self.ctx)
        if self.mode == "slo-only":
            return {"slo": slo}
        return recommended_policy(self.ctx)  # recommended, prefix-blind

    def _classes(self) -> ClassResolver:
        if self._resolver is None:
            self._resolver = ClassResolver(self.spec.tenants)
        return self._resolver

    def admission_config(self) -> AdmissionConfig:
        engine = self.ctx.engine
        cfg = AdmissionConfig.from_policy(self.spec, kv_capacity_tokens=self.ctx.kv_capacity_tokens)
        if cfg.max_concurrency is None:
            cfg = dataclasses.replace(cfg, max_concurrency=engine.max_num_seqs)
        return cfg

    def admission_request(self, req: Request) -> AdmissionRequest:
        ar = super().admission_request(req)
        ar.priority = 0
        if self.mode in ("recommended", "prefix-blind"):  # as the sidecar resolves the class
            cls = self._classes()(req.tenant)
            ar.weight, ar.priority, ar.ttft_slo_seconds = (
                cls.weight,
                cls.priority,
                cls.ttft_slo_seconds,
            )
        return ar


def slo_stanza(ctx: ArmContext) -> dict[str, float]:
    """The policy's ``slo`` stanza: ``ctx.slo`` when set, else the benchmark's SLO."""
    ttft, tpot = ctx.slo if ctx.slo is not None else (TTFT_SLO_S, TPOT_SLO_S)
    return {"ttftSeconds": ttft, "tpotSeconds": tpot}


def recommended_policy(ctx: ArmContext) -> dict[str, Any]:
    """The README's recommended RateLimitPolicy ``spec`` for a workload's tenants: the SLO,
    a ShortestFirst queue of at most 10 s with Degrade (to 128 tokens) before it, and one tenant
    class per tier, matched by tenant name: ``interactive`` (the TTFT and TPOT SLO) and, where
    the workload has batch tenants, ``batch`` (no latency SLO); each tenant's weight its own
    (classes per distinct weight). A workload that declares its classes (``tiers``:
    :attr:`~kvgate_bench.effectiveness.model.schedule.Tenant.class_name`) gets them by that
    name, with their tenants' weight (the class's ``weight`` is each of its tenants' weight
    in kvgate's fair queue). Nothing from the measured capacity. The SLO is
    :func:`slo_stanza`'s."""
    slo = slo_stanza(ctx)
    classes: dict[tuple[str, float, str], list[str]] = {}
    for t in ctx.tenants.values():
        classes.setdefault((t.tier, t.weight, t.class_name or ""), []).append(t.name)
    specs: list[dict[str, Any]] = []
    for (tier, weight, declared), names in sorted(classes.items()):
        c: dict[str, Any] = {
            "name": declared or f"{tier}-w{round(weight * 100)}",
            "match": {"tenants": sorted(names)},
            "weight": weight,
        }
        if tier == BATCH:
            c["batch"] = True
        else:
            c["slo"] = slo
        specs.append(c)
    return {
        "slo": slo,
        "tenants": {"classes": specs},
        "queue": {"order": "ShortestFirst", "maxWaitSeconds": 10},
        "overload": {"actions": ["Degrade", "Queue", "Reject"], "degrade": {"minMaxTokens": 128}},
    }
