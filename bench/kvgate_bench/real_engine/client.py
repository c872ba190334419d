"""One seeded open-loop schedule through one arm into llama-server, over real HTTP.

**Requests.** Each request of the schedule is a streaming chat completion sent at its arrival
time, with its tenant in ``x-kvgate-tenant`` (the prompt and the body:
:mod:`kvgate_bench.real_engine.prompts`; ``cache_prompt: false``). ``max_tokens`` is the
schedule's, capped at the run's ceiling; the output ends where the model stops (EOS) or at that
cap, and its length is llama-server's own count (``usage.completion_tokens``), as is the
prompt's (``usage.prompt_tokens``) and the prompt tokens it took from a cache
(:func:`kvgate_bench.real_engine.prompts.cached_tokens`: 0 when the cache is off, as it must
be).

**Arms** (:data:`kvgate_bench.real_engine.plan.ARMS`). ``none`` sends straight to
llama-server. ``concurrency-cap`` and ``token-bucket`` are the virtual benchmark's own arms
(:class:`kvgate_bench.effectiveness.arms.baselines.ConcurrencyCapArm`,
:class:`~kvgate_bench.effectiveness.arms.baselines.TokenBucketArm`) driven on the real clock by this
client (:class:`HttpGate`: what they dispatch is sent to llama-server, what they refuse is a
refusal with no HTTP at all: a proxy in front of the engine that costs nothing). ``kvgate`` and
``kvgate-empty`` are the real sidecar (``kvgate-agent sidecar``, a child process) in front of
llama-server, enforcing the README's recommended policy (:func:`kvgate_policy`) or an empty
spec (the defaults); their admin port's ``kvgate_concurrency_limit`` is polled every 0.5 s
(:mod:`kvgate_bench.real_engine.limit_trace`) and the wait the sidecar reports
(``x-kvgate-queue-wait-ms``) is each admitted request's queue wait.

Every request opens its own connection (a reused keep-alive connection that llama-server
closed after a stream fails the next request's write: the stale keep-alive of issue 24).

**Measured**, per request, on the real clock from the schedule's start: the first chunk with
text (TTFT), the chunk with ``finish_reason`` (the end), refusals (any status but 200: the
sidecar's 429/503; a 5xx other than 503 or a broken connection is an *error*), the degradation
headers, and how late it was sent (send lag). Requests still running ``drain_s`` after the
schedule's end are cancelled (llama-server stops a slot whose client left) and counted as
*timeouts*: served, never finished, no SLO met. The records fill
:class:`kvgate_bench.effectiveness.model.gate.RunResult`, which
:func:`kvgate_bench.effectiveness.model.metrics.summarize` scores as it scores the virtual runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kvgate_bench.effectiveness.arms.context import ArmContext
from kvgate_bench.effectiveness.arms.registry import make_arm
from kvgate_bench.effectiveness.model.gate import (
    DEGRADED,
    REJECTED,
    SERVED,
    Arm,
    Gate,
    RequestRecord,
    RunResult,
)
from kvgate_bench.effectiveness.model.schedule import Request, Schedule
from kvgate_bench.kit import processes
from kvgate_bench.kit.sse import sse_json
from kvgate_bench.kit.toolkit import percentile
from kvgate_bench.real_engine.engine import EngineSampler, EngineStats, wait_idle
from kvgate_bench.real_engine.limit_trace import LimitPoller
from kvgate_bench.real_engine.plan import ARMS, KVGATE, KVGATE_EMPTY, NONE
from kvgate_bench.real_engine.prompts import cached_tokens, prompt_for, request_body
from kvgate_bench.real_engine.sidecar_arm import start_sidecar
from kvgate_bench.sim.engine import SimEngine
from kvgate_bench.sim.steptime import constant_profile

TENANT_HEADER = "x-kvgate-tenant"
#: The client's largest 99th-percentile send lag for a run that kept up, seconds (the
#: real-time benchmark's bound, ``effectiveness.realtime.run.KEPT_UP_SEND_LAG_S``).
KEPT_UP_SEND_LAG_S = 0.05


@dataclass
class ArmRun:
    """One arm's run (times in seconds from the schedule's start).

    Attributes:
        result: the run as the virtual driver's (``steps`` 0, ``engine`` a placeholder).
        send_lags_s: how late each request was sent after its arrival time, schedule order.
        statuses: HTTP status -> answers (``error`` for a broken connection).
        timeouts: requests cut at the drain deadline.
        errors_5xx: answers 5xx other than 503 (the sidecar's refusal) and broken connections.
        prompt_tokens, output_tokens, finish: by request id, llama-server's usage and
            ``finish_reason`` of the requests it served.
        cached_tokens: by request id, the prompt tokens llama-server took from a cache
            (:func:`kvgate_bench.real_engine.prompts.cached_tokens`), where it said.
        queue_waits_s: by request id, the wait the sidecar reported (``kvgate`` arms).
        limit_trace: (seconds, limit) samples of the sidecar's concurrency limit (``kvgate``
            arms; empty otherwise).
        engine: llama-server's gauges over the run.
        wall_s: real seconds from the first send to the last end.
        loadavg_before, loadavg_after: the machine's 1-minute load average.
    """

    result: RunResult
    send_lags_s: list[float]
    statuses: dict[str, int]
    timeouts: int
    errors_5xx: int
    prompt_tokens: dict[str, int]
    output_tokens: dict[str, int]
    finish: dict[str, str]
    cached_tokens: dict[str, int]
    queue_waits_s: dict[str, float]
    limit_trace: list[tuple[float, float]]
    engine: EngineStats
    wall_s: float
    loadavg_before: float
    loadavg_after: float
    errors: list[str] = field(default_factory=list)

    @property
    def cached_prompt_tokens(self) -> int:
        """Prompt tokens llama-server took from a cache over the run (0 with the cache off)."""
        return sum(self.cached_tokens.values())

    @property
    def send_lag_p99_s(self) -> float:
        return percentile(self.send_lags_s, 99) or 0.0

    @property
    def kept_up(self) -> bool:
        """Whether the client sent 99 % of the requests within :data:`KEPT_UP_SEND_LAG_S`."""
        return self.send_lag_p99_s <= KEPT_UP_SEND_LAG_S


class HttpGate(Gate):
    """A virtual arm's gate on the real clock: ``dispatch`` sends over HTTP, ``reject`` records
    a refusal (no engine model behind it: llama-server is the engine)."""

    def __init__(self, client: _Client) -> None:  # no SimEngine: Gate's state is unused
        self.client = client

    def dispatch(
        self, req: Request, now: float, max_tokens: int | None = None, degraded: bool = False
    ) -> None:
        self.client.send(req, max_tokens)

    def reject(self, req: Request, now: float, retry_after_s: float | None = None) -> None:
        rec = self.client.records[req.rid]
        rec.outcome, rec.finished_at, rec.retry_after_s = REJECTED, now, retry_after_s
        self.client.statuses["arm"] = self.client.statuses.get("arm", 0) + 1


_DEGRADED_MAX_TOKENS = re.compile(r"max_tokens=(\d+)")


class _Client:
    """Sends the requests, runs a virtual arm's callbacks, records what came back."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str,
        schedule: Schedule,
        max_tokens: int,
        words: list[str],
        arm: Arm | None,
        alias: str,
    ) -> None:
        self.session, self.url, self.max_tokens, self.arm = session, url, max_tokens, arm
        self.alias = alias
        self.cached: dict[str, int] = {}
        self.queue_waits: dict[str, float] = {}
        self.loop = asyncio.get_running_loop()
        self.t0 = 0.0
        self.records = {r.rid: RequestRecord(r) for r in schedule.requests}
        self.prompts = {r.rid: prompt_for(r, words) for r in schedule.requests}
        self.send_lags: dict[str, float] = {}
        self.statuses: dict[str, int] = {}
        self.usage_prompt: dict[str, int] = {}
        self.usage_output: dict[str, int] = {}
        self.finish: dict[str, str] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.running: set[str] = set()
        self.errors: list[str] = []
        self._wake: asyncio.TimerHandle | None = None

    def now(self) -> float:
        return self.loop.time() - self.t0

    def cap(self, req: Request) -> int:
        return min(self.max_tokens, req.max_tokens or self.max_tokens)

    async def arrive(self, req: Request) -> None:
        delay = self.t0 + req.arrival_s - self.loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        self.send_lags[req.rid] = self.now() - req.arrival_s
        if self.arm is None:
            await self.one(req, None)
            return
        self.arm.on_arrival(req, self.now())
        self._rearm()

    def send(self, req: Request, max_tokens: int | None) -> None:
        task = asyncio.create_task(self.one(req, max_tokens))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _rearm(self) -> None:
        if self.arm is None:
            return
        if self._wake is not None:
            self._wake.cancel()
            self._wake = None
        at = self.arm.next_wake()
        if at is not None:
            self._wake = self.loop.call_at(self.t0 + at, self._on_wake)

    def _on_wake(self) -> None:
        self._wake = None
        if self.arm is not None:
            self.arm.on_wake(self.now())
            self._rearm()

    async def one(self, req: Request, max_tokens: int | None) -> None:
        rec = self.records[req.rid]
        mt = self.cap(req) if max_tokens is None else min(max_tokens, self.cap(req))
        rec.admitted_at = self.now()
        rec.max_tokens_sent = mt
        self.running.add(req.rid)
        try:
            async with self.session.post(
                self.url + "/v1/chat/completions",
                json=request_body(self.prompts[req.rid], mt, self.alias),
                headers={TENANT_HEADER: req.tenant},
            ) as r:
                self.statuses[str(r.status)] = self.statuses.get(str(r.status), 0) + 1
                await self._read(rec, r)
        except (aiohttp.ClientError, ValueError) as exc:
            self.statuses["error"] = self.statuses.get("error", 0) + 1
            self.errors.append(f"{req.rid}: {exc!r}")
            rec.outcome, rec.finished_at = REJECTED, self.now()
        finally:
            self.running.discard(req.rid)
            if self.arm is not None:  # it dispatched this one: its slot is free again
                self.arm.on_finish(req, rec.output_tokens, self.now())
                self._rearm()

    async def _read(self, rec: RequestRecord, r: aiohttp.ClientResponse) -> None:
        req = rec.request
        if r.status != 200:
            await r.read()
            rec.outcome, rec.finished_at, rec.admitted_at = REJECTED, self.now(), None
            ra = r.headers.get("Retry-After")
            rec.retry_after_s = float(ra) if ra is not None and ra.isdigit() else None
            return
        wait_ms = r.headers.get("x-kvgate-queue-wait-ms")
        if wait_ms is not None and wait_ms.isdigit():
            self.queue_waits[req.rid] = int(wait_ms) / 1e3
        decision = r.headers.get("x-kvgate-decision")
        if decision == "degraded":
            m = _DEGRADED_MAX_TOKENS.search(r.headers.get("x-kvgate-degraded", ""))
            if m is not None:
                rec.max_tokens_sent = int(m.group(1))
        rec.outcome = DEGRADED if decision == "degraded" else SERVED
        chunks = 0
        async for obj in sse_json(r.content):
            cached = cached_tokens(obj)
            if cached is not None:
                self.cached[req.rid] = cached
            usage = obj.get("usage")
            if usage:
                self.usage_prompt[req.rid] = int(usage.get("prompt_tokens", 0))
                self.usage_output[req.rid] = int(usage.get("completion_tokens", 0))
            for choice in obj.get("choices") or ():
                if (choice.get("delta") or {}).get("content"):
                    chunks += 1
                    if rec.first_token_at is None:
                        rec.first_token_at = self.now()
                if choice.get("finish_reason") is not None:
                    rec.finished_at = self.now()
                    self.finish[req.rid] = str(choice["finish_reason"])
            rec.output_tokens = self.usage_output.get(req.rid, chunks)
        if rec.finished_at is None:
            raise ValueError("the stream ended without a finish_reason")


