"""Exact prompt counts from the engine's own tokenizer endpoint (``--tokenizer engine``), with
kvgate's estimate (:class:`~kvgate_agent.sidecar.reading.tokens.PromptCounter`) as the fallback.

Two dialects, told apart by the first answer:

- vLLM (and the llm-d simulator): ``POST /tokenize`` with ``{"model", "prompt"}`` or
  ``{"model", "messages", "add_generation_prompt", "tools", ...}`` answers ``{"count": N, ...}``
  (https://docs.vllm.ai/en/latest/serving/openai_compatible_server.html#tokenizer-api).
- llama.cpp's ``llama-server``: ``POST /tokenize`` with ``{"content", "add_special"}`` answers
  ``{"tokens": [...]}``; a chat is first rendered by ``POST /apply-template`` (``{"messages",
  "tools", ...}`` -> ``{"prompt": "..."}``)
  (https://github.com/ggml-org/llama.cpp/blob/master/tools/server/README.md). A vLLM-shaped
  request gets ``{"tokens": []}`` (no ``count``) from it, which is how it is recognised.

Counts are cached by the SHA-256 of the prompt's fields (an LRU of ``cache_size`` entries), so a
repeated prompt (a retry, the optimistic re-admission) costs no request. A miss waits at most
``timeout`` seconds for the engine; past that, or on any error, the estimate is used and the
engine's answer still fills the cache when it comes. After a failure (no answer, a 5xx, an answer
without a count) the engine is not asked for ``backoff`` seconds, doubled after each further
failure up to :data:`MAX_BACKOFF_SECONDS` and reset by an answer (a 4xx is the prompt's fault, not
the engine's: no pause); at most ``max_in_flight`` requests are outstanding. So an engine that is
down, slow or has no such endpoint adds no latency beyond one ``timeout`` now and then. Each
engine count also calibrates the estimate (:meth:`PromptCounter.observe`), so the fallback
improves while the engine answers.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, Literal

import aiohttp

from kvgate_agent.sidecar.reading import PromptCount, PromptCounter

__all__ = [
    "DEFAULT_BACKOFF_SECONDS",
    "DEFAULT_CACHE_SIZE",
    "DEFAULT_TIMEOUT_SECONDS",
    "EngineTokenizer",
    "TokenizeQuery",
    "tokenize_query",
]

log = logging.getLogger("kvgate")

DEFAULT_TIMEOUT_SECONDS = 0.25
"""Longest wait (seconds) for the engine's count before the estimate is used."""
DEFAULT_CACHE_SIZE = 4096
"""Prompt counts kept (entries; a 32-byte key and an int each)."""
DEFAULT_BACKOFF_SECONDS = 5.0
"""Seconds the engine is not asked after a failed request."""
MAX_BACKOFF_SECONDS = 60.0
"""Longest pause (seconds) after repeated failures."""
DEFAULT_MAX_IN_FLIGHT = 32
"""Most outstanding tokenize requests; beyond them the estimate is used at once."""

#: Chat request fields that reach vLLM's chat ``/tokenize`` and llama.cpp's ``/apply-template``
#: as sent (the template renders them), besides ``messages``.
_CHAT_FIELDS = (
    "tools",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
)
#: Fields whose text a chat template may render but neither tokenize endpoint accepts: such a
#: prompt is estimated (see :data:`~kvgate_agent.sidecar.reading.tokens.PROMPT_JSON_FIELDS`).
_UNSUPPORTED_FIELDS = ("functions", "documents")

Dialect = Literal["vllm", "llamacpp"]


class TokenizeQuery:
    """What to ask the engine for one prompt: a completions ``prompt`` string or a chat.

    Attributes:
        prompt: the completions prompt (None for a chat).
        chat: ``messages`` and the :data:`_CHAT_FIELDS` present (None for a completion).
        key: SHA-256 of the query's canonical JSON (the cache key).
    """

    __slots__ = ("chat", "key", "prompt")

    def __init__(self, prompt: str | None, chat: dict[str, Any] | None) -> None:
        self.prompt = prompt
        self.chat = chat
        canon = json.dumps(
            [prompt, chat], separators=(",", ":"), sort_keys=True, ensure_ascii=False
        )
        self.key = hashlib.sha256(canon.encode("utf-8", "surrogatepass")).digest()


def _text_only(messages: list[Any]) -> bool:
    """Every message's content is a string, null or a list of text parts (an image or audio
    part needs the engine's multimodal processor: estimated instead)."""
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"):
                    return False
        elif content is not None and not isinstance(content, str):
            return False
    return True


