"""OpenAI chat (``POST /v1/chat/completions``, llama.cpp's ``/chat/completions``) and completions
(``POST /v1/completions``): the API vLLM, SGLang, TGI and llama.cpp all serve, as two
:class:`~kvgate_agent.sidecar.reading.apis.base.Api` objects, :data:`CHAT` and :data:`COMPLETIONS`.

Only the fields admission depends on are checked; everything else is left for the model server
to judge. An explicit JSON ``null`` counts as absent for the optional fields (``max_tokens``,
``max_completion_tokens``, ``stream``, ``stream_options``, ``n``, ``best_of``), as the OpenAI
API treats it. Usage: ``usage.prompt_tokens``/``completion_tokens``, the cached prompt tokens
``usage.prompt_tokens_details.cached_tokens`` (vLLM with ``--enable-prompt-tokens-details``,
SGLang, llama.cpp) else llama.cpp's ``timings.cache_n``; streams are read by
:class:`~kvgate_agent.sidecar.reading.sse.StreamAccountant` itself (deltas, the usage chunk asked
for with ``stream_options.include_usage``, ``[DONE]``). Pure JSON logic: no HTTP framework.
"""

from __future__ import annotations

from typing import Any

from kvgate_agent.sidecar.reading.request import (
    ParsedRequest,
    bad,
    check_context,
    check_messages,
    check_sequences,
    decode_object,
    effective_limit,
    is_int,
    n_predict_limit,
    positive_int,
)
from kvgate_agent.sidecar.reading.usage import Counts, EventReader, decode_body, openai_cached, pair

__all__ = ["CHAT", "COMPLETIONS", "OpenAI"]


