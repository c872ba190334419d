"""The kvgate arms of the effectiveness benchmark: the real admission core on the virtual clock.

``kvgate-maxtokens``, ``kvgate`` (and its ablations), ``oracle`` and ``kvgate-noisy``, as
described in :mod:`kvgate_bench.effectiveness.arms`, which lists every arm and builds them.
"""

from __future__ import annotations

import math
import random
from typing import Any

from kvgate_agent.admission import (
    AdmissionConfig,
    AdmissionController,
    AdmissionRequest,
    Decision,
    Outcome,
    Ticket,
)
from kvgate_agent.contract.policy import RateLimitPolicySpec
from kvgate_bench.effectiveness.arms.context import ArmContext
from kvgate_bench.effectiveness.model.gate import Arm
from kvgate_bench.effectiveness.model.metrics import TPOT_SLO_S, TTFT_SLO_S
from kvgate_bench.effectiveness.model.schedule import BATCH, Request, content_keys
from kvgate_bench.kit.toolkit import FakeClock
from kvgate_bench.sim.prefix_cache import extend_chain


class KvgateMaxTokensArm(Arm):
    """Today's kvgate: the real admission core on the virtual clock (see the module docstring).

    ``max_kv_reserved`` records the largest KV reservation seen (tokens); after a run the
    controller's ``in_flight``, ``kv_reserved_tokens`` and ``queue_length`` are back to 0.
    """

    name = "kvgate-maxtokens"
    #: The policy's ``tenants.defaultMaxTokens`` (the CRD default), tokens.
    DEFAULT_MAX_TOKENS = 1024
    #: Prefix-aware: each request carries its prompt's block hashes (:meth:`prefix_blocks`)
    #: and settles with the engine's reported cached tokens. Off: whole prompts reserved and
    #: charged, nothing told of the engine's prefix cache.
    prefix_aware = False

    def __init__(self, ctx: ArmContext) -> None:
        super().__init__()
        self.ctx = ctx
        self.clock = FakeClock()
        self.spec = RateLimitPolicySpec.model_validate(self.policy())
        self.controller = AdmissionController(self.admission_config(), self.clock)
        self._tickets: dict[str, Ticket] = {}
        self._waiting: dict[int, Request] = {}
        self.max_kv_reserved = 0
        self.params = {}

    def policy(self) -> dict[str, Any]:
        """The RateLimitPolicy ``spec`` enforced (camelCase, as in a manifest)."""
        ctx = self.ctx
        per_tenant_tpm = max(1.0, 0.5 * ctx.capacity_tokens_per_s * 60.0)
        return {
            "model": {"blockSize": ctx.engine.block_size, "maxModelLen": ctx.engine.max_model_len},
            "capacity": {"kvCacheTokens": ctx.kv_capacity_tokens},
            "concurrency": {"maxRequests": ctx.engine.max_num_seqs},
            "tenants": {"defaultMaxTokens": self.DEFAULT_MAX_TOKENS},
            "rateLimits": [
                {"name": "per-tenant", "per": "Tenant", "tokensPerMinute": per_tenant_tpm}
            ],
            "queue": {"maxLength": 100, "maxWaitSeconds": 10, "order": "ShortestFirst"},
            "overload": {
                "actions": ["Degrade", "Queue", "Reject"],
                "degrade": {"minMaxTokens": 128},
            },
        }

    def admission_config(self) -> AdmissionConfig:
        """What the sidecar resolves ``spec`` to (the policy states its KV capacity)."""
        return AdmissionConfig.from_policy(self.spec)

    def admission_request(self, req: Request) -> AdmissionRequest:
        """What the sidecar would hand the core for ``req``: the policy's default max_tokens
        (within the context, as ``default_within_context``) when the client set none."""
        mt = req.max_tokens
        if mt is None:
            mml = self.ctx.engine.max_model_len
            mt = min(self.spec.tenants.default_max_tokens, max(1, mml - req.prompt_tokens))
        ar = AdmissionRequest(req.tenant, req.prompt_tokens, mt, 0)
        if self.prefix_aware:
            ar.prefix_blocks = self.prefix_blocks(req)
        return ar

    def prefix_blocks(self, req: Request) -> list[int] | None:
        """The chained hashes of ``req``'s prompt's full blocks, as the engine names them
        (:func:`~kvgate_bench.sim.prefix_cache.extend_chain` over
        :func:`~kvgate_bench.effectiveness.model.schedule.content_keys`); None for a request
        without content keys (never a hit)."""
        bs = self.ctx.engine.block_size
        keys = content_keys(req, bs)
        if keys is None:
            return None
        return extend_chain([], keys, req.prompt_tokens // bs)

    def _apply(self, req: Request, d: Decision, now: float) -> None:
        if d.ticket is not None:
            self._tickets[req.rid] = d.ticket
            degraded = d.outcome is Outcome.DEGRADED
            self.gate.dispatch(req, now, d.max_tokens, degraded=degraded)
            if self.gate.sequences.get(req.rid) is None:  # the engine refused it (400)
                # As the sidecar settles a 4xx from upstream: nothing was served.
                self.controller.release(
                    self._tickets.pop(req.rid), completion_tokens=0, reached_upstream=False
                )
        elif d.waiter is not None:
            self._waiting[d.waiter.seq] = req
        else:
            self.gate.reject(req, now, None if d.retry_after is None else float(d.retry_after))

    def _settle(self, now: float) -> None:
        ctl = self.controller
        for w in ctl.take_resolved():
            req = self._waiting.pop(w.seq)
            if w.decision is not None:
                self._apply(req, w.decision, now)
        self.max_kv_reserved = max(self.max_kv_reserved, ctl.stats().kv_reserved_tokens)

    def on_arrival(self, req: Request, now: float) -> None:
        self.clock.now = now
        ar = self.admission_request(req)
        ar.waited_seconds = max(0.0, now - req.arrival_s)  # a pool's retry: the client waited
        self._apply(req, self.controller.submit(ar), now)
        self._settle(now)

    def on_finish(self, req: Request, output_tokens: int, now: float) -> None:
        self.clock.now = now
        ticket = self._tickets.pop(req.rid)
        cached = self.gate.cached_tokens(req.rid) if self.prefix_aware else None
        self.controller.release(
            ticket,
            completion_tokens=output_tokens,
            prompt_tokens=req.prompt_tokens,
            cached_tokens=cached,
        )
        self.controller.pump()
        self._settle(now)

    def queued(self) -> int:
        return len(self._waiting)

    def router_gauges(self) -> tuple[float, float] | None:
        """The sidecar's ``kvgate_queue_depth`` (kvgate's queue plus the engine's waiting
        requests) and ``kvgate_kv_reserved_fraction`` (reserved KV / capacity)."""
        st = self.controller.stats()
        kv = st.kv_reserved_tokens / st.kv_capacity_tokens if st.kv_capacity_tokens else 0.0
        return float(st.queue_length + self.gate.engine.num_waiting), kv

    def next_wake(self) -> float | None:
        """The controller's :attr:`~AdmissionController.next_wake` (the queue side's own), as
        the sidecar's timer uses it."""
        return self.controller.next_wake()

    def on_wake(self, now: float) -> None:
        self.clock.now = now
        self.controller.pump()
        self._settle(now)


class KvgateArm(KvgateMaxTokensArm):
    """kvgate's default policy: predicted reservations, live correction, SLO-driven concurrency
    and shedding (see the module docstring). ``variant`` selects an ablation: ``no-kv``,
    ``no-degrade`` or ``fifo``."""

    name = "kvgate-bench-policy"
    #: Priority interactive clients send (``slo.minPriority``); batch clients send 0.
    INTERACTIVE_PRIORITY = 1

    def __init__(self, ctx: ArmContext, variant: str | None = None) -> None:
        if variant not in (None, "no-kv", "no-degrade", "fifo", "tenant-budgets"):
            raise ValueError(f"unknown kvgate variant {variant!r}")
        self.variant = variant
        super().__init__(ctx)
        if variant is not None:
            self.name = f"kvgate-{variant}"

    def policy(self) -> dict[str, Any]:
        spec = super().policy()
        spec["capacity"] = {
            **spec["capacity"],
            "reservation": "Predicted",
            "reservationQuantile": 0.9,
        }
        ttft, tpot = self.ctx.slo if self.ctx.slo is not None else (TTFT_SLO_S, TPOT_SLO_S)
        spec["slo"] = {
            "ttftSeconds": ttft,
            "tpotSeconds": tpot,
            "minPriority": self.INTERACTIVE_PRIORITY,
        }
        # The clients label their own tier with the priority header (over HTTP, in
        # effectiveness.realtime): they stand for a gateway that sets it, so it is trusted.
        spec["priority"] = {"trusted": True}
        if self.variant == "no-kv":
            del spec["capacity"]["kvCacheTokens"]
        elif self.variant == "no-degrade":
            spec["overload"] = {"actions": ["Queue", "Reject"]}
        elif self.variant == "fifo":
            spec["queue"] = {**spec["queue"], "order": "FIFO"}
        elif self.variant == "tenant-budgets":
            # Every tenant's tokensPerMinute = an equal share of the load-1 token capacity x
            # 1.5 with a 10 s burst (the token-bucket baseline's best multi-tenant setting; the
            # workloads' tenants all weigh 1), as kvgate's own per-tenant limit: charged prompt +
            # max_tokens at admission and settled to the real usage at release.
            ctx = self.ctx
            tpm = 1.5 * ctx.capacity_tokens_per_s * 60.0 / max(1, len(ctx.tenants))
            spec["rateLimits"] = [
                {
                    "name": "per-tenant",
                    "per": "Tenant",
                    "tokensPerMinute": tpm,
                    "burstTokens": max(ctx.engine.max_model_len, round(tpm / 6)),
                }
            ]
        return spec

    def admission_request(self, req: Request) -> AdmissionRequest:
        ar = super().admission_request(req)
        ar.priority = 0 if req.tier == BATCH else self.INTERACTIVE_PRIORITY
        ar.model = "model"
        ar.predicted_output_tokens = self.predicted_output(req, ar.max_tokens)
        return ar

    def predicted_output(self, req: Request, max_tokens: int) -> int | None:
        """The length to reserve for instead of the learned prediction (None: learned)."""
        return None

    #: How often the arm reads the engine's KV usage into the controller, seconds (the sidecar's
    #: ``--engine-usage-seconds`` default).
    ENGINE_USAGE_S = 1.0
    _next_usage = 0.0

    def on_tokens(self, new_tokens: dict[str, int], now: float) -> None:
        self.clock.now = now
        if now >= self._next_usage:
            eng = self.gate.engine
            self.controller.live.observe_engine_kv(
                math.ceil(eng.kv_usage * self.ctx.kv_capacity_tokens)
            )
            self._next_usage = now + self.ENGINE_USAGE_S
        tickets = self._tickets
        observe = self.controller.live.observe_tokens
        for rid, index in new_tokens.items():
            t = tickets.get(rid)
            if t is not None:
                observe(t, index + 1)


class OracleArm(KvgateArm):
    """``kvgate`` told each request's true output length, capped by its max_tokens."""

    name = "oracle"

    def predicted_output(self, req: Request, max_tokens: int) -> int | None:
        return min(req.output_tokens, max_tokens)


class NoisyKvgateArm(KvgateArm):
    """``kvgate`` whose prediction is the true length x exp(N(0, ``sigma``)), seeded per
    request id (the same request gets the same error in every run)."""

    name = "kvgate-noisy"

    def __init__(self, ctx: ArmContext, sigma: float = 1.0) -> None:
        super().__init__(ctx)
        self.sigma = sigma

    def predicted_output(self, req: Request, max_tokens: int) -> int | None:
        err = random.Random(f"noise:{req.rid}").gauss(0.0, self.sigma)
        return max(1, min(max_tokens, round(req.output_tokens * math.exp(err))))
