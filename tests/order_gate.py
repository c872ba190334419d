"""A virtual-time gate for the effectiveness baselines' unit tests: an engine that never steps
(times are passed in) and the order in which an arm dispatched requests."""

from __future__ import annotations

from kvgate_bench.effectiveness.model.gate import Gate, RequestRecord
from kvgate_bench.effectiveness.model.schedule import Request
from kvgate_bench.sim.engine import SimEngine
from kvgate_bench.sim.sequences import EngineConfig
from kvgate_bench.sim.steptime import profile

#: 2048 blocks of 16: a KV pool of 32,768 tokens; 8192 tokens per step.
ENGINE = EngineConfig(
    num_gpu_blocks=2048, max_model_len=8192, max_num_batched_tokens=8192, chunked_prefill=True
)


class OrderGate(Gate):
    """A gate over :data:`ENGINE` (never stepped) that records the order of dispatches
    (:attr:`order`, request ids) and answers each request's record and outcome."""

    def __init__(self, requests: list[Request]) -> None:
        super().__init__(
            SimEngine(ENGINE, profile("h100-llama3-8b")),
            {r.rid: RequestRecord(r) for r in requests},
        )
        self.order: list[str] = []

    def dispatch(
        self, req: Request, now: float, max_tokens: int | None = None, degraded: bool = False
    ) -> None:
        self.order.append(req.rid)
        super().dispatch(req, now, max_tokens, degraded)

    def record(self, rid: str) -> RequestRecord:
        """The record of request ``rid``."""
        return self._records[rid]

    def outcome(self, rid: str) -> str:
        """The outcome of request ``rid`` so far (``PENDING``, ``REJECTED``, ...)."""
        return self._records[rid].outcome
