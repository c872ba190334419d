"""A pure, clock-free continuous-batching engine modelled on vLLM's V1 scheduler: how a paged
KV cache fills up under continuous batching, and when running requests get preempted.

Invariant: no clock and no I/O; :meth:`SimEngine.step` advances exactly one engine iteration and
the caller (``kvgate_bench.sim.server``) turns that into wall-clock time.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative integers (e.g. tokens -> blocks)."""
    return -(-a // b)


class RequestRejected(ValueError):
    """A request that the engine can never serve; the server answers 400.

    ``param`` names the offending OpenAI request field (or ``None``), like the
    ``param`` of vLLM's OpenAI error body.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True)
class EngineConfig:
    """Static engine configuration.

    Attributes:
        num_gpu_blocks: KV pool size in blocks.
        block_size: tokens per KV block (vLLM default 16).
        max_model_len: maximum prompt + completion length in tokens.
        max_num_seqs: maximum number of RUNNING requests (vLLM default 256).
        max_num_batched_tokens: prefill tokens admitted per step; must be at
            least ``max_model_len`` since prefill is never chunked.
        watermark: fraction of the pool kept free when admitting (not when
            decoding), as vLLM's block manager watermark (0.01).
    """

    num_gpu_blocks: int
    block_size: int = 16
    max_model_len: int = 8192
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    watermark: float = 0.01

    def __post_init__(self) -> None:
        if self.num_gpu_blocks < 1 or self.block_size < 1 or self.max_num_seqs < 1:
            raise ValueError("num_gpu_blocks, block_size and max_num_seqs must be >= 1")
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2 tokens")
        if self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "max_num_batched_tokens must be >= max_model_len (prefill is not chunked)"
            )
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError("watermark must be in [0, 1)")

    @property
    def watermark_blocks(self) -> int:
        """Blocks that admission leaves free (``int(watermark * num_gpu_blocks)``)."""
        return int(self.watermark * self.num_gpu_blocks)


@dataclass(eq=False)
class Sequence:
    """One request inside the engine.

    ``generated`` counts output tokens produced so far (they survive
    preemption); ``num_computed`` counts tokens whose KV is in the cache (reset
    to 0 on preemption); ``blocks`` is the number of KV blocks held.
    """

    request_id: str
    prompt_tokens: int
    max_tokens: int
    tenant: str
    arrival: int
    generated: int = 0
    num_computed: int = 0
    blocks: int = 0
    num_preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens (vLLM ``Request.num_tokens``)."""
        return self.prompt_tokens + self.generated


@dataclass
class StepResult:
    """What one :meth:`SimEngine.step` did.

    Attributes:
        new_tokens: request id -> 0-based index of the output token produced
            this step (one token per scheduled request).
        finished: ids that reached ``max_tokens`` this step (blocks freed).
        preempted: ids preempted this step (now at the front of waiting).
        admitted: ids admitted from waiting this step (new or resumed).
        prefill_tokens: tokens prefilled this step (prompt, or prompt +
            generated for resumed requests); drives the step's duration.
        decode_tokens: tokens decoded this step (one per running request).
    """

    new_tokens: dict[str, int] = field(default_factory=dict)
    finished: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    admitted: list[str] = field(default_factory=list)
    prefill_tokens: int = 0
    decode_tokens: int = 0


class SimEngine:
    """Continuous-batching engine with a paged KV pool of ``num_gpu_blocks`` blocks of
    ``block_size`` tokens, and recompute preemption. Pure and synchronous: no clock, no I/O.

    Each :meth:`step` follows ``vllm/v1/core/sched/scheduler.py`` (``Scheduler.schedule``):

    * RUNNING requests are scheduled first, in admission order. Each needs KV slots for the
      tokens it computes this step; if the pool has no free block, the most recently admitted
      running request is popped (``self.running.pop()``), all its blocks are freed, its
      computed-token count is reset to 0, and it is put at the FRONT of the waiting queue
      (``waiting.prepend_request``). If the victim is the request being scheduled, it is simply
      not scheduled.
    * WAITING requests are admitted FIFO only when no preemption happened in this step, while
      ``running < max_num_seqs``, while the prefill fits the token budget and while its blocks
      fit above a small watermark (vLLM V0's ``BlockSpaceManager`` ``watermark=0.01``).
      Admission stops at the first request that does not fit (head-of-line, FCFS). A resumed
      request's prefill covers its prompt plus every token generated so far.
    * Every scheduled request then produces exactly one token (prefill produces the first
      token, as in vLLM); a request that reaches ``max_tokens`` finishes and frees its blocks.

    Simplifications: no chunked prefill (the budget applies to prefill tokens only and must be
    at least ``max_model_len``), no prefix caching, no stop strings.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.running: list[Sequence] = []
        self.waiting: deque[Sequence] = deque()
        self._by_id: dict[str, Sequence] = {}
        self._arrivals = 0
        self.used_blocks = 0
        self.preemptions_total = 0
        self.preemptions_by_tenant: dict[str, int] = {}
        self.finished_total = 0
        self.cancelled_total = 0

    # -- gauges ---------------------------------------------------------------

    @property
    def num_running(self) -> int:
        """Requests holding KV blocks (vLLM ``num_requests_running``)."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Requests queued for admission (vLLM ``num_requests_waiting``)."""
        return len(self.waiting)

    @property
    def free_blocks(self) -> int:
        """Unallocated KV blocks."""
        return self.config.num_gpu_blocks - self.used_blocks

    @property
    def kv_usage(self) -> float:
        """Used blocks / total blocks, in 0..1 (vLLM ``kv_cache_usage_perc``)."""
        return self.used_blocks / self.config.num_gpu_blocks

    @property
    def has_work(self) -> bool:
        """True while any request is running or waiting."""
        return bool(self.running or self.waiting)

    def get(self, request_id: str) -> Sequence | None:
        """The live (running or waiting) sequence with this id, if any."""
        return self._by_id.get(request_id)

    # -- requests -------------------------------------------------------------

    def check(self, prompt_tokens: int, max_tokens: int) -> None:
        """Raise :class:`RequestRejected` if the request can never be served.

        Mirrors vLLM's 400s for prompts at/over ``max_model_len`` and for
        ``prompt + max_tokens > max_model_len``; additionally rejects requests
        whose peak KV footprint (``prompt + max_tokens - 1`` tokens, the last
        token needs no KV) cannot fit the pool minus the watermark, where vLLM
        would instead refuse to start.
        """
        cfg = self.config
        if prompt_tokens < 1:
            raise RequestRejected("The decoder prompt cannot be empty", "prompt")
        if prompt_tokens >= cfg.max_model_len:
            raise RequestRejected(
                f"This model's maximum context length is {cfg.max_model_len} tokens. "
                f"However, your request has {prompt_tokens} input tokens. "
                "Please reduce the length of the input messages.",
                "messages",
            )
        if max_tokens < 1:
            raise RequestRejected(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
        if prompt_tokens + max_tokens > cfg.max_model_len:
            raise RequestRejected(
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. "
                f"This model's maximum context length is {cfg.max_model_len} tokens and "
                f"your request has {prompt_tokens} input tokens "
                f"({max_tokens} > {cfg.max_model_len} - {prompt_tokens}).",
                "max_tokens",
            )
        peak_blocks = cdiv(prompt_tokens + max_tokens - 1, cfg.block_size)
        if peak_blocks > cfg.num_gpu_blocks - cfg.watermark_blocks:
            raise RequestRejected(
                f"The request needs {peak_blocks} KV blocks of {cfg.block_size} tokens "
                f"but the KV cache only has {cfg.num_gpu_blocks} blocks "
                f"({cfg.watermark_blocks} reserved as watermark).",
                "max_tokens",
            )

    def submit(
        self, request_id: str, prompt_tokens: int, max_tokens: int, tenant: str = ""
    ) -> Sequence:
        """Queue a request (tokens) at the back of waiting; it is admitted by step().

        Raises :class:`RequestRejected` (see :meth:`check`) or ``ValueError``
        for a duplicate live id.
        """
        if request_id in self._by_id:
            raise ValueError(f"duplicate request id {request_id!r}")
        self.check(prompt_tokens, max_tokens)
        seq = Sequence(request_id, prompt_tokens, max_tokens, tenant, self._arrivals)
        self._arrivals += 1
        self._by_id[request_id] = seq
        self.waiting.append(seq)
        return seq

    def cancel(self, request_id: str) -> bool:
        """Remove a live request wherever it is and free its blocks.

        Returns True if it was live (running or waiting), False if unknown or
        already finished (a no-op then).
        """
        seq = self._by_id.pop(request_id, None)
        if seq is None:
            return False
        if seq in self.waiting:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
        self._free(seq)
        self.cancelled_total += 1
        return True

    # -- scheduling -----------------------------------------------------------

    def _free(self, seq: Sequence) -> None:
        self.used_blocks -= seq.blocks
        seq.blocks = 0

    def _allocate(self, seq: Sequence, num_tokens: int, reserve: int = 0) -> bool:
        """Grow ``seq`` to hold ``num_tokens`` KV slots, keeping ``reserve`` free."""
        need = cdiv(num_tokens, self.config.block_size) - seq.blocks
        if need > self.free_blocks - reserve:
            return False
        if need > 0:
            seq.blocks += need
            self.used_blocks += need
        return True

    def _preempt(self, seq: Sequence) -> None:
        self._free(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        self.preemptions_total += 1
        self.preemptions_by_tenant[seq.tenant] = self.preemptions_by_tenant.get(seq.tenant, 0) + 1

    def step(self) -> StepResult:
        """Advance one engine iteration: schedule, then produce one token each.

        Returns a :class:`StepResult`; a no-op result when there is no work.
        """
        result = StepResult()
        scheduled: list[Sequence] = []

        # 1. RUNNING requests, oldest first; preempt from the tail when full.
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            while not self._allocate(seq, seq.num_tokens):
                victim = self.running.pop()
                self._preempt(victim)
                result.preempted.append(victim.request_id)
                if victim is seq:
                    break
            else:
                scheduled.append(seq)
                result.decode_tokens += seq.num_tokens - seq.num_computed
                i += 1

        # 2. WAITING requests, FIFO, only if nothing was preempted this step.
        budget = self.config.max_num_batched_tokens
        while not result.preempted and self.waiting:
            seq = self.waiting[0]
            prefill = seq.num_tokens - seq.num_computed
            if len(self.running) >= self.config.max_num_seqs or prefill > budget:
                break
            if not self._allocate(seq, seq.num_tokens, reserve=self.config.watermark_blocks):
                break
            self.waiting.popleft()
            self.running.append(seq)
            scheduled.append(seq)
            budget -= prefill
            result.prefill_tokens += prefill
            result.admitted.append(seq.request_id)

        # 3. "Execute": every scheduled request computes its tokens and samples one.
        for seq in scheduled:
            seq.num_computed = seq.num_tokens
            result.new_tokens[seq.request_id] = seq.generated
            seq.generated += 1
            if seq.generated >= seq.max_tokens:
                self.running.remove(seq)
                del self._by_id[seq.request_id]
                self._free(seq)
                self.finished_total += 1
                result.finished.append(seq.request_id)
        return result
