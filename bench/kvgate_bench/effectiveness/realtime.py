"""Real-time driver: one schedule over real HTTP through the real kvgate sidecar and kvgate-sim.

The virtual-time driver (:mod:`kvgate_bench.effectiveness.driver`) runs the admission core and
the engine model in one process on a virtual clock. This module runs the same
:class:`~kvgate_bench.effectiveness.workloads.Schedule` the way a deployment would (the
schedule and the arms' context built as the virtual-time runner builds them, ``isolation`` at
``--noisy-load K`` included: :mod:`kvgate_bench.effectiveness.realtime_plan`):

* **kvgate-sim** (:mod:`kvgate_bench.sim.server`) serves the engine model on the real clock,
  in a subprocess (``python -m kvgate_bench.sim.cli``: its step loop gets a CPU core of its
  own) or in this process. Its configuration is the virtual driver's
  :func:`~kvgate_bench.effectiveness.driver.engine_config` (same profile, KV pool, block size,
  context, ``max_num_seqs``, token budget; :func:`sim_config` checks they match).
* **arm** ``none``: the client talks to kvgate-sim directly. An arm with a kvgate policy
  (:class:`~kvgate_bench.effectiveness.arms.KvgateMaxTokensArm` and its subclasses: the
  ``spec`` of :meth:`~kvgate_bench.effectiveness.arms.KvgateMaxTokensArm.policy`) puts the real
  sidecar (:class:`kvgate_agent.sidecar.app.Sidecar`) in front, in this process, enforcing that
  spec as a RateLimitPolicy manifest. The other arms have no real-time counterpart here.
* **client**: one aiohttp task per request sends, at the request's arrival time, a streaming
  completion with its tenant in ``x-kvgate-tenant``, its ``max_tokens`` (omitted when the
  schedule has none) and its true output length in the simulator-only header
  ``x-sim-output-tokens`` (the sidecar forwards it untouched, kvgate-sim stops there).

**Prompt tokens.** By default the prompt is a list of ``prompt_tokens`` token ids
(``/v1/completions``): kvgate-sim and the sidecar both count one token per id, exactly the
schedule's count, at no tokenizing cost. With ``chat`` it is a chat completion of one user
message of ``prompt_tokens - 6`` words, which kvgate-sim counts as ``words + 4`` per message
``+ 2`` (exactly the schedule's count); the sidecar is then given a word-level tokenizer (one
token per whitespace-separated word, a temporary ``tokenizer.json``) and counts the words plus
its fixed chat framing (4 per message + 3 for the reply primer): ``prompt_tokens + 1``, one token
more than the virtual-time arm charges. (A prompt under 7 tokens, which the workloads practically
never draw, is sent as an empty message: kvgate-sim then counts 6.) Why token ids by default: the
tokenizer runs on the sidecar's event loop, about 2 us per word here (1.6 ms for the median
conversation prompt of 757 tokens, 16 ms for 7,900), and a burst of long prompts delays the
tokens the sidecar relays and, in this process, the client's next sends (multi-tenant's bursty
arrivals at load 1.5: sends 100-200 ms late).

**What is measured**, per request, on the real clock from the schedule's start: the first
token's time (the first chunk with text: a non-empty ``text``, or ``delta.content`` in chat),
the finish (the chunk carrying ``finish_reason``), the output tokens (chunks with text; each is
one token in kvgate-sim), refusals (any status but 200: 429/503 from the sidecar, 400 from
either), a degradation (``x-kvgate-decision: degraded``, its ``x-kvgate-degraded:
max_tokens=N``), and the times kvgate-sim preempted it (``/sim/preemptions``, by the ``id``
of its chunks). The KV usage is sampled from ``/sim/stats`` every :data:`KV_SAMPLE_S` seconds.
They fill the same
:class:`~kvgate_bench.effectiveness.driver.RequestRecord` / ``RunResult`` the virtual driver
builds, so :func:`kvgate_bench.effectiveness.metrics.summarize` scores both the same way.

**Time scale.** With ``time_scale`` k > 1 kvgate-sim runs k times slower than the GPU it models
(``SimConfig.time_scale``), the client sends request i at ``k x arrival_s``, every time measured
is divided by k, and the sidecar's admission clock is ``time.monotonic() / k`` (so its queue
timeouts, token buckets and Retry-After are in modelled seconds, as the policy says). The SLOs
(:mod:`kvgate_bench.effectiveness.metrics`) then apply unchanged. It lets a small machine keep
up with a load whose token rate it could not stream in real time; the price is k times the wall
time. The HTTP hops' own latency (about a millisecond on loopback) shrinks by k in modelled time.

**Where the two runs differ by design.** In virtual time a request dispatched during a step joins
the engine's queue at once and is scheduled from the next step; over HTTP it joins when its
request has crossed the sidecar (a millisecond or so later), usually the same next step.
kvgate-sim paces its steps to deadlines (its loop's CPU time does not stretch the modelled
timeline) but falls behind when the machine cannot keep up; the client then sends late too.
:attr:`RealtimeRun.kept_up` says whether it kept up (from kvgate-sim's step lag and the
client's send lags); one that did not is no comparison (rerun it with a larger time scale). The
measured times include what HTTP adds: the first token reaches the client a few milliseconds
after the step that made it ended.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

from kvgate_agent.contract.policy import parse_policy
from kvgate_agent.sidecar.app import Sidecar, SidecarSettings
from kvgate_agent.sidecar.server import SidecarServer
from kvgate_bench.effectiveness.arms import (
    ArmContext,
    KvgateMaxTokensArm,
    NoisyKvgateArm,
    OracleArm,
    make_arm,
)
from kvgate_bench.effectiveness.driver import (
    DEGRADED,
    PENDING,
    REJECTED,
    SERVED,
    RequestRecord,
    RunResult,
    engine_default_max_tokens,
    simulate,
)
from kvgate_bench.effectiveness.kvgate_defaults import KvgateDefaultsArm
from kvgate_bench.effectiveness.metrics import summarize
from kvgate_bench.effectiveness.realtime_plan import (
    ISOLATION,
    isolation_agree,
    isolation_ratios,
    isolation_text,
    plan,
    tenant_slo,
)
from kvgate_bench.effectiveness.workloads import DEFAULT_NOISY_LOAD, WORKLOADS, Request, Schedule
from kvgate_bench.kit import processes
from kvgate_bench.kit.sse import sse_json
from kvgate_bench.kit.toolkit import free_port, percentile
from kvgate_bench.sim.engine import EngineConfig, SimEngine
from kvgate_bench.sim.lengths import OUTPUT_TOKENS_HEADER
from kvgate_bench.sim.server import SIM_KEY, TENANT_HEADER, SimConfig, start_sim
from kvgate_bench.sim.steptime import PROFILES, StepTimeModel, profile

#: Interval of the KV-usage samples, modelled seconds.
KV_SAMPLE_S = 0.1
#: kvgate-sim's fixed chat framing: 4 tokens per message + 2 (``count_chat_prompt_tokens``).
SIM_CHAT_OVERHEAD = 6
#: The word chat prompts are made of (one token for kvgate-sim and for the sidecar's tokenizer).
PROMPT_WORD = "hi"
#: The token id completions prompts are made of.
PROMPT_TOKEN_ID = 1000
MODEL = "kvgate-sim-model"
#: The sidecar's default priority header (``spec.priority.header``).
PRIORITY_HEADER = "x-kvgate-priority"
#: The arm that stands for kvgate in :func:`compare` and the test (switch when ``kvgate`` lands).
DEFAULT_KVGATE_ARM = "kvgate-bench-policy"


def sim_config(profile_name: str, config: EngineConfig, time_scale: float = 1.0) -> SimConfig:
    """The kvgate-sim configuration that runs ``config`` under profile ``profile_name``.

    Raises ``ValueError`` when kvgate-sim cannot run exactly ``config`` (a watermark other than
    its 0.01, or chunked prefill that differs from the profile's), or for a bad time scale.
    """
    sc = SimConfig(
        model=MODEL,
        kv_capacity_tokens=config.num_gpu_blocks * config.block_size,
        block_size=config.block_size,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        profile=profile_name,
        time_scale=time_scale,
    )
    if sc.engine_config() != config:
        raise ValueError(f"kvgate-sim cannot run {config} (it would run {sc.engine_config()})")
    return sc


def sim_argv(sc: SimConfig, port: int = 0) -> list[str]:
    """The ``kvgate-sim`` command line (``python -m kvgate_bench.sim.cli``) serving ``sc``."""
    argv = processes.sim_argv(
        "--port", str(port), "--model", sc.model, "--profile", sc.profile,
        "--kv-capacity-tokens", str(sc.kv_tokens), "--block-size", str(sc.block_size),
        "--max-model-len", str(sc.max_model_len), "--max-num-seqs", str(sc.max_num_seqs),
        "--time-scale", repr(sc.time_scale),
    )  # fmt: skip
    if sc.max_num_batched_tokens is not None:
        argv += ["--max-num-batched-tokens", str(sc.max_num_batched_tokens)]
    return argv


def policy_manifest(spec: dict[str, Any], name: str = "effectiveness") -> dict[str, Any]:
    """A RateLimitPolicy manifest around ``spec`` (what the sidecar's ``--policy`` reads)."""
    return {
        "apiVersion": "kvgate.io/v1alpha1",
        "kind": "RateLimitPolicy",
        "metadata": {"name": name},
        "spec": spec,
    }


def kvgate_arm(arm: str, ctx: ArmContext) -> KvgateMaxTokensArm | None:
    """The virtual-time arm ``arm`` stands for in real time (its policy, its clients'
    priorities); None for ``none``. Raises ``ValueError`` for an arm with no real-time
    counterpart (the baselines, the oracle, kvgate-noisy) or an unknown one."""
    if arm == "none":
        return None
    try:
        a = make_arm(arm, ctx, {})
    except KeyError:  # a baseline that needs its tuned parameters
        a = None
    if not isinstance(a, KvgateMaxTokensArm) or isinstance(a, OracleArm | NoisyKvgateArm):
        raise ValueError(
            f"arm {arm!r} has no real-time counterpart (none or a kvgate arm; the oracle's and "
            "kvgate-noisy's lengths exist in the virtual-time process only)"
        )
    return a


def arm_policy(arm: str, ctx: ArmContext) -> dict[str, Any] | None:
    """The kvgate policy ``spec`` arm ``arm`` enforces; None for ``none``. A day-one arm
    (``kvgate``, ``kvgate-slo-only``, ``kvgate-empty``) has what its sidecar would read from the
    engine (the KV pool, ``max_num_seqs``) written into its spec, as kvgate-sim does not report
    them: ``capacity.kvCacheTokens`` and, unless the spec sets one, ``concurrency.maxRequests``.
    Raises as :func:`kvgate_arm`."""
    a = kvgate_arm(arm, ctx)
    if a is None:
        return None
    spec = a.policy()
    if isinstance(a, KvgateDefaultsArm):
        cfg = a.controller.config
        spec = {
            **spec,
            "capacity": {**spec.get("capacity", {}), "kvCacheTokens": cfg.kv_capacity_tokens},
            "concurrency": {"maxRequests": cfg.max_concurrency, **spec.get("concurrency", {})},
        }
    return spec


def write_word_tokenizer(path: Path) -> None:
    """Write a Hugging Face ``tokenizer.json`` that makes every whitespace-separated word one
    token (a WordLevel model whose only entry is the unknown token)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    tok = Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.save(str(path))


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


#: :attr:`RealtimeRun.kept_up` bounds, modelled seconds: the client's 99th-percentile send lag
#: and kvgate-sim's largest step lag. On an idle 2-core machine the first is about 5 ms and the
#: second 10-25 ms; runs whose agreement failed had 230-400 ms of send lag.
KEPT_UP_SEND_LAG_S = 0.05
KEPT_UP_SIM_LAG_S = 0.1


@dataclass
class RealtimeRun:
    """One real-time run.

    Attributes:
        result: the run, as the virtual driver's (times in modelled seconds; ``steps``
            kvgate-sim's; ``cpu_s`` this process's CPU time: client and sidecar; ``engine``
            kvgate-sim's own when it ran in this process, else a fresh, never-stepped engine
            of the same configuration: the one that ran lived in the subprocess).
        wall_s: real seconds the run took (kvgate-sim's start to the last request's end).
        time_scale: real seconds per modelled second.
        late_s: real seconds kvgate-sim's step loop fell behind beyond what it catches up.
        sim_lag_max_s: the most a kvgate-sim step started after its deadline, real seconds.
        send_lags_s: how late the client sent each request after its arrival time, modelled
            seconds, in schedule order.
        sim_preemptions: kvgate-sim's preemption total (equals the records' sum unless a
            preempted request's id was not seen).
    """

    result: RunResult
    wall_s: float
    time_scale: float
    late_s: float
    sim_lag_max_s: float
    send_lags_s: list[float]
    sim_preemptions: int
    errors: list[str] = field(default_factory=list)

    @property
    def kept_up(self) -> bool:
        """Whether the machine kept up with the schedule: the client sent 99 % of the requests
        within :data:`KEPT_UP_SEND_LAG_S` of their arrival times and kvgate-sim's steps started
        within :data:`KEPT_UP_SIM_LAG_S` of their deadlines (modelled seconds). A run that did
        not is no test of agreement: rerun it with a larger ``time_scale``."""
        return (
            self.send_lag_p99_s <= KEPT_UP_SEND_LAG_S
            and self.sim_lag_max_s / self.time_scale <= KEPT_UP_SIM_LAG_S
            and self.late_s == 0.0
        )

    @property
    def send_lag_max_s(self) -> float:
        """The latest a request was sent, modelled seconds after its arrival time."""
        return max(self.send_lags_s, default=0.0)

    @property
    def send_lag_p99_s(self) -> float:
        """The 99th percentile of the send lags, modelled seconds."""
        return percentile(self.send_lags_s, 99) or 0.0


@contextlib.asynccontextmanager
async def _sim(
    sc: SimConfig, subprocess: bool, engines: list[SimEngine], tmp: Path
) -> AsyncIterator[str]:
    """kvgate-sim serving ``sc`` (a subprocess, its log in ``tmp``, or in this loop: its engine
    is appended to ``engines``); yields its base URL."""
    if not subprocess:
        runner, port = await start_sim(sc)
        engines.append(runner.app[SIM_KEY].engine)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            await runner.cleanup()
        return
    port = free_port()
    proc = await asyncio.to_thread(
        processes.start,
        sim_argv(sc, port),
        tmp / "kvgate-sim.log",
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        url=f"http://127.0.0.1:{port}",
        ready="/health",
    )
    try:
        yield proc.url
    finally:
        await asyncio.to_thread(proc.stop)


@contextlib.asynccontextmanager
async def _sidecar(
    upstream: str, spec: dict[str, Any], time_scale: float, tokenizer: Path | None
) -> AsyncIterator[str]:
    """The kvgate sidecar enforcing ``spec`` in front of ``upstream``, in this loop, its
    admission clock in modelled seconds; yields its base URL."""
    settings = SidecarSettings(
        upstream=upstream,
        policy=parse_policy(policy_manifest(spec)),
        tokenizer_file=None if tokenizer is None else str(tokenizer),
        upstream_timeout=None,
    )
    clock: Callable[[], float] = time.monotonic
    if time_scale != 1.0:
        clock = lambda: time.monotonic() / time_scale  # noqa: E731
    server = SidecarServer(Sidecar(settings, clock))
    await server.start(("127.0.0.1", 0), None)
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        await server.cleanup()


@contextlib.asynccontextmanager
async def _sidecar_process(
    upstream: str, spec: dict[str, Any], tmp: Path, tokenizer: Path | None
) -> AsyncIterator[str]:
    """The ``kvgate-agent sidecar`` CLI enforcing ``spec`` in front of ``upstream``, as a child
    process on the real clock; yields its base URL. Raises ``RuntimeError`` if it does not
    answer ``/healthz`` within 30 s (its log is in the message)."""
    policy = tmp / "policy.json"
    policy.write_text(json.dumps(policy_manifest(spec)))
    argv = ["--upstream-timeout", "3600"]
    if tokenizer is not None:
        argv += ["--tokenizer", str(tokenizer)]
    proc = await asyncio.to_thread(
        processes.start_sidecar, tmp / "sidecar.log", *argv, upstream=upstream, policy=policy
    )
    try:
        yield proc.url
    finally:
        await asyncio.to_thread(proc.stop)


_DEGRADED_MAX_TOKENS = re.compile(r"max_tokens=(\d+)")


class _Client:
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


async def _sample_kv(
    session: aiohttp.ClientSession, sim_url: str, client: _Client, out: list[float]
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


async def run_realtime(
    schedule: Schedule,
    arm: str,
    ctx: ArmContext,
    profile_name: str,
    *,
    time_scale: float = 1.0,
    sim_subprocess: bool = True,
    sidecar_process: bool = False,
    chat: bool = False,
) -> RealtimeRun:
    """Run ``schedule`` over HTTP through arm ``arm`` (``none`` or a kvgate arm, its policy
    built from ``ctx``) into kvgate-sim running ``ctx.engine`` under profile ``profile_name``
    (see the module docstring). Raises ``ValueError`` for an arm or engine kvgate-sim cannot
    run, ``RuntimeError`` when a request failed (a broken stream, a connection error).

    ``sidecar_process`` runs the sidecar as the ``kvgate-agent sidecar`` CLI in a child process
    (its own CPU; the real clock, so ``time_scale`` 1 only: ``ValueError`` otherwise) instead of
    in this event loop."""
    if sidecar_process and time_scale != 1.0:
        raise ValueError("a sidecar process keeps the real clock: time_scale must be 1")
    ka = kvgate_arm(arm, ctx)
    spec = None if ka is None else ka.policy()
    # Each request's x-kvgate-priority, as the virtual-time arm's admission_request gives it.
    priority = None if ka is None else (lambda req: ka.admission_request(req).priority)
    sc = sim_config(profile_name, ctx.engine, time_scale)
    c0 = time.process_time()
    w0 = time.perf_counter()
    records = [RequestRecord(r) for r in schedule.requests]
    kv_busy = [0.0]
    engines: list[SimEngine] = []
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    connector = aiohttp.TCPConnector(limit=0)
    with tempfile.TemporaryDirectory(prefix="kvgate-realtime-") as tmp:
        tokenizer = Path(tmp) / "tokenizer.json" if chat else None
        if tokenizer is not None:
            write_word_tokenizer(tokenizer)
        async with (
            _sim(sc, sim_subprocess, engines, Path(tmp)) as sim_url,
            contextlib.AsyncExitStack() as stack,
            aiohttp.ClientSession(timeout=timeout, connector=connector) as session,
        ):
            url = sim_url
            if spec is not None and sidecar_process:
                url = await stack.enter_async_context(
                    _sidecar_process(sim_url, spec, Path(tmp), tokenizer)
                )
            elif spec is not None:
                url = await stack.enter_async_context(
                    _sidecar(sim_url, spec, time_scale, tokenizer)
                )
            client = _Client(session, url, time_scale, chat, priority)
            mml = ctx.engine.max_model_len
            defaults = [
                engine_default_max_tokens(r, mml)
                if spec is None
                else min(KvgateMaxTokensArm.DEFAULT_MAX_TOKENS, max(1, mml - r.prompt_tokens))
                for r in schedule.requests
            ]
            client.t0 = client.loop.time() + 0.05 * time_scale  # time to create the tasks
            sampler = asyncio.create_task(_sample_kv(session, sim_url, client, kv_busy))
            try:
                await asyncio.gather(
                    *(client.one(rec, d) for rec, d in zip(records, defaults, strict=True))
                )
            finally:
                sampler.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sampler
            async with session.get(sim_url + "/sim/preemptions") as r:
                pre = await r.json()
            async with session.get(sim_url + "/sim/stats") as r:
                stats = await r.json()
    by_rid = {rec.request.rid: rec for rec in records}
    for resp_id, n in pre["requests"].items():
        rid = client.ids.get(resp_id)
        if rid is not None:
            by_rid[rid].preemptions = int(n)
    errors = list(client.errors)
    errors += [f"{r.request.rid}: never ended" for r in records if r.outcome == PENDING]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[:3]}")
    end = max([0.0] + [r.finished_at for r in records if r.finished_at is not None])
    result = RunResult(
        schedule,
        arm,
        {},
        records,
        end,
        kv_busy[0],
        int(stats["steps"]),
        time.process_time() - c0,
        engines[0] if engines else SimEngine(ctx.engine, sc.steptime),
    )
    return RealtimeRun(
        result,
        time.perf_counter() - w0,
        time_scale,
        float(stats["late_s"]),
        float(stats["lag_max_s"]),
        [client.send_lags.get(r.request.rid, 0.0) for r in records],
        int(pre["total"]),
        errors,
    )


def steptime_with_pool(profile_name: str, kv_capacity_tokens: int | None) -> StepTimeModel:
    """Profile ``profile_name``'s step-time model, its KV pool replaced when given (tokens)."""
    st = profile(profile_name)
    return st if kv_capacity_tokens is None else replace(st, kv_capacity_tokens=kv_capacity_tokens)


#: Relative tolerance of the virtual/real agreement on goodput and on preemptions.
GOODPUT_TOLERANCE = 0.10
#: Absolute tolerance on preemptions, counts: a request that joins the engine one step earlier
#: or later over HTTP can add or save a preemption or two; on a handful of preemptions 10 % is
#: below one.
PREEMPTIONS_ABS_TOLERANCE = 2


def preemptions_agree(virtual: int, real: int) -> bool:
    """``|real - virtual| <= max(10 % of the larger, 2)`` (counts over the whole run)."""
    tol = max(GOODPUT_TOLERANCE * max(virtual, real), PREEMPTIONS_ABS_TOLERANCE)
    return abs(real - virtual) <= tol


def well_behaved_agree(virtual: dict[str, Any], real: dict[str, Any]) -> bool:
    """The well-behaved tenants' SLO attainment (``summarize``'s
    ``well_behaved_slo_attainment``, 0..1) of the real run within :data:`GOODPUT_TOLERANCE` of
    the virtual one, relative; True when the schedule has no noisy tenant (None)."""
    v, r = virtual.get("well_behaved_slo_attainment"), real.get("well_behaved_slo_attainment")
    if v is None or r is None:
        return v is None and r is None
    return bool(abs(float(r) - float(v)) <= GOODPUT_TOLERANCE * float(v))


@dataclass(frozen=True)
class Agreement:
    """Virtual- and real-time figures of one arm on one schedule (``summarize`` rows)."""

    arm: str
    virtual: dict[str, Any]
    real: dict[str, Any]
    virtual_preemptions: int
    real_preemptions: int
    run: RealtimeRun
    #: The virtual-time run (its per-request records), when kept.
    virtual_run: RunResult | None = None

    @property
    def agree(self) -> bool:
        """Goodput within :data:`GOODPUT_TOLERANCE`, preemptions within
        :func:`preemptions_agree` and, for a schedule with a noisy tenant, the well-behaved
        tenants' SLO attainment within :func:`well_behaved_agree`."""
        return (
            abs(self.goodput_ratio - 1.0) <= GOODPUT_TOLERANCE
            and preemptions_agree(self.virtual_preemptions, self.real_preemptions)
            and well_behaved_agree(self.virtual, self.real)
        )

    @property
    def goodput_ratio(self) -> float:
        """Real-time goodput / virtual-time goodput (1.0 when both are 0)."""
        v, r = self.virtual["goodput_tokens_per_s"], self.real["goodput_tokens_per_s"]
        return 1.0 if v == r == 0 else (r / v if v else float("inf"))

    @property
    def isolation_ratios(self) -> dict[str, float | None]:
        """Real / virtual goodput and well-behaved SLO attainment (all, worst tenant):
        :func:`~kvgate_bench.effectiveness.realtime_plan.isolation_ratios`."""
        return isolation_ratios(self.virtual, self.real)


async def compare(
    schedule: Schedule,
    arm: str,
    ctx: ArmContext,
    profile_name: str,
    steptime: StepTimeModel,
    *,
    time_scale: float = 1.0,
    sim_subprocess: bool = True,
    sidecar_process: bool = False,
    chat: bool = False,
    real_profile: str | None = None,
) -> Agreement:
    """Run ``schedule`` through ``arm`` in virtual time (``steptime``, ``ctx.engine``) and in
    real time (kvgate-sim on ``real_profile`` or ``profile_name``, same engine). Raises
    ``ValueError`` for an arm with no real-time counterpart (see :func:`arm_policy`)."""
    kvgate_arm(arm, ctx)  # refuse a baseline before running anything
    run_v = simulate(schedule, make_arm(arm, ctx, {}), steptime, ctx.engine)
    run_r = await run_realtime(
        schedule,
        arm,
        ctx,
        real_profile or profile_name,
        time_scale=time_scale,
        sim_subprocess=sim_subprocess,
        sidecar_process=sidecar_process,
        chat=chat,
    )
    return Agreement(
        arm,
        summarize(run_v),
        summarize(run_r.result),
        sum(r.preemptions for r in run_v.records),
        sum(r.preemptions for r in run_r.result.records),
        run_r,
        run_v,
    )


def _row(label: str, s: dict[str, Any], pre: int) -> str:
    iso = isolation_text(s)
    return (
        f"  {label:<8} goodput {s['goodput_tokens_per_s']:8.1f} tok/s  throughput "
        f"{s['throughput_tokens_per_s']:8.1f}  SLO {s['slo_attainment']:.3f}  preemptions "
        f"{pre:4d}  rejected {s['rejected']:3d}  degraded {s['degraded']:3d}  TTFT p99 "
        f"{s['ttft_p99_s'] or 0:.3f} s  span {s['span_s']:.1f} s"
        + (f"\n{'':11}{iso}" if iso else "")
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m kvgate_bench.effectiveness.realtime",
        description="One schedule over HTTP through the kvgate sidecar and kvgate-sim, "
        "next to the same schedule in virtual time.",
    )
    p.add_argument("--workload", default="conversation", choices=WORKLOADS)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--load", type=float, help="x the none arm's calibrated capacity (default 1)")
    g.add_argument("--rate", type=float, help="arrivals per second (instead of --load)")
    p.add_argument(
        "--noisy-load",
        type=float,
        help="isolation only: the noisy tenant's offer, x capacity (default 3; load 0.6 + K)",
    )
    p.add_argument("--duration", type=float, default=60.0, help="schedule length, s")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--arm", default="none", help=f"none or a kvgate arm ({DEFAULT_KVGATE_ARM})")
    p.add_argument("--profile", default="h100-llama3-8b", choices=sorted(PROFILES))
    p.add_argument("--kv-capacity-tokens", type=int, help="KV pool, tokens (default: profile's)")
    p.add_argument("--time-scale", type=float, default=1.0, help="real s per modelled s")
    p.add_argument("--in-process", action="store_true", help="kvgate-sim in this process")
    p.add_argument(
        "--chat",
        action="store_true",
        help="chat completions of words (the sidecar counts them with a word-level tokenizer) "
        "instead of completions of token ids",
    )
    p.add_argument(
        "--sidecar-process",
        action="store_true",
        help="the sidecar as a kvgate-agent child process (time scale 1 only)",
    )
    p.add_argument(
        "--real-profile",
        choices=sorted(PROFILES),
        help="run kvgate-sim on this profile instead (a check that a mismatch shows)",
    )
    p.add_argument("--json", type=Path, help="write both summaries here")
    return p.parse_args(argv)


async def _main(args: argparse.Namespace) -> int:
    steptime = steptime_with_pool(args.profile, args.kv_capacity_tokens)
    if args.rate is None and args.kv_capacity_tokens is not None:
        print("--load calibrates on the profile's own pool: give --rate", file=sys.stderr)
        return 2
    sched, ctx = plan(
        args.workload,
        args.profile,
        steptime,
        args.duration,
        args.seed,
        load=args.load,
        rate=args.rate,
        noisy_load=args.noisy_load,
    )
    rate = sched.rate_rps
    noisy = (
        f" (noisy load {DEFAULT_NOISY_LOAD if args.noisy_load is None else args.noisy_load:g})"
        if args.workload == ISOLATION
        else ""
    )
    print(
        f"{args.workload}{noisy} at {rate:.2f} req/s for {args.duration:g} s (seed {args.seed}): "
        f"{len(sched.requests)} requests, arm {args.arm}, {args.profile}, KV pool "
        f"{ctx.kv_capacity_tokens} tokens, time scale {args.time_scale:g}",
        flush=True,
    )
    a = await compare(
        sched,
        args.arm,
        ctx,
        args.profile,
        steptime,
        time_scale=args.time_scale,
        sim_subprocess=not args.in_process,
        sidecar_process=args.sidecar_process,
        chat=args.chat,
        real_profile=args.real_profile,
    )
    print(_row("virtual", a.virtual, a.virtual_preemptions))
    print(_row("real", a.real, a.real_preemptions))
    run = a.run
    print(
        f"  {'agree' if a.agree else 'DISAGREE'}: real/virtual goodput {a.goodput_ratio:.3f}; "
        f"wall {run.wall_s:.1f} s, kvgate-sim lag max {run.sim_lag_max_s * 1000:.1f} ms "
        f"(written off {run.late_s:.3f} s), "
        f"send lag p99 {run.send_lag_p99_s * 1000:.1f} ms, max {run.send_lag_max_s * 1000:.1f} ms"
    )
    if args.workload == ISOLATION:
        rs = a.isolation_ratios
        print(
            f"  isolation {'agrees' if isolation_agree(a.virtual, a.real) else 'DISAGREES'}: "
            + ", ".join(f"{k} {v:.3f}" for k, v in rs.items() if v is not None)
        )
    if not run.kept_up:
        print(
            "  the machine did not keep up (lags above): the real-time figures are not a fair "
            "comparison; rerun with a larger --time-scale",
            flush=True,
        )
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "arm": args.arm,
                    "workload": args.workload,
                    "noisy_load": args.noisy_load,
                    "rate_rps": rate,
                    "time_scale": run.time_scale,
                    "kept_up": run.kept_up,
                    "send_lag_p99_s": run.send_lag_p99_s,
                    "sim_lag_max_s": run.sim_lag_max_s,
                    "isolation_ratios": a.isolation_ratios,
                    "tenant_slo": {  # well-behaved tenants: [met SLO, requests]
                        "virtual": tenant_slo(a.virtual_run.records) if a.virtual_run else None,
                        "real": tenant_slo(run.result.records),
                    },
                    "virtual": a.virtual,
                    "real": a.real,
                    "virtual_preemptions": a.virtual_preemptions,
                    "real_preemptions": a.real_preemptions,
                    "wall_s": run.wall_s,
                    "late_s": run.late_s,
                },
                indent=2,
            )
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m kvgate_bench.effectiveness.realtime``; the exit status."""
    coro = _main(parse_args(argv))
    try:
        try:
            import uvloop
        except ImportError:
            return asyncio.run(coro)
        return uvloop.run(coro)  # the client and the sidecar share this loop: the faster the better
    except ValueError as exc:  # e.g. an arm with no real-time counterpart
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
