"""The chained hashes of a prompt's leading full KV blocks, as an engine's prefix cache names
them, for prefix-aware reservations (:mod:`kvgate_agent.admission.prefix_index`).

vLLM's automatic prefix caching (https://docs.vllm.ai/en/latest/design/prefix_caching.html)
names each *full* block of ``B`` tokens (``B``: the policy's ``model.blockSize``) by a hash of
its parent block's hash and its own tokens, so two prompts share block ``i``'s hash exactly when
their first ``(i + 1) x B`` tokens match; a partial last block is never named. SGLang's radix
cache and llama.cpp's slot cache reuse the same leading tokens. :func:`prefix_blocks` names a
prompt's leading full blocks the same way, from what the request carries:

- token ids, when the prompt is given as ids (completions' ``prompt`` as a list of ints or one
  such list; llama.cpp's ``prompt`` of ids; SGLang's ``input_ids``): block ``i`` is ids
  ``[i*B, (i+1)*B)``, exactly the engine's blocks;
- else the prompt's canonical text (a completions, TGI or SGLang prompt string as is; chat,
  Responses and Messages messages serialized in order, one compact JSON object with sorted keys
  per message, empty fields dropped): block ``i`` is bytes ``[i*4B, (i+1)*4B)`` of its UTF-8,
  :data:`BYTES_PER_TOKEN` bytes standing for a token. Such a block only approximates ``B``
  tokens; the prefix index's ``trust`` (the engine's reported cached tokens over the index's
  run) absorbs the difference.

Each chain starts from a seed hashed from the kind of prompt (ids or text), the model name and,
for chat, the request fields a chat template renders around the messages (``tools``,
``functions``, ``documents``, ``chat_template``, ``chat_template_kwargs``): prompts for different
models or tool sets never share a block. Since a conversation's next turn resends the earlier
turns first, its leading blocks are the earlier turn's.

A batch of several prompts, a prompt of mixed strings and ids, or embeddings are not named
(None): their reservation stays the whole prompt. Cost: O(prompt bytes) for the serialization,
bounded by the request body, and at most ``max_blocks`` blocks hashed (BLAKE2b, 8-byte digests).
Pure: no I/O, no clock.

:class:`PrefixNaming` is the sidecar's gate: it names blocks only once the engine has reported
cached prompt tokens (a positive count) at least once; an engine without a prefix cache, or one
that does not report it, keeps whole-prompt reservations.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

__all__ = [
    "BYTES_PER_TOKEN",
    "MAX_BLOCKS",
    "PrefixNaming",
    "canonical_text",
    "prefix_blocks",
    "prompt_ids",
]

#: UTF-8 bytes of prompt text standing for one token when no token ids are given (about 4 for
#: English text with the common BPE tokenizers).
BYTES_PER_TOKEN = 4
#: Blocks hashed at most per prompt (131,072 tokens of 16-token blocks), also when the context
#: is larger; the context per request bounds it further.
MAX_BLOCKS = 8192
#: Request fields a chat template renders into the prompt besides the messages: part of a chat
#: chain's seed.
TEMPLATE_FIELDS = ("tools", "functions", "documents", "chat_template", "chat_template_kwargs")


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def _compact(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"))


def _seed(kind: str, model: str, body: Mapping[str, Any]) -> int:
    """The chain's seed: the prompt's kind, ``model`` and the template fields present."""
    extra = {k: body[k] for k in TEMPLATE_FIELDS if body.get(k) is not None}
    text = f"{kind}\0{model}\0{_compact(extra) if extra else ''}"
    return _digest(text.encode("utf-8", "surrogatepass"))


def prompt_ids(body: Mapping[str, Any]) -> list[int] | None:
    """The prompt's token ids when ``body["prompt"]`` is a list of non-negative ints (or a list
    holding one such list); None otherwise."""
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        return None
    if len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
        if not prompt:
            return None
    if all(type(t) is int and t >= 0 for t in prompt):
        return prompt
    return None


def _message(msg: object) -> str:
    """One message as compact JSON with sorted keys, fields that are None or empty dropped (a
    client resending an answer with ``"refusal": null`` names the same prompt)."""
    if isinstance(msg, dict):
        msg = {k: v for k, v in msg.items() if v is not None and v != "" and v != []}
    return _compact(msg) + "\n"


def canonical_text(body: Mapping[str, Any], limit: int) -> str | None:
    """The prompt as text: a ``prompt`` string (or a list holding one string) as is; the
    ``messages`` serialized in order (:func:`_message` each), stopping once ``limit`` characters
    are reached. None for any other prompt (a batch, ids, mixed)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts: list[str] = []
        size = 0
        for m in messages:
            s = _message(m)
            parts.append(s)
            size += len(s)
            if size >= limit:
                break
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else None


