"""kvgate-sim HTTP server: a vLLM-compatible OpenAI API (chat and text completions with SSE
streaming, ``/v1/models``, ``/health``, ``/metrics`` with vLLM's metric names, ``/sim/stats``,
``/sim/preemptions``)
driven by :class:`~kvgate_bench.sim.engine.SimEngine` in real time
(:class:`~kvgate_bench.sim.loop.EngineLoop`), configured by
:class:`~kvgate_bench.sim.config.SimConfig`.

Invariant: deterministic output without a tokenizer; generated token ``i`` is the word
``WORDS[i % len(WORDS)]`` with a leading space, so a completion's whitespace word count equals
its token count. A completion has ``min(L, max_tokens)`` tokens, ``L`` its true length (the
simulator-only header ``x-sim-output-tokens``, else a draw from
:class:`kvgate_bench.sim.lengths.OutputLengths`, by default none: it runs to ``max_tokens``);
finish_reason is ``"stop"`` when ``L < max_tokens``, ``"length"`` otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.exposition import generate_latest

from kvgate_bench.sim.config import SimConfig
from kvgate_bench.sim.lengths import OUTPUT_TOKENS_HEADER, parse_output_tokens
from kvgate_bench.sim.loop import EngineLoop
from kvgate_bench.sim.prefix_cache import BlockKeys, token_block_keys
from kvgate_bench.sim.prompt_keys import chat_prompt_tokens, completion_prompt_tokens
from kvgate_bench.sim.sequences import RequestRejected, Sequence

TENANT_HEADER = "x-kvgate-tenant"
WORDS: tuple[str, ...] = (
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy",
    "dog", "while", "kv", "blocks", "fill", "up", "and", "drain",
)  # fmt: skip


class ApiError(Exception):
    """An OpenAI-style error, rendered as ``{"error": {message, type, param, code}}``."""

    def __init__(
        self, status: int, message: str, param: str | None = None, err_type: str = "BadRequestError"
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.err_type, self.param = status, message, err_type, param

    def response(self) -> web.Response:
        """The JSON error response, shaped like vLLM's ``ErrorResponse``."""
        body = {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.status,
            }
        }
        return web.json_response(body, status=self.status)


def token_text(index: int) -> str:
    """Text of output token ``index`` (0-based): one word with a leading space."""
    return " " + WORDS[index % len(WORDS)]


def _words(value: Any) -> int:
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, list):  # OpenAI content parts
        return sum(_words(p.get("text", "")) for p in value if isinstance(p, dict))
    return 0


def count_chat_prompt_tokens(messages: list[Any]) -> int:
    """Prompt tokens of a chat request: ``sum(words(content) + 4 for each message) + 2``; a list
    content counts the words of its ``text`` parts."""
    return sum(_words(m.get("content")) + 4 for m in messages) + 2


def count_completion_prompt_tokens(prompt: Any) -> int:
    """Prompt tokens of a completions request: the words of a string, the sum over a list of
    strings (treated as ONE prompt, unlike vLLM's batch semantics), the length of a list of
    token ids."""
    if isinstance(prompt, str):
        return len(prompt.split())
    if isinstance(prompt, list) and all(isinstance(p, int) for p in prompt):
        return len(prompt)
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        return sum(len(p.split()) for p in prompt)
    raise ApiError(400, "'prompt' must be a string or a list of strings or token ids", "prompt")


