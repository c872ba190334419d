"""kvgate arms that know only what a platform engineer knows on day one.

Each runs the real admission core as :class:`~kvgate_bench.effectiveness.arms.KvgateArm` does
(every streamed token and, each second, the engine's KV usage fed back), but with a policy that
takes nothing from the benchmark's measured capacity, and clients that send no priority header
(priority 0 for everyone):

``kvgate-slo-only``
    The spec holds only the workload's ``slo`` stanza (``ttftSeconds`` 0.5, ``tpotSeconds``
    0.05); everything else takes its default (``minPriority`` 0, so every request has the TTFT
    budget, the batch tier's too).
``kvgate-empty``
    An empty spec, ``RateLimitPolicySpec()``.
``kvgate-classes``
    The future ``kvgate`` arm: the README's recommended policy (the ``slo`` stanza) plus the
    workload's tenant classes, handed to the core per request as a tenant class would be:
    ``AdmissionRequest.weight`` = the tenant's weight, ``ttft_slo_seconds`` 0.5 for the
    interactive tier and ``math.inf`` (no TTFT SLO) for batch. Today's core reads neither
    field; the arm is kept behind its own name until the fair queue that reads them lands.

What the sidecar learns from the engine itself (and nothing else) completes the resolved
configuration, as ``AdmissionConfig.from_policy(spec, kv_capacity_tokens=...)`` in
``kvgate_agent.sidecar.thresholds`` does: the engine's KV pool (``num_gpu_blocks x
block_size`` tokens, vLLM's ``vllm:cache_config_info``) and, where the spec sets no
``concurrency.maxRequests``, the engine's ``max_num_seqs`` as the concurrency cap; a client's
unset max_tokens becomes ``tenants.defaultMaxTokens`` (1024) within the engine's context.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from kvgate_agent.admission import AdmissionConfig, AdmissionRequest
from kvgate_bench.effectiveness.context import ArmContext
from kvgate_bench.effectiveness.kvgate_arms import KvgateArm
from kvgate_bench.effectiveness.metrics import TPOT_SLO_S, TTFT_SLO_S
from kvgate_bench.effectiveness.workloads import BATCH, Request

#: The arms of this module, by mode.
MODES: tuple[str, ...] = ("slo-only", "empty", "classes")


class KvgateDefaultsArm(KvgateArm):
    """kvgate with the spec of ``mode`` (``slo-only``, ``empty`` or ``classes``; see the module
    docstring), the engine's KV pool and max_num_seqs, and priority-0 clients."""

    def __init__(self, ctx: ArmContext, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
        self.mode = mode
        super().__init__(ctx)
        self.name = f"kvgate-{mode}"

    def policy(self) -> dict[str, Any]:
        if self.mode == "empty":
            return {}
        return {"slo": {"ttftSeconds": TTFT_SLO_S, "tpotSeconds": TPOT_SLO_S}}

    def admission_config(self) -> AdmissionConfig:
        engine = self.ctx.engine
        cfg = AdmissionConfig.from_policy(self.spec, kv_capacity_tokens=self.ctx.kv_capacity_tokens)
        if cfg.max_concurrency is None:
            cfg = dataclasses.replace(cfg, max_concurrency=engine.max_num_seqs)
        return cfg

    def admission_request(self, req: Request) -> AdmissionRequest:
        ar = super().admission_request(req)
        ar.priority = 0
        if self.mode == "classes":
            ar.weight = self.ctx.tenants[req.tenant].weight
            ar.ttft_slo_seconds = math.inf if req.tier == BATCH else TTFT_SLO_S
        return ar
