"""The ``vllm-queue-limit`` arm: vLLM's own admission caps, the engine refusing at once.

vLLM (v0.29 on; https://github.com/vllm-project/vllm/pull/49445) checks two independent caps in
``AsyncLLM.check_admission`` before a request enters the engine, and answers HTTP 503 at once
when one is exceeded (a client-visible refusal, no Retry-After):

* ``--max-num-queued-reqs``: requests in flight in the server, waiting + running (a request
  with n > 1 counts n; here n is always 1).
* ``--max-num-queued-tokens``: the prompt tokens of the requests still in their prefill phase
  (no output token yet), "set to about target_TTFT x prefill_throughput".

The arm keeps the two counters as the API server does (from what it dispatched, the first
tokens streamed and the finishes) and refuses a request when the in-flight count plus it would
exceed ``max_num_queued_reqs`` or when the prefill backlog has already reached
``max_num_queued_tokens`` (the new prompt is not added: vLLM's ``check_admission`` compares
``get_num_queued_tokens() >= max_num_queued_tokens``, as its tests
``tests/v1/engine/test_admission_control.py`` pin down). Either cap may be None (unset, vLLM's
default). Counts are requests, tokens are prompt tokens.
"""

from __future__ import annotations

from typing import Any

from kvgate_bench.effectiveness.model.gate import Arm
from kvgate_bench.effectiveness.model.schedule import Request


class VllmQueueLimitArm(Arm):
    """vLLM's ``max_num_queued_reqs`` / ``max_num_queued_tokens`` (see the module docstring).

    ``in_flight``: requests dispatched and not finished; ``prefill_tokens``: prompt tokens of
    dispatched requests that have produced no output token yet.
    """

    name = "vllm-queue-limit"

    def __init__(self, max_num_queued_reqs: int | None, max_num_queued_tokens: int | None) -> None:
        super().__init__()
        if max_num_queued_reqs is not None and max_num_queued_reqs < 1:
            raise ValueError("max_num_queued_reqs must be >= 1 or None")
        if max_num_queued_tokens is not None and max_num_queued_tokens < 1:
            raise ValueError("max_num_queued_tokens must be >= 1 or None")
        self.max_reqs = max_num_queued_reqs
        self.max_tokens = max_num_queued_tokens
        self.params = {
            "max_num_queued_reqs": max_num_queued_reqs,
            "max_num_queued_tokens": max_num_queued_tokens,
        }
        self.in_flight = 0
        self.prefill_tokens = 0
        self._in_prefill: dict[str, int] = {}  # request id -> prompt tokens, until its 1st token

    def admits(self) -> bool:
        """Whether one more request passes both caps now."""
        if self.max_reqs is not None and self.in_flight + 1 > self.max_reqs:
            return False
        return self.max_tokens is None or self.prefill_tokens < self.max_tokens

    def on_arrival(self, req: Request, now: float) -> None:
        if not self.admits():
            self.gate.reject(req, now, None)
            return
        self.in_flight += 1
        self.prefill_tokens += req.prompt_tokens
        self._in_prefill[req.rid] = req.prompt_tokens
        self.gate.dispatch(req, now)
        if self.gate.sequences.get(req.rid) is None:  # the engine refused it (400)
            self._left(req.rid)

    def _left_prefill(self, rid: str) -> None:
        self.prefill_tokens -= self._in_prefill.pop(rid, 0)

    def _left(self, rid: str) -> None:
        self._left_prefill(rid)
        self.in_flight -= 1

    def on_tokens(self, new_tokens: dict[str, int], now: float) -> None:
        for rid, index in new_tokens.items():
            if index == 0:
                self._left_prefill(rid)

    def on_finish(self, req: Request, output_tokens: int, now: float) -> None:
        self._left(req.rid)


#: Swept settings: (max_num_queued_reqs, max_num_queued_tokens); both unset is ``none``.
SHORT_REQS: tuple[int | None, ...] = (64, 96, 128, None)
SHORT_TOKENS: tuple[int | None, ...] = (1024, 2048, 8192, None)
FULL_REQS: tuple[int | None, ...] = (48, 64, 96, 128, 192, 256, 384, None)
FULL_TOKENS: tuple[int | None, ...] = (512, 1024, 2048, 4096, 8192, 16384, None)


def candidates(short: bool) -> list[dict[str, Any]]:
    """The settings swept: every pair of caps but (None, None), which is the ``none`` arm."""
    reqs, toks = (SHORT_REQS, SHORT_TOKENS) if short else (FULL_REQS, FULL_TOKENS)
    return [
        {"max_num_queued_reqs": r, "max_num_queued_tokens": t}
        for r in reqs
        for t in toks
        if r is not None or t is not None
    ]
