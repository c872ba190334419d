"""The engine profile fitted to llama-server (pure): a decode step-time table by batch size,
the prefill cost per token and the context cost, as a JSON engine profile
(:class:`kvgate_bench.sim.profile_file.EngineProfile`) that the virtual twin simulates and
``--write-profile`` writes.

The measurements (:mod:`kvgate_bench.real_engine.calibration_run`), all from llama-server's
``timings`` of each request (``prompt_n`` tokens prefilled in ``prompt_ms``; ``predicted_n``
tokens decoded at ``predicted_per_token_ms``; ``tools/server/server.cpp``,
https://github.com/ggml-org/llama.cpp/tree/master/tools/server):

* **Unloaded requests** (one at a time, prompts of several lengths): the prefill cost,
  ``prefill_ms_per_token`` = sum(prompt_ms) / sum(prompt_n) (a least-squares line through the
  origin weighted by length), and the context cost ``d`` (us per context token), the slope of
  the lone sequence's step time against its mean context (prompt_n + predicted_n / 2),
  ordinary least squares, floored at 0.
* **Bursts** of k equal requests sent together, k = 1 .. ``parallel``, at least
  :data:`MIN_BURSTS` each: k sequences decode side by side, so the step time with k in the
  batch is their mean ``predicted_per_token_ms``. The table's entry for k is the median over
  its bursts of that time less ``d`` x the k sequences' context: the profile adds ``d x K``
  back for the context a simulated step has (:mod:`kvgate_bench.sim.steptime`).

A profile's step times must be > 0 (:mod:`kvgate_bench.sim.profile_file`): a table entry or a
prefill cost that the subtraction or a cache-warm run drives to 0 or below is floored at
:data:`MIN_STEP_MS`.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvgate_bench.real_engine.calibration import Slo
from kvgate_bench.sim.profile_file import EngineProfile

#: The least step time (and prefill cost per token) a fitted profile holds, ms.
MIN_STEP_MS = 1e-3
#: Bursts per batch size.
MIN_BURSTS = 3
#: The virtual engine's KV block, tokens.
BLOCK = 16
#: llama.cpp's default logical batch (``-b``): the most prompt tokens one step takes.
LLAMA_BATCH = 2048


@dataclass(frozen=True)
class Burst:
    """One burst of ``k`` equal requests: each one's mean context while decoding (tokens) and
    its step time (ms per token)."""

    k: int
    contexts: tuple[float, ...]
    per_token_ms: tuple[float, ...]


def burst_from_timings(timings: Sequence[Mapping[str, Any]]) -> Burst:
    """A :class:`Burst` from the ``timings`` of its requests (one each). Raises ``ValueError``
    for none."""
    if not timings:
        raise ValueError("a burst of no requests")
    ctx = tuple(float(t["prompt_n"]) + float(t["predicted_n"]) / 2 for t in timings)
    per = tuple(float(t["predicted_per_token_ms"]) for t in timings)
    return Burst(len(timings), ctx, per)


def prefill_ms_per_token(unloaded: Sequence[Mapping[str, Any]]) -> float:
    """sum(prompt_ms) / sum(prompt_n) over the unloaded requests' ``timings``, ms/token; 0 for
    none."""
    n = sum(float(t["prompt_n"]) for t in unloaded)
    return sum(float(t["prompt_ms"]) for t in unloaded) / n if n > 0 else 0.0


def context_us_per_token(unloaded: Sequence[Mapping[str, Any]]) -> float:
    """The slope of a lone sequence's step time (ms) against its mean context (tokens), as us
    per token, floored at 0 (module docstring); 0 with fewer than two distinct contexts."""
    pts = [
        (float(t["prompt_n"]) + float(t["predicted_n"]) / 2, float(t["predicted_per_token_ms"]))
        for t in unloaded
        if int(t.get("predicted_n", 0)) > 1
    ]
    if len({x for x, _ in pts}) < 2:
        return 0.0
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    sxy = sum((x - mx) * (y - my) for x, y in pts)
    return max(0.0, sxy / sxx * 1e3)


def decode_table(bursts: Sequence[Burst], d_us: float) -> dict[int, float]:
    """Batch size -> step time, ms (module docstring): per k, the median over its bursts of
    the mean step time less ``d_us`` x the burst's total context. Raises ``ValueError`` for no
    burst."""
    if not bursts:
        raise ValueError("no bursts to fit a decode table to")
    by_k: dict[int, list[float]] = {}
    for b in bursts:
        step = statistics.fmean(b.per_token_ms) - d_us / 1e3 * sum(b.contexts)
        by_k.setdefault(b.k, []).append(max(MIN_STEP_MS, step))
    return {k: statistics.median(v) for k, v in sorted(by_k.items())}


def fit_profile(
    name: str,
    *,
    parallel: int,
    ctx: int,
    unloaded: Sequence[Mapping[str, Any]],
    bursts: Sequence[Burst],
    slo: Slo | None,
) -> EngineProfile:
    """The engine profile of llama-server ``--parallel P -c C --no-kv-unified``: P sequences of
    at most C / P tokens, a KV pool of C tokens in 16-token blocks, prompts within llama.cpp's
    2048-token batch, and the step times of the module docstring; the calibrated SLO."""
    d_us = context_us_per_token(unloaded)
    return EngineProfile(
        name=name,
        max_num_seqs=parallel,
        kv_capacity_tokens=ctx,
        block_size=BLOCK,
        max_model_len=ctx // parallel,
        prefill_chunk_tokens=LLAMA_BATCH,
        prefill_ms_per_token=max(MIN_STEP_MS, prefill_ms_per_token(unloaded)),
        decode_step_ms=decode_table(bursts, d_us),
        context_us_per_token=d_us,
        slo=slo.pair() if slo is not None else None,
    )
