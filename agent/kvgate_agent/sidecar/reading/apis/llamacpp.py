"""llama.cpp's native API, ``POST /completion``, ``/completions`` and ``/infill``
(https://github.com/ggml-org/llama.cpp/blob/master/tools/server/README.md). Output limit
``n_predict``/``max_tokens`` (``-1``: unbounded, so the policy default is sent); sequences
``n_cmpl`` (or ``n``) x the prompts of a multi-prompt list. Usage:
``tokens_evaluated``/``tokens_predicted``, the cached prompt tokens ``timings.cache_n``, a batch's
list summed; a stream has ``content`` per event and ``stop: true`` with the counts, per ``index``.
(``tokens_cached`` is not read: it counts the tokens the slot holds after the request, the
output's included, not the prompt tokens it reused: 19 for a 16-token prompt and 4 generated
tokens with ``cache_n`` 0, observed.) Pure JSON logic: no HTTP framework.
"""

from __future__ import annotations

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

__all__ = ["LLAMACPP", "LlamaCpp", "LlamaCppReader"]


class LlamaCpp(NativeApi):
    """See the module's docstring."""

    def __init__(self) -> None:
        super().__init__("llamacpp", "prompt", "n_predict")

    def fields(self, body: dict[str, Any]) -> Fields:
        """``prompt``: a string, token ids, a mix (one prompt), or a list of strings and id
        lists (one completion each); ``/infill`` adds ``input_prefix``, ``input_suffix`` and
        ``input_extra``. ``max_tokens`` here, ``n_predict`` (which wins in llama.cpp) folded in
        by :meth:`~kvgate_agent.sidecar.reading.apis.native.NativeApi.parse_body`: ``-1`` means
        unbounded, so the policy's default is charged and sent; ``0`` evaluates the prompt only
        (charged as 1). ``n_cmpl`` (alias ``n``): completions per prompt ("If the input has
        multiple prompts, total outputs will be N prompts times n_cmpl")."""
        prompts, count = _prompts(body)
        v = body.get("max_tokens")
        limit: int | None
        if v is None or v == -1:
            limit = None
        elif is_int(v) and v >= 0:
            limit = max(1, v)
        else:
            raise bad("'max_tokens' must be an integer >= -1 (-1: unbounded)", "max_tokens")
        param = "n_cmpl" if body.get("n_cmpl") is not None else "n"
        per_prompt = positive_int(body, param) or 1
        check_sequences(per_prompt, 1, param)
        sequences = check_sequences(per_prompt, prompts, "prompt")
        return Fields(
            None, stream_flag(body), limit, ("max_tokens",), "max_tokens", sequences, count
        )

    def body_usage(self, data: bytes) -> Counts:
        """``tokens_evaluated``, ``tokens_predicted``, ``timings.cache_n``."""
        return batch_usage(decode_body(data), _usage)

    def event_reader(self) -> EventReader:
        """A :class:`LlamaCppReader`."""
        return LlamaCppReader()


#: ``POST /completion``, ``/completions``, ``/infill``.
LLAMACPP = LlamaCpp()


def _usage(obj: Any) -> Counts:
    prompt, completion = pair(obj, "tokens_evaluated", "tokens_predicted")
    return prompt, completion, dig(obj, "timings", "cache_n")


def _piece(p: object) -> list[str | int] | None:
    """One element of a llama.cpp prompt list as strings and token ids (None: invalid). A
    multimodal ``{"prompt_string": ...}`` object counts its text only."""
    if isinstance(p, str) or (type(p) is int and p >= 0):
        return [p]
    if isinstance(p, list) and p and all(isinstance(t, str) or (is_int(t) and t >= 0) for t in p):
        return list(p)
    if isinstance(p, dict) and isinstance(p.get("prompt_string"), str):
        return [p["prompt_string"]]
    return None


def _prompts(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """(prompts, the prompt in counting shape): a top-level list holding a token id is one
    (mixed) prompt; otherwise each element of a list is a prompt of its own."""
    extra: list[str | int] = []
    for key in ("input_prefix", "input_suffix"):
        v = body.get(key)
        if v is not None and not isinstance(v, str):
            raise bad(f"'{key}' must be a string", key)
        if v:
            extra.append(v)
    chunks = body.get("input_extra")
    if isinstance(chunks, list):
        texts = (c.get("text") for c in chunks if isinstance(c, dict))
        extra += [t for t in texts if isinstance(t, str)]
    prompt = body.get("prompt")
    if prompt is None and extra:
        return 1, {"prompt": extra}
    if isinstance(prompt, str):
        return 1, {"prompt": [prompt, *extra]}
    if isinstance(prompt, list) and prompt:
        if any(is_int(p) for p in prompt):
            one = _piece(prompt)
            if one is not None:
                return 1, {"prompt": [*one, *extra]}
        else:
            pieces = [_piece(p) for p in prompt]
            if all(x is not None for x in pieces):
                flat = [t for x in pieces if x is not None for t in x]
                return len(prompt), {"prompt": [*flat, *extra]}
    raise bad(
        "'prompt' must be a string, a list of token ids or a list of prompts (strings, "
        "token lists)",
        "prompt",
    )


class LlamaCppReader(EventReader):
    """A llama.cpp stream: an event with ``content`` counts output; ``stop: true`` ends a
    sequence with its counts, cumulative per ``index``."""

    __slots__ = ("_by_index", "_cached_by_index")

    def __init__(self) -> None:
        super().__init__()
        self._by_index: dict[object, int] = {}  # cumulative completion tokens per sequence
        self._cached_by_index: dict[object, int | None] = {}  # cached prompt tokens per sequence

    def event(self, obj: dict[str, Any]) -> None:
        """Account one event's JSON object."""
        prompt, out, cached = _usage(obj)
        if obj.get("content"):
            self.deltas += 1
        if obj.get("stop") is True:
            self.done = True
        if prompt is not None:
            self.prompt_tokens = prompt
        index = obj.get("index", 0)
        if out is not None:
            self._by_index[index] = out
            self.reported = sum(self._by_index.values())
        if cached is not None:
            self._cached_by_index[index] = cached
            self.cached_tokens = sum_known(list(self._cached_by_index.values()))
