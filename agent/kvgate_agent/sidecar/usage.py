"""The token usage each generation API reports, read from a whole response body
(:func:`body_usage`) or from its stream's events (:func:`event_reader`), so every admitted
request settles on what the engine really did.

What each kind reports (whole body; stream events):

* chat, completions: ``usage.prompt_tokens``/``completion_tokens``; streams are read by
  :class:`~kvgate_agent.sidecar.sse.StreamAccountant` itself (deltas, usage chunk, ``[DONE]``).
* responses: ``usage.input_tokens``/``output_tokens``; ``*.delta`` events, then
  ``response.completed`` (or ``.incomplete``, ``.failed``) with the usage.
* messages: ``usage.input_tokens`` (plus cache tokens), ``output_tokens``;
  ``content_block_delta`` events, usage in ``message_start`` and ``message_delta``, then
  ``message_stop``.
* tgi: ``details.generated_tokens`` (plus ``best_of_sequences``), a list summed; one ``token``
  per event, the last with ``generated_text`` and ``details``.
* sglang: ``meta_info.prompt_tokens``/``completion_tokens``, a list summed; ``meta_info`` per
  event, cumulative per ``index``, then ``[DONE]``.
* llamacpp: ``tokens_evaluated``/``tokens_predicted``, a list summed; ``content`` per event,
  ``stop: true`` with the counts, per ``index``.

Sources: as in :mod:`kvgate_agent.sidecar.endpoints`; Anthropic's stream events
(https://docs.anthropic.com/en/docs/build-with-claude/streaming), OpenAI's Responses stream
(https://platform.openai.com/docs/api-reference/responses-streaming). Without a report a request
is charged what it reserved (body) or the events counted (stream). Nothing here raises on
upstream content. Pure JSON logic: no HTTP framework.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from kvgate_agent.sidecar.request import PathKind

__all__ = ["EventReader", "body_usage", "decode_json", "event_reader"]

_json_decode = json.JSONDecoder().decode
_fast_decode = msgspec.json.Decoder().decode


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


def _count(v: object) -> int | None:
    return v if type(v) is int and v >= 0 else None


def _sum(values: list[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _pair(obj: Any, prompt_key: str, completion_key: str) -> tuple[int | None, int | None]:
    if not isinstance(obj, dict):
        return None, None
    return _count(obj.get(prompt_key)), _count(obj.get(completion_key))


def _anthropic_input(usage: dict[str, Any]) -> int | None:
    """Anthropic's ``input_tokens`` excludes cached prompt tokens: add them back."""
    base = _count(usage.get("input_tokens"))
    if base is None:
        return None
    extra = (
        _count(usage.get("cache_creation_input_tokens")),
        _count(usage.get("cache_read_input_tokens")),
    )
    return base + sum(e for e in extra if e is not None)


def _one(kind: PathKind, obj: Any) -> tuple[int | None, int | None]:
    """(prompt, completion) tokens reported by one response object of ``kind``."""
    if not isinstance(obj, dict):
        return None, None
    if kind in ("chat", "completions"):
        return _pair(obj.get("usage"), "prompt_tokens", "completion_tokens")
    if kind == "responses":
        return _pair(obj.get("usage"), "input_tokens", "output_tokens")
    if kind == "messages":
        usage = obj.get("usage")
        if not isinstance(usage, dict):
            return None, None
        return _anthropic_input(usage), _count(usage.get("output_tokens"))
    if kind == "tgi":
        details = obj.get("details")
        if not isinstance(details, dict):
            return None, None
        out = [_count(details.get("generated_tokens"))]
        best = details.get("best_of_sequences")
        if isinstance(best, list):
            out += [_count(b.get("generated_tokens")) for b in best if isinstance(b, dict)]
        return None, _sum(out)
    if kind == "sglang":
        return _pair(obj.get("meta_info"), "prompt_tokens", "completion_tokens")
    return _pair(obj, "tokens_evaluated", "tokens_predicted")  # llama.cpp