class OpenAI:
    """OpenAI chat (``chat``) or completions: see the module's docstring."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.name = "chat" if chat else "completions"
        self.prompt_param = "messages" if chat else "prompt"
        self.limit_param = "max_tokens"
        self.stream_usage_option = True

    def __repr__(self) -> str:
        return f"<Api {self.name}>"

    def parse(
        self,
        raw: bytes,
        *,
        default_max_tokens: int,
        max_tokens_cap: int | None,
        max_model_len: int | None,
    ) -> ParsedRequest:
        """Decode and validate a request body (see
        :meth:`~kvgate_agent.sidecar.reading.apis.base.Route.parse`).

        Raises:
            RequestError: status 400, ``invalid_request_error``, ``param`` naming the field
                (None for a body that is not UTF-8 JSON or not an object): ``model``,
                ``messages``, ``messages[i]``, ``messages[i].role``, ``prompt``,
                ``max_tokens``, ``max_completion_tokens``, ``stream``, ``stream_options``,
                ``stream_options.include_usage``, ``n``, ``best_of`` (also for more sequences
                than :func:`~kvgate_agent.sidecar.reading.request.check_sequences` allows).
        """
        body = decode_object(raw)
        model = body.get("model")
        if not isinstance(model, str) or not model.strip():
            raise bad("'model' is required and must be a non-empty string", "model")
        if self.chat:
            check_messages(body.get("messages"))
        else:
            if "prompt" not in body:
                raise bad("'prompt' is required", "prompt")
            _check_prompt(body["prompt"])
        field, client_max, also = _client_limit(body, self.chat, max_model_len)
        stream, wants_usage = _stream_options(body)
        n = _sequences(body, self.chat)
        effective, clamped = effective_limit(
            client_max, default_max_tokens, max_tokens_cap, max_model_len
        )
        return ParsedRequest(
            body=body,
            model=model,
            api=self,
            stream=stream,
            client_wants_usage=wants_usage,
            max_tokens=effective,
            max_tokens_defaulted=client_max is None,
            max_tokens_clamped=clamped,
            client_max_tokens=client_max,
            max_tokens_field=field,
            n=n,
            also_limits=also,
            raw=raw,
        )

    def body_usage(self, data: bytes) -> Counts:
        """``usage.prompt_tokens``, ``usage.completion_tokens``,
        :func:`~kvgate_agent.sidecar.reading.usage.openai_cached`."""
        return _usage(decode_body(data))

    def event_reader(self) -> EventReader | None:
        """None: :class:`~kvgate_agent.sidecar.reading.sse.StreamAccountant` reads OpenAI
        streams."""
        return None


#: ``POST /v1/chat/completions``.
CHAT = OpenAI(chat=True)
#: ``POST /v1/completions``.
COMPLETIONS = OpenAI(chat=False)


def _usage(obj: Any) -> Counts:
    if not isinstance(obj, dict):
        return None, None, None
    prompt, completion = pair(obj.get("usage"), "prompt_tokens", "completion_tokens")
    return prompt, completion, openai_cached(obj)


def _check_prompt(prompt: object) -> None:
    """Accept str, list[str], list[int], list[list[int]] (non-empty lists, ids >= 0)."""
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return
        if all(is_int(p) and p >= 0 for p in prompt):
            return
        if all(isinstance(p, list) and p and all(is_int(t) and t >= 0 for t in p) for p in prompt):
            return
    raise bad(
        "'prompt' must be a string, a list of strings, a list of token ids or a list of "
        "lists of token ids (non-empty)",
        "prompt",
    )


def _sequences(body: dict[str, Any], chat: bool) -> int:
    """Sequences of an OpenAI request: ``max(n, best_of, n_cmpl)`` per prompt (vLLM's
    ``best_of``, also the beam width of its ``use_beam_search``:
    https://docs.vllm.ai/en/latest/api/vllm/sampling_params.html; llama.cpp's own ``n_cmpl``,
    "number of completions", copied through its OpenAI routes:
    https://github.com/ggml-org/llama.cpp/blob/master/tools/server/README.md), times the
    prompts of a completions list prompt (a list of strings or of token lists; a list of ints
    is one)."""
    prompts = 1
    prompt = body.get("prompt")
    if not chat and isinstance(prompt, list) and not is_int(prompt[0]):
        prompts = len(prompt)
    get = body.get
    if get("n") is None and get("best_of") is None and get("n_cmpl") is None:
        return check_sequences(1, prompts, "prompt")  # the usual case: one per prompt
    counts = {k: positive_int(body, k) or 1 for k in ("n", "best_of", "n_cmpl")}
    param = max(counts, key=lambda k: counts[k])  # the first of the largest
    per_prompt = counts[param]
    check_sequences(per_prompt, 1, param)
    return check_sequences(per_prompt, prompts, "prompt")


def _client_limit(
    body: dict[str, Any], chat: bool, max_model_len: int | None
) -> tuple[str, int | None, tuple[str, ...]]:
    """(the limit field to rewrite upstream, the client's output limit in tokens or None, other
    limit fields to rewrite: see :func:`n_predict_limit`). Chat's ``max_completion_tokens``
    wins over ``max_tokens``; a limit above the context length is refused."""
    field = "max_tokens"
    client_max = positive_int(body, "max_tokens")
    if chat:
        mct = positive_int(body, "max_completion_tokens")
        if mct is not None:
            field, client_max = "max_completion_tokens", mct
    check_context(field, client_max, max_model_len)
    client_max, also = n_predict_limit(body, client_max, max_model_len)
    return field, client_max, also


def _stream_options(body: dict[str, Any]) -> tuple[bool, bool]:
    """(``stream``, ``stream_options.include_usage``), each False when absent or null."""
    stream = body.get("stream")
    if stream is None:
        stream = False
    elif not isinstance(stream, bool):
        raise bad("'stream' must be a boolean", "stream")
    wants_usage = False
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad("'stream_options' must be an object", "stream_options")
        inc = opts.get("include_usage")
        if inc is not None and not isinstance(inc, bool):
            raise bad(
                "'stream_options.include_usage' must be a boolean", "stream_options.include_usage"
            )
        wants_usage = inc is True
    return stream, wants_usage