def tokenize_query(body: Mapping[str, Any]) -> TokenizeQuery | None:
    """The query for a prompt in :meth:`PromptCounter.count`'s shape, or None where the engine
    cannot count it exactly (a list prompt, token ids, non-text parts, ``functions`` or
    ``documents``): those keep the estimate."""
    if any(body.get(k) for k in _UNSUPPORTED_FIELDS):
        return None
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        if not _text_only(messages) or "prompt" in body:
            return None
        chat = {"messages": messages}
        chat.update({k: body[k] for k in _CHAT_FIELDS if body.get(k) is not None})
        return TokenizeQuery(None, chat)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # one string prompt (llama.cpp's /completion is parsed as a list)
    if isinstance(prompt, str) and not any(body.get(k) for k in _CHAT_FIELDS):
        return TokenizeQuery(prompt, None)
    return None


class EngineError(Exception):
    """The engine's tokenize endpoint gave no count (status, shape); ``status`` is the HTTP
    status when it answered with an error."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class EngineTokenizer:
    """Prompt counts from the engine's ``/tokenize`` (see the module docstring).

    Args:
        upstream: the engine's base URL, without a trailing ``/``.
        counter: the estimator: the fallback, calibrated with every engine count.
        timeout: seconds a request waits for a count it does not have (> 0).
        cache_size: counts kept, least recently used dropped first (>= 1).
        backoff: seconds without asking after a failed tokenize request.
        max_in_flight: most outstanding tokenize requests.
        clock: monotonic seconds (injected for tests).
        session: returns the client to ask the engine with, None while there is none.

    ``session`` returns the client to ask the engine with (the sidecar's
    :meth:`ModelServer.opened_session`); while it returns None every count is the estimate.
    """

    def __init__(
        self,
        upstream: str,
        counter: PromptCounter,
        *,
        timeout: float = DEFAULT_TIMEOUT_SECONDS,
        cache_size: int = DEFAULT_CACHE_SIZE,
        backoff: float = DEFAULT_BACKOFF_SECONDS,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        clock: Callable[[], float] = time.monotonic,
        session: Callable[[], aiohttp.ClientSession | None] = lambda: None,
    ) -> None:
        if timeout <= 0 or cache_size < 1 or max_in_flight < 1:
            raise ValueError("timeout must be > 0, cache_size and max_in_flight >= 1")
        self.upstream = upstream
        self.counter = counter
        self.timeout = timeout
        self.cache_size = cache_size
        self.backoff = backoff
        self.max_in_flight = max_in_flight
        self._session = session
        self.dialect: Dialect | None = None
        self._clock = clock
        self._cache: OrderedDict[bytes, int] = OrderedDict()
        self._pending: dict[bytes, asyncio.Task[int]] = {}
        self._quiet_until = float("-inf")
        self._pause = 0.0  # the last pause after failures, seconds (0: the last call answered)
        #: Counts answered, by source: ``engine``, ``cache``, ``estimate`` (the fallback: the
        #: engine slow, down or failing), ``unsupported`` (a prompt it cannot count; the
        #: estimate too).
        self.answered: dict[str, int] = dict.fromkeys(
            ("engine", "cache", "estimate", "unsupported"), 0
        )

    async def count(self, body: Mapping[str, Any], estimate: PromptCount) -> PromptCount:
        """The prompt count of ``body`` (as :meth:`PromptCounter.count` reads it): the engine's
        exact one when cached or answered within :attr:`timeout`, else ``estimate``. Never
        raises for the engine's faults."""
        if estimate.exact:  # token ids only, or no text: nothing to ask
            return estimate
        query = tokenize_query(body)
        if query is None:
            self.answered["unsupported"] += 1
            return estimate
        cached = self._cache.get(query.key)
        if cached is not None:
            self._cache.move_to_end(query.key)
            self.answered["cache"] += 1
            return self._exact(cached, estimate)
        task = self._pending.get(query.key)
        if task is None:
            session = self._session()
            if session is None or self._clock() < self._quiet_until:
                return self._fallback(estimate)
            if len(self._pending) >= self.max_in_flight:
                return self._fallback(estimate)
            task = asyncio.ensure_future(self._fetch(session, query, estimate))
            self._pending[query.key] = task
            task.add_done_callback(functools.partial(self._settle, query.key))
        try:
            tokens = await asyncio.wait_for(asyncio.shield(task), self.timeout)
        except Exception:  # slow, down or wrong: the estimate, never a failed request
            return self._fallback(estimate)
        self.answered["engine"] += 1
        return self._exact(tokens, estimate)

    def close(self) -> None:
        """Cancel the outstanding tokenize requests (at shutdown, before the session closes)."""
        for task in list(self._pending.values()):
            task.cancel()

    @staticmethod
    def _exact(tokens: int, estimate: PromptCount) -> PromptCount:
        return PromptCount(tokens, estimate.text_bytes, True, 0)

    def _fallback(self, estimate: PromptCount) -> PromptCount:
        self.answered["estimate"] += 1
        return estimate

    def _settle(self, key: bytes, task: asyncio.Task[int]) -> None:
        """A tokenize request ended: cache its count, or stop asking for :attr:`backoff`."""
        self._pending.pop(key, None)
        if task.cancelled():
            return
        exc = task.exception()
        if isinstance(exc, EngineError) and exc.status is not None and exc.status < 500:
            return  # this prompt's fault (a template that refuses it): the next may be fine
        if exc is not None:
            twice = min(2 * self._pause, MAX_BACKOFF_SECONDS)
            pause = self._pause = self.backoff if self._pause == 0 else twice
            log.warning(
                "engine tokenize failed (%s); estimating prompts for %.0fs",
                exc or type(exc).__name__,
                pause,
            )
            self._quiet_until = self._clock() + pause
            return
        self._pause = 0.0
        self._cache[key] = task.result()
        self._cache.move_to_end(key)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    async def _fetch(
        self, session: aiohttp.ClientSession, query: TokenizeQuery, estimate: PromptCount
    ) -> int:
        """The engine's count for ``query`` (tokens), learning the dialect on the first call.

        Raises:
            EngineError, aiohttp.ClientError, TimeoutError, ValueError: no count.
        """
        if self.dialect != "llamacpp":
            answer = await self._post(session, "/tokenize", _vllm_body(query))
            if "count" in answer:
                self.dialect = "vllm"
                tokens = _int(answer["count"])
                self.counter.observe(estimate.text_bytes, tokens, estimate.overhead_tokens)
                return tokens
            if self.dialect == "vllm" or "tokens" not in answer:
                raise EngineError(f"no count in the engine's /tokenize answer: {answer!r:.200}")
            self.dialect = "llamacpp"
        tokens = await self._llamacpp_count(session, query)
        self.counter.observe(estimate.text_bytes, tokens, estimate.overhead_tokens)
        return tokens

    async def _llamacpp_count(self, session: aiohttp.ClientSession, query: TokenizeQuery) -> int:
        """llama.cpp: the chat rendered by ``/apply-template``, then ``/tokenize`` with the
        model's special tokens added (its completion routes tokenize prompts so)."""
        if query.chat is not None:
            rendered = await self._post(session, "/apply-template", query.chat)
            content = rendered.get("prompt")
            if not isinstance(content, str):
                raise EngineError("no prompt in the engine's /apply-template answer")
        else:
            assert query.prompt is not None
            content = query.prompt
        answer = await self._post(session, "/tokenize", {"content": content, "add_special": True})
        tokens = answer.get("tokens")
        if not isinstance(tokens, list):
            raise EngineError("no tokens in the engine's /tokenize answer")
        return len(tokens)

    async def _post(
        self, session: aiohttp.ClientSession, path: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        data = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode(
            "utf-8", "surrogatepass"
        )
        timeout = aiohttp.ClientTimeout(total=max(10 * self.timeout, 5.0))
        async with session.post(
            self.upstream + path,
            data=data,
            headers={"Content-Type": "application/json"},
            timeout=timeout,
        ) as r:
            if r.status != 200:
                raise EngineError(f"{path} answered {r.status}", r.status)
            answer = await r.json(content_type=None)
        if not isinstance(answer, dict):
            raise EngineError(f"{path} answered no JSON object")
        return answer


def _vllm_body(query: TokenizeQuery) -> dict[str, Any]:
    """vLLM's ``/tokenize`` body: a completion's prompt with the special tokens it adds, or a
    chat with the generation prompt (as a chat request renders it unless the client says
    otherwise). The model is not named: vLLM serves one model per server."""
    if query.chat is not None:
        return {"add_generation_prompt": True, **query.chat}
    return {"prompt": query.prompt, "add_special_tokens": True}


def _int(value: object) -> int:
    if type(value) is not int or value < 0:
        raise EngineError(f"the engine's count is not a count: {value!r:.40}")
    return value