def _chain(seed: int, blocks: list[bytes]) -> list[int]:
    out: list[int] = []
    h = seed
    for block in blocks:
        h = _digest(h.to_bytes(8, "big") + block)
        out.append(h)
    return out


def prefix_blocks(
    body: Mapping[str, Any], model: str, block_size: int, max_blocks: int = MAX_BLOCKS
) -> list[int] | None:
    """The chained hashes of the prompt's leading full blocks (module docstring).

    Args:
        body: the prompt in counting shape (a parsed request's ``count_body``, else its body):
            ``messages`` (with the template fields beside them) or ``prompt``.
        model: the model asked for (the chain's seed).
        block_size: tokens per KV block, ``B`` (the policy's ``model.blockSize``), >= 1.
        max_blocks: blocks hashed at most (the context per request over ``B``, say), >= 0.

    Returns:
        At most ``max_blocks`` hashes (unsigned 64-bit ints), block ``i`` covering tokens
        ``[i*B, (i+1)*B)``; ``[]`` for a prompt shorter than one block; None for a prompt that
        cannot be named (a batch, mixed strings and ids, embeddings, no prompt).
    """
    ids = prompt_ids(body)
    if ids is not None:
        n = min(len(ids) // block_size, max_blocks)
        blocks = [
            ",".join(map(str, ids[i * block_size : (i + 1) * block_size])).encode()
            for i in range(n)
        ]
        return _chain(_seed("ids", model, body), blocks)
    step = block_size * BYTES_PER_TOKEN
    text = canonical_text(body, (max_blocks + 1) * step)
    if text is None:
        return None
    data = text.encode("utf-8", "surrogatepass")
    n = min(len(data) // step, max_blocks)
    return _chain(_seed("text", model, body), [data[i * step : (i + 1) * step] for i in range(n)])


class PrefixNaming:
    """Whether the sidecar names prompts' blocks for admission: only once the engine has
    reported a positive count of cached prompt tokens (:meth:`observe`); until then every
    request is reserved whole (``prefix_blocks`` None).

    Attributes:
        reported: the engine reported cached prompt tokens at least once.
    """

    __slots__ = ("reported",)

    def __init__(self) -> None:
        self.reported = False

    def observe(self, cached_tokens: int | None) -> None:
        """The engine reported ``cached_tokens`` cached prompt tokens for a request (None: it
        did not say); a positive count opens the gate for good."""
        if cached_tokens is not None and cached_tokens > 0:
            self.reported = True

    def blocks(
        self, body: Mapping[str, Any], model: str, block_size: int, context: int | None
    ) -> list[int] | None:
        """:func:`prefix_blocks` of a request once the gate is open, at most ``context //
        block_size`` blocks (``context``: tokens per request, None: unknown) and
        :data:`MAX_BLOCKS`; None while it is closed."""
        if not self.reported:
            return None
        cap = MAX_BLOCKS if context is None else min(MAX_BLOCKS, context // block_size)
        return prefix_blocks(body, model, block_size, cap)
