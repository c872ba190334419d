"""Which requests go through admission, which pass through, which are refused; and the parsing of
the engines' native generation APIs into a :class:`~kvgate_agent.sidecar.request.ParsedRequest`.

Every generation API of the engines kvgate supports is admission-controlled
(:data:`GENERATION_PATHS`), its cost and KV taken from that API's own length fields:

=====================================  =========  ============================================
path                                   kind       output limit, sequences
=====================================  =========  ============================================
``/v1/chat/completions``,              chat       ``max_completion_tokens``/``max_tokens``;
``/chat/completions`` (llama.cpp)                 ``max(n, best_of, n_cmpl)``
``/v1/completions``                    completions ``max_tokens``; ``max(n, best_of, n_cmpl)`` x
                                                  prompts
``/v1/responses`` (vLLM)               responses  ``max_output_tokens``; 1
``/v1/messages`` (vLLM, Anthropic)     messages   ``max_tokens`` (required); 1
``/generate`` with ``inputs`` (TGI),   tgi        ``parameters.max_new_tokens``;
``/generate_stream`` (TGI)                        ``parameters.best_of``
``/generate`` with ``text`` or         sglang     ``sampling_params.max_new_tokens``;
``input_ids`` (SGLang)                            ``sampling_params.n`` x prompts
``/completion``, ``/completions``,     llamacpp   ``n_predict``/``max_tokens`` (``-1``: unbounded,
``/infill`` (llama.cpp)                           so the policy default is sent); ``n_cmpl`` (or
                                                  ``n``) x the prompts of a multi-prompt list
=====================================  =========  ============================================

On every path with a top-level limit, llama.cpp's own ``n_predict`` is read too (its OpenAI
routes copy it through and let it override ``max_tokens``): the larger limit is charged
(``-1``: the policy default) and every limit field is rewritten to the reservation (see
:func:`~kvgate_agent.sidecar.request.n_predict_limit`).

Prompt parts held by the engine rather than sent (a Responses ``previous_response_id`` or stored
``prompt`` template) cannot be counted here: they are charged when the engine reports its usage.

Sources: vLLM's OpenAI-compatible server
(https://docs.vllm.ai/en/latest/serving/openai_compatible_server.html), TGI's API
(https://huggingface.github.io/text-generation-inference/), SGLang's native API
(https://docs.sglang.io/basic_usage/sampling_params.html), llama.cpp's server
(https://github.com/ggml-org/llama.cpp/blob/master/tools/server/README.md).

Any other request with a mutating method (POST, PUT, PATCH, DELETE, ...) is refused with 404
unless its path is on the pass-through allowlist (:data:`DEFAULT_PASSTHROUGH` plus the
``--passthrough-path`` setting); GET, HEAD and OPTIONS pass on every other path (read-only by
HTTP's method semantics, RFC 9110 §9.2.1). Pure JSON logic: no HTTP framework.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from kvgate_agent.sidecar.request import (
    ADMITTED_PATHS,
    ParsedRequest,
    PathKind,
    bad,
    check_context,
    check_messages,
    check_sequences,
    decode_object,
    effective_limit,
    is_int,
    n_predict_limit,
    parse_completion_request,
    positive_int,
)

__all__ = [
    "DEFAULT_PASSTHROUGH",
    "GENERATION_PATHS",
    "SAFE_METHODS",
    "Passthrough",
    "Route",
    "parse_generation",
]

#: A generation path's kind; ``"generate"`` is TGI's or SGLang's, told apart by the body.
Route = PathKind | Literal["generate", "tgi_stream"]
#: Every admission-controlled path and how its body is read.
GENERATION_PATHS: dict[str, Route] = {
    **ADMITTED_PATHS,
    "/chat/completions": "chat",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
    "/generate": "generate",
    "/generate_stream": "tgi_stream",
    "/completion": "llamacpp",
    "/completions": "llamacpp",
    "/infill": "llamacpp",
}
#: Methods that pass through on any path but a generation one (RFC 9110 §9.2.1 "safe").
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
#: Paths any method may reach the model server on without admission: tokenizer utilities, CPU
#: only (vLLM's and llama.cpp's ``/tokenize``, ``/detokenize``; TGI's ``/tokenize`` and
#: ``/chat_tokenize``, https://huggingface.github.io/text-generation-inference/; vLLM's
#: Anthropic ``/v1/messages/count_tokens``; llama.cpp's ``/apply-template``), and vLLM's
#: ``POST /v1/responses/{response_id}/cancel``, which stops a generation rather than starting
#: one (https://docs.vllm.ai/en/latest/serving/openai_compatible_server.html).
DEFAULT_PASSTHROUGH: tuple[str, ...] = (
    "/tokenize",
    "/detokenize",
    "/chat_tokenize",
    "/v1/messages/count_tokens",
    "/apply-template",
    "/v1/responses/*/cancel",
)


@dataclass(frozen=True, slots=True)
class Passthrough:
    """The pass-through allowlist for mutating methods: exact paths, prefixes written with a
    trailing ``*`` (``/admin/*``), or paths with ``*`` standing for one whole segment
    (``/v1/responses/*/cancel``). Entries are matched against the canonical path
    (:func:`~kvgate_agent.sidecar.request.canonical_path`).

    Raises:
        ValueError: an entry that does not start with ``/``, or that could never match: a
            ``?`` (the query is not part of the path), a non-canonical path (empty, ``.`` or
            ``..`` segments, ``%`` escapes, a trailing ``/``), a ``*`` inside a segment, or a
            generation path (:data:`GENERATION_PATHS`: always admission-controlled).
    """

    exact: frozenset[str]
    prefixes: tuple[str, ...]
    patterns: tuple[tuple[str, ...], ...] = ()  # segments; "*" matches any one

    @classmethod
    def of(cls, extra: Iterable[str] = ()) -> Passthrough:
        """:data:`DEFAULT_PASSTHROUGH` plus ``extra``."""
        exact: set[str] = set()
        prefixes: list[str] = []
        patterns: list[tuple[str, ...]] = []
        for entry in (*DEFAULT_PASSTHROUGH, *extra):
            _check_entry(entry)
            if entry.endswith("*") and "*" not in entry[:-1]:
                prefixes.append(entry[:-1])
            elif "*" in entry:
                patterns.append(tuple(entry.split("/")))
            else:
                exact.add(entry)
        return cls(frozenset(exact), tuple(prefixes), tuple(patterns))

    def allows(self, path: str) -> bool:
        """``path`` (canonical) may be forwarded with any method."""
        if path in self.exact or any(path.startswith(p) for p in self.prefixes):
            return True
        segs = path.split("/")
        return any(
            len(p) == len(segs) and all(a in ("*", b) for a, b in zip(p, segs, strict=True))
            for p in self.patterns
        )


def _check_entry(entry: str) -> None:
    """Refuse an allowlist entry that could never match (see :class:`Passthrough`)."""
    if not entry.startswith("/"):
        raise ValueError(f"a pass-through path must start with '/', got {entry!r}")
    if "?" in entry:
        raise ValueError(f"a pass-through path has no query ('?'), got {entry!r}")
    prefix = entry.endswith("*") and "*" not in entry[:-1]
    body = entry[:-1] if prefix else entry
    segments = body.split("/")[1:]
    if prefix and segments and segments[-1] == "":
        segments.pop()  # "/admin/*": the prefix "/admin/"
    if any(seg in ("", ".", "..") or "%" in seg for seg in segments) and body != "/":
        raise ValueError(f"a pass-through path must be canonical (never matched), got {entry!r}")
    if any("*" in seg and seg != "*" for seg in segments):
        raise ValueError(f"'*' must be a whole segment or the last character, got {entry!r}")
    if entry in GENERATION_PATHS:
        raise ValueError(f"{entry!r} is a generation path: it is always admission-controlled")


def parse_generation(
    raw: bytes,
    route: Route,
    *,
    default_max_tokens: int,
    max_tokens_cap: int | None,
    max_model_len: int | None,
) -> ParsedRequest:
    """Decode and validate the body of a generation request on a path of kind ``route``.

    Arguments as :func:`~kvgate_agent.sidecar.request.parse_completion_request` (tokens).

    Raises:
        RequestError: 400 ``invalid_request_error`` naming the offending field (dotted for
            nested ones: ``parameters.best_of``, ``sampling_params.n``).
    """
    if route in ("chat", "completions"):
        return parse_completion_request(
            raw,
            "chat" if route == "chat" else "completions",
            default_max_tokens=default_max_tokens,
            max_tokens_cap=max_tokens_cap,
            max_model_len=max_model_len,
        )
    body = decode_object(raw)
    if route == "generate":
        route = _generate_kind(body)
    parse = _PARSERS[route]
    fields = parse(body, route == "tgi_stream")
    also: tuple[str, ...] = ()
    field, client_max = fields.limit_path[-1], fields.client_max
    nested = len(fields.limit_path) > 1
    check_context(fields.param, client_max, max_model_len)
    if not nested:
        client_max, also = n_predict_limit(body, client_max, max_model_len)
    effective, clamped = effective_limit(
        client_max, default_max_tokens, max_tokens_cap, max_model_len
    )
    fill = None
    if fields.some_unset and client_max is not None:  # those get the default, the rest theirs
        fill = effective_limit(None, default_max_tokens, max_tokens_cap, max_model_len)[0]
        effective = max(effective, fill)
    return ParsedRequest(
        body=body,
        model=fields.model or "",
        path_kind=fields.kind,
        stream=fields.stream,
        client_wants_usage=False,
        max_tokens=effective,
        max_tokens_defaulted=client_max is None,
        max_tokens_clamped=clamped,
        client_max_tokens=client_max,
        max_tokens_field=field,
        n=fields.sequences,
        limit_path=fields.limit_path if nested else None,
        count_body=fields.count_body,
        model_field=fields.model is not None,
        also_limits=also,
        fill_limit=fill,
        raw=raw,
    )


@dataclass(slots=True)
class _Fields:
    """What one API's parser read (see :func:`parse_generation`)."""

    kind: PathKind
    model: str | None
    stream: bool
    client_max: int | None  # tokens; None: the client sent no (or an unbounded) limit
    limit_path: tuple[str, ...]
    param: str  # the limit's name in error messages
    sequences: int
    count_body: dict[str, Any]
    some_unset: bool = False  # a per-prompt list where only some elements set the limit


