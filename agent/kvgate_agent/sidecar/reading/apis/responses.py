"""OpenAI Responses, ``POST /v1/responses`` (vLLM,
https://docs.vllm.ai/en/latest/serving/openai_compatible_server.html): output limit
``max_output_tokens``, one sequence. Usage: ``usage.input_tokens``/``output_tokens``, the cached
prompt tokens ``usage.input_tokens_details.cached_tokens``; a stream's
``*.delta`` events carry output, then ``response.completed`` (or ``.incomplete``, ``.failed``)
carries the usage (https://platform.openai.com/docs/api-reference/responses-streaming).

Prompt parts held by the engine rather than sent (a ``previous_response_id`` or stored
``prompt`` template) cannot be counted here: they are charged when the engine reports its
usage. Pure JSON logic: no HTTP framework.
"""

from __future__ import annotations

from typing import Any

from kvgate_agent.sidecar.reading.apis.native import (
    Fields,
    NativeApi,
    model_name,
    stream_flag,
    text_part,
)
from kvgate_agent.sidecar.reading.request import bad, positive_int
from kvgate_agent.sidecar.reading.usage import Counts, EventReader, decode_body, dig, pair

__all__ = ["RESPONSES", "Responses", "ResponsesReader"]


class Responses(NativeApi):
    """See the module's docstring."""

    def __init__(self) -> None:
        super().__init__("responses", "input", "max_output_tokens")

    def fields(self, body: dict[str, Any]) -> Fields:
        """``input``: a string or a non-empty list of items (messages with string or part-list
        ``content``, function calls and their outputs); ``instructions``: the system prompt.
        ``background: true`` is refused: the answer returns before the generation ends, so the
        reservation could not be held for it."""
        model = model_name(body)
        if body.get("background") is True:
            raise bad("kvgate does not admit background responses", "background")
        inp = body.get("input")
        messages: list[dict[str, Any]] = []
        instructions = body.get("instructions")
        if isinstance(instructions, str):
            messages.append({"role": "system", "content": instructions})
        if isinstance(inp, str):
            messages.append({"role": "user", "content": inp})
        elif isinstance(inp, list) and inp:
            for i, item in enumerate(inp):
                if not isinstance(item, dict):
                    raise bad(f"'input[{i}]' must be an object", f"input[{i}]")
                messages.append(_response_item(item))
        else:
            raise bad("'input' must be a string or a non-empty list of items", "input")
        limit = positive_int(body, "max_output_tokens")
        count: dict[str, Any] = {"messages": messages}
        if body.get("tools"):
            count["tools"] = body["tools"]
        return Fields(
            model, stream_flag(body), limit, ("max_output_tokens",), "max_output_tokens", 1,
            count,
        )  # fmt: skip

    def body_usage(self, data: bytes) -> Counts:
        """``usage.input_tokens``, ``usage.output_tokens``,
        ``usage.input_tokens_details.cached_tokens``."""
        return _usage(decode_body(data))

    def event_reader(self) -> EventReader:
        """A :class:`ResponsesReader`."""
        return ResponsesReader()


#: ``POST /v1/responses``.
RESPONSES = Responses()


def _usage(obj: Any) -> Counts:
    if not isinstance(obj, dict):
        return None, None, None
    prompt, completion = pair(obj.get("usage"), "input_tokens", "output_tokens")
    return prompt, completion, dig(obj, "usage", "input_tokens_details", "cached_tokens")


def _response_item(item: dict[str, Any]) -> dict[str, Any]:
    """One Responses input item as a chat message for counting (input_text, output_text and
    text parts are text; other parts, e.g. images and files, cost a non-text part)."""
    content = item.get("content")
    if isinstance(content, list):
        parts = [
            text_part(p.get("text"))
            if isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
            else {"type": "non_text"}
            for p in content
        ]
        return {"role": "user", "content": parts}
    if isinstance(content, str):
        return {"role": "user", "content": content}
    text = "".join(v for k in ("arguments", "output", "name") if isinstance(v := item.get(k), str))
    return {"role": "tool", "content": text}


class ResponsesReader(EventReader):
    """A Responses stream: ``*.delta`` events count output; ``response.completed``,
    ``.incomplete`` or ``.failed`` ends it with the usage."""

    __slots__ = ()

    def event(self, obj: dict[str, Any]) -> None:
        """Account one event's JSON object."""
        kind = obj.get("type")
        if not isinstance(kind, str):
            return
        if kind.endswith(".delta"):
            self.deltas += 1
        elif kind in ("response.completed", "response.incomplete", "response.failed"):
            self.done = True
            prompt, out, cached = _usage(obj.get("response"))
            if prompt is not None:
                self.prompt_tokens = prompt
            if cached is not None:
                self.cached_tokens = cached
            if out is not None:
                self.reported = out
