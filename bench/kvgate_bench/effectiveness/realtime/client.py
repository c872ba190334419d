"""The real-time run's client: each request of the schedule sent at its arrival time as a
streaming completion (:func:`request_body`: token ids, or a chat of words) with its tenant, its
priority and its true output length in headers, and what came back recorded in its
:class:`~kvgate_bench.effectiveness.model.gate.RequestRecord` (:class:`Client`); kvgate-sim's KV
usage integrated over modelled time (:func:`sample_kv`). See
:mod:`kvgate_bench.effectiveness.realtime`.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import Any

import aiohttp

from kvgate_bench.effectiveness.model.gate import (
    DEGRADED,
    REJECTED,
    SERVED,
    RequestRecord,
)
from kvgate_bench.effectiveness.model.schedule import Request
from kvgate_bench.effectiveness.realtime.servers import MODEL
from kvgate_bench.kit.sse import sse_json
from kvgate_bench.sim.lengths import OUTPUT_TOKENS_HEADER
from kvgate_bench.sim.server import TENANT_HEADER

#: Interval of the KV-usage samples, modelled seconds.
KV_SAMPLE_S = 0.1
#: kvgate-sim's fixed chat framing: 4 tokens per message + 2 (``count_chat_prompt_tokens``).
SIM_CHAT_OVERHEAD = 6
#: The word chat prompts are made of (one token for kvgate-sim and for the sidecar's tokenizer).
PROMPT_WORD = "hi"
#: The token id completions prompts are made of.
PROMPT_TOKEN_ID = 1000
#: The sidecar's default priority header (``spec.priority.header``).
PRIORITY_HEADER = "x-kvgate-priority"


def prompt_text(prompt_tokens: int) -> str:
    """A chat message's content that kvgate-sim counts as ``prompt_tokens`` in one message."""
    return " ".join([PROMPT_WORD] * max(0, prompt_tokens - SIM_CHAT_OVERHEAD))


def request_body(req: Request, chat: bool = False) -> dict[str, Any]:
    """The streaming request sent for ``req``: a completion whose prompt is
    ``req.prompt_tokens`` token ids, or (``chat``) a chat completion of one user message of
    ``prompt_tokens - 6`` words; ``max_tokens`` only when the schedule has one."""
    body: dict[str, Any] = {
        "model": MODEL,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if chat:
        body["messages"] = [{"role": "user", "content": prompt_text(req.prompt_tokens)}]
    else:
        body["prompt"] = [PROMPT_TOKEN_ID] * req.prompt_tokens
    if req.max_tokens is not None:
        body["max_tokens"] = req.max_tokens
    return body


_DEGRADED_MAX_TOKENS = re.compile(r"max_tokens=(\d+)")


class Client:
    """Sends a schedule's requests at their arrival times and records what came back."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str,
        scale: float,
        chat: bool,
        priority: Callable[[Request], int] | None = None,
    ) -> None:
        self.session = session
        self.priority = priority
        self.chat = chat
        self.url = url + ("/v1/chat/completions" if chat else "/v1/completions")
        self.scale = scale
        self.loop = asyncio.get_running_loop()
        self.t0 = 0.0
        self.send_lags: dict[str, float] = {}
        self.ids: dict[str, str] = {}  # response id -> request id
        self.errors: list[str] = []

    def now(self) -> float:
        """Modelled seconds since the schedule's start."""
        return (self.loop.time() - self.t0) / self.scale

    async def one(self, rec: RequestRecord, default_max_tokens: int) -> None:
        req = rec.request
        delay = self.t0 + req.arrival_s * self.scale - self.loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        self.send_lags[req.rid] = self.now() - req.arrival_s
        headers = {TENANT_HEADER: req.tenant, OUTPUT_TOKENS_HEADER: str(req.output_tokens)}
        if self.priority is not None:
            headers[PRIORITY_HEADER] = str(self.priority(req))
        try:
            async with self.session.post(
                self.url, json=request_body(req, self.chat), headers=headers
            ) as r:
                await self._read(rec, r, default_max_tokens)
        except (aiohttp.ClientError, ValueError) as exc:
            self.errors.append(f"{req.rid}: {exc!r}")

    async def _read(
        self, rec: RequestRecord, r: aiohttp.ClientResponse, default_max_tokens: int
    ) -> None:
        req = rec.request
        if r.status != 200:
            await r.read()
            rec.outcome = REJECTED
            rec.finished_at = self.now()
            ra = r.headers.get("Retry-After")
            rec.retry_after_s = float(ra) if ra is not None and ra.isdigit() else None
            return
        rec.admitted_at = self.now()
        decision = r.headers.get("x-kvgate-decision")
        rec.max_tokens_sent = req.max_tokens if req.max_tokens is not None else default_max_tokens
        if decision == "degraded":
            m = _DEGRADED_MAX_TOKENS.search(r.headers.get("x-kvgate-degraded", ""))
            if m is not None:
                rec.max_tokens_sent = int(m.group(1))
        tokens = 0
        usage: int | None = None
        finished = False
        # Whole reads, split into SSE events: one await per read, not per line (the client
        # shares its loop with the sidecar; a busy loop sends the next requests late).
        async for obj in sse_json(r.content):
            if tokens == 0 and "id" in obj:
                self.ids[obj["id"]] = req.rid
            if obj.get("usage"):
                usage = obj["usage"].get("completion_tokens")
            for choice in obj.get("choices") or ():
                text = choice["delta"].get("content") if self.chat else choice.get("text")
                if text:
                    tokens += 1
                    if rec.first_token_at is None:
                        rec.first_token_at = self.now()
                if choice.get("finish_reason") is not None:
                    rec.finished_at = self.now()
                    finished = True
        if not finished:
            raise ValueError("the stream ended without a finish_reason")
        if usage is not None and usage != tokens:
            raise ValueError(f"{tokens} content chunks but usage says {usage}")
        rec.output_tokens = tokens
        rec.outcome = DEGRADED if decision == "degraded" else SERVED


async def sample_kv(
    session: aiohttp.ClientSession, sim_url: str, client: Client, out: list[float]
) -> None:
    """Integrate kvgate-sim's KV usage over modelled time into ``out[0]`` (until cancelled)."""
    last = client.now()
    kv = 0.0
    while True:
        await asyncio.sleep(KV_SAMPLE_S * client.scale)
        async with session.get(sim_url + "/sim/stats") as r:
            stats = await r.json()
        now = client.now()
        out[0] += kv * (now - last)  # the last sample held since it was taken
        kv, last = float(stats["kv_usage"]), now
