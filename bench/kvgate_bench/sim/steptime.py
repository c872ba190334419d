"""Step-time model of the simulated engine: ``t = a + b*P + c*D + d*K`` seconds per step, or
``t = table(D) + b*P + d*K`` with a measured decode table.

One engine iteration (one :meth:`kvgate_bench.sim.engine.SimEngine.step`) takes

* ``a``: a fixed cost per step (weights streamed from HBM once, per-layer and
  per-step overheads), seconds;
* ``b`` per prefill token ``P`` scheduled in the step (compute-bound), seconds/token;
* ``c`` per decoding sequence ``D`` in the step (scheduling, sampling), seconds/sequence;
* ``d`` per context token ``K`` the decoding sequences attend to (their KV read
  from HBM: prompt + tokens generated before the step), seconds/token.

**Decode table.** An engine whose step time is not a line in ``D`` (llama-server on CPU: 22 ms
with one sequence, 63 with two, 78 with four) is described by ``decode_table``: points
``(batch size, seconds per step)``, sorted by batch size. A step with ``D >= 1`` then costs
``table(D) + b*P + d*K``, where ``table`` interpolates linearly between points, gives the
first point's value below the first point, and above the last point extends the line through
the last two points (never below the last point's value; with one point, that value). A step
with ``D = 0`` costs ``b*P`` (no fixed part). ``a`` and ``c`` must be 0 then. JSON engine
profiles (:mod:`kvgate_bench.sim.profile_file`) build such models.

Profiles (:data:`PROFILES`, chosen by ``kvgate-sim --profile``):

``constant`` (the default)
    Today's behaviour: ``a = --decode-ms``, ``b = --prefill-us-per-token``,
    ``c = d = 0``, whole-prompt prefill (no chunking), KV pool 65536 tokens
    unless ``--kv-capacity-tokens`` says otherwise.

``h100-llama3-8b``
    a 7.5 ms, b 33 us, c 4.4 us, d 0.076 us; KV pool 467,280 tokens (29,205
    blocks of 16); chunked prefill.

``a100-llama3-8b``
    a 12 ms, b 100 us, c 20 us, d 0.125 us; KV pool 467,280 tokens (29,205
    blocks of 16); chunked prefill.

Where the realistic constants come from (Llama-3.1-8B: 32 layers, hidden
4096, 8 KV heads of 128, FFN 14336, BF16; vLLM with TP 1). BLIS, the
inference-sim project's simulator of vLLM (https://github.com/inference-sim/inference-sim),
fits step times in two ways, both read in its repository:

* Its older "blackbox" fit ``beta0 + beta1*prefill_tokens + beta2*decode_tokens``
  (microseconds) in ``defaults.yaml`` for ``meta-llama/llama-3.1-8b-instruct``,
  TP 1, vLLM v0.8.4 (e.g. commit 3f8538b1be630cd6762559324fccaa1edbd3628c,
  https://github.com/inference-sim/inference-sim/blob/3f8538b1be630cd6762559324fccaa1edbd3628c/defaults.yaml):
  H100 beta = (5752.7, 17.25, 6.00), A100-80 beta = (16441.5, 47.84, 18.21),
  both with ``total_kv_blocks: 29205``, which is where the 467,280-token
  (29,205 x 16) KV pool comes from.
* Its current "trained-physics" model (``trained_physics_coefficients`` in
  https://github.com/inference-sim/inference-sim/blob/main/defaults.yaml, the
  formula in https://github.com/inference-sim/inference-sim/blob/main/sim/latency/trained_physics_model.go
  and https://github.com/inference-sim/inference-sim/blob/main/docs/guide/latency-models.md):
  roofline terms times learned corrections, with beta3 = 1.3625 (weight
  loading), beta5 = 32.10 us per layer, beta6 = 4.417 us per request in the
  batch, beta7 = 126.0 us per step, beta2b = 1.947 (decode KV reads), and the
  hardware in https://github.com/inference-sim/inference-sim/blob/main/hardware_config.json:
  H100 989.5 TFLOP/s BF16 dense, 3.35 TB/s HBM, prefill MFU 0.45; A100 312
  TFLOP/s, 2.039 TB/s.

From those:

* ``d`` (KV read per context token): 2 (K and V) x 32 layers x 1024 (8 x 128)
  x 2 bytes = 131,072 bytes; / 3.35e12 B/s = 39.1 ns, x beta2b 1.947 =
  **0.076 us** (H100); / 2.039e12 B/s = 64.3 ns, x 1.947 = **0.125 us** (A100).
* ``c`` (per decoding sequence): BLIS's beta6 = **4.4 us** (H100; BLIS charges it
  for every request in the batch, prefilling ones too). The A100's
  **20 us** is the issue's value; it is close to the A100 blackbox fit's
  beta2 (18.2 us per decode token).
* ``a`` (per step): streaming the weights once, 8.03e9 parameters x 2 bytes =
  16.06 GB / 3.35 TB/s = 4.79 ms, x beta3 1.3625 = 6.53 ms, plus 32 layers x
  32.10 us = 1.03 ms, plus beta7 0.13 ms = 7.69 ms on the H100 (BLIS itself
  counts only the 6.98e9 layer parameters, 6.83 ms); the profile uses the
  issue's **7.5 ms** (within 3 % of the first figure, 10 % of the second; its
  exact rounding is not reproduced here). The same sum on the A100 (2.039
  TB/s) gives 10.73 + 1.03 + 0.13 = 11.9 ms: **12 ms**.
* ``b`` (per prefill token), raised to the FLOP floor: BLIS's fitted prefill
  terms are at or under that floor (blackbox 17.25 us/token on the H100, i.e.
  88 % MFU; trained-physics beta1a = 0.152 x the roofline, about 2.1
  us/token), while a long, compute-bound prefill runs at a realistic MFU. A
  forward pass costs about 2 FLOPs per parameter per token: 2 x (6.98e9 layer
  + 0.53e9 lm_head parameters) = 15.0 GFLOP (attention adds 4 x 32 x 4096 =
  0.52 MFLOP per token of context, 3.5 % at 1,000 tokens). The H100 SXM
  datasheet (https://www.nvidia.com/en-us/data-center/h100/) lists 1,979
  TFLOP/s BF16 *with sparsity*, i.e. 989.5 TFLOP/s dense: 15.0e9 / 989.5e12
  = 15.2 us at 100 % MFU; at BLIS's prefill MFU 0.45, 15.0e9 / (0.45 x
  989.5e12) = 33.7 us: **33 us**. The A100's **100 us** is the issue's value: 15.0e9 / 312e12 =
  48.1 us at 100 % MFU, so 100 us is 48 % MFU (BLIS calibrates the A100's
  prefill MFU at 0.38, which would give 127 us).

Everything here is pure arithmetic: no clock, no I/O.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass

#: KV pool of the realistic profiles: BLIS's ``total_kv_blocks`` (29,205) x 16 tokens.
LLAMA3_8B_KV_TOKENS = 29205 * 16
#: KV pool of the ``constant`` profile (``kvgate-sim --kv-capacity-tokens`` default).
CONSTANT_KV_TOKENS = 65536


@dataclass(frozen=True)
class StepTimeModel:
    """``t = a + b*P + c*D + d*K`` (or ``table(D) + b*P + d*K``) seconds for one engine step, plus
    the profile's engine shape.

    Attributes:
        name: profile name (``--profile``).
        a_s: fixed cost per step, seconds.
        b_s: cost per prefill token scheduled in the step, seconds/token.
        c_s: cost per decoding sequence in the step, seconds/sequence.
        d_s: cost per context token of the decoding sequences, seconds/token.
        kv_capacity_tokens: the profile's KV pool, tokens (``--kv-capacity-tokens``
            overrides it).
        chunked_prefill: whether the engine chunks prefills under the token
            budget (vLLM V1's default) or prefills whole prompts (``constant``).
        decode_table: ``((batch size, seconds per step), ...)`` sorted by batch size, or
            ``()`` (the linear model). When set it replaces ``a + c*D`` (see the module
            docstring).

    Raises ``ValueError`` on construction for a negative coefficient, a pool
    under one token, or a decode table that is unsorted, has a batch size under 1 or
    twice, a time that is negative or not finite, or comes with ``a`` or ``c`` above 0.
    """

    name: str
    a_s: float
    b_s: float = 0.0
    c_s: float = 0.0
    d_s: float = 0.0
    kv_capacity_tokens: int = CONSTANT_KV_TOKENS
    chunked_prefill: bool = False
    decode_table: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if min(self.a_s, self.b_s, self.c_s, self.d_s) < 0:
            raise ValueError(f"step-time coefficients must be >= 0 (profile {self.name!r})")
        if self.kv_capacity_tokens < 1:
            raise ValueError("kv_capacity_tokens must be >= 1")
        if self.decode_table:
            _check_table(self.name, self.decode_table)
            if self.a_s or self.c_s:
                raise ValueError(
                    f"a decode table replaces a and c: they must be 0 (profile {self.name!r})"
                )

    def seconds(self, prefill_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        """Duration of one step, seconds: ``a + b*P + c*D + d*K``.

        Args:
            prefill_tokens: ``P``, prefill tokens computed in the step (prompt
                chunks, and prompt + generated tokens of resumed requests).
            decode_seqs: ``D``, sequences that decode one token in the step.
            context_tokens: ``K``, the decoding sequences' total context, tokens
                (prompt + tokens generated before this step, each).
        """
        if self.decode_table:
            fixed = self.decode_seconds(decode_seqs) if decode_seqs > 0 else 0.0
            return fixed + self.b_s * prefill_tokens + self.d_s * context_tokens
        return (
            self.a_s
            + self.b_s * prefill_tokens
            + self.c_s * decode_seqs
            + self.d_s * context_tokens
        )

    def decode_seconds(self, decode_seqs: int) -> float:
        """``table(D)``: the decode table's seconds per step at ``decode_seqs`` sequences
        (interpolated, extended; the module docstring). Raises ``ValueError`` without a table."""
        table = self.decode_table
        if not table:
            raise ValueError(f"profile {self.name!r} has no decode table")
        i = bisect_right(table, (decode_seqs, math.inf))  # first point above decode_seqs
        if i == 0:
            return table[0][1]
        if i < len(table):
            (n0, t0), (n1, t1) = table[i - 1], table[i]
            return t0 + (t1 - t0) * (decode_seqs - n0) / (n1 - n0)
        n_last, t_last = table[-1]
        if len(table) == 1 or decode_seqs == n_last:
            return t_last
        n_prev, t_prev = table[-2]
        slope = max(0.0, (t_last - t_prev) / (n_last - n_prev))
        return t_last + slope * (decode_seqs - n_last)


def _check_table(name: str, table: tuple[tuple[int, float], ...]) -> None:
    """Raise ``ValueError`` unless ``table`` is sorted by distinct batch sizes >= 1 with finite
    times >= 0 (seconds)."""
    prev = 0
    for n, t in table:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"decode table batch sizes must be integers >= 1 (profile {name!r})")
        if n <= prev:
            raise ValueError(
                f"decode table must be sorted by distinct batch sizes (profile {name!r})"
            )
        if not math.isfinite(t) or t < 0:
            raise ValueError(f"decode table times must be finite and >= 0 (profile {name!r})")
        prev = n


def constant_profile(
    decode_ms: float = 10.0,
    prefill_us_per_token: float = 20.0,
    kv_capacity_tokens: int = CONSTANT_KV_TOKENS,
) -> StepTimeModel:
    """The ``constant`` profile: ``decode_ms`` per step + ``prefill_us_per_token`` per token.

    Whole-prompt prefill, no per-sequence or per-context cost: kvgate-sim's
    behaviour before profiles existed. ``decode_ms`` in milliseconds,
    ``prefill_us_per_token`` in microseconds.
    """
    return StepTimeModel(
        "constant",
        a_s=decode_ms / 1e3,
        b_s=prefill_us_per_token / 1e6,
        kv_capacity_tokens=kv_capacity_tokens,
    )


#: The realistic profiles by ``--profile`` name (see the module docstring for the derivation).
PROFILES: dict[str, StepTimeModel] = {
    "h100-llama3-8b": StepTimeModel(
        "h100-llama3-8b", a_s=7.5e-3, b_s=33e-6, c_s=4.4e-6, d_s=0.076e-6,
        kv_capacity_tokens=LLAMA3_8B_KV_TOKENS, chunked_prefill=True,
    ),
    "a100-llama3-8b": StepTimeModel(
        "a100-llama3-8b", a_s=12e-3, b_s=100e-6, c_s=20e-6, d_s=0.125e-6,
        kv_capacity_tokens=LLAMA3_8B_KV_TOKENS, chunked_prefill=True,
    ),
}  # fmt: skip

#: Every ``--profile`` choice, the default first.
PROFILE_NAMES: tuple[str, ...] = ("constant", *PROFILES)


def profile(
    name: str, decode_ms: float = 10.0, prefill_us_per_token: float = 20.0
) -> StepTimeModel:
    """The step-time model named ``name``.

    ``decode_ms`` and ``prefill_us_per_token`` apply to ``constant`` only.
    Raises ``ValueError`` for an unknown name.
    """
    if name == "constant":
        return constant_profile(decode_ms, prefill_us_per_token)
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(
            f"unknown profile {name!r}; choose one of {', '.join(PROFILE_NAMES)}"
        ) from None