async def run_arm(
    engine_url: str,
    schedule: Schedule,
    arm: str,
    ctx: ArmContext,
    params: dict[str, Any],
    *,
    max_tokens: int,
    drain_s: float,
    words: list[str],
    workdir: Path,
    alias: str,
    client_cpus: str | None = None,
    sample_s: float = 1.0,
) -> ArmRun:
    """Run ``schedule`` through ``arm`` (:data:`~kvgate_bench.real_engine.plan.ARMS`;
    ``params`` the baseline's setting) into the llama-server at ``engine_url`` serving the
    model ``alias`` (module docstring). A ``kvgate`` arm's sidecar runs as a child process
    pinned to ``client_cpus``, its log and policy in ``workdir``. Raises ``ValueError`` for an
    unknown arm."""
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; choose from {', '.join(ARMS)}")
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    load0 = os.getloadavg()[0]
    sidecar: processes.Proc | None = None
    url = engine_url
    admin_url: str | None = None
    if arm in (KVGATE, KVGATE_EMPTY):
        sidecar, admin_url = await start_sidecar(engine_url, arm, ctx, workdir, client_cpus)
        url = sidecar.url
    virtual = None if arm in (NONE, KVGATE, KVGATE_EMPTY) else make_arm(arm, ctx, params)
    w0 = time.perf_counter()
    try:
        async with aiohttp.ClientSession(
            timeout=timeout, connector=aiohttp.TCPConnector(limit=0, force_close=True)
        ) as session:
            client = _Client(session, url, schedule, max_tokens, words, virtual, alias)
            sampler = EngineSampler(session, engine_url, sample_s)
            poller = LimitPoller(session, admin_url, client.now) if admin_url else None
            await wait_idle(session, engine_url)  # a previous arm's cut requests have ended
            client.t0 = client.loop.time() + 0.05
            if virtual is not None:
                virtual.start(HttpGate(client), 0.0)
            sampler.start()
            if poller is not None:
                poller.start()
            arrivals = [asyncio.create_task(client.arrive(r)) for r in schedule.requests]
            deadline = client.t0 + schedule.duration_s + drain_s
            while True:
                left = deadline - client.loop.time()
                pending = [t for t in (*arrivals, *client.tasks) if not t.done()]
                if not pending or left <= 0:
                    break
                await asyncio.wait(
                    pending, timeout=min(left, 0.5), return_when=asyncio.FIRST_COMPLETED
                )
            end = client.now()
            cut = [t for t in [*arrivals, *client.tasks] if not t.done()]
            timeouts = len(client.running)
            for t in cut:
                t.cancel()
            for t in cut:
                with contextlib.suppress(asyncio.CancelledError):
                    await t
            stats = await sampler.stop()
            trace = await poller.stop() if poller is not None else []
    finally:
        if sidecar is not None:
            await asyncio.to_thread(sidecar.stop)
    records = [client.records[r.rid] for r in schedule.requests]
    for rec in records:  # cut while waiting in the arm's queue: refused at the deadline
        if rec.outcome not in (SERVED, DEGRADED, REJECTED):
            rec.outcome = REJECTED if rec.admitted_at is None else SERVED
            if rec.outcome == REJECTED:
                rec.finished_at = end
    last = max([0.0] + [r.finished_at for r in records if r.finished_at is not None])
    end_s = end if timeouts else last
    result = RunResult(
        schedule,
        arm,
        dict(params),
        records,
        end_s,
        0.0,
        0,
        0.0,
        SimEngine(ctx.engine, constant_profile()),
    )
    s5 = sum(n for code, n in client.statuses.items() if code.startswith("5") and code != "503")
    return ArmRun(
        result,
        [client.send_lags.get(r.rid, drain_s) for r in schedule.requests],
        dict(client.statuses),
        timeouts,
        s5 + client.statuses.get("error", 0),
        dict(client.usage_prompt),
        dict(client.usage_output),
        dict(client.finish),
        dict(client.cached),
        dict(client.queue_waits),
        trace,
        stats,
        time.perf_counter() - w0,
        load0,
        os.getloadavg()[0],
        client.errors,
    )
