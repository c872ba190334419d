"""Anthropic Messages, ``POST /v1/messages`` (vLLM, https://docs.anthropic.com/en/api/messages):
output limit ``max_tokens`` (required, as in Anthropic's API), one sequence; ``system``: a
string or text blocks. Usage: ``usage.input_tokens`` (plus the cache tokens),
``output_tokens``, the cached prompt tokens ``cache_read_input_tokens``; a stream's
``content_block_delta`` events carry output, the usage comes in ``message_start`` and
``message_delta``, then ``message_stop``
(https://docs.anthropic.com/en/docs/build-with-claude/streaming). Pure JSON logic: no HTTP
framework.
"""

from __future__ import annotations

import json
from typing import Any

from kvgate_agent.sidecar.reading.apis.native import (
    Fields,
    NativeApi,
    model_name,
    stream_flag,
    text_part,
)
from kvgate_agent.sidecar.reading.request import bad, check_messages, positive_int
from kvgate_agent.sidecar.reading.usage import Counts, EventReader, count, decode_body

__all__ = ["MESSAGES", "Messages", "MessagesReader"]


class Messages(NativeApi):
    """See the module's docstring."""

    def __init__(self) -> None:
        super().__init__("messages", "messages", "max_tokens")

    def fields(self, body: dict[str, Any]) -> Fields:
        """``messages`` as in chat, ``max_tokens`` required, ``system`` and ``tools`` counted."""
        model = model_name(body)
        check_messages(body.get("messages"))
        limit = positive_int(body, "max_tokens")
        if limit is None:
            raise bad("'max_tokens' is required", "max_tokens")
        messages: list[dict[str, Any]] = []
        system = body.get("system")
        if isinstance(system, str):
            messages.append({"role": "system", "content": system})
        elif isinstance(system, list):
            messages.append({"role": "system", "content": [_block(b) for b in system]})
        for m in body["messages"]:
            content = m.get("content")
            if isinstance(content, list):
                content = [_block(b) for b in content]
            messages.append({"role": m["role"], "content": content})
        count_body: dict[str, Any] = {"messages": messages}
        if body.get("tools"):
            count_body["tools"] = body["tools"]
        return Fields(model, stream_flag(body), limit, ("max_tokens",), "max_tokens", 1, count_body)

    def body_usage(self, data: bytes) -> Counts:
        """``usage.input_tokens`` (plus the cache tokens), ``usage.output_tokens``,
        ``usage.cache_read_input_tokens``."""
        obj = decode_body(data)
        if not isinstance(obj, dict):
            return None, None, None
        usage = obj.get("usage")
        if not isinstance(usage, dict):
            return None, None, None
        return (
            _input(usage),
            count(usage.get("output_tokens")),
            count(usage.get("cache_read_input_tokens")),
        )

    def event_reader(self) -> EventReader:
        """A :class:`MessagesReader`."""
        return MessagesReader()


#: ``POST /v1/messages``.
MESSAGES = Messages()


def _block(block: object) -> dict[str, Any]:
    """An Anthropic content block as a chat part: text, tool input and tool results are text;
    images and documents are non-text parts."""
    if not isinstance(block, dict):
        return {"type": "non_text"}
    kind = block.get("type")
    if kind in ("text", "thinking"):
        return text_part(block.get("text", block.get("thinking")))
    if kind == "tool_use":
        return text_part(json.dumps(block.get("input"), ensure_ascii=False))
    if kind == "tool_result":
        inner = block.get("content")
        if isinstance(inner, list):
            inner = "".join(
                b.get("text", "") for b in inner if isinstance(b, dict) and b.get("type") == "text"
            )
        return text_part(inner)
    return {"type": "non_text"}


def _input(usage: dict[str, Any]) -> int | None:
    """Anthropic's ``input_tokens`` excludes cached prompt tokens: add them back."""
    base = count(usage.get("input_tokens"))
    if base is None:
        return None
    extra = (
        count(usage.get("cache_creation_input_tokens")),
        count(usage.get("cache_read_input_tokens")),
    )
    return base + sum(e for e in extra if e is not None)


class MessagesReader(EventReader):
    """A Messages stream: ``content_block_delta`` events count output; the usage is in
    ``message_start`` (the prompt) and ``message_delta`` (cumulative output); ``message_stop``
    ends it."""

    __slots__ = ()

    def event(self, obj: dict[str, Any]) -> None:
        """Account one event's JSON object."""
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
            prompt = _input(usage)
            if prompt is not None:
                self.prompt_tokens = prompt
            cached = count(usage.get("cache_read_input_tokens"))
            if cached is not None:
                self.cached_tokens = cached
            out = count(usage.get("output_tokens"))
            if out is not None and kind == "message_delta":  # cumulative at message_delta
                self.reported = out
