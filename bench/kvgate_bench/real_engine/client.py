"""One seeded open-loop schedule through one arm into llama-server, over real HTTP.

**Requests.** Each request of the schedule is a streaming chat completion
(``/v1/chat/completions``, ``stream_options.include_usage``) sent at its arrival time, with its
tenant in ``x-kvgate-tenant``. The prompt is real English text: ``words`` words of the Python
standard library's own module documentation (:func:`corpus`, the same on every machine with the
same Python) after an instruction to summarise it, where ``words`` is the schedule's prompt
length / :data:`PROMPT_SCALE` within [:data:`MIN_WORDS`, :data:`MAX_WORDS`] (a 270M model on a
CPU core prefills about a token a millisecond; the virtual workloads' 757-token median prompt
would leave it no time to decode). ``max_tokens`` is the schedule's, capped at the run's
``max_tokens``; the output ends where the model stops (EOS) or at that cap, and its length is
llama-server's own count (``usage.completion_tokens``), as is the prompt's
(``usage.prompt_tokens``).

**Arms.** ``none`` sends straight to llama-server. ``concurrency-cap`` and ``token-bucket`` are
the virtual benchmark's own arms (:class:`kvgate_bench.effectiveness.arms.ConcurrencyCapArm`,
:class:`~kvgate_bench.effectiveness.arms.TokenBucketArm`) driven on the real clock by this
client (:class:`HttpGate`: what they dispatch is sent to llama-server, what they refuse is a
refusal with no HTTP at all: a proxy in front of the engine that costs nothing). ``kvgate`` is
the real sidecar (``kvgate-agent sidecar``, a child process) in front of llama-server,
enforcing the README's recommended policy (:func:`kvgate_policy`).

Every request opens its own connection (a reused keep-alive connection that llama-server
closed after a stream fails the next request's write: the stale keep-alive of issue 24).

**Measured**, per request, on the real clock from the schedule's start: the first chunk with
text (TTFT), the chunk with ``finish_reason`` (the end), refusals (any status but 200: the
sidecar's 429/503; a 5xx other than 503 or a broken connection is an *error*), the degradation
headers, and how late it was sent (send lag). Requests still running ``drain_s`` after the
schedule's end are cancelled (llama-server stops a slot whose client left) and counted as
*timeouts*: served, never finished, no SLO met. The records fill
:class:`kvgate_bench.effectiveness.driver.RunResult`, which
:func:`kvgate_bench.effectiveness.metrics.summarize` scores as it scores the virtual runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib
import inspect
import json
import os
import re
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kvgate_bench.effectiveness.arms import ArmContext, make_arm
from kvgate_bench.effectiveness.driver import (
    DEGRADED,
    REJECTED,
    SERVED,
    Arm,
    Gate,
    RequestRecord,
    RunResult,
)
from kvgate_bench.effectiveness.kvgate_defaults import recommended_policy
from kvgate_bench.effectiveness.realtime import policy_manifest
from kvgate_bench.effectiveness.workloads import Request, Schedule
from kvgate_bench.kit import processes
from kvgate_bench.kit.llamaserver import LLAMA_MODEL
from kvgate_bench.kit.sse import sse_json
from kvgate_bench.kit.toolkit import free_port, percentile
from kvgate_bench.real_engine.engine import EngineSampler, EngineStats, taskset_prefix, wait_idle
from kvgate_bench.sim.engine import SimEngine
from kvgate_bench.sim.steptime import constant_profile

TENANT_HEADER = "x-kvgate-tenant"
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
INSTRUCTION = "Summarize the following text in a few sentences.\n\n"
#: Arm names (the virtual benchmark's, for the two baselines).
NONE, CAP, BUCKET, KVGATE = "none", "concurrency-cap", "token-bucket", "kvgate"
ARMS = (NONE, CAP, BUCKET, KVGATE)
#: The client's largest 99th-percentile send lag for a run that kept up, seconds (the
#: real-time benchmark's bound, ``effectiveness.realtime.KEPT_UP_SEND_LAG_S``).
KEPT_UP_SEND_LAG_S = 0.05


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


def request_body(req: Request, prompt: str, max_tokens: int) -> dict[str, Any]:
    """The streaming chat completion sent for ``req`` with at most ``max_tokens`` tokens."""
    return {
        "model": LLAMA_MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def kvgate_policy(ctx: ArmContext) -> dict[str, Any]:
    """The ``kvgate`` arm's spec: the README's recommended policy
    (:func:`kvgate_bench.effectiveness.kvgate_defaults.recommended_policy`: the SLO of
    ``ctx.slo``, tenant classes, a ShortestFirst queue with Degrade) with the KV capacity read
    from the engine (``capacity.fromEngineMetrics``, as ``examples/ratelimitpolicy-minimal.yaml``
    writes it)."""
    spec = recommended_policy(ctx)
    return {**spec, "capacity": {"fromEngineMetrics": True}}


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
    engine: EngineStats
    wall_s: float
    loadavg_before: float
    loadavg_after: float
    errors: list[str] = field(default_factory=list)

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
    ) -> None:
        self.session, self.url, self.max_tokens, self.arm = session, url, max_tokens, arm
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
                json=request_body(req, self.prompts[req.rid], mt),
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
        decision = r.headers.get("x-kvgate-decision")
        if decision == "degraded":
            m = _DEGRADED_MAX_TOKENS.search(r.headers.get("x-kvgate-degraded", ""))
            if m is not None:
                rec.max_tokens_sent = int(m.group(1))
        rec.outcome = DEGRADED if decision == "degraded" else SERVED
        chunks = 0
        async for obj in sse_json(r.content):
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
    client_cpus: str | None = None,
    sample_s: float = 1.0,
) -> ArmRun:
    """Run ``schedule`` through ``arm`` (:data:`ARMS`; ``params`` the baseline's setting) into
    the llama-server at ``engine_url`` (module docstring). The ``kvgate`` sidecar runs as a child
    process pinned to ``client_cpus``, its log and policy in ``workdir``."""
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; choose from {', '.join(ARMS)}")
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    load0 = os.getloadavg()[0]
    sidecar: processes.Proc | None = None
    url = engine_url
    if arm == KVGATE:
        policy = workdir / "policy.json"
        policy.write_text(json.dumps(policy_manifest(kvgate_policy(ctx), "real-engine")))
        port = free_port()
        argv = processes.sidecar_argv(
            "--upstream-timeout", "3600", upstream=engine_url, policy=policy, port=port
        )
        sidecar = await asyncio.to_thread(
            processes.start,
            [*taskset_prefix(client_cpus), *argv],
            workdir / "sidecar.log",
            url=f"http://127.0.0.1:{port}",
            ready="/healthz",
            status=200,
            what="kvgate-agent sidecar",
        )
        url = sidecar.url
    virtual = None if arm in (NONE, KVGATE) else make_arm(arm, ctx, params)
    w0 = time.perf_counter()
    try:
        async with aiohttp.ClientSession(
            timeout=timeout, connector=aiohttp.TCPConnector(limit=0, force_close=True)
        ) as session:
            client = _Client(session, url, schedule, max_tokens, words, virtual)
            sampler = EngineSampler(session, engine_url, sample_s)
            await wait_idle(session, engine_url)  # a previous arm's cut requests have ended
            client.t0 = client.loop.time() + 0.05
            if virtual is not None:
                virtual.start(HttpGate(client), 0.0)
            sampler.start()
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
        stats,
        time.perf_counter() - w0,
        load0,
        os.getloadavg()[0],
        client.errors,
    )