def _opt_int(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"'{key}' must be an integer", param=key)
    return value


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class SimServer:
    """The aiohttp handlers in front of :attr:`loop` (the engine on the real clock,
    :class:`~kvgate_bench.sim.loop.EngineLoop`, and its metrics). JSON shapes are those of
    vLLM's OpenAI server; ``stream_options.include_usage`` is honoured as vLLM does;
    ``max_tokens`` (``max_completion_tokens`` for chat) defaults to ``max_model_len - prompt``.
    A request's tenant is its ``x-kvgate-tenant`` header ("" when absent).
    """

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.loop = EngineLoop(config)
        self.lengths = config.output_length_source()
        self.runner: web.AppRunner | None = None
        self.active_requests = 0

    async def on_shutdown(self, app: web.Application) -> None:
        """Abort in-flight requests so a graceful shutdown does not wait for them."""
        self.loop.abort_all()

    # -- handlers -------------------------------------------------------------

    @web.middleware
    async def error_middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Render :class:`ApiError` as an OpenAI error body."""
        try:
            resp: web.StreamResponse = await handler(request)
            return resp
        except ApiError as exc:
            return exc.response()

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions."""
        return await self._complete(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions."""
        return await self._complete(request, chat=False)

    async def _parse(self, request: web.Request, chat: bool) -> tuple[dict[str, Any], int]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"Invalid JSON body: {exc}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "Request body must be a JSON object")
        model = body["model"] = body.get("model") or self.config.model  # optional, as vLLM
        if model not in self.config.served_models:
            raise ApiError(404, f"The model `{model}` does not exist.", "model", "NotFoundError")
        if chat:
            messages = body.get("messages")
            if (
                not isinstance(messages, list)
                or not messages
                or not all(isinstance(m, dict) for m in messages)
            ):
                raise ApiError(400, "'messages' must be a non-empty list of objects", "messages")
            prompt_tokens = count_chat_prompt_tokens(messages)
        else:
            if "prompt" not in body:
                raise ApiError(400, "'prompt' is required", param="prompt")
            prompt_tokens = count_completion_prompt_tokens(body["prompt"])
        n = _opt_int(body, "n")
        if n not in (None, 1):
            raise ApiError(400, "kvgate-sim supports only n=1", param="n")
        if body.get("stream_options") is not None and not body.get("stream"):
            raise ApiError(
                400,
                "Stream options can only be defined when `stream=True`.",
                param="stream_options",
            )
        return body, prompt_tokens

    async def _complete(self, request: web.Request, chat: bool) -> web.StreamResponse:
        if self.loop.closing:
            raise ApiError(503, "Server is shutting down or its engine died",
                           err_type="ServiceUnavailableError")  # fmt: skip
        body, prompt_tokens = await self._parse(request, chat)
        max_tokens = _opt_int(body, "max_completion_tokens") if chat else None
        if max_tokens is None:
            max_tokens = _opt_int(body, "max_tokens")
        if max_tokens is None:
            max_tokens = self.config.max_model_len - prompt_tokens
        tenant = request.headers.get(TENANT_HEADER, "")
        try:
            output_tokens = parse_output_tokens(request.headers.get(OUTPUT_TOKENS_HEADER))
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        try:
            self.loop.engine.check(prompt_tokens, max_tokens)
            if output_tokens is None:
                output_tokens = self.lengths.draw()  # drawn only for requests the engine takes
            seq = self.loop.engine.submit(
                rid, prompt_tokens, max_tokens, tenant, output_tokens, self._keys(body, chat)
            )
        except RequestRejected as exc:
            raise ApiError(400, exc.message, param=exc.param) from None
        queue = self.loop.open(rid, tenant)
        self.active_requests += 1
        details = seq if self.config.prompt_tokens_details else None
        reply = _Reply(rid, str(body["model"]), chat, prompt_tokens, seq.finish_reason, seq=details)
        try:
            if body.get("stream"):
                opts = body.get("stream_options") or {}
                include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
                return await self._stream(request, reply, queue, seq.target_tokens, include_usage)
            return await self._collect(reply, queue, seq.target_tokens)
        finally:
            # Runs on completion, on error and on client disconnect (handler cancelled).
            self.active_requests -= 1
            self.loop.close(rid)

    def _keys(self, body: dict[str, Any], chat: bool) -> BlockKeys | None:
        """The prompt's full blocks of tokens, for the prefix cache (None when
        ``prefix_caching`` is off: content of its own)."""
        if not self.config.prefix_caching:
            return None
        if chat:
            tokens = chat_prompt_tokens(body["messages"])
        else:
            tokens = completion_prompt_tokens(body["prompt"])
        return token_block_keys(tokens, self.config.block_size)

    async def _collect(
        self, reply: _Reply, queue: asyncio.Queue[int | None], target: int
    ) -> web.Response:
        text: list[str] = []
        while len(text) < target:
            index = await queue.get()
            if index is None:
                raise ApiError(
                    503,
                    "Request aborted: server is shutting down",
                    err_type="ServiceUnavailableError",
                )
            text.append(token_text(index))
        return web.json_response(reply.full("".join(text), len(text)))

    async def _stream(
        self,
        request: web.Request,
        reply: _Reply,
        queue: asyncio.Queue[int | None],
        target: int,
        include_usage: bool,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        sent = 0
        with contextlib.suppress(ConnectionResetError):  # client went away mid-write
            await resp.prepare(request)
            if reply.chat:
                await resp.write(_sse(reply.chunk({"role": "assistant", "content": ""}, None)))
            while sent < target:
                index = await queue.get()
                if index is None:  # shutting down: end the stream without [DONE]
                    return resp
                sent += 1
                finish = reply.finish_reason if sent == target else None
                await resp.write(_sse(reply.chunk(token_text(index), finish)))
            if include_usage:
                await resp.write(_sse(reply.usage_chunk(sent)))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        return resp

    async def models(self, request: web.Request) -> web.Response:
        """GET /v1/models: OpenAI model list."""
        now = int(time.time())
        data = [
            {
                "id": name,
                "object": "model",
                "created": now,
                "owned_by": "vllm",
                "root": name,
                "parent": None,
                "max_model_len": self.config.max_model_len,
            }
            for name in self.config.served_models
        ]
        return web.json_response({"object": "list", "data": data})

    async def health(self, request: web.Request) -> web.Response:
        """GET /health: 200 with an empty body, as vLLM; 503 once shutting down."""
        return web.Response(status=503 if self.loop.closing else 200)

    async def metrics(self, request: web.Request) -> web.Response:
        """GET /metrics: Prometheus text exposition of this app's registry."""
        return web.Response(
            body=generate_latest(self.loop.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def stats(self, request: web.Request) -> web.Response:
        """GET /sim/stats: engine state as JSON (blocks, counts) for tests and demos."""
        loop, eng = self.loop, self.loop.engine
        server = self.runner.server if self.runner is not None else None
        return web.json_response(
            {
                "running": eng.num_running,
                "waiting": eng.num_waiting,
                "used_blocks": eng.used_blocks,
                "cached_blocks": eng.cached_blocks,
                "num_gpu_blocks": eng.config.num_gpu_blocks,
                "profile": self.config.profile,
                "kv_usage": eng.kv_usage,
                "preemptions": eng.preemptions_total,
                "preemptions_by_tenant": eng.preemptions_by_tenant,
                "finished_total": eng.finished_total,
                "cancelled_total": eng.cancelled_total,
                "active_requests": self.active_requests,
                "active_connections": len(server.connections) if server is not None else None,
                "time_scale": self.config.time_scale,
                "late_s": loop.late_s,
                "lag_max_s": loop.lag_max_s,
                "steps": loop.steps,
            }
        )

    async def preempted(self, request: web.Request) -> web.Response:
        """GET /sim/preemptions: ``{"total": n, "requests": {response id: times}}``: the
        preemptions so far and, for the last
        :data:`~kvgate_bench.sim.loop.PREEMPTED_KEPT` preempted requests, how
        often each was preempted (by the ``id`` of its completion chunks)."""
        return web.json_response(
            {
                "total": self.loop.engine.preemptions_total,
                "requests": dict(self.loop.preempted_requests),
            }
        )


@dataclass(frozen=True)
class _Reply:
    """Builds the OpenAI response objects of one request (``finish_reason``: stop or length)."""

    rid: str
    model: str
    chat: bool
    prompt_tokens: int
    finish_reason: str = "length"
    created: int = field(default_factory=lambda: int(time.time()))
    #: The request in the engine, when the usage carries ``prompt_tokens_details``.
    seq: Sequence | None = None

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def _usage(self, completion_tokens: int) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        }
        if self.seq is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.seq.cached_tokens}
        return usage

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def chunk(self, content: str | dict[str, str], finish: str | None) -> dict[str, Any]:
        """One streaming chunk: chat delta (``content`` may be a full delta) or text."""
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["delta"] = content if isinstance(content, dict) else {"content": content}
        else:
            choice["text"] = content
        choice.update(logprobs=None, finish_reason=finish)
        if finish is not None:
            choice["stop_reason"] = None
        return {**self._head(self._chunk_object), "choices": [choice]}

    def usage_chunk(self, completion_tokens: int) -> dict[str, Any]:
        """The final ``include_usage`` chunk: ``choices: []`` plus usage."""
        return {
            **self._head(self._chunk_object),
            "choices": [],
            "usage": self._usage(completion_tokens),
        }

    def full(self, text: str, completion_tokens: int) -> dict[str, Any]:
        """The non-streaming response object."""
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice.update(logprobs=None, finish_reason=self.finish_reason, stop_reason=None)
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [choice], "usage": self._usage(completion_tokens)}