def _generate_kind(body: dict[str, Any]) -> PathKind:
    """``/generate`` is TGI's when the body has ``inputs``, SGLang's with ``text``,
    ``input_ids`` or ``input_embeds``; both or neither is refused."""
    tgi = "inputs" in body
    sglang = any(k in body for k in ("text", "input_ids", "input_embeds"))
    if tgi and sglang:
        raise bad("give 'inputs' (TGI) or 'text'/'input_ids' (SGLang), not both", "inputs")
    if not (tgi or sglang):
        raise bad("'inputs' (TGI) or 'text'/'input_ids' (SGLang) is required", "inputs")
    return "tgi" if tgi else "sglang"


def _stream(body: dict[str, Any], param: str = "stream") -> bool:
    v = body.get("stream")
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(f"'{param}' must be a boolean", param)
    return v


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str):
        raise bad("'model' is required and must be a string", "model")
    return model


def _object(body: dict[str, Any], key: str) -> dict[str, Any]:
    v = body.get(key)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise bad(f"'{key}' must be an object", key)
    return v


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


def _text_part(text: object) -> dict[str, Any]:
    return {"type": "text", "text": text if isinstance(text, str) else ""}


# ---------------------------------------------------------------- OpenAI Responses (vLLM)


def _responses(body: dict[str, Any], _: bool) -> _Fields:
    """``input``: a string or a non-empty list of items (messages with string or part-list
    ``content``, function calls and their outputs); ``instructions``: the system prompt.
    ``background: true`` is refused: the answer returns before the generation ends, so the
    reservation could not be held for it."""
    model = _model(body)
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
    return _Fields(
        "responses", model, _stream(body), limit, ("max_output_tokens",), "max_output_tokens", 1,
        count,
    )  # fmt: skip


