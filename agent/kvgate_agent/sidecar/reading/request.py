"""A parsed admission-controlled request (:class:`ParsedRequest`) and its rewriting for the
upstream, the checks every generation API shares (output limits, sequences, llama.cpp's
``n_predict``, chat messages), and the canonical form of request paths (:func:`canonical_path`).

Each API's own parsing is in its module of :mod:`kvgate_agent.sidecar.reading.apis`, which builds
the :class:`ParsedRequest`. Pure byte/JSON logic: no HTTP framework.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from kvgate_agent.sidecar.reading.apis.traits import ApiTraits
from kvgate_agent.sidecar.reading.jsonbody import decode_object, encode
from kvgate_agent.sidecar.reading.openai_errors import RequestError

__all__ = [
    "MAX_SEQUENCES",
    "MAX_SEQUENCES_PER_PROMPT",
    "ParsedRequest",
    "bad",
    "canonical_path",
    "check_context",
    "check_messages",
    "check_sequences",
    "decode_object",
    "effective_limit",
    "is_int",
    "is_json",
    "n_predict_limit",
    "positive_int",
]

MAX_SEQUENCES_PER_PROMPT = 128
"""Most sequences one prompt may ask for (``n``, ``best_of``, beam width): the maximum the OpenAI
API allows for ``n`` (https://platform.openai.com/docs/api-reference/chat/create, "n ... minimum
1, maximum 128"). Larger values are refused with 400 before reaching the model server."""
MAX_SEQUENCES = 2048
"""Most sequences one request may ask for in all (prompts of a batch x sequences per prompt):
the OpenAI API's limit on the entries of an array input
(https://platform.openai.com/docs/api-reference/embeddings/create, "must not exceed ... 2048").
"""


def bad(message: str, param: str | None) -> RequestError:
    """A 400 ``invalid_request_error`` naming ``param``."""
    return RequestError(400, message, param=param)


def is_int(v: object) -> bool:
    """``v`` is a JSON integer (not a bool)."""
    return type(v) is int  # bool is an int subclass, and not a valid count


def check_sequences(per_prompt: int, prompts: int, param: str) -> int:
    """The sequences a request makes the engine run: ``per_prompt`` x ``prompts``.

    Raises:
        RequestError: 400 naming ``param`` when ``per_prompt`` exceeds
            :data:`MAX_SEQUENCES_PER_PROMPT`, or the total :data:`MAX_SEQUENCES`.
    """
    if per_prompt > MAX_SEQUENCES_PER_PROMPT:
        raise bad(
            f"'{param}' is {per_prompt}; kvgate admits at most {MAX_SEQUENCES_PER_PROMPT} "
            "sequences per prompt",
            param,
        )
    total = per_prompt * prompts
    if total > MAX_SEQUENCES:
        raise bad(
            f"the request asks for {total} sequences ({prompts} prompts x {per_prompt}); kvgate "
            f"admits at most {MAX_SEQUENCES}",
            param,
        )
    return total


def effective_limit(
    client_max: int | None,
    default_max_tokens: int,
    max_tokens_cap: int | None,
    max_model_len: int | None,
) -> tuple[int, bool]:
    """(the output limit to charge and send, tokens; whether the client's was clamped): the
    client's limit clamped to ``max_tokens_cap``, or without one the default bounded by the cap
    and the context length."""
    if client_max is None:
        effective = default_max_tokens
        for bound in (max_tokens_cap, max_model_len):
            if bound is not None:
                effective = min(effective, bound)
        return effective, False
    if max_tokens_cap is not None and client_max > max_tokens_cap:
        return max_tokens_cap, True
    return client_max, False


def check_context(param: str, limit: int | None, max_model_len: int | None) -> None:
    """Refuse an output limit (tokens) above the model's context length: it can never be
    served.

    Raises:
        RequestError: 400 naming ``param``.
    """
    if limit is not None and max_model_len is not None and limit > max_model_len:
        raise bad(
            f"'{param}' is {limit}, more than the model's context length {max_model_len}", param
        )


def n_predict_limit(
    body: dict[str, Any], client_max: int | None, max_model_len: int | None
) -> tuple[int | None, tuple[str, ...]]:
    """Fold llama.cpp's own ``n_predict`` into an API's output limit: (the limit to charge in
    tokens or None for the policy default, the extra fields the limit must also be written to
    upstream). The API's own field is always rewritten too, so an engine that ignores
    ``n_predict`` (vLLM) never runs past the reservation either.

    llama.cpp's OpenAI routes copy every other body field through and let ``n_predict``
    override ``max_tokens`` ("Copy remaining properties to llama_params ... if "n_predict" is
    present, we overwrite the value specified earlier by "max_tokens"",
    https://github.com/ggml-org/llama.cpp/blob/master/tools/server/server-common.cpp,
    ``oaicompat_chat_params_parse``); ``-1`` is unbounded
    (https://github.com/ggml-org/llama.cpp/blob/master/tools/server/README.md). So the larger
    of the limits is charged, ``-1`` charges the policy default, and every limit field sent is
    rewritten to the reservation.

    Raises:
        RequestError: 400 naming ``n_predict`` for a non-integer, a negative other than -1, or
            a value above the context length.
    """
    if "n_predict" not in body:
        return client_max, ()
    v = body["n_predict"]
    if v is None:
        return client_max, ("n_predict",)
    if not is_int(v) or v < -1:
        raise bad(
            f"'n_predict' must be an integer >= -1 (-1: unbounded), got {json.dumps(v)[:64]}",
            "n_predict",
        )
    if v == -1:
        return None, ("n_predict",)
    own = max(1, int(v))
    check_context("n_predict", own, max_model_len)
    return (own if client_max is None else max(own, client_max)), ("n_predict",)


#: Body fields by which engines order their own queue: vLLM's ``priority`` (lower first, with
#: ``--scheduling-policy priority``,
#: https://docs.vllm.ai/en/latest/serving/openai_compatible_server.html#extra-parameters) and
#: SGLang's ``priority``. Never forwarded from a client.
ENGINE_PRIORITY_FIELDS = ("priority",)


@dataclass(slots=True)
class ParsedRequest:
    """A validated completion request.

    Attributes:
        body: the decoded JSON object (not modified by this module).
        model: the ``model`` field.
        api: the generation API (:class:`~kvgate_agent.sidecar.reading.apis.traits.ApiTraits`) the
            request came in on: its usage reader, its fields' names in a 400.
        stream: the ``stream`` field (False when absent).
        client_wants_usage: the client set ``stream_options.include_usage`` true.
        max_tokens: effective output limit, tokens: the client's value clamped to
            ``max_tokens_cap``, or ``default_max_tokens`` when the client sent none.
        max_tokens_defaulted: the client sent no limit.
        max_tokens_clamped: the client's limit exceeded ``max_tokens_cap``.
        client_max_tokens: the client's limit as sent, or None.
        max_tokens_field: the field that limit came from (chat: ``"max_completion_tokens"``
            when the client used it, else ``"max_tokens"``); the field to rewrite upstream.
        n: sequences the engine runs for the request, all prompts together: for completions
            ``max(n, best_of)`` per prompt (vLLM samples ``best_of`` and returns ``n``; beam search
            runs that many beams) times the prompts of a list prompt; cost and KV scale with it.
        limit_path: where the output limit lives when not at the top level (e.g.
            ``("parameters", "max_new_tokens")``); a list met on the way (SGLang's per-prompt
            ``sampling_params``) gets the limit in each element, never raised above its own.
        count_body: the prompt in the shape :meth:`PromptCounter.count` reads (``messages``,
            ``prompt``, ``tools``); None: :attr:`body` itself.
        model_field: the API names its model in ``model``, so a fallback model can be sent.
        also_limits: other top-level limit fields the client sent (llama.cpp's ``n_predict``
            on an OpenAI path, ``max_tokens`` beside a native ``n_predict``): the body is
            always rewritten with the limit in each of them, so no field the engine may read
            exceeds the reservation.
        fill_limit: along :attr:`limit_path`, the limit (tokens) written where a list element
            has none of its own (SGLang's per-prompt ``sampling_params`` when only some set
            ``max_new_tokens``: the policy default), so other elements' limits stay theirs;
            None: :attr:`max_tokens`.
        raw: the body bytes as received (:attr:`body` decoded from them); empty when not
            known. With them, a body that only gains fields is rewritten by inserting those
            fields into the client's bytes rather than by re-encoding it all.
    """

    body: dict[str, Any]
    model: str
    api: ApiTraits
    stream: bool
    client_wants_usage: bool
    max_tokens: int
    max_tokens_defaulted: bool
    max_tokens_clamped: bool
    client_max_tokens: int | None
    max_tokens_field: str
    n: int
    limit_path: tuple[str, ...] | None = None
    count_body: dict[str, Any] | None = None
    model_field: bool = True
    also_limits: tuple[str, ...] = ()
    fill_limit: int | None = None
    raw: bytes = b""

    @property
    def usage_injected(self) -> bool:
        """The proxy asks the stream for a usage chunk the client did not (OpenAI chat and
        completions only), and strips it on the way back."""
        return self.api.stream_usage_option and self.stream and not self.client_wants_usage

    def upstream_body(
        self,
        *,
        max_tokens: int | None = None,
        model: str | None = None,
        include_usage: bool = False,
        priority: int | None = None,
    ) -> bytes | None:
        """The body to send upstream, or None when the client's bytes can go unchanged.

        Args:
            max_tokens: output limit to send (tokens), e.g. degraded by admission; None means
                :attr:`max_tokens`. Written to :attr:`max_tokens_field` (and to any other limit
                field the client also sent) when it differs from what the client sent.
            model: model name to send; rewritten when it differs from :attr:`model`.
            include_usage: ask for the final usage chunk (``stream_options.include_usage``,
                other ``stream_options`` keys kept). Ignored for non-streaming requests (vLLM
                rejects ``stream_options`` without ``stream``) and when the client already asked.

        A client's own ``priority`` field (:data:`ENGINE_PRIORITY_FIELDS`) is removed: engines
        that schedule by it (vLLM ``--scheduling-policy priority``, SGLang) would otherwise let a
        client jump the engine's queue around kvgate's priority, which comes from the policy's
        header. ``priority``: the engine's own priority value to write instead (see
        :func:`kvgate_agent.sidecar.identity.tenants.engine_priority`); None: the field stays out.

        Returns the client's bytes with the new fields inserted first when every change adds a
        field the body does not have (nothing is re-encoded: a 1 KB body costs a copy), else
        the whole body re-encoded as compact UTF-8 JSON (msgspec; Python's :mod:`json` with
        ``\\u`` escapes for a string that is not valid Unicode, a lone surrogate escape).

        Raises:
            ValueError: ``max_tokens`` below 1.
        """
        limit = self.max_tokens if max_tokens is None else max_tokens
        if limit < 1:
            raise ValueError(f"max_tokens must be >= 1, got {limit}")
        changes: dict[str, Any] = {}
        body = self.body
        rewrite = limit != self.client_max_tokens or bool(self.also_limits)
        if self.limit_path is not None and (rewrite or self.fill_limit is not None):
            key = self.limit_path[0]
            fill = limit if self.fill_limit is None else min(self.fill_limit, limit)
            changes[key] = _with_limit(body.get(key), self.limit_path[1:], limit, fill)
        elif rewrite:
            for other in (self.max_tokens_field, "max_tokens", "max_completion_tokens"):
                if other == self.max_tokens_field or body.get(other) is not None:
                    changes[other] = limit  # keep every limit field consistent
            for other in self.also_limits:  # lowered to the limit, never raised (0 stays 0)
                own: Any = body.get(other)
                changes[other] = min(own, limit) if is_int(own) and own >= 0 else limit
            changes = {k: v for k, v in changes.items() if body.get(k) != v}
        if model is not None and model != self.model and self.model_field:
            changes["model"] = model
        if include_usage and self.usage_injected:
            opts = body.get("stream_options")
            changes["stream_options"] = {**(opts or {}), "include_usage": True}
        dropped = [k for k in ENGINE_PRIORITY_FIELDS if k in body]
        if priority is not None:
            changes.update(dict.fromkeys(ENGINE_PRIORITY_FIELDS, priority))
            dropped = []
        if not changes and not dropped:
            return None
        if not dropped and self.raw and body and not any(k in body for k in changes):
            return _insert_fields(self.raw, changes)
        out = {**body, **changes}
        for key in dropped:  # the engine's queue order is kvgate's to give (its priority)
            del out[key]
        try:
            return encode(out)
        except UnicodeEncodeError:  # lone surrogate from a \\ud800 escape: keep it escaped
            return json.dumps(out, separators=(",", ":")).encode()


def _insert_fields(raw: bytes, fields: dict[str, Any]) -> bytes:
    """``raw`` (a non-empty JSON object's text) with ``fields`` (keys it does not have)
    inserted after its opening brace; the rest of the client's bytes unchanged."""
    start = raw.index(b"{") + 1  # only whitespace may precede an object's brace
    return b"".join((raw[:start], encode(fields)[1:-1], b",", raw[start:]))


def _with_limit(node: Any, path: tuple[str, ...], limit: int, fill: int) -> Any:
    """A copy of ``node`` with a limit written at ``path`` (dicts created where absent): a
    value already there is lowered to ``limit``, never raised; where none is, ``fill``; a
    list's elements each get theirs."""
    if isinstance(node, list):
        return [_with_limit(e, path, limit, fill) for e in node]
    out = dict(node) if isinstance(node, dict) else {}
    if len(path) == 1:
        own = out.get(path[0])
        out[path[0]] = min(own, limit) if type(own) is int and own >= 0 else fill
    else:
        out[path[0]] = _with_limit(out.get(path[0]), path[1:], limit, fill)
    return out


def positive_int(body: dict[str, Any], key: str, param: str | None = None) -> int | None:
    """``body[key]`` when a positive integer, None when absent or null.

    Raises:
        RequestError: 400 naming ``param`` (default ``key``) for any other value.
    """
    v = body.get(key)
    if v is None:
        return None
    if not is_int(v) or v <= 0:
        name = param or key
        raise bad(f"'{name}' must be a positive integer, got {json.dumps(v)[:64]}", name)
    return int(v)


def check_messages(messages: object) -> None:
    """``messages`` is a non-empty list of objects each with a string ``role``."""
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list of message objects", "messages")
    for m in messages:  # the usual case in one pass; the index only for an error
        if type(m) is not dict or type(m.get("role")) is not str:
            break
    else:
        return
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"'messages[{i}]' must be an object", f"messages[{i}]")
        if not isinstance(m.get("role"), str):
            raise bad(f"'messages[{i}].role' must be a string", f"messages[{i}].role")


def canonical_path(raw_path: str) -> str:
    """``raw_path`` (the request target's path, query dropped) percent-decoded, with empty
    and ``.`` segments removed and ``..`` applied, as a normalising server would see it."""
    path = unquote(raw_path.split("?", 1)[0])
    segments: list[str] = []
    for seg in path.split("/"):
        if seg in ("", "."):
            continue
        if seg == "..":
            if segments:
                segments.pop()
            continue
        segments.append(seg)
    return "/" + "/".join(segments)


def is_json(content_type: str) -> bool:
    """``application/json`` or ``application/<x>+json``, any parameters (``charset=utf-8``),
    any case (RFC 9110 §8.3.1)."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )
