"""The engine a ``--profile`` value names: a built-in profile, or a JSON engine profile file.

**Built-in** (``h100-llama3-8b``, ``a100-llama3-8b``; :data:`kvgate_bench.sim.steptime.PROFILES`),
optionally ``@`` a KV pool in tokens (``h100-llama3-8b@65536``): the step-time model, the
benchmark's engine shape (:func:`kvgate_bench.effectiveness.model.driver.engine_config`: 16-token
blocks, max_model_len 8192, max_num_seqs 256, 8192 tokens a step) and the benchmark's fixed SLO
(TTFT <= 0.5 s, TPOT <= 50 ms: :mod:`kvgate_bench.effectiveness.model.metrics`), which is not
derived
from the engine.

**A file** (:mod:`kvgate_bench.sim.profile_file`): the step-time model, the engine shape
(max_num_seqs, KV pool, block size, max_model_len, prefill chunk) and the SLO come from it. A
file without ``slo`` gets the SLO as the real-engine benchmark calibrates one
(:func:`kvgate_bench.real_engine.calibration.slo_from_unloaded`: 4x the unloaded TTFT p50 and
3x the unloaded TPOT p50), with the unloaded latencies measured in virtual time on the file's
engine: one request at a time of each of :data:`UNLOADED_PROMPTS` prompt tokens (the
real-engine calibration's prompts, clipped to the context) and :data:`UNLOADED_OUTPUT` output
tokens. The fixed SLO would not do: it was written for the H100 profile, and a CPU engine
misses it unloaded.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvgate_bench.effectiveness.model.driver import engine_config
from kvgate_bench.effectiveness.model.metrics import DEFAULT_SLO, Slo
from kvgate_bench.real_engine.calibration import slo_from_unloaded
from kvgate_bench.sim.engine import SimEngine
from kvgate_bench.sim.profile_file import EngineProfile, load_profile
from kvgate_bench.sim.sequences import EngineConfig
from kvgate_bench.sim.steptime import PROFILES, StepTimeModel, profile

#: Prompt lengths of the unloaded requests a file's SLO is derived from, tokens (the
#: real-engine calibration's).
UNLOADED_PROMPTS: tuple[int, ...] = (48, 160, 320, 480, 640)
#: Output of each unloaded request, tokens (the real-engine benchmark's max_tokens).
UNLOADED_OUTPUT = 96


@dataclass(frozen=True)
class Engine:
    """The engine of one ``--profile`` value.

    Attributes:
        name: the profile's name, as rows and ``meta`` report it (a built-in's ``--profile``
            value, a file's ``name``).
        steptime: its step-time model.
        config: its engine shape.
        slo: the interactive (TTFT, TPOT) SLO, seconds, or None for the benchmark's fixed one.
        slo_source: ``benchmark`` (fixed), ``file`` (the file's ``slo``) or ``unloaded``
            (derived from unloaded latencies; the module docstring).
        file: the profile file's contents, None for a built-in.
        path: the file's path as given, None for a built-in.
    """

    name: str
    steptime: StepTimeModel
    config: EngineConfig
    slo: Slo | None = None
    slo_source: str = "benchmark"
    file: EngineProfile | None = None
    path: str | None = None

    @property
    def score_slo(self) -> Slo:
        """The (TTFT, TPOT) SLO the rows are scored under, seconds."""
        return self.slo if self.slo is not None else DEFAULT_SLO

    def meta(self) -> dict[str, Any]:
        """What a run's JSON ``meta`` says of the engine: ``profile`` (the name) and, for a
        file, ``profile_file`` (its path), ``engine_profile`` (its contents) and ``slo``
        (``ttft_s``, ``tpot_s`` seconds and ``source``)."""
        if self.file is None:
            return {"profile": self.name}
        ttft, tpot = self.score_slo
        return {
            "profile": self.name,
            "profile_file": self.path,
            "engine_profile": self.file.to_json(),
            "slo": {"ttft_s": ttft, "tpot_s": tpot, "source": self.slo_source},
        }


def is_builtin(prof: str) -> bool:
    """Whether ``prof`` names a built-in profile (optionally ``@`` a pool), not a file."""
    return prof.partition("@")[0] in PROFILES


def steptime_of(prof: str) -> StepTimeModel:
    """The step-time model named ``prof``: a profile name (``steptime.PROFILES``), optionally
    ``@`` a KV pool in tokens replacing the profile's (``h100-llama3-8b@65536``: the same GPU
    with less room for KV, e.g. a larger model's weights). Raises ``ValueError`` for an
    unknown profile or a pool that is not a positive integer."""
    name, _, pool = prof.partition("@")
    st = profile(name)
    if not pool:
        return st
    if not pool.isdigit() or int(pool) <= 0:
        raise ValueError(f"KV pool must be a positive number of tokens, got {pool!r}")
    return dataclasses.replace(st, kv_capacity_tokens=int(pool))


def unloaded_latencies(
    steptime: StepTimeModel, config: EngineConfig, prompt_tokens: int, output_tokens: int
) -> tuple[float, float]:
    """(TTFT, TPOT) of one request alone on a fresh engine, virtual seconds: ``prompt_tokens``
    in, ``output_tokens`` (>= 2) out; TPOT = (last token - first token) / (output - 1)."""
    engine = SimEngine(config, steptime)
    engine.submit("unloaded", prompt_tokens, output_tokens, output_tokens=output_tokens)
    t = 0.0
    first: float | None = None
    last = 0.0
    while engine.has_work:
        step = engine.step()
        t += step.duration_s
        if "unloaded" in step.new_tokens:
            first = t if first is None else first
            last = t
    assert first is not None  # a lone request that fits always runs to the end
    return first, (last - first) / (output_tokens - 1)


def unloaded_slo(steptime: StepTimeModel, config: EngineConfig) -> Slo:
    """The SLO of a profile file without one (the module docstring), seconds."""
    out = max(2, min(UNLOADED_OUTPUT, config.max_model_len // 2))
    lat = [
        unloaded_latencies(steptime, config, max(1, min(p, config.max_model_len - out)), out)
        for p in UNLOADED_PROMPTS
    ]
    return slo_from_unloaded([a for a, _ in lat], [b for _, b in lat]).pair()


@functools.lru_cache(maxsize=16)
def engine_of(prof: str) -> Engine:
    """The :class:`Engine` of the ``--profile`` value ``prof``: a built-in name (optionally
    ``@`` a pool) or a path to a JSON profile file (cached per process). Raises ``ValueError``
    (one line) for an unknown name, a bad pool, or a missing or invalid file."""
    if is_builtin(prof):
        st = steptime_of(prof)
        return Engine(prof, st, engine_config(st))
    if not Path(prof).exists():
        names = ", ".join(sorted(PROFILES))
        raise ValueError(f"--profile {prof}: neither a built-in profile ({names}) nor a file")
    try:
        prof_file = load_profile(prof)
    except ValueError as e:
        raise ValueError(f"--profile: {e}") from None
    st, cfg = prof_file.steptime(), prof_file.engine_config()
    if prof_file.slo is not None:
        return Engine(prof_file.name, st, cfg, prof_file.slo, "file", prof_file, prof)
    return Engine(prof_file.name, st, cfg, unloaded_slo(st, cfg), "unloaded", prof_file, prof)
