"""SGLang's native API, ``POST /generate`` with ``text``, ``input_ids`` or ``input_embeds``
(https://docs.sglang.io/basic_usage/sampling_params.html; the path is shared with TGI, told
apart by the body: :mod:`kvgate_agent.sidecar.reading.apis.generate`). Output limit
``sampling_params.max_new_tokens``; sequences ``sampling_params.n`` x the prompts of a batch.
Usage: ``meta_info.prompt_tokens``/``completion_tokens``, the cached prompt tokens
``meta_info.cached_tokens`` (https://docs.sglang.io/basic_usage/native_api.html), a batch's list
summed; a stream has
``meta_info`` per event, cumulative per ``index``, then ``[DONE]``. Pure JSON logic: no HTTP
framework.
"""

from __future__ import annotations

import json
from typing import Any

from kvgate_agent.sidecar.reading.apis.native import Fields, NativeApi, stream_flag
from kvgate_agent.sidecar.reading.request import bad, check_sequences, is_int, positive_int
from kvgate_agent.sidecar.reading.usage import (
    Counts,
    EventReader,
    batch_usage,
    decode_body,
    dig,
    pair,
    sum_known,
)

__all__ = ["SGLANG", "SGLang", "SGLangReader"]


class SGLang(NativeApi):
    """See the module's docstring."""

    def __init__(self) -> None:
        super().__init__("sglang", "text", "sampling_params.max_new_tokens")

    def fields(self, body: dict[str, Any]) -> Fields:
        """``text`` (a string or a batch of strings), ``input_ids`` (one list of ids or a
        batch) or ``input_embeds`` (one row per token); ``sampling_params``: one object or one
        per prompt, each with ``max_new_tokens`` (``0``: the prompt only, charged as 1) and
        ``n``."""
        prompts, count = _prompts(body)
        sp = body.get("sampling_params")
        if sp is None:
            sp = {}
        if isinstance(sp, dict):
            per = [sp] * prompts
        elif isinstance(sp, list) and len(sp) == prompts and all(isinstance(p, dict) for p in sp):
            per = sp
        else:
            raise bad(
                "'sampling_params' must be an object or one object per prompt", "sampling_params"
            )
        limits = [_non_negative(p, "max_new_tokens", "sampling_params.max_new_tokens") for p in per]
        ns = [positive_int(p, "n", "sampling_params.n") or 1 for p in per]
        check_sequences(max(ns), prompts, "sampling_params.n")  # bounds sum(ns) too
        sequences = sum(ns)
        given = [v for v in limits if v is not None]
        limit = max(given) if given else None
        return Fields(
            None, stream_flag(body), limit, ("sampling_params", "max_new_tokens"),
            "sampling_params.max_new_tokens", sequences, count, len(given) < len(limits),
        )  # fmt: skip

    def body_usage(self, data: bytes) -> Counts:
        """``meta_info.prompt_tokens``, ``meta_info.completion_tokens``,
        ``meta_info.cached_tokens``."""
        return batch_usage(decode_body(data), _usage)

    def event_reader(self) -> EventReader:
        """A :class:`SGLangReader`."""
        return SGLangReader()


#: ``POST /generate`` with ``text``, ``input_ids`` or ``input_embeds``.
SGLANG = SGLang()


def _usage(obj: Any) -> Counts:
    if not isinstance(obj, dict):
        return None, None, None
    prompt, completion = pair(obj.get("meta_info"), "prompt_tokens", "completion_tokens")
    return prompt, completion, dig(obj, "meta_info", "cached_tokens")


def _non_negative(body: dict[str, Any], key: str, param: str) -> int | None:
    """An output limit that may be 0 (evaluate the prompt only): charged as 1 token; None when
    absent or null.

    Raises:
        RequestError: 400 naming ``param`` for anything but an integer >= 0.
    """
    v = body.get(key)
    if v is None:
        return None
    if not is_int(v) or v < 0:
        raise bad(f"'{param}' must be an integer >= 0, got {json.dumps(v)[:64]}", param)
    return max(1, int(v))


def _prompts(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """(prompts in the batch, the prompt in counting shape)."""
    text = body.get("text")
    ids = body.get("input_ids")
    embeds = body.get("input_embeds")
    if text is not None:
        if isinstance(text, str):
            return 1, {"prompt": text}
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return len(text), {"prompt": text}
        raise bad("'text' must be a string or a non-empty list of strings", "text")
    if ids is not None:
        if isinstance(ids, list) and ids and all(is_int(t) and t >= 0 for t in ids):
            return 1, {"prompt": ids}
        if (
            isinstance(ids, list)
            and ids
            and all(isinstance(p, list) and p and all(is_int(t) and t >= 0 for t in p) for p in ids)
        ):
            return len(ids), {"prompt": ids}
        raise bad("'input_ids' must be a list of token ids or a list of such lists", "input_ids")
    if isinstance(embeds, list) and embeds:
        batch = isinstance(embeds[0], list) and embeds[0] and isinstance(embeds[0][0], list)
        rows = sum(len(e) for e in embeds if isinstance(e, list)) if batch else len(embeds)
        return (len(embeds) if batch else 1), {"prompt": [0] * rows}
    raise bad("'input_embeds' must be a non-empty list", "input_embeds")


class SGLangReader(EventReader):
    """An SGLang stream: an event with ``text`` or ``output_ids`` counts output; ``meta_info``
    counts are cumulative per sequence ``index``."""

    __slots__ = ("_by_index", "_cached_by_index")

    def __init__(self) -> None:
        super().__init__()
        self._by_index: dict[object, int] = {}  # cumulative completion tokens per sequence
        self._cached_by_index: dict[object, int | None] = {}  # cached prompt tokens per sequence

    def event(self, obj: dict[str, Any]) -> None:
        """Account one event's JSON object."""
        prompt, out, cached = _usage(obj)
        if obj.get("text") or obj.get("output_ids"):
            self.deltas += 1
        if prompt is not None:
            self.prompt_tokens = prompt
        index = obj.get("index", 0)
        if out is not None:
            self._by_index[index] = out
            self.reported = sum(self._by_index.values())
        if cached is not None:
            self._cached_by_index[index] = cached
            self.cached_tokens = sum_known(list(self._cached_by_index.values()))
