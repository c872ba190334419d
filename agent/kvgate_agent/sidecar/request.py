"""Parse and validate an admission-controlled request body, rewrite it for the upstream, and
canonicalise request paths (:func:`canonical_path`).

Covers ``POST /v1/chat/completions`` (``path_kind="chat"``) and ``POST /v1/completions``
(``"completions"``). Only the fields admission depends on are checked; everything else is left
for the model server to judge. An explicit JSON ``null`` counts as absent for the optional fields
(``max_tokens``, ``max_completion_tokens``, ``stream``, ``stream_options``, ``n``), as the OpenAI
API treats it. Pure byte/JSON logic: no HTTP framework.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, NoReturn
from urllib.parse import unquote

from kvgate_agent.sidecar.openai_errors import RequestError

__all__ = [
    "ADMITTED_PATHS",
    "ParsedRequest",
    "PathKind",
    "canonical_path",
    "parse_completion_request",
]

PathKind = Literal["chat", "completions"]
#: The admission-controlled paths and the kind of request each takes.
ADMITTED_PATHS: dict[str, PathKind] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
}


def _bad(message: str, param: str | None) -> RequestError:
    return RequestError(400, message, param=param)


def _is_int(v: object) -> bool:
    return type(v) is int  # bool is an int subclass, and not a valid count


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not valid JSON")


@dataclass(slots=True)
class ParsedRequest:
    """A validated completion request.

    Attributes:
        body: the decoded JSON object (not modified by this module).
        model: the ``model`` field.
        path_kind: ``"chat"`` or ``"completions"``.
        stream: the ``stream`` field (False when absent).
        client_wants_usage: the client set ``stream_options.include_usage`` true.
        max_tokens: effective output limit, tokens: the client's value clamped to
            ``max_tokens_cap``, or ``default_max_tokens`` when the client sent none.
        max_tokens_defaulted: the client sent no limit.
        max_tokens_clamped: the client's limit exceeded ``max_tokens_cap``.
        client_max_tokens: the client's limit as sent, or None.
        max_tokens_field: the field that limit came from (chat: ``"max_completion_tokens"``
            when the client used it, else ``"max_tokens"``); the field to rewrite upstream.
        n: completions generated per prompt (``n``, default 1); cost scales with it.
    """

    body: dict[str, Any]
    model: str
    path_kind: PathKind
    stream: bool
    client_wants_usage: bool
    max_tokens: int
    max_tokens_defaulted: bool
    max_tokens_clamped: bool
    client_max_tokens: int | None
    max_tokens_field: str
    n: int

    def upstream_body(
        self,
        *,
        max_tokens: int | None = None,
        model: str | None = None,
        include_usage: bool = False,
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

        Returns compact JSON (``separators=(",", ":")``, ``ensure_ascii=False``), UTF-8.

        Raises:
            ValueError: ``max_tokens`` below 1.
        """
        limit = self.max_tokens if max_tokens is None else max_tokens
        if limit < 1:
            raise ValueError(f"max_tokens must be >= 1, got {limit}")
        changes: dict[str, Any] = {}
        if limit != self.client_max_tokens:
            changes[self.max_tokens_field] = limit
            if self.path_kind == "chat":  # keep both limit fields consistent
                for other in ("max_tokens", "max_completion_tokens"):
                    if self.body.get(other) is not None:
                        changes[other] = limit
        if model is not None and model != self.model:
            changes["model"] = model
        if include_usage and self.stream and not self.client_wants_usage:
            opts = self.body.get("stream_options")
            changes["stream_options"] = {**(opts or {}), "include_usage": True}
        if not changes:
            return None
        out = {**self.body, **changes}
        try:
            return json.dumps(out, separators=(",", ":"), ensure_ascii=False).encode()
        except UnicodeEncodeError:  # lone surrogate from a \\ud800 escape: keep it escaped
            return json.dumps(out, separators=(",", ":")).encode()


def _positive_int(body: dict[str, Any], key: str) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if not _is_int(v) or v <= 0:
        raise _bad(f"'{key}' must be a positive integer, got {json.dumps(v)[:64]}", key)
    return int(v)


def _check_prompt(prompt: object) -> None:
    """Accept str, list[str], list[int], list[list[int]] (non-empty lists, ids >= 0)."""
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return
        if all(_is_int(p) and p >= 0 for p in prompt):
            return
        if all(isinstance(p, list) and p and all(_is_int(t) and t >= 0 for t in p) for p in prompt):
            return
    raise _bad(
        "'prompt' must be a string, a list of strings, a list of token ids or a list of "
        "lists of token ids (non-empty)",
        "prompt",
    )


