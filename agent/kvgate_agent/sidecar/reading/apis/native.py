"""What the engines' own generation APIs (Responses, Messages, TGI, SGLang, llama.cpp: every API
but OpenAI chat and completions) share: each reads its body into :class:`Fields` (its model,
stream flag, output limit, sequences and prompt in counting shape) and :class:`NativeApi` turns
those into a :class:`~kvgate_agent.sidecar.reading.request.ParsedRequest` the same way for all.

On every path with a top-level limit, llama.cpp's own ``n_predict`` is read too (its OpenAI
routes copy it through and let it override ``max_tokens``): the larger limit is charged
(``-1``: the policy default) and every limit field is rewritten to the reservation (see
:func:`~kvgate_agent.sidecar.reading.request.n_predict_limit`). Pure JSON logic: no HTTP framework.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvgate_agent.sidecar.reading.request import (
    ParsedRequest,
    bad,
    check_context,
    decode_object,
    effective_limit,
    n_predict_limit,
)
from kvgate_agent.sidecar.reading.usage import Counts, EventReader

__all__ = ["Fields", "NativeApi", "model_name", "stream_flag", "text_part"]


@dataclass(slots=True)
class Fields:
    """What one API's parser read from a body (see :meth:`NativeApi.fields`)."""

    model: str | None
    stream: bool
    client_max: int | None  # tokens; None: the client sent no (or an unbounded) limit
    limit_path: tuple[str, ...]
    param: str  # the limit's name in error messages
    sequences: int
    count_body: dict[str, Any]
    some_unset: bool = False  # a per-prompt list where only some elements set the limit


class NativeApi:
    """An engine's own generation API; a subclass reads its body (:meth:`fields`) and its usage
    (:meth:`body_usage`, :meth:`event_reader`). Satisfies
    :class:`~kvgate_agent.sidecar.reading.apis.base.Api`."""

    def __init__(self, name: str, prompt_param: str, limit_param: str) -> None:
        self.name = name
        self.prompt_param = prompt_param
        self.limit_param = limit_param
        self.stream_usage_option = False

    def __repr__(self) -> str:
        return f"<Api {self.name}>"

    def fields(self, body: dict[str, Any]) -> Fields:
        """Validate and read a decoded body.

        Raises:
            RequestError: 400 naming the offending field.
        """
        raise NotImplementedError

    def body_usage(self, data: bytes) -> Counts:
        """See :meth:`~kvgate_agent.sidecar.reading.apis.base.Api.body_usage`."""
        raise NotImplementedError

    def event_reader(self) -> EventReader | None:
        """See :meth:`~kvgate_agent.sidecar.reading.apis.base.Api.event_reader`."""
        raise NotImplementedError

    def parse(
        self,
        raw: bytes,
        *,
        default_max_tokens: int,
        max_tokens_cap: int | None,
        max_model_len: int | None,
    ) -> ParsedRequest:
        """See :meth:`~kvgate_agent.sidecar.reading.apis.base.Route.parse`."""
        return self.parse_body(
            raw,
            decode_object(raw),
            default_max_tokens=default_max_tokens,
            max_tokens_cap=max_tokens_cap,
            max_model_len=max_model_len,
        )

    def parse_body(
        self,
        raw: bytes,
        body: dict[str, Any],
        *,
        default_max_tokens: int,
        max_tokens_cap: int | None,
        max_model_len: int | None,
    ) -> ParsedRequest:
        """:meth:`parse` of a body already decoded from ``raw``."""
        fields = self.fields(body)
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
            api=self,
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


def stream_flag(body: dict[str, Any], param: str = "stream") -> bool:
    """The ``stream`` field; False when absent or null.

    Raises:
        RequestError: 400 naming ``param`` for a non-boolean.
    """
    v = body.get("stream")
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(f"'{param}' must be a boolean", param)
    return v


def model_name(body: dict[str, Any]) -> str:
    """The ``model`` field.

    Raises:
        RequestError: 400 naming ``model`` when absent, not a string or empty (blank).
    """
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise bad("'model' is required and must be a non-empty string", "model")
    return model


def text_part(text: object) -> dict[str, Any]:
    """A chat content part of ``text`` (empty when not a string), for counting."""
    return {"type": "text", "text": text if isinstance(text, str) else ""}
