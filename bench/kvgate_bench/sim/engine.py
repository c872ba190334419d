"""A pure, clock-free continuous-batching engine modelled on vLLM's V1 scheduler: how a paged
KV cache fills up under continuous batching, and when running requests get preempted.

Invariant: no clock and no I/O; :meth:`SimEngine.step` advances exactly one engine iteration and
returns what happened with its modelled duration in seconds
(:class:`kvgate_bench.sim.steptime.StepTimeModel`); the caller turns that into time
(``kvgate_bench.sim.loop`` sleeps it on the real clock, an in-process driver can add it to a
virtual clock). Its configuration, its requests and what a step did are
:mod:`kvgate_bench.sim.sequences`'.

"""

from __future__ import annotations

from collections import deque

from kvgate_bench.sim.prefix_cache import (
    BlockKeys,
    BlockPool,
    admit_on_hit,
    cache_hit,
    register_blocks,
)
from kvgate_bench.sim.sequences import (
    EngineConfig,
    Sequence,
    StepResult,
    cdiv,
    check_request,
)
from kvgate_bench.sim.steptime import StepTimeModel, constant_profile


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
        """Raise :class:`~kvgate_bench.sim.sequences.RequestRejected` if the request can never be
        served on this engine (:func:`~kvgate_bench.sim.sequences.check_request`)."""
        check_request(self.config, prompt_tokens, max_tokens)

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