SIM_KEY = web.AppKey("kvgate_sim", SimServer)


def create_app(config: SimConfig) -> web.Application:
    """Build the simulator's aiohttp application (its own Prometheus registry).

    The :class:`SimServer` is available as ``app[SIM_KEY]``.
    """
    sim = SimServer(config)
    app = web.Application(middlewares=[sim.error_middleware])
    app[SIM_KEY] = sim
    app.cleanup_ctx.append(sim.loop.lifecycle)
    app.on_shutdown.append(sim.on_shutdown)
    app.router.add_post("/v1/chat/completions", sim.chat_completions)
    app.router.add_post("/v1/completions", sim.completions)
    app.router.add_get("/v1/models", sim.models)
    app.router.add_get("/health", sim.health)
    app.router.add_get("/metrics", sim.metrics)
    app.router.add_get("/sim/stats", sim.stats)
    app.router.add_get("/sim/preemptions", sim.preempted)
    return app


async def start_sim(
    config: SimConfig, host: str = "127.0.0.1", port: int = 0
) -> tuple[web.AppRunner, int]:
    """Start the simulator in the running loop; returns ``(runner, bound_port)``.

    ``port=0`` picks a free port. Handlers are cancelled when their client
    disconnects (``handler_cancellation=True``), which cancels the request in
    the engine and frees its KV blocks. Stop with ``await runner.cleanup()``.
    """
    app = create_app(config)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    app[SIM_KEY].runner = runner
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    return runner, int(bound)
