"""kvgate-sim HTTP server: a vLLM-compatible OpenAI API (chat and text completions with SSE
streaming, ``/v1/models``, ``/health``, ``/metrics`` with vLLM's metric names, ``/sim/stats``,
``/sim/preemptions``)
driven by :class:`~kvgate_bench.sim.engine.SimEngine` in real time.

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
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge
from prometheus_client.exposition import generate_latest

from kvgate_bench.sim.engine import EngineConfig, RequestRejected, Sequence, SimEngine, StepResult
from kvgate_bench.sim.lengths import OUTPUT_TOKENS_HEADER, OutputLengths, parse_output_tokens
from kvgate_bench.sim.prefix_cache import BlockKeys, token_block_keys
from kvgate_bench.sim.prompt_keys import chat_prompt_tokens, completion_prompt_tokens
from kvgate_bench.sim.steptime import StepTimeModel, constant_profile
from kvgate_bench.sim.steptime import profile as steptime_profile

logger = logging.getLogger(__name__)

TENANT_HEADER = "x-kvgate-tenant"
#: How far (real seconds) the engine loop may fall behind its step deadlines and catch up
#: (shorter sleeps); beyond it the lag is written off (``/sim/stats`` ``late_s``).
MAX_LAG_S = 0.25
#: Preempted requests whose counts ``/sim/preemptions`` keeps (the most recent).
PREEMPTED_KEPT = 100_000
WORDS: tuple[str, ...] = (
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy",
    "dog", "while", "kv", "blocks", "fill", "up", "and", "drain",
)  # fmt: skip


@dataclass(frozen=True)
class SimConfig:
    """Simulator configuration (all sizes in tokens, latencies as named).

    Attributes:
        model: served model name; requests naming another model get 404.
        extra_models: further accepted model names (for fallback routing).
        kv_capacity_tokens: KV pool size in tokens; blocks = this // block_size;
            ``None`` means the profile's pool (``constant``: 65536).
        block_size: tokens per KV block.
        max_model_len: maximum prompt + completion tokens per request.
        max_num_seqs: maximum concurrently running requests.
        max_num_batched_tokens: token budget per step (prefill tokens only for
            ``constant``, every scheduled token for the chunked-prefill
            profiles); ``None`` means ``max(8192, max_model_len)`` for
            ``constant`` and 8192 otherwise.
        decode_ms: ``constant`` profile: duration of one engine iteration, milliseconds.
        prefill_us_per_token: ``constant`` profile: extra iteration time per
            prefilled token, microseconds.
        profile: step-time profile (``constant``, ``h100-llama3-8b``,
            ``a100-llama3-8b``; :mod:`kvgate_bench.sim.steptime`), or the name of
            ``steptime_model``'s profile when that is set.
        steptime_model: a step-time model that replaces ``profile``'s (a JSON engine
            profile's: :mod:`kvgate_bench.sim.profile_file`), or ``None``.
        output_lengths: true lengths of requests without ``x-sim-output-tokens``:
            ``max`` (run to max_tokens) or ``lognormal`` (seeded draws).
        output_seed: seed of the ``lognormal`` draws.
        time_scale: real seconds per modelled second (> 0): each step lasts
            ``time_scale x`` its modelled duration on the real clock. Above 1 the
            simulator runs slower than the GPU it models, so that a load generator and a
            proxy on a small machine keep up; the client then sends its arrivals
            ``time_scale x`` later and divides what it measures by it (see
            :mod:`kvgate_bench.effectiveness.realtime`).
        prefix_caching: key the engine's prefix cache with the prompts' tokens
            (``--enable-prefix-caching``; :mod:`kvgate_bench.sim.prompt_keys`), so that
            prompts reuse the KV blocks of leading tokens already cached. Off by default,
            unlike vLLM: every prompt is then content of its own, never a hit (the
            engine's configuration is the same either way), because the harnesses that
            drive kvgate-sim stand for distinct prompts with one repeated token or word,
            which would all share their blocks and be prefilled once.
        prompt_tokens_details: add ``usage.prompt_tokens_details.cached_tokens``
            (the prompt tokens found cached) to responses, streamed usage included, as
            vLLM's ``--enable-prompt-tokens-details`` does.
    """

    model: str = "kvgate-sim-model"
    extra_models: tuple[str, ...] = ()
    kv_capacity_tokens: int | None = None
    block_size: int = 16
    max_model_len: int = 8192
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    decode_ms: float = 10.0
    prefill_us_per_token: float = 20.0
    profile: str = "constant"
    output_lengths: str = "max"
    output_seed: int = 0
    time_scale: float = 1.0
    prefix_caching: bool = False
    prompt_tokens_details: bool = False
    steptime_model: StepTimeModel | None = None

    def __post_init__(self) -> None:
        if not self.time_scale > 0:
            raise ValueError("time_scale must be > 0")

    @property
    def steptime(self) -> StepTimeModel:
        """The step-time model: ``steptime_model`` when set, else ``profile``'s; raises
        ``ValueError`` for an unknown profile."""
        if self.steptime_model is not None:
            return self.steptime_model
        if self.profile == "constant":
            return constant_profile(self.decode_ms, self.prefill_us_per_token)
        return steptime_profile(self.profile)

    @property
    def kv_tokens(self) -> int:
        """KV pool size in tokens: ``kv_capacity_tokens`` or the profile's pool."""
        if self.kv_capacity_tokens is not None:
            return self.kv_capacity_tokens
        return self.steptime.kv_capacity_tokens

    @property
    def num_gpu_blocks(self) -> int:
        """KV pool size in blocks."""
        return self.kv_tokens // self.block_size

    @property
    def served_models(self) -> tuple[str, ...]:
        """Every model name this server accepts, the primary one first."""
        return (self.model, *(m for m in self.extra_models if m != self.model))

    def engine_config(self) -> EngineConfig:
        """The :class:`EngineConfig` for this simulator; ``ValueError`` if invalid."""
        chunked = self.steptime.chunked_prefill
        default_batched = 8192 if chunked else max(8192, self.max_model_len)
        return EngineConfig(
            num_gpu_blocks=self.num_gpu_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens or default_batched,
            chunked_prefill=chunked,
        )

    def output_length_source(self) -> OutputLengths:
        """A fresh :class:`OutputLengths` for this configuration; ``ValueError`` if invalid."""
        return OutputLengths(self.output_lengths, self.output_seed)


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
    """Engine + metrics + the real-time loop; the aiohttp handlers live here.

    One background task runs the engine while there is work: each iteration lasts the duration
    the engine's step-time model gives it (:mod:`kvgate_bench.sim.steptime`: the ``constant``
    profile's ``decode_ms`` plus ``prefill_us_per_token`` per prefilled token by default, or a
    realistic profile's ``a + b*P + c*D + d*K``) times ``time_scale``, paced on the real clock
    to deadlines (step ``k`` ends at the start of the busy period plus the scaled durations of
    steps ``1..k``, so the loop's own CPU time does not stretch it; a lag over
    :data:`MAX_LAG_S` is written off and counted in ``/sim/stats`` ``late_s``), then the tokens
    it produced go to the waiting handlers; when idle it sleeps on an :class:`asyncio.Event` (no
    polling). JSON shapes are those of vLLM's OpenAI server; ``stream_options.include_usage`` is
    honoured as vLLM does; ``max_tokens`` (``max_completion_tokens`` for chat) defaults to
    ``max_model_len - prompt``. A request's tenant is its ``x-kvgate-tenant`` header ("" when
    absent).
    """

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.engine = SimEngine(config.engine_config(), config.steptime)
        self.lengths = config.output_length_source()
        self.runner: web.AppRunner | None = None
        self.active_requests = 0
        self._queues: dict[str, asyncio.Queue[int | None]] = {}
        self._wake = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        #: Response id -> times preempted, for the last PREEMPTED_KEPT preempted requests.
        self.preempted_requests: OrderedDict[str, int] = OrderedDict()
        #: Real seconds the engine loop fell behind its step deadlines by more than
        #: MAX_LAG_S (written off, so the modelled timeline stretched by that much).
        self.late_s = 0.0
        #: The most (real seconds) a step started after its deadline (the previous step's end).
        self.lag_max_s = 0.0
        #: Engine steps taken.
        self.steps = 0
        self.registry = CollectorRegistry(auto_describe=True)
        self._init_metrics()

    # -- metrics (names and help strings from vllm/v1/metrics/loggers.py) -----

    def _init_metrics(self) -> None:
        reg, eng, model = self.registry, self.engine, {"model_name": self.config.model}
        gauges = {
            "vllm:num_requests_running": ("Number of requests in model execution batches.",
                                          lambda: eng.num_running),
            "vllm:num_requests_waiting": ("Number of requests waiting to be processed.",
                                          lambda: eng.num_waiting),
            "vllm:kv_cache_usage_perc": ("KV-cache usage. 1 means 100 percent usage.",
                                         lambda: eng.kv_usage),
        }  # fmt: skip
        for name, (doc, fn) in gauges.items():
            Gauge(name, doc, ["model_name"], registry=reg).labels(**model).set_function(fn)
        self.preemptions = Counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            ["model_name"],
            registry=reg,
        ).labels(**model)
        Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            ["block_size", "num_gpu_blocks"],
            registry=reg,
        ).labels(
            block_size=str(self.config.block_size), num_gpu_blocks=str(self.config.num_gpu_blocks)
        ).set(1)
        self.preemptions_by_tenant = Counter(
            "kvgate_sim_preemptions_by_tenant",
            "Preemptions of requests, by the x-kvgate-tenant header of the preempted request.",
            ["tenant"],
            registry=reg,
        )
        self.requests_total = Counter(
            "kvgate_sim_requests",
            "Requests accepted by the engine, by x-kvgate-tenant header.",
            ["tenant"],
            registry=reg,
        )

    # -- engine loop ----------------------------------------------------------

    async def _run(self) -> None:
        """Step the engine in real time while it has work; wait on the event when idle.

        Should the engine raise (a bug), in-flight requests are aborted and the
        server reports itself dead (503 on /health and new requests), as vLLM
        does when its engine core dies.
        """
        loop = asyncio.get_running_loop()
        scale = self.config.time_scale
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                end = loop.time()  # the first step starts now
                while self.engine.has_work:
                    result = self.engine.step()
                    self.steps += 1
                    self._count_preemptions(result)
                    # Paced to deadlines: a step ends its (scaled) duration after the previous
                    # step ended, so the loop's own CPU time (stepping, delivering tokens) does
                    # not stretch the modelled timeline. Lag beyond MAX_LAG_S is written off.
                    late = loop.time() - end
                    self.lag_max_s = max(self.lag_max_s, late)
                    if late > MAX_LAG_S:
                        self.late_s += late - MAX_LAG_S
                        end += late - MAX_LAG_S
                    end += result.duration_s * scale
                    await asyncio.sleep(max(0.0, end - loop.time()))
                    for rid, index in result.new_tokens.items():
                        queue = self._queues.get(rid)
                        if queue is not None:
                            queue.put_nowait(index)
        except Exception:
            logger.exception("kvgate-sim engine loop died")
            self._abort_all()

    def _count_preemptions(self, result: StepResult) -> None:
        kept = self.preempted_requests
        for rid in result.preempted:
            self.preemptions.inc()
            seq = self.engine.get(rid)
            self.preemptions_by_tenant.labels(tenant=seq.tenant if seq else "").inc()
            kept[rid] = kept.pop(rid, 0) + 1
            if len(kept) > PREEMPTED_KEPT:
                kept.popitem(last=False)

    async def lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        """aiohttp cleanup context: runs the engine loop for the app's lifetime."""
        self._task = asyncio.create_task(self._run(), name="kvgate-sim-engine")
        yield
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    def _abort_all(self) -> None:
        self._closing = True
        for queue in self._queues.values():
            queue.put_nowait(None)

    async def on_shutdown(self, app: web.Application) -> None:
        """Abort in-flight requests so a graceful shutdown does not wait for them."""
        self._abort_all()

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
        if self._closing:
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
            self.engine.check(prompt_tokens, max_tokens)
            if output_tokens is None:
                output_tokens = self.lengths.draw()  # drawn only for requests the engine takes
            seq = self.engine.submit(
                rid, prompt_tokens, max_tokens, tenant, output_tokens, self._keys(body, chat)
            )
        except RequestRejected as exc:
            raise ApiError(400, exc.message, param=exc.param) from None
        self.requests_total.labels(tenant=tenant).inc()
        queue: asyncio.Queue[int | None] = asyncio.Queue()
        self._queues[rid] = queue
        self._wake.set()
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
            del self._queues[rid]
            self.engine.cancel(rid)

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
        return web.Response(status=503 if self._closing else 200)

    async def metrics(self, request: web.Request) -> web.Response:
        """GET /metrics: Prometheus text exposition of this app's registry."""
        return web.Response(
            body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def stats(self, request: web.Request) -> web.Response:
        """GET /sim/stats: engine state as JSON (blocks, counts) for tests and demos."""
        eng = self.engine
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
                "late_s": self.late_s,
                "lag_max_s": self.lag_max_s,
                "steps": self.steps,
            }
        )

    async def preempted(self, request: web.Request) -> web.Response:
        """GET /sim/preemptions: ``{"total": n, "requests": {response id: times}}``: the
        preemptions so far and, for the last :data:`PREEMPTED_KEPT` preempted requests, how
        often each was preempted (by the ``id`` of its completion chunks)."""
        return web.json_response(
            {"total": self.engine.preemptions_total, "requests": dict(self.preempted_requests)}
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
    app.cleanup_ctx.append(sim.lifecycle)
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
