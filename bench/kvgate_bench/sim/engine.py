"""A pure, clock-free continuous-batching engine modelled on vLLM's V1 scheduler: how a paged
KV cache fills up under continuous batching, and when running requests get preempted.

Invariant: no clock and no I/O; :meth:`SimEngine.step` advances exactly one engine iteration and
returns what happened with its modelled duration in seconds
(:class:`kvgate_bench.sim.steptime.StepTimeModel`); the caller turns that into time
(``kvgate_bench.sim.server`` sleeps it on the real clock, an in-process driver can add it to a
virtual clock).

"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvgate_bench.sim.prefix_cache import (
    BlockKeys,
    BlockPool,
    admit_on_hit,
    cache_hit,
    register_blocks,
)
from kvgate_bench.sim.steptime import StepTimeModel, constant_profile


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
        max_num_batched_tokens: the token budget of one step: every scheduled
            token with ``chunked_prefill``, prefill tokens only without it
            (then it must be at least ``max_model_len``, as a whole prompt
            must fit).
        watermark: fraction of the pool kept free when admitting (not when
            decoding), as vLLM's block manager watermark (0.01).
        chunked_prefill: chunk prefills under the token budget (vLLM V1) or
            prefill whole prompts (kvgate-sim before profiles).
        prefix_caching: keep the KV blocks of known prefixes for reuse
            (:mod:`kvgate_bench.sim.prefix_cache`; vLLM V1's default, on); off,
            or for requests that describe no content, nothing is ever reused.

    Raises ``ValueError`` on construction for sizes below their minimum.
    """

    num_gpu_blocks: int
    block_size: int = 16
    max_model_len: int = 8192
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    watermark: float = 0.01
    chunked_prefill: bool = False
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.num_gpu_blocks < 1 or self.block_size < 1 or self.max_num_seqs < 1:
            raise ValueError("num_gpu_blocks, block_size and max_num_seqs must be >= 1")
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2 tokens")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if not self.chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
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
    to 0 on preemption); ``blocks`` is the number of KV blocks held;
    ``prefill_len`` is the length of the current prefill (prompt + generated at
    admission): the sequence decodes once ``num_computed`` reaches it.
    ``output_tokens`` is the model's true output length (EOS included), or
    ``None`` to run to ``max_tokens``. All counts are tokens.

    Prefix caching: ``block_keys`` says what the sequence's tokens are, block by
    block (``None``: its own content, never reused); ``cached_tokens`` is how many
    prompt tokens were found cached at its first admission (vLLM's
    ``usage.prompt_tokens_details.cached_tokens``); ``held`` are the hashes of the
    cached blocks it references (the rest of its ``blocks`` are its own),
    ``chain`` the hashes of its leading full blocks computed so far, and
    ``registered`` how many of its blocks were offered to the cache.
    """

    request_id: str
    prompt_tokens: int
    max_tokens: int
    tenant: str
    arrival: int
    output_tokens: int | None = None
    generated: int = 0
    num_computed: int = 0
    blocks: int = 0
    num_preemptions: int = 0
    prefill_len: int = 0
    block_keys: BlockKeys | None = None
    cached_tokens: int = 0
    held: list[int] = field(default_factory=list)
    chain: list[int] = field(default_factory=list)
    registered: int = 0

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens (vLLM ``Request.num_tokens``)."""
        return self.prompt_tokens + self.generated

    @property
    def target_tokens(self) -> int:
        """Output tokens this request will produce: ``min(output_tokens, max_tokens)``."""
        if self.output_tokens is None:
            return self.max_tokens
        return min(self.output_tokens, self.max_tokens)

    @property
    def finish_reason(self) -> str:
        """``"length"`` if it runs to ``max_tokens``, ``"stop"`` if EOS comes first."""
        return "length" if self.target_tokens >= self.max_tokens else "stop"

    @property
    def decoding(self) -> bool:
        """True once the current prefill is complete (the next step decodes)."""
        return self.num_computed >= self.prefill_len


@dataclass
class StepResult:
    """What one :meth:`SimEngine.step` did.

    Attributes:
        new_tokens: request id -> 0-based index of the output token produced
            this step (one per request that decoded or completed its prefill;
            none for a partial prefill chunk).
        finished: ids that produced their last token this step (blocks freed).
        finish_reasons: finished id -> ``"stop"`` or ``"length"``.
        preempted: ids preempted this step (now at the front of waiting).
        admitted: ids admitted from waiting this step (new or resumed).
        prefill_tokens: ``P``, tokens prefilled this step (prompt chunks, or
            prompt + generated for resumed requests).
        decode_tokens: tokens decoded this step (one per decoding request).
        decode_seqs: ``D``, sequences that decoded this step.
        cached_tokens: tokens of the admitted requests found in the prefix
            cache (not prefilled, not in ``prefill_tokens``).
        context_tokens: ``K``, the decoding sequences' total context (prompt +
            tokens generated before this step, each), tokens.
        duration_s: the modelled duration of the step,
            ``StepTimeModel.seconds(P, D, K)``; 0 when there was no work.
    """

    new_tokens: dict[str, int] = field(default_factory=dict)
    finished: list[str] = field(default_factory=list)
    finish_reasons: dict[str, str] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)
    admitted: list[str] = field(default_factory=list)
    prefill_tokens: int = 0
    decode_tokens: int = 0
    decode_seqs: int = 0
    context_tokens: int = 0
    cached_tokens: int = 0
    duration_s: float = 0.0


