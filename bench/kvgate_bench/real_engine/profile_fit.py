"""The engine profile fitted to llama-server (pure): a decode step-time table by batch size,
the prefill cost per token and the context cost, as a JSON engine profile
(:class:`kvgate_bench.sim.profile_file.EngineProfile`) that the virtual twin simulates and
``--write-profile`` writes.

The measurements (:mod:`kvgate_bench.real_engine.calibration_run`), all from llama-server's
``timings`` of each request (``prompt_n`` tokens prefilled in ``prompt_ms``; ``predicted_n``
tokens decoded at ``predicted_per_token_ms``; ``tools/server/server.cpp``,
https://github.com/ggml-org/llama.cpp/tree/master/tools/server):

* **Unloaded requests** (one at a time, prompts of several lengths): the prefill cost,
  sum(prompt_ms) / sum(prompt_n) (a least-squares line through the origin weighted by
  length), and the context cost ``d`` (us per context token), the slope of
  the lone sequence's step time against its mean context (prompt_n + predicted_n / 2),
  ordinary least squares, floored at 0.
* **Bursts** of k equal requests sent together, k = 1 .. ``parallel``, at least
  :data:`MIN_BURSTS` each, ``outputs`` tokens each (EOS ignored): k sequences decode side by
  side. llama-server does not prefill them in one step: the prompts that reach a slot after
  others have started decoding are prefilled in a later step, *batched with the earlier ones'
  decodes* (``update_slots`` puts the decoding slots' tokens and the new prompts' in one
  batch), and an earlier sequence's ``predicted_per_token_ms`` carries that prefill:
  measured, a burst of 4 gave 94.5, 40.0, 40.0, 40.0 ms/token, and (94.5 - 40.0) x 48 tokens
  = 2.6 s is the three later 171-token prompts at 5.1 ms/token. The *stall-free* sequences
  (the fastest of the burst, :data:`GROUP_TOLERANCE`) decoded with no prefill beside them, so
  the table's entry for k is the median over its bursts of the fastest sequence's time less
  ``d`` x the k sequences' context (the profile adds ``d x K`` back for the context a
  simulated step has, :mod:`kvgate_bench.sim.steptime`). Averaging all k (as the fit did
  before) counted the later prompts' prefill twice: once in the table, once as the
  simulator's ``b x P`` in the step that prefills them (k = 3: 49.4 ms instead of 36.1).
* **Loaded prefill** (:func:`stall_prefill`): the slower sequences' excess over the
  stall-free ones, x ``outputs``, is the prefill time of the prompts that joined after them
  while they decoded: the prefill cost under load, per token. ``prefill_ms_per_token`` pools
  it with the unloaded requests' (token-weighted: sum of ms over sum of tokens); on the
  issue-33 calibration 5.19 ms/token under load (2072 tokens) against 5.18 unloaded.

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
#: Output tokens of each burst request in the calibrations written before ``Burst.outputs``.
BURST_OUTPUTS = 48
#: Sequences of a burst whose step times are within this fraction of each other joined the
#: batch together (the same prefill stalls them).
GROUP_TOLERANCE = 0.05


@dataclass(frozen=True)
class Burst:
    """One burst of ``k`` equal requests: each one's mean context while decoding (tokens), its
    step time (ms per token) and the tokens each decoded (``outputs``)."""

    k: int
    contexts: tuple[float, ...]
    per_token_ms: tuple[float, ...]
    outputs: int = BURST_OUTPUTS


def burst_from_timings(timings: Sequence[Mapping[str, Any]]) -> Burst:
    """A :class:`Burst` from the ``timings`` of its requests (one each). Raises ``ValueError``
    for none."""
    if not timings:
        raise ValueError("a burst of no requests")
    ctx = tuple(float(t["prompt_n"]) + float(t["predicted_n"]) / 2 for t in timings)
    per = tuple(float(t["predicted_per_token_ms"]) for t in timings)
    return Burst(len(timings), ctx, per, min(int(t["predicted_n"]) for t in timings))


def burst_of(raw: Mapping[str, Any]) -> Burst:
    """A :class:`Burst` from a calibration's JSON (``k``, ``contexts``, ``per_token_ms`` and,
    when written, ``outputs``; else :data:`BURST_OUTPUTS`)."""
    return Burst(
        int(raw["k"]),
        tuple(float(x) for x in raw["contexts"]),
        tuple(float(x) for x in raw["per_token_ms"]),
        int(raw.get("outputs", BURST_OUTPUTS)),
    )


def groups(b: Burst) -> list[list[int]]:
    """The burst's sequences (indices) grouped by step time, fastest group first: sorted by
    time, a sequence more than :data:`GROUP_TOLERANCE` slower than the previous one starts a
    new group (it was stalled by one more prefill)."""
    order = sorted(range(len(b.per_token_ms)), key=lambda i: b.per_token_ms[i])
    out: list[list[int]] = []
    for i in order:
        prev = b.per_token_ms[out[-1][-1]] if out else None
        if prev is None or b.per_token_ms[i] > prev * (1 + GROUP_TOLERANCE):
            out.append([i])
        else:
            out[-1].append(i)
    return out


def stall_free_ms(b: Burst) -> float:
    """The burst's step time with no prefill beside it, ms: the fastest group's mean
    (module docstring)."""
    return statistics.fmean(b.per_token_ms[i] for i in groups(b)[0])


def stall_prefill(bursts: Sequence[Burst]) -> tuple[float, float]:
    """(ms, tokens) of prefill measured under load (module docstring): for each slower group
    of a burst, its mean excess over the stall-free time x ``outputs`` (ms) against the
    prompt tokens of the sequences that joined after it, the faster groups' (their context
    less ``outputs`` / 2 each)."""
    ms = tokens = 0.0
    for b in bursts:
        gs = groups(b)
        clean = stall_free_ms(b)
        for n, g in enumerate(gs[1:], start=1):
            later = [i for faster in gs[:n] for i in faster]
            ms += (statistics.fmean(b.per_token_ms[i] for i in g) - clean) * b.outputs
            tokens += sum(max(0.0, b.contexts[i] - b.outputs / 2) for i in later)
    return ms, tokens


def prefill_ms_per_token(
    unloaded: Sequence[Mapping[str, Any]], bursts: Sequence[Burst] = ()
) -> float:
    """The prefill cost, ms/token: sum(prompt_ms) / sum(prompt_n) over the unloaded requests'
    ``timings``, pooled with the bursts' loaded prefill (:func:`stall_prefill`); 0 for
    none."""
    ms, n = stall_prefill(bursts)
    n += sum(float(t["prompt_n"]) for t in unloaded)
    ms += sum(float(t["prompt_ms"]) for t in unloaded)
    return ms / n if n > 0 else 0.0


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
    the stall-free step time (:func:`stall_free_ms`) less ``d_us`` x the burst's total
    context. Raises ``ValueError`` for no burst."""
    if not bursts:
        raise ValueError("no bursts to fit a decode table to")
    by_k: dict[int, list[float]] = {}
    for b in bursts:
        step = stall_free_ms(b) - d_us / 1e3 * sum(b.contexts)
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
        prefill_ms_per_token=max(MIN_STEP_MS, prefill_ms_per_token(unloaded, bursts)),
        decode_step_ms=decode_table(bursts, d_us),
        context_us_per_token=d_us,
        slo=slo.pair() if slo is not None else None,
    )


def refit(calibration: Mapping[str, Any]) -> EngineProfile:
    """The profile of a calibration as today's fit makes it from the raw data the calibration
    kept (``unloaded`` requests' ``timings``, ``bursts``, ``slo``), with the stored profile's
    name and shape (``max_num_seqs``, ``kv_capacity_tokens``): a resume file written by an
    older fit gets today's table and prefill cost without running anything."""
    stored = calibration["profile"]
    slo = calibration.get("slo")
    return fit_profile(
        str(stored["name"]),
        parallel=int(stored["max_num_seqs"]),
        ctx=int(stored["kv_capacity_tokens"]),
        unloaded=[m["timings"] for m in calibration["unloaded"]],
        bursts=[burst_of(b) for b in calibration["bursts"]],
        slo=Slo(**slo) if slo else None,
    )