def _check_messages(messages: object) -> None:
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list of message objects", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _bad(f"'messages[{i}]' must be an object", f"messages[{i}]")
        if not isinstance(m.get("role"), str):
            raise _bad(f"'messages[{i}].role' must be a string", f"messages[{i}].role")


def parse_completion_request(
    raw: bytes,
    path_kind: PathKind,
    *,
    default_max_tokens: int,
    max_tokens_cap: int | None,
    max_model_len: int | None,
) -> ParsedRequest:
    """Decode and validate a request body.

    Args:
        raw: the request body bytes (must be UTF-8 JSON).
        path_kind: ``"chat"`` (``/v1/chat/completions``) or ``"completions"``.
        default_max_tokens: output limit (tokens) used when the client sends none; also bounded
            by ``max_tokens_cap`` and ``max_model_len``.
        max_tokens_cap: largest output limit (tokens) forwarded; larger client values are
            clamped. None: no cap.
        max_model_len: the model's context length (tokens), when known; a client limit above it
            can never be served and is rejected.

    Raises:
        RequestError: status 400, ``invalid_request_error``, ``param`` naming the field
            (None for a body that is not UTF-8 JSON or not an object): ``model``, ``messages``,
            ``messages[i]``, ``messages[i].role``, ``prompt``, ``max_tokens``,
            ``max_completion_tokens``, ``stream``, ``stream_options``,
            ``stream_options.include_usage``, ``n``.
    """
    body = _decode(raw)
    model = body.get("model")
    if not isinstance(model, str):
        raise _bad("'model' is required and must be a string", "model")
    if path_kind == "chat":
        _check_messages(body.get("messages"))
    else:
        if "prompt" not in body:
            raise _bad("'prompt' is required", "prompt")
        _check_prompt(body["prompt"])
    field, client_max = _client_limit(body, path_kind, max_model_len)
    stream, wants_usage = _stream_options(body)
    n = _positive_int(body, "n") or 1
    if client_max is None:
        effective = default_max_tokens
        for bound in (max_tokens_cap, max_model_len):
            if bound is not None:
                effective = min(effective, bound)
        clamped = False
    else:
        clamped = max_tokens_cap is not None and client_max > max_tokens_cap
        effective = min(client_max, max_tokens_cap) if max_tokens_cap is not None else client_max
    return ParsedRequest(
        body=body,
        model=model,
        path_kind=path_kind,
        stream=stream,
        client_wants_usage=wants_usage,
        max_tokens=effective,
        max_tokens_defaulted=client_max is None,
        max_tokens_clamped=clamped,
        client_max_tokens=client_max,
        max_tokens_field=field,
        n=n,
    )


def _decode(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object (constants such as ``NaN`` refused)."""
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise _bad("The request body is not valid UTF-8", None) from None
    except (ValueError, RecursionError):
        raise _bad("The request body is not valid JSON", None) from None
    if not isinstance(body, dict):
        raise _bad("The request body must be a JSON object", None)
    return body


def _client_limit(
    body: dict[str, Any], path_kind: PathKind, max_model_len: int | None
) -> tuple[str, int | None]:
    """(the limit field to rewrite upstream, the client's output limit in tokens or None).
    Chat's ``max_completion_tokens`` wins over ``max_tokens``; a limit above the context length
    is refused."""
    field = "max_tokens"
    client_max = _positive_int(body, "max_tokens")
    if path_kind == "chat":
        mct = _positive_int(body, "max_completion_tokens")
        if mct is not None:
            field, client_max = "max_completion_tokens", mct
    if client_max is not None and max_model_len is not None and client_max > max_model_len:
        raise _bad(
            f"'{field}' is {client_max}, more than the model's context length {max_model_len}",
            field,
        )
    return field, client_max


def _stream_options(body: dict[str, Any]) -> tuple[bool, bool]:
    """(``stream``, ``stream_options.include_usage``), each False when absent or null."""
    stream = body.get("stream")
    if stream is None:
        stream = False
    elif not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream")
    wants_usage = False
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise _bad("'stream_options' must be an object", "stream_options")
        inc = opts.get("include_usage")
        if inc is not None and not isinstance(inc, bool):
            raise _bad(
                "'stream_options.include_usage' must be a boolean", "stream_options.include_usage"
            )
        wants_usage = inc is True
    return stream, wants_usage


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