class SimEngine:
    """Continuous-batching engine with a paged KV pool of ``num_gpu_blocks`` blocks of
    ``block_size`` tokens, and recompute preemption. Pure and synchronous: no clock, no I/O.

    Pure and synchronous: no clock, no I/O. ``steptime`` prices each step (default: the
    ``constant`` profile, 10 ms per step + 20 us per prefill token). Each :meth:`step` follows
    ``Scheduler.schedule`` in vLLM's
    https://github.com/vllm-project/vllm/blob/main/vllm/v1/core/sched/scheduler.py:

    * RUNNING requests are scheduled first, in admission order. Each needs KV slots for the
      tokens it computes this step: one for a decode, the next chunk for a request whose
      prefill is still partial (it was admitted last, so it comes after the decodes). If the
      pool has no free block, the most recently admitted running request is popped
      (``self.running.pop()``), all its blocks are freed, its computed-token count is reset to
      0, and it is put at the FRONT of the waiting queue (``waiting.prepend_request``). If the
      victim is the request being scheduled, it is simply not scheduled.
    * WAITING requests are admitted FIFO only when no preemption happened in this step, while
      ``running < max_num_seqs``, while token budget is left and while their blocks fit above a
      small watermark (vLLM V0's ``BlockSpaceManager`` ``watermark=0.01``). Admission stops at
      the first request that does not fit (head-of-line, FCFS). A resumed request's prefill
      covers its prompt plus every token generated so far (recompute preemption).
    * Token budget (``max_num_batched_tokens``): with ``chunked_prefill`` (vLLM V1's default)
      it bounds every token scheduled in the step, decodes (one each) included, and a prefill
      that does not fit takes what is left of the budget (``num_new_tokens =
      min(num_new_tokens, token_budget)``) and continues in the next steps. Without it (the
      ``constant`` profile, kvgate-sim's behaviour before chunking) it bounds prefill tokens
      only and a prompt is prefilled whole or not at all.
    * A request samples a token only in a step that completes its prefill (its first token) or
      decodes (one more token). It finishes when it has produced ``min(output_tokens,
      max_tokens)`` tokens: ``finish_reason`` ``length`` when that is ``max_tokens`` (vLLM's
      ``check_stop`` tests the length cap before EOS), ``stop`` when the model's true length
      (EOS) came first.

    * Prefix caching (``EngineConfig.prefix_caching``, on as in vLLM V1): a request admitted
      from WAITING first looks up the longest run of its leading full blocks already cached
      (at most ``num_tokens - 1`` tokens: one is always computed), references them, and
      prefills only the rest: the hit costs no token budget and no step time. Blocks fill and
      join the cache as they are computed; a finished, preempted or cancelled request's cached
      blocks stay cached until an allocation evicts them, least recently used first
      (:class:`kvgate_bench.sim.prefix_cache.BlockPool`). ``used_blocks`` counts a block
      shared by several requests once; ``used + cached + empty`` is always the pool.

    Simplifications: no stop strings, no ``long_prefill_token_threshold``, no speculative
    decoding.
    """

    def __init__(self, config: EngineConfig, steptime: StepTimeModel | None = None) -> None:
        self.config = config
        self.steptime = steptime if steptime is not None else constant_profile()
        self.running: list[Sequence] = []
        self.waiting: deque[Sequence] = deque()
        self._by_id: dict[str, Sequence] = {}
        self._arrivals = 0
        self.pool = BlockPool(config.num_gpu_blocks, config.prefix_caching)
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
    def used_blocks(self) -> int:
        """KV blocks referenced by running requests (a shared cached block once)."""
        return self.pool.used

    @property
    def cached_blocks(self) -> int:
        """KV blocks holding a cached prefix nobody references (free, evictable)."""
        return self.pool.cached

    @property
    def free_blocks(self) -> int:
        """Unallocated KV blocks (cached ones included: evicted when needed)."""
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
        self,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
        tenant: str = "",
        output_tokens: int | None = None,
        block_keys: BlockKeys | None = None,
    ) -> Sequence:
        """Queue a request (tokens) at the back of waiting; it is admitted by step().

        ``output_tokens`` is the model's true output length (EOS included;
        ``None``: run to ``max_tokens``); the request produces
        ``min(output_tokens, max_tokens)`` tokens. ``block_keys``: its content,
        block by block, for the prefix cache (``None``: never reused). Raises
        :class:`RequestRejected` (see :meth:`check`), or ``ValueError`` for a
        duplicate live id or ``output_tokens < 1``.
        """
        if request_id in self._by_id:
            raise ValueError(f"duplicate request id {request_id!r}")
        if output_tokens is not None and output_tokens < 1:
            raise ValueError(f"output_tokens must be >= 1, got {output_tokens}")
        self.check(prompt_tokens, max_tokens)
        seq = Sequence(request_id, prompt_tokens, max_tokens, tenant, self._arrivals, output_tokens)
        seq.block_keys = block_keys
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
        self.pool.release(seq.held, seq.blocks - len(seq.held))
        seq.blocks = 0
        seq.held = []
        seq.registered = 0

    def _allocate(self, seq: Sequence, num_tokens: int, reserve: int = 0) -> bool:
        """Grow ``seq`` to hold ``num_tokens`` KV slots, keeping ``reserve`` free."""
        need = cdiv(num_tokens, self.config.block_size) - seq.blocks
        if need > self.free_blocks - reserve:
            return False
        if need > 0:
            seq.blocks += need
            self.pool.take(need)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self._free(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        self.preemptions_total += 1
        self.preemptions_by_tenant[seq.tenant] = self.preemptions_by_tenant.get(seq.tenant, 0) + 1

    def step(self) -> StepResult:
        """Advance one engine iteration: schedule, compute, sample.

        Returns a :class:`StepResult` with the modelled ``duration_s``; a no-op
        result (duration 0) when there is no work.
        """
        result = StepResult()
        if not self.has_work:
            return result
        cfg = self.config
        chunked = cfg.chunked_prefill
        budget = cfg.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []  # (sequence, tokens computed this step)

        # 1. RUNNING requests, oldest first; preempt from the tail when full.
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            num_new = seq.num_tokens - seq.num_computed
            if chunked:
                num_new = min(num_new, budget)
                if num_new == 0:  # budget spent: not scheduled this step, keeps its blocks
                    i += 1
                    continue
            while not self._allocate(seq, seq.num_computed + num_new):
                victim = self.running.pop()
                self._preempt(victim)
                result.preempted.append(victim.request_id)
                if victim is seq:
                    break
            else:
                scheduled.append((seq, num_new))
                if chunked:
                    budget -= num_new
                i += 1

        # 2. WAITING requests, FIFO, only if nothing was preempted this step.
        while not result.preempted and self.waiting:
            seq = self.waiting[0]
            hit = cache_hit(self.pool, seq, cfg.block_size)
            num_new = seq.num_tokens - seq.num_computed - len(hit) * cfg.block_size
            if len(self.running) >= cfg.max_num_seqs:
                break
            if chunked:
                if budget <= 0:
                    break
                num_new = min(num_new, budget)
            elif num_new > budget:
                break
            if hit:
                if not admit_on_hit(self.pool, seq, hit, num_new, cfg):
                    break
                result.cached_tokens += seq.num_computed
            elif not self._allocate(seq, seq.num_computed + num_new, reserve=cfg.watermark_blocks):
                break
            if seq.num_preemptions == 0:
                seq.cached_tokens = min(seq.num_computed, seq.prompt_tokens)
            self.waiting.popleft()
            seq.prefill_len = seq.num_tokens
            self.running.append(seq)
            scheduled.append((seq, num_new))
            budget -= num_new
            result.admitted.append(seq.request_id)

        # 3. "Execute": compute the scheduled tokens; sample where a prefill
        # completed or a sequence decoded.
        for seq, num_new in scheduled:
            if seq.decoding:
                result.decode_tokens += num_new
                result.decode_seqs += 1
                result.context_tokens += seq.num_tokens
            else:
                result.prefill_tokens += num_new
            seq.num_computed += num_new
            register_blocks(self.pool, seq, cfg.block_size)
            if seq.num_computed < seq.num_tokens:
                continue  # a partial prefill chunk: no token yet
            result.new_tokens[seq.request_id] = seq.generated
            seq.generated += 1
            if seq.generated >= seq.target_tokens:
                self.running.remove(seq)
                del self._by_id[seq.request_id]
                self._free(seq)
                self.finished_total += 1
                result.finished.append(seq.request_id)
                result.finish_reasons[seq.request_id] = seq.finish_reason
        result.duration_s = self.steptime.seconds(
            result.prefill_tokens, result.decode_seqs, result.context_tokens
        )
        return result
