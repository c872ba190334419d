"""kvgate-sim's configuration (:class:`SimConfig`): the model it serves, the engine's shape (KV
pool, block size, context, sequences, step budget), the step-time profile, the output lengths,
the time scale and the prefix cache. Sizes are tokens, latencies as named. Read by
:mod:`kvgate_bench.sim.server` (the HTTP API), :mod:`kvgate_bench.sim.loop` (the engine on the
real clock) and the ``kvgate-sim`` command line (:mod:`kvgate_bench.sim.cli`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgate_bench.sim.lengths import OutputLengths
from kvgate_bench.sim.sequences import EngineConfig
from kvgate_bench.sim.steptime import StepTimeModel, constant_profile
from kvgate_bench.sim.steptime import profile as steptime_profile


@dataclass(frozen=True)
class SimConfig:
    """Simulator configuration (all sizes in tokens, latencies as named).

    Attributes:
        model: served model name; requests naming another model get 404.
        extra_models: further accepted model names (for fallback routing).
        kv_capacity_tokens: KV pool size in tokens; blocks = this // block_size;
            ``None`` means the profile's pool (``constant``: 65536).
        block_size: tokens per KV block.
        max_model_len: maximum prompt + completion tokens per request.
        max_num_seqs: maximum concurrently running requests.
        max_num_batched_tokens: token budget per step (prefill tokens only for
            ``constant``, every scheduled token for the chunked-prefill
            profiles); ``None`` means ``max(8192, max_model_len)`` for
            ``constant`` and 8192 otherwise.
        decode_ms: ``constant`` profile: duration of one engine iteration, milliseconds.
        prefill_us_per_token: ``constant`` profile: extra iteration time per
            prefilled token, microseconds.
        profile: step-time profile (``constant``, ``h100-llama3-8b``,
            ``a100-llama3-8b``; :mod:`kvgate_bench.sim.steptime`), or the name of
            ``steptime_model``'s profile when that is set.
        steptime_model: a step-time model that replaces ``profile``'s (a JSON engine
            profile's: :mod:`kvgate_bench.sim.profile_file`), or ``None``.
        output_lengths: true lengths of requests without ``x-sim-output-tokens``:
            ``max`` (run to max_tokens) or ``lognormal`` (seeded draws).
        output_seed: seed of the ``lognormal`` draws.
        time_scale: real seconds per modelled second (> 0): each step lasts
            ``time_scale x`` its modelled duration on the real clock. Above 1 the
            simulator runs slower than the GPU it models, so that a load generator and a
            proxy on a small machine keep up; the client then sends its arrivals
            ``time_scale x`` later and divides what it measures by it (see
            :mod:`kvgate_bench.effectiveness.realtime`).
        prefix_caching: key the engine's prefix cache with the prompts' tokens
            (``--enable-prefix-caching``; :mod:`kvgate_bench.sim.prompt_keys`), so that
            prompts reuse the KV blocks of leading tokens already cached. Off by default,
            unlike vLLM: every prompt is then content of its own, never a hit (the
            engine's configuration is the same either way), because the harnesses that
            drive kvgate-sim stand for distinct prompts with one repeated token or word,
            which would all share their blocks and be prefilled once.
        prompt_tokens_details: add ``usage.prompt_tokens_details.cached_tokens``
            (the prompt tokens found cached) to responses, streamed usage included, as
            vLLM's ``--enable-prompt-tokens-details`` does.
    """

    model: str = "kvgate-sim-model"
    extra_models: tuple[str, ...] = ()
    kv_capacity_tokens: int | None = None
    block_size: int = 16
    max_model_len: int = 8192
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    decode_ms: float = 10.0
    prefill_us_per_token: float = 20.0
    profile: str = "constant"
    output_lengths: str = "max"
    output_seed: int = 0
    time_scale: float = 1.0
    prefix_caching: bool = False
    prompt_tokens_details: bool = False
    steptime_model: StepTimeModel | None = None

    def __post_init__(self) -> None:
        if not self.time_scale > 0:
            raise ValueError("time_scale must be > 0")

    @property
    def steptime(self) -> StepTimeModel:
        """The step-time model: ``steptime_model`` when set, else ``profile``'s; raises
        ``ValueError`` for an unknown profile."""
        if self.steptime_model is not None:
            return self.steptime_model
        if self.profile == "constant":
            return constant_profile(self.decode_ms, self.prefill_us_per_token)
        return steptime_profile(self.profile)

    @property
    def kv_tokens(self) -> int:
        """KV pool size in tokens: ``kv_capacity_tokens`` or the profile's pool."""
        if self.kv_capacity_tokens is not None:
            return self.kv_capacity_tokens
        return self.steptime.kv_capacity_tokens

    @property
    def num_gpu_blocks(self) -> int:
        """KV pool size in blocks."""
        return self.kv_tokens // self.block_size

    @property
    def served_models(self) -> tuple[str, ...]:
        """Every model name this server accepts, the primary one first."""
        return (self.model, *(m for m in self.extra_models if m != self.model))

    def engine_config(self) -> EngineConfig:
        """The :class:`EngineConfig` for this simulator; ``ValueError`` if invalid."""
        chunked = self.steptime.chunked_prefill
        default_batched = 8192 if chunked else max(8192, self.max_model_len)
        return EngineConfig(
            num_gpu_blocks=self.num_gpu_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens or default_batched,
            chunked_prefill=chunked,
        )

    def output_length_source(self) -> OutputLengths:
        """A fresh :class:`OutputLengths` for this configuration; ``ValueError`` if invalid."""
        return OutputLengths(self.output_lengths, self.output_seed)
