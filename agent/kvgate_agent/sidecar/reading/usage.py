"""The machinery each generation API's usage reading shares: decoding a whole response body
(:func:`decode_body`) or one stream event (:func:`decode_json`), reading counts
(:func:`count`, :func:`pair`, :func:`dig`, :func:`batch_usage`) and the state of a stream's
reader (:class:`EventReader`), so every admitted request settles on what the engine really did:
its prompt and output tokens and, where the engine says, the prompt tokens it found in its
prefix cache (the third figure of :data:`Counts`). What each API reports, and which of its events
carry output, is in its module of :mod:`kvgate_agent.sidecar.reading.apis`
(:meth:`~kvgate_agent.sidecar.reading.apis.base.Api.body_usage`,
:meth:`~kvgate_agent.sidecar.reading.apis.base.Api.event_reader`).

Without a report a request is charged what it reserved (body) or the events counted (stream).
Nothing here raises on upstream content. Pure JSON logic: no HTTP framework.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import msgspec

__all__ = [
    "Counts",
    "EventReader",
    "Pair",
    "batch_usage",
    "count",
    "decode_body",
    "decode_json",
    "dig",
    "openai_cached",
    "pair",
    "sum_known",
]

_json_decode = json.JSONDecoder().decode
_fast_decode = msgspec.json.Decoder().decode

#: (prompt tokens, completion tokens), each None when not reported.
Pair = tuple[int | None, int | None]
#: (prompt tokens, completion tokens, cached prompt tokens), each None when not reported; the
#: cached ones are the prompt tokens the engine found in its prefix cache (not computed anew).
Counts = tuple[int | None, int | None, int | None]


def decode_json(data: bytes) -> Any:
    """One stream event's data as JSON: msgspec first; what it refuses (``NaN``, a lone
    surrogate escape, ``1e400``, deep nesting) by Python's :mod:`json` on the UTF-8 text, the
    reference, so both accept the same events and read them alike.

    Raises:
        ValueError: not JSON, or not UTF-8. RecursionError: nested too deep for either.
    """
    try:
        return _fast_decode(data)
    except (ValueError, RecursionError):  # msgspec.DecodeError, UnicodeDecodeError
        return _json_decode(data.decode())


def decode_body(data: bytes) -> Any:
    """A whole response body as JSON (msgspec first, then Python's :mod:`json`, which also
    reads UTF-16 and UTF-32 bodies); None when neither can."""
    try:
        return _fast_decode(data)
    except (ValueError, RecursionError):
        try:  # the reference: Python's json
            return json.loads(data)
        except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
            return None


def count(v: object) -> int | None:
    """``v`` when a non-negative JSON integer, else None."""
    return v if type(v) is int and v >= 0 else None


def sum_known(values: list[int | None]) -> int | None:
    """The sum of the counts that are known; None when none is."""
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def pair(obj: Any, prompt_key: str, completion_key: str) -> Pair:
    """(``obj[prompt_key]``, ``obj[completion_key]``) as counts; (None, None) for a non-object."""
    if not isinstance(obj, dict):
        return None, None
    return count(obj.get(prompt_key)), count(obj.get(completion_key))


def dig(obj: Any, *keys: str) -> int | None:
    """``obj[keys[0]][keys[1]]...`` as a count: None when a step is not an object, a key is
    missing, or the value is not a non-negative integer."""
    for k in keys:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(k)
    return count(obj)


def openai_cached(obj: dict[str, Any]) -> int | None:
    """The prompt tokens an OpenAI response (or stream chunk) ``obj`` reports found in the
    engine's prefix cache: ``usage.prompt_tokens_details.cached_tokens`` (OpenAI's field, vLLM's
    with ``--enable-prompt-tokens-details``:
    https://docs.vllm.ai/en/latest/serving/openai_compatible_server.html), else llama.cpp's
    ``timings.cache_n`` (https://github.com/ggml-org/llama.cpp/blob/master/tools/server/README.md);
    None when neither is a count."""
    cached = dig(obj, "usage", "prompt_tokens_details", "cached_tokens")
    return cached if cached is not None else dig(obj, "timings", "cache_n")


def batch_usage(obj: Any, one: Callable[[Any], Counts]) -> Counts:
    """The usage of a decoded body of an API that answers a batch with a list of results:
    ``one`` of each summed; ``one(obj)`` for a single result."""
    if isinstance(obj, list):
        all_counts = [one(o) for o in obj]
        return (
            sum_known([p for p, _, _ in all_counts]),
            sum_known([c for _, c, _ in all_counts]),
            sum_known([k for _, _, k in all_counts]),
        )
    return one(obj)


class EventReader:
    """Accounts the decoded JSON events of one stream of an API other than OpenAI chat and
    completions; each API's reader (a subclass) says in :meth:`event` what its events carry.

    Attributes:
        prompt_tokens: prompt tokens reported, or None.
        cached_tokens: prompt tokens the engine reported found in its prefix cache, or None.
        reported: completion tokens reported so far (all sequences), or None.
        deltas: events that carried output (about one per token).
        done: the stream's final event was seen.
    """

    __slots__ = ("cached_tokens", "deltas", "done", "prompt_tokens", "reported")

    def __init__(self) -> None:
        self.prompt_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.reported: int | None = None
        self.deltas = 0
        self.done = False

    @property
    def completion_tokens(self) -> int:
        """Output tokens: the report when there is one, else the output events counted."""
        return self.reported if self.reported is not None else self.deltas

    def event(self, obj: dict[str, Any]) -> None:
        """Account one event's JSON object."""
        raise NotImplementedError
