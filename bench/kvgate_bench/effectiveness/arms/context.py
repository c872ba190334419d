"""What an admission arm of the effectiveness benchmark may know about the deployment it guards."""

from __future__ import annotations

from dataclasses import dataclass

from kvgate_bench.effectiveness.model.schedule import Tenant
from kvgate_bench.sim.sequences import EngineConfig


@dataclass(frozen=True)
class ArmContext:
    """What an arm may know about the deployment it guards (a platform team knows it too).

    Attributes:
        engine: the engine's configuration (KV pool = ``num_gpu_blocks x block_size`` tokens).
        tenants: the workload's tenants by name (weights, tiers).
        capacity_rps: the request rate at load 1 (the ``none`` arm's measured goodput
            capacity), requests per second.
        capacity_tokens_per_s: prompt + output tokens per second at load 1.
        slo: the interactive (TTFT, TPOT) SLO in seconds that a policy states, when not the
            benchmark's fixed one (``metrics.TTFT_SLO_S``, ``TPOT_SLO_S``): an engine of
            another speed (:mod:`kvgate_bench.real_engine`).
    """

    engine: EngineConfig
    tenants: dict[str, Tenant]
    capacity_rps: float
    capacity_tokens_per_s: float
    slo: tuple[float, float] | None = None

    @property
    def kv_capacity_tokens(self) -> int:
        """The engine's KV pool, tokens."""
        return self.engine.num_gpu_blocks * self.engine.block_size

    def share(self, tenant: str) -> float:
        """``tenant``'s weighted share of the server (0..1)."""
        total = sum(t.weight for t in self.tenants.values())
        return self.tenants[tenant].weight / total
