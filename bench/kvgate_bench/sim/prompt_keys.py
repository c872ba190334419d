"""The tokens of a kvgate-sim prompt, for the engine's prefix cache.

kvgate-sim counts a prompt's tokens by words
(:func:`kvgate_bench.sim.server.count_chat_prompt_tokens`,
:func:`~kvgate_bench.sim.server.count_completion_prompt_tokens`); here are the tokens
themselves, as hashable stand-ins, so that two prompts share their leading KV blocks exactly
when their leading tokens match (:func:`kvgate_bench.sim.prefix_cache.token_block_keys`).
A chat message is its words framed by four tokens (its role, a start, a separator, an end),
and the prompt ends with two tokens that open the assistant's answer, as a chat template
does: a conversation resent with one more message shares every block before its old ending.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any


def _words(value: Any) -> list[str]:
    if isinstance(value, str):
        return value.split()
    if isinstance(value, list):  # OpenAI content parts
        out: list[str] = []
        for p in value:
            if isinstance(p, dict):
                out.extend(_words(p.get("text", "")))
        return out
    return []


def chat_prompt_tokens(messages: list[Any]) -> list[Hashable]:
    """The prompt's tokens of a chat request (as many as ``count_chat_prompt_tokens`` counts):
    per message its role, ``<|start|>``, its words, ``<|sep|>`` and ``<|end|>``, then the
    assistant's opening ``<|start|>``, ``assistant``."""
    tokens: list[Hashable] = []
    for m in messages:
        tokens.append(("role", str(m.get("role"))))
        tokens.append("<|start|>")
        tokens.extend(_words(m.get("content")))
        tokens.append("<|sep|>")
        tokens.append("<|end|>")
    tokens.extend(("<|start|>", ("role", "assistant")))
    return tokens


def completion_prompt_tokens(prompt: Any) -> list[Hashable]:
    """The prompt's tokens of a completions request (as many as
    ``count_completion_prompt_tokens`` counts): the words of a string or of a list of strings,
    or the token ids themselves; empty for anything else (the count rejects it)."""
    if isinstance(prompt, str):
        return list(prompt.split())
    if isinstance(prompt, list) and all(isinstance(p, int) for p in prompt):
        return list(prompt)
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        return [w for p in prompt for w in p.split()]
    return []