def _response_item(item: dict[str, Any]) -> dict[str, Any]:
    """One Responses input item as a chat message for counting (input_text, output_text and
    text parts are text; other parts, e.g. images and files, cost a non-text part)."""
    content = item.get("content")
    if isinstance(content, list):
        parts = [
            _text_part(p.get("text"))
            if isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
            else {"type": "non_text"}
            for p in content
        ]
        return {"role": "user", "content": parts}
    if isinstance(content, str):
        return {"role": "user", "content": content}
    text = "".join(v for k in ("arguments", "output", "name") if isinstance(v := item.get(k), str))
    return {"role": "tool", "content": text}


# ---------------------------------------------------------------- Anthropic Messages (vLLM)


def _messages(body: dict[str, Any], _: bool) -> _Fields:
    """``max_tokens`` is required (as in Anthropic's API,
    https://docs.anthropic.com/en/api/messages); ``system``: a string or text blocks."""
    model = _model(body)
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
    count: dict[str, Any] = {"messages": messages}
    if body.get("tools"):
        count["tools"] = body["tools"]
    return _Fields("messages", model, _stream(body), limit, ("max_tokens",), "max_tokens", 1, count)


def _block(block: object) -> dict[str, Any]:
    """An Anthropic content block as a chat part: text, tool input and tool results are text;
    images and documents are non-text parts."""
    if not isinstance(block, dict):
        return {"type": "non_text"}
    kind = block.get("type")
    if kind in ("text", "thinking"):
        return _text_part(block.get("text", block.get("thinking")))
    if kind == "tool_use":
        return _text_part(json.dumps(block.get("input"), ensure_ascii=False))
    if kind == "tool_result":
        inner = block.get("content")
        if isinstance(inner, list):
            inner = "".join(
                b.get("text", "") for b in inner if isinstance(b, dict) and b.get("type") == "text"
            )
        return _text_part(inner)
    return {"type": "non_text"}


