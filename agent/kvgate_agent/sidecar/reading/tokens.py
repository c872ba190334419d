"""Prompt token counting for admission: exact with the model's tokenizer, else a safe estimate,
and the estimates built on a count (optimistic retry, defaulted ``max_tokens`` within the context).

Invariant: without a tokenizer, estimates over-count (``ceil(bytes / bytes_per_token)`` with
``bytes_per_token`` starting below English BPE's ~4) until :meth:`PromptCounter.observe`
calibrates them against the server's reported ``usage.prompt_tokens``. Pure logic: no HTTP.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

__all__ = [
    "DEFAULT_BYTES_PER_TOKEN",
    "NON_TEXT_PART_TOKENS",
    "OPTIMISTIC_BYTES_PER_TOKEN",
    "REPLY_PRIMER_TOKENS",
    "TOKENS_PER_MESSAGE",
    "PromptCount",
    "PromptCounter",
    "default_within_context",
    "optimistic_prompt_tokens",
]

TOKENS_PER_MESSAGE = 4
"""Per chat message overhead, tokens: the larger per-message figure (``gpt-3.5-turbo-0301``) of
OpenAI's cookbook "How to count tokens with tiktoken"
(https://cookbook.openai.com/examples/how_to_count_tokens_with_tiktoken), used for every model;
it also covers the role and separators of common open-model chat templates (Llama 3 frames a
message with ~5 special tokens, so the overhead stays an approximation even when ``exact``)."""
REPLY_PRIMER_TOKENS = 3
"""Tokens priming the assistant reply, once per chat request (OpenAI cookbook)."""
NON_TEXT_PART_TOKENS = 765
"""Tokens charged per non-text content part (image, audio, ...). 765 is what OpenAI bills a
1024x1024 image at ``detail: high`` (85 base + 4 tiles x 170; OpenAI vision guide, "Calculating
costs"); it also exceeds LLaVA-1.5's 576 image tokens. Override per model with the constructor."""
DEFAULT_BYTES_PER_TOKEN = 3.0
"""Initial estimate ratio, UTF-8 bytes per token: below English BPE's ~4 (OpenAI, "What are
tokens and how to count them?": "1 token ~= 4 chars in English"), so it over-counts."""
SAFETY_FACTOR = 0.9
"""Estimates divide by ``SAFETY_FACTOR x`` the observed average bytes/token (over-count 10%)."""
MIN_BYTES_PER_TOKEN = 1.0
MAX_BYTES_PER_TOKEN = 6.0
"""Clamp of the bytes/token ratio used for estimates."""
EMA_ALPHA = 0.1
"""Weight of a new observation in the moving average of bytes/token."""
MIN_OBSERVE_BYTES = 256
"""Observations of prompts with fewer text bytes are ignored: framing dominates them."""

_JSON_SEPARATORS = (",", ":")


@dataclass(frozen=True, slots=True)
class PromptCount:
    """A prompt's size.

    Attributes:
        tokens: prompt tokens (text + ``overhead_tokens`` + token-id prompts).
        text_bytes: UTF-8 bytes of the text that was tokenized or estimated; pass it back to
            :meth:`PromptCounter.observe`.
        exact: True when the text was encoded with the model's tokenizer (or there was no text
            to estimate). Chat framing and non-text parts are fixed approximations regardless.
        overhead_tokens: the fixed part of ``tokens``: chat framing and non-text parts.
    """

    tokens: int
    text_bytes: int
    exact: bool
    overhead_tokens: int = 0


#: Request fields a chat template may render into the prompt, counted as their compact JSON.
PROMPT_JSON_FIELDS = ("tools", "functions", "documents", "chat_template_kwargs")


#: String fields of a content part that reach the prompt as text, whatever the part's ``type``
#: (``text``, ``input_text``, ``output_text``, ``refusal``, ``thinking``: vLLM parses them all as
#: text, https://github.com/vllm-project/vllm/blob/main/vllm/entrypoints/chat_utils.py).
PART_TEXT_FIELDS = ("text", "refusal", "thinking")


def _part_texts(part: object) -> list[str]:
    """The text a content part puts into the prompt: a bare string part, or its string
    :data:`PART_TEXT_FIELDS`; empty for a part without text (an image, audio)."""
    if isinstance(part, str):
        return [part]
    if not isinstance(part, dict):
        return []
    return [t for t in (part.get(k) for k in PART_TEXT_FIELDS) if isinstance(t, str)]


def _utf8_len(s: str) -> int:
    return len(s) if s.isascii() else len(s.encode("utf-8", "surrogatepass"))


def _dumps(obj: object) -> str:
    return json.dumps(obj, separators=_JSON_SEPARATORS, ensure_ascii=False)


class TokenizerError(ValueError):
    """A tokenizer file that cannot be loaded."""


class PromptCounter:
    """Counts the prompt tokens of a chat or completions request body.

    Args:
        tokenizer_file: path of a Hugging Face ``tokenizers`` JSON file (``tokenizer.json``) of
            the served model; None for estimates.

    Raises:
        TokenizerError: the tokenizer file cannot be read or parsed.
        non_text_part_tokens: tokens charged per non-text chat content part.

    Encoding is CPU work proportional to the prompt; a caller on an event loop may want to run
    :meth:`count` in an executor for very large prompts.
    """

    def __init__(
        self,
        tokenizer_file: str | None = None,
        *,
        non_text_part_tokens: int = NON_TEXT_PART_TOKENS,
    ) -> None:
        self._tok: Tokenizer | None = None
        if tokenizer_file is not None:
            try:
                self._tok = Tokenizer.from_file(tokenizer_file)
            except Exception as exc:  # the Rust binding raises a bare Exception
                raise TokenizerError(f"cannot load tokenizer {tokenizer_file}: {exc}") from None
        self._non_text = non_text_part_tokens
        self._avg = DEFAULT_BYTES_PER_TOKEN / SAFETY_FACTOR  # observed bytes/token (EMA)
        self._bpt = DEFAULT_BYTES_PER_TOKEN

    @property
    def exact(self) -> bool:
        """True when a tokenizer is loaded."""
        return self._tok is not None

    @property
    def bytes_per_token(self) -> float:
        """UTF-8 bytes per token used for estimates, within [1.0, 6.0]."""
        return self._bpt

    def count(self, body: Mapping[str, Any]) -> PromptCount:
        """Count the prompt of a request body (already validated as a JSON object).

        Chat (``messages``): each message's ``content`` (a string, or a list of parts where a
        part's text (:data:`PART_TEXT_FIELDS`, any ``type``; a bare string part) counts as text
        and a part without text (an image, audio) costs ``non_text_part_tokens``), ``name``,
        ``reasoning_content`` / ``reasoning`` (an assistant turn's reasoning, which chat
        templates may render) and ``tool_calls`` (JSON), plus
        ``TOKENS_PER_MESSAGE`` per message and ``REPLY_PRIMER_TOKENS``. Completions
        (``prompt``): a string, a list of strings, a list of token ids (one token each) or a list
        of such lists; strings are encoded with the tokenizer's special tokens (as vLLM does).
        The request-level fields a chat template can render into the prompt count too: ``tools``,
        legacy ``functions``, ``documents`` (RAG templates, e.g. Command-R and Granite) and
        ``chat_template_kwargs`` as their compact JSON text, a client's own ``chat_template`` as
        its text (vLLM's chat parameters:
        https://docs.vllm.ai/en/latest/serving/openai_compatible_server.html#chat-api). Unexpected
        shapes are skipped, never raised on.
        """
        chat: list[str] = []  # encoded without special tokens (the chat template adds them)
        plain: list[str] = []  # completions prompts: encoded with special tokens
        fixed = 0
        ids = 0
        messages = body.get("messages")
        if isinstance(messages, list):
            fixed += REPLY_PRIMER_TOKENS + TOKENS_PER_MESSAGE * len(messages)
            for msg in messages:
                if not isinstance(msg, dict):
                    continue
                content = msg.get("content")
                if isinstance(content, str):
                    chat.append(content)
                elif isinstance(content, list):
                    for part in content:
                        texts = _part_texts(part)
                        if texts:
                            chat.extend(texts)
                        else:
                            fixed += self._non_text
                for key in ("name", "reasoning_content", "reasoning"):
                    text = msg.get(key)
                    if isinstance(text, str):
                        chat.append(text)
                tool_calls = msg.get("tool_calls")
                if tool_calls:
                    chat.append(_dumps(tool_calls))
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            plain.append(prompt)
        elif isinstance(prompt, list):
            for p in prompt:
                if isinstance(p, str):
                    plain.append(p)
                elif isinstance(p, int):
                    ids += 1
                elif isinstance(p, list):
                    ids += len(p)
        for key in PROMPT_JSON_FIELDS:
            if body.get(key):
                chat.append(_dumps(body[key]))
        template = body.get("chat_template")
        if isinstance(template, str):
            chat.append(template)

        text_bytes = sum(map(_utf8_len, chat)) + sum(map(_utf8_len, plain))
        if self._tok is None:
            text_tokens = math.ceil(text_bytes / self._bpt)
        else:
            text_tokens = self._encode(chat, special=False) + self._encode(plain, special=True)
        exact = self._tok is not None or text_bytes == 0
        return PromptCount(text_tokens + fixed + ids, text_bytes, exact, fixed)

    def _encode(self, texts: list[str], *, special: bool) -> int:
        assert self._tok is not None
        if not texts:
            return 0
        try:
            encs = self._tok.encode_batch(texts, add_special_tokens=special)
        except Exception:  # e.g. a lone surrogate the Rust side refuses: encode a repaired copy
            fixed = [t.encode("utf-8", "replace").decode("utf-8") for t in texts]
            encs = self._tok.encode_batch(fixed, add_special_tokens=special)
        return sum(len(e.ids) for e in encs)

    def observe(
        self, estimated_bytes: int, actual_prompt_tokens: int, overhead_tokens: int = 0
    ) -> None:
        """Calibrate estimates with the prompt tokens the server reported for a request.

        Args:
            estimated_bytes: ``PromptCount.text_bytes`` of that request (bytes).
            actual_prompt_tokens: the server's ``usage.prompt_tokens`` (tokens).
            overhead_tokens: ``PromptCount.overhead_tokens`` of that request, subtracted so the
                ratio reflects text only (leaving it 0 errs toward over-counting).

        Updates an exponential moving average (weight ``EMA_ALPHA``) of bytes/token; estimates
        then use ``SAFETY_FACTOR x`` the average, clamped to [1.0, 6.0]. Observations with fewer
        than ``MIN_OBSERVE_BYTES`` text bytes or no text tokens are ignored.
        """
        text_tokens = actual_prompt_tokens - overhead_tokens
        if estimated_bytes < MIN_OBSERVE_BYTES or text_tokens <= 0:
            return
        lo, hi = MIN_BYTES_PER_TOKEN / SAFETY_FACTOR, MAX_BYTES_PER_TOKEN / SAFETY_FACTOR
        avg = self._avg + EMA_ALPHA * (estimated_bytes / text_tokens - self._avg)
        self._avg = min(max(avg, lo), hi)
        self._bpt = min(max(SAFETY_FACTOR * self._avg, MIN_BYTES_PER_TOKEN), MAX_BYTES_PER_TOKEN)


OPTIMISTIC_BYTES_PER_TOKEN = 4.5
"""Bytes per token for an optimistic prompt estimate: English text under Llama-3-class BPE
vocabularies averages about 4 bytes per token; 4.5 errs towards fewer tokens."""


def optimistic_prompt_tokens(prompt: PromptCount, bytes_per_token: float) -> int | None:
    """A low estimate (tokens) of an inexact prompt count: the text part re-counted at
    :data:`OPTIMISTIC_BYTES_PER_TOKEN` instead of the cautious ``bytes_per_token``; None for an
    exact count. Admission decides a request that would never fit at the cautious count on this
    one (``AdmissionRequest.prompt_tokens_min``): "never fits" must not rest on a guess, and the
    server's reported usage settles the charge."""
    if prompt.exact:
        return None
    cautious_text = math.ceil(prompt.text_bytes / bytes_per_token)
    rest = max(0, prompt.tokens - cautious_text)
    return rest + math.ceil(prompt.text_bytes / OPTIMISTIC_BYTES_PER_TOKEN)


def default_within_context(default: int, prompt: PromptCount, max_model_len: int) -> int:
    """The max_tokens to charge and send for a request that gave none: the policy's default,
    lowered so prompt + max_tokens stays within the engine's context (the engine's own default
    is max_model_len − prompt; a request that works direct must not fail through kvgate).

    An estimated prompt may under-count (digits, punctuation, CJK), so the room is taken against
    an upper bound first: a byte-level BPE token covers at least one byte, so tokens ≤ text bytes
    + fixed overhead. Where that leaves no room (a long prompt), the estimate is used instead.
    """
    upper = (
        prompt.tokens
        if prompt.exact
        else max(prompt.tokens, prompt.text_bytes + prompt.overhead_tokens)
    )
    for bound in (upper, prompt.tokens):
        if max_model_len - bound >= 1:
            return min(default, max_model_len - bound)
    return default


def output_within_context(max_tokens: int, prompt_tokens: int, context: int) -> int:
    """Output tokens per choice to reserve KV for: ``max_tokens``, at most what ``context`` (the
    most one sequence, prompt + output, holds: tokens) leaves after ``prompt_tokens``, at least
    1. No engine runs a sequence past its context: llama.cpp cuts the answer at its slot's end
    (``finish_reason`` ``length``), vLLM refuses prompt + max_tokens > max_model_len with 400;
    so a request's reservation never exceeds its context, whatever max_tokens it sent.
    """
    return max(1, min(max_tokens, context - prompt_tokens))


def prompt_over_context(prompt: PromptCount, bytes_per_token: float, context: int) -> str | None:
    """Why a prompt can never be served within ``context`` tokens (the engine's
    ``max_model_len``, llama.cpp's slot context), or None when it may fit. A prompt needs room
    for at least one output token: llama-server refuses ``prompt >= n_ctx``
    (``exceed_context_size_error``), vLLM ``prompt + max_tokens > max_model_len``. An estimated
    count is taken at a low end of :data:`MAX_BYTES_PER_TOKEN` bytes a token (Gemma 3's 262k
    vocabulary spends 5-6 bytes on a token of plain English words, above the optimistic 4.5 that
    sizes reservations), so a prompt the engine would serve is not refused on a guess; an exact
    count (a tokenizer file, ``--tokenizer engine``) is judged as it is.
    """
    low = (
        prompt.tokens
        if prompt.exact
        else max(0, prompt.tokens - math.ceil(prompt.text_bytes / bytes_per_token))
        + math.ceil(prompt.text_bytes / MAX_BYTES_PER_TOKEN)
    )
    if low < context:
        return None
    size = f"{low} tokens" if prompt.exact else f"an estimated {low} tokens or more"
    return (
        f"the prompt is {size}, which leaves no room for output within the model's context "
        f"length of {context} tokens; shorten the prompt"
    )
