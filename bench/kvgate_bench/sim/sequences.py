"""What the engine model (:class:`kvgate_bench.sim.engine.SimEngine`) is made of: its
configuration (:class:`EngineConfig`), its requests (:class:`Sequence`: tokens computed and
generated, KV blocks held), what one step did (:class:`StepResult`), and the requests it refuses
outright (:func:`check_request`, vLLM's 400s). Sizes are tokens and KV blocks, durations
seconds. Pure: no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvgate_bench.sim.prefix_cache import BlockKeys


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


def check_request(cfg: EngineConfig, prompt_tokens: int, max_tokens: int) -> None:
    """Raise :class:`RequestRejected` if a request of ``prompt_tokens`` and ``max_tokens`` can
    never be served on an engine of ``cfg``.

    Mirrors vLLM's 400s for prompts at/over ``max_model_len`` and for
    ``prompt + max_tokens > max_model_len``; additionally rejects requests
    whose peak KV footprint (``prompt + max_tokens - 1`` tokens, the last
    token needs no KV) cannot fit the pool minus the watermark, where vLLM
    would instead refuse to start.
    """
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