# ---------------------------------------------------------------- TGI


def _tgi(body: dict[str, Any], always_stream: bool) -> _Fields:
    """``inputs`` (a string), ``parameters.max_new_tokens`` and ``parameters.best_of`` (TGI
    samples that many sequences and returns the best one). ``/generate_stream`` always
    streams."""
    inputs = body.get("inputs")
    if not isinstance(inputs, str):
        raise bad("'inputs' must be a string", "inputs")
    params = _object(body, "parameters")
    limit = positive_int(params, "max_new_tokens", "parameters.max_new_tokens")
    best_of = positive_int(params, "best_of", "parameters.best_of") or 1
    sequences = check_sequences(best_of, 1, "parameters.best_of")
    stream = True if always_stream else _stream(body)
    return _Fields(
        "tgi", None, stream, limit, ("parameters", "max_new_tokens"),
        "parameters.max_new_tokens", sequences, {"prompt": inputs},
    )  # fmt: skip


# ---------------------------------------------------------------- SGLang


def _sglang(body: dict[str, Any], _: bool) -> _Fields:
    """``text`` (a string or a batch of strings), ``input_ids`` (one list of ids or a batch) or
    ``input_embeds`` (one row per token); ``sampling_params``: one object or one per prompt,
    each with ``max_new_tokens`` (``0``: the prompt only, charged as 1) and ``n``."""
    prompts, count = _sglang_prompts(body)
    sp = body.get("sampling_params")
    if sp is None:
        sp = {}
    if isinstance(sp, dict):
        per = [sp] * prompts
    elif isinstance(sp, list) and len(sp) == prompts and all(isinstance(p, dict) for p in sp):
        per = sp
    else:
        raise bad("'sampling_params' must be an object or one object per prompt", "sampling_params")
    limits = [_non_negative(p, "max_new_tokens", "sampling_params.max_new_tokens") for p in per]
    ns = [positive_int(p, "n", "sampling_params.n") or 1 for p in per]
    check_sequences(max(ns), prompts, "sampling_params.n")  # bounds sum(ns) too
    sequences = sum(ns)
    given = [v for v in limits if v is not None]
    limit = max(given) if given else None
    return _Fields(
        "sglang", None, _stream(body), limit, ("sampling_params", "max_new_tokens"),
        "sampling_params.max_new_tokens", sequences, count, len(given) < len(limits),
    )  # fmt: skip


def _sglang_prompts(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
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


# ---------------------------------------------------------------- llama.cpp


def _llamacpp(body: dict[str, Any], _: bool) -> _Fields:
    """``prompt``: a string, token ids, a mix (one prompt), or a list of strings and id lists
    (one completion each); ``/infill`` adds ``input_prefix``, ``input_suffix`` and
    ``input_extra``. ``max_tokens`` here, ``n_predict`` (which wins in llama.cpp) folded in by
    :func:`parse_generation`: ``-1`` means unbounded, so the policy's default is charged and
    sent; ``0`` evaluates the prompt only (charged as 1). ``n_cmpl`` (alias ``n``): completions
    per prompt ("If the input has multiple prompts, total outputs will be N prompts times
    n_cmpl", https://github.com/ggml-org/llama.cpp/blob/master/tools/server/README.md)."""
    prompts, count = _llamacpp_prompts(body)
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
    return _Fields(
        "llamacpp", None, _stream(body), limit, ("max_tokens",), "max_tokens", sequences, count,
    )  # fmt: skip


def _llamacpp_piece(p: object) -> list[str | int] | None:
    """One element of a llama.cpp prompt list as strings and token ids (None: invalid). A
    multimodal ``{"prompt_string": ...}`` object counts its text only."""
    if isinstance(p, str) or (type(p) is int and p >= 0):
        return [p]
    if isinstance(p, list) and p and all(isinstance(t, str) or (is_int(t) and t >= 0) for t in p):
        return list(p)
    if isinstance(p, dict) and isinstance(p.get("prompt_string"), str):
        return [p["prompt_string"]]
    return None


def _llamacpp_prompts(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
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
            one = _llamacpp_piece(prompt)
            if one is not None:
                return 1, {"prompt": [*one, *extra]}
        else:
            pieces = [_llamacpp_piece(p) for p in prompt]
            if all(x is not None for x in pieces):
                flat = [t for x in pieces if x is not None for t in x]
                return len(prompt), {"prompt": [*flat, *extra]}
    raise bad(
        "'prompt' must be a string, a list of token ids or a list of prompts (strings, "
        "token lists)",
        "prompt",
    )


_PARSERS = {
    "responses": _responses,
    "messages": _messages,
    "tgi": _tgi,
    "tgi_stream": _tgi,
    "sglang": _sglang,
    "llamacpp": _llamacpp,
}
