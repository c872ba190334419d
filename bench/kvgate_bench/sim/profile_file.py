"""Engine profiles as data: a JSON file that describes an engine to the simulator.

A profile says how a model server is shaped and how long its steps take, as measured on it
(``python -m kvgate_bench.effectiveness --profile FILE``, ``kvgate-sim --profile FILE``)::

    {"name": "cpu-4slot", "max_num_seqs": 4, "kv_capacity_tokens": 16384, "block_size": 16,
     "max_model_len": 4096, "prefill_chunk_tokens": 512, "prefill_ms_per_token": 4.0,
     "decode_step_ms": {"1": 22, "2": 63, "4": 78}, "context_us_per_token": 0.0,
     "slo": {"ttft_s": 2.0, "tpot_s": 0.07}}

Fields:

* ``name``: the profile's name (the benchmarks' ``profile`` field), a non-empty string.
* ``max_num_seqs``: sequences the engine runs at once (llama-server's ``--parallel``), >= 1.
* ``kv_capacity_tokens``: the KV pool, tokens (>= ``block_size``); ``block_size``: tokens per
  KV block, >= 1; the pool is ``kv_capacity_tokens // block_size`` blocks.
* ``max_model_len``: the longest prompt + output, tokens, >= 2.
* ``prefill_chunk_tokens``: the token budget of one step (chunked prefill; vLLM's
  ``max_num_batched_tokens``, llama-server's ``--batch-size``), >= 1.
* ``prefill_ms_per_token``: cost of one prefill token, ms (finite, > 0).
* ``decode_step_ms``: one step's time by the number of sequences decoding in it, ms: a
  non-empty table from batch size (an integer >= 1; in JSON a string of one written
  canonically, ``"4"``, not ``"4.0"``, ``" 4"`` or ``"04"``; each batch size once) to finite
  times > 0, interpolated between points and extended from the last two
  (:mod:`kvgate_bench.sim.steptime`).
* ``context_us_per_token``: cost per context token the decoding sequences attend to, us
  (finite, >= 0; default 0).

Numbers are validated strictly: a string (``"4"``), ``true``/``false``, or a fraction where an
integer is expected is refused, not converted. A key given twice in the file is refused.
* ``slo``: optional ``{"ttft_s": ..., "tpot_s": ...}``, seconds (finite, > 0): the interactive
  SLO the benchmarks score against; absent or ``null``, the benchmark derives one.

Unknown keys are refused. :func:`load_profile` raises ``ValueError`` naming the file and the
field; constructing :class:`EngineProfile` in Python raises pydantic's ``ValidationError`` (a
``ValueError``).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from kvgate_bench.sim.sequences import EngineConfig
from kvgate_bench.sim.steptime import StepTimeModel


def _not_bool(v: Any) -> Any:
    if isinstance(v, bool):
        raise ValueError("must be a number, not true/false")
    return v


#: A batch size as a JSON key: an integer >= 1 written canonically.
_BATCH_KEY = re.compile(r"[1-9][0-9]*")


def _batch_sizes(v: Any) -> Any:
    """The decode table with its batch sizes as ints: a key must be an int >= 1 or its
    canonical string (``"4"``); each batch size once."""
    if not isinstance(v, dict):
        return v
    out: dict[int, Any] = {}
    for k, ms in v.items():
        ok_int = isinstance(k, int) and not isinstance(k, bool) and k >= 1
        if not (ok_int or (isinstance(k, str) and _BATCH_KEY.fullmatch(k))):
            raise ValueError(f'batch size {k!r} is not an integer >= 1 written as one ("4")')
        n = int(k)
        if n in out:
            raise ValueError(f"batch size {n} given twice")
        out[n] = ms
    return out


PositiveInt = Annotated[int, BeforeValidator(_not_bool), Field(ge=1, strict=True)]
#: A time that may be 0 (a cost the engine may not have).
Millis = Annotated[
    float, BeforeValidator(_not_bool), Field(ge=0.0, allow_inf_nan=False, strict=True)
]
#: A step time: > 0 (a step that takes no time is a fitting error, not an engine).
StepMillis = Annotated[
    float, BeforeValidator(_not_bool), Field(gt=0.0, allow_inf_nan=False, strict=True)
]


class EngineProfile(BaseModel):
    """One engine profile (the module docstring's fields); frozen.

    ``decode_step_ms`` is kept sorted by batch size; ``slo`` is ``(ttft_s, tpot_s)`` seconds or
    ``None`` (given as ``{"ttft_s": ..., "tpot_s": ...}``, or as a pair).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Annotated[str, Field(min_length=1, strict=True)]
    max_num_seqs: PositiveInt
    kv_capacity_tokens: PositiveInt
    block_size: PositiveInt
    max_model_len: Annotated[int, BeforeValidator(_not_bool), Field(ge=2, strict=True)]
    prefill_chunk_tokens: PositiveInt
    prefill_ms_per_token: StepMillis
    decode_step_ms: Annotated[dict[PositiveInt, StepMillis], BeforeValidator(_batch_sizes)]
    context_us_per_token: Millis = 0.0
    slo: tuple[float, float] | None = None

    @field_validator("decode_step_ms")
    @classmethod
    def _table(cls, v: dict[int, float]) -> dict[int, float]:
        if not v:
            raise ValueError("needs at least one batch size")
        return dict(sorted(v.items()))

    @field_validator("slo", mode="before")
    @classmethod
    def _slo(cls, v: Any) -> Any:
        if v is None:
            return None
        if isinstance(v, dict):
            keys = set(v)
            if keys != {"ttft_s", "tpot_s"}:
                extra, missing = keys - {"ttft_s", "tpot_s"}, {"ttft_s", "tpot_s"} - keys
                why = [f"unknown {sorted(extra)}" if extra else "", f"missing {sorted(missing)}"
                       if missing else ""]  # fmt: skip
                raise ValueError(
                    f"needs exactly ttft_s and tpot_s ({', '.join(filter(None, why))})"
                )
            pair = (v["ttft_s"], v["tpot_s"])
        elif isinstance(v, list | tuple) and len(v) == 2:
            pair = (v[0], v[1])
        else:
            raise ValueError('must be {"ttft_s": seconds, "tpot_s": seconds} or null')
        for key, x in zip(("ttft_s", "tpot_s"), pair, strict=True):
            if (
                isinstance(x, bool)
                or not isinstance(x, int | float)
                or not math.isfinite(x)
                or x <= 0
            ):
                raise ValueError(f"{key} must be a finite number of seconds > 0, got {x!r}")
        return (float(pair[0]), float(pair[1]))

    @model_validator(mode="after")
    def _pool(self) -> EngineProfile:
        if self.kv_capacity_tokens < self.block_size:
            raise ValueError(
                f"kv_capacity_tokens ({self.kv_capacity_tokens}) must hold one block "
                f"(block_size {self.block_size})"
            )
        return self

    def __hash__(self) -> int:
        return hash(json.dumps(self.to_json(), sort_keys=True))

    def steptime(self) -> StepTimeModel:
        """The step-time model: ``table(D) + b*P + d*K`` with the decode table in seconds,
        ``b = prefill_ms_per_token / 1e3`` s/token, ``d = context_us_per_token / 1e6`` s/token,
        chunked prefill, the profile's KV pool."""
        return StepTimeModel(
            self.name,
            a_s=0.0,
            b_s=self.prefill_ms_per_token / 1e3,
            d_s=self.context_us_per_token / 1e6,
            kv_capacity_tokens=self.kv_capacity_tokens,
            chunked_prefill=True,
            decode_table=tuple((n, ms / 1e3) for n, ms in self.decode_step_ms.items()),
        )

    def engine_config(self) -> EngineConfig:
        """The engine's shape: ``kv_capacity_tokens // block_size`` blocks of ``block_size``,
        ``max_model_len``, ``max_num_seqs``, chunked prefill under a budget of
        ``prefill_chunk_tokens`` tokens per step (vLLM's watermark and prefix caching)."""
        return EngineConfig(
            num_gpu_blocks=self.kv_capacity_tokens // self.block_size,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.prefill_chunk_tokens,
            chunked_prefill=True,
        )

    def to_json(self) -> dict[str, Any]:
        """The profile as the file holds it (batch sizes as strings; ``slo`` left out when
        ``None``); ``EngineProfile(**p.to_json()) == p``."""
        out: dict[str, Any] = {
            "name": self.name,
            "max_num_seqs": self.max_num_seqs,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "prefill_chunk_tokens": self.prefill_chunk_tokens,
            "prefill_ms_per_token": self.prefill_ms_per_token,
            "decode_step_ms": {str(n): ms for n, ms in self.decode_step_ms.items()},
            "context_us_per_token": self.context_us_per_token,
        }
        if self.slo is not None:
            out["slo"] = {"ttft_s": self.slo[0], "tpot_s": self.slo[1]}
        return out


def _problems(err: ValidationError) -> str:
    """``field: message`` for each of ``err``'s errors, joined by ``; ``."""
    parts = []
    for e in err.errors(include_url=False):
        loc = ".".join(str(x) for x in e["loc"]) or "profile"
        msg = str(e["msg"]).removeprefix("Value error, ")
        if str(e["type"]).endswith("_type"):  # strict: say what was given instead
            msg += f", got {e['input']!r}"
        parts.append(f"{loc}: {msg}")
    return "; ".join(parts)


class _Pairs(dict[str, Any]):
    """A JSON object that remembers the keys it was given more than once (``json.loads``
    keeps the last silently)."""

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(pairs)
        seen: set[str] = set()
        self.twice: list[str] = []
        for k, _ in pairs:
            if k in seen:
                self.twice.append(k)
            seen.add(k)


def _twice(raw: Any) -> str | None:
    """``field: ... given twice`` for the first key the file gives twice, else None."""
    if isinstance(raw, _Pairs) and raw.twice:
        return f"{raw.twice[0]}: given twice"
    for k, v in raw.items():
        if isinstance(v, _Pairs) and v.twice:
            what = "batch size" if k == "decode_step_ms" else "key"
            return f"{k}: {what} {v.twice[0]!r} given twice"
    return None


def load_profile(path: str | Path) -> EngineProfile:
    """The profile in the JSON file at ``path``.

    Raises ``ValueError`` (one line, naming ``path`` and the offending fields) when the file
    cannot be read, is not a JSON object, or fails validation.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"engine profile {path}: cannot read it: {e}") from None
    try:
        raw = json.loads(text, object_pairs_hook=_Pairs)
    except json.JSONDecodeError as e:
        raise ValueError(f"engine profile {path}: not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"engine profile {path}: must be a JSON object")
    twice = _twice(raw)
    if twice:
        raise ValueError(f"engine profile {path}: {twice}")
    try:
        return EngineProfile.model_validate(raw)
    except ValidationError as e:
        raise ValueError(f"engine profile {path}: {_problems(e)}") from None


def write_profile(profile: EngineProfile, path: str | Path) -> None:
    """Write ``profile`` to ``path`` as indented JSON (:meth:`EngineProfile.to_json`); raises
    ``OSError`` when it cannot be written."""
    Path(path).write_text(json.dumps(profile.to_json(), indent=2) + "\n", encoding="utf-8")