def body_usage(kind: PathKind, data: bytes) -> tuple[int | None, int | None]:
    """(prompt_tokens, completion_tokens) a whole response body of ``kind`` reports, each None
    when absent or not a non-negative integer; a list of results (a batch) is summed."""
    try:
        obj = _fast_decode(data)
    except (ValueError, RecursionError):
        try:  # the reference: Python's json, which also reads UTF-16 and UTF-32 bodies
            obj = json.loads(data)
        except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
            return None, None
    if isinstance(obj, list) and kind in ("tgi", "sglang", "llamacpp"):
        pairs = [_one(kind, o) for o in obj]
        return _sum([p for p, _ in pairs]), _sum([c for _, c in pairs])
    return _one(kind, obj)


class EventReader:
    """Accounts the decoded JSON events of one stream of a non-OpenAI API (see the table above).

    Attributes:
        prompt_tokens: prompt tokens reported, or None.
        reported: completion tokens reported so far (all sequences), or None.
        deltas: events that carried output (about one per token).
        done: the stream's final event was seen.
    """

    __slots__ = ("_by_index", "deltas", "done", "kind", "prompt_tokens", "reported")

    def __init__(self, kind: PathKind) -> None:
        self.kind = kind
        self.prompt_tokens: int | None = None
        self.reported: int | None = None
        self.deltas = 0
        self.done = False
        self._by_index: dict[object, int] = {}  # cumulative completion tokens per sequence

    @property
    def completion_tokens(self) -> int:
        """Output tokens: the report when there is one, else the output events counted."""
        return self.reported if self.reported is not None else self.deltas

    def event(self, obj: dict[str, Any]) -> None:
        """Account one event's JSON object."""
        kind = self.kind
        if kind == "responses":
            self._responses(obj)
        elif kind == "messages":
            self._messages(obj)
        elif kind == "tgi":
            if "token" in obj:
                self.deltas += 1
            if obj.get("generated_text") is not None:
                self.done = True
                _, out = _one("tgi", obj)
                if out is not None:
                    self.reported = out
        else:  # sglang, llamacpp: cumulative counts per sequence index
            prompt, out = _one(kind, obj)
            if kind == "llamacpp":
                if obj.get("content"):
                    self.deltas += 1
                if obj.get("stop") is True:
                    self.done = True
            elif obj.get("text") or obj.get("output_ids"):
                self.deltas += 1
            if prompt is not None:
                self.prompt_tokens = prompt
            if out is not None:
                self._by_index[obj.get("index", 0)] = out
                self.reported = sum(self._by_index.values())

    def _responses(self, obj: dict[str, Any]) -> None:
        kind = obj.get("type")
        if not isinstance(kind, str):
            return
        if kind.endswith(".delta"):
            self.deltas += 1
        elif kind in ("response.completed", "response.incomplete", "response.failed"):
            self.done = True
            prompt, out = _one("responses", obj.get("response"))
            if prompt is not None:
                self.prompt_tokens = prompt
            if out is not None:
                self.reported = out

    def _messages(self, obj: dict[str, Any]) -> None:
        kind = obj.get("type")
        usage: object = None
        if kind == "content_block_delta":
            self.deltas += 1
        elif kind == "message_start":
            message = obj.get("message")
            usage = message.get("usage") if isinstance(message, dict) else None
        elif kind == "message_delta":
            usage = obj.get("usage")
        elif kind == "message_stop":
            self.done = True
        if isinstance(usage, dict):
            prompt = _anthropic_input(usage)
            if prompt is not None:
                self.prompt_tokens = prompt
            out = _count(usage.get("output_tokens"))
            if out is not None and kind == "message_delta":  # cumulative at message_delta
                self.reported = out


def event_reader(kind: PathKind) -> EventReader | None:
    """The reader for a stream of ``kind``; None for OpenAI chat and completions, which
    :class:`~kvgate_agent.sidecar.sse.StreamAccountant` reads itself."""
    return None if kind in ("chat", "completions") else EventReader(kind)
