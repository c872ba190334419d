"""One real-time run (:func:`run_realtime`): a schedule over HTTP through an arm's sidecar into
kvgate-sim, measured into the virtual driver's ``RunResult``, and whether the machine kept up
with it (:class:`RealtimeRun`). See :mod:`kvgate_bench.effectiveness.realtime`.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import aiohttp

from kvgate_bench.effectiveness.arms.context import ArmContext
from kvgate_bench.effectiveness.arms.kvgate_arms import (
    KvgateMaxTokensArm,
)
from kvgate_bench.effectiveness.model.gate import (
    PENDING,
    RequestRecord,
    RunResult,
    engine_default_max_tokens,
)
from kvgate_bench.effectiveness.model.schedule import Schedule
from kvgate_bench.effectiveness.realtime.client import Client, sample_kv
from kvgate_bench.effectiveness.realtime.servers import (
    kvgate_arm,
    sidecar_child,
    sidecar_in_loop,
    sim_config,
    sim_server,
    write_word_tokenizer,
)
from kvgate_bench.kit.toolkit import percentile
from kvgate_bench.sim.engine import SimEngine
from kvgate_bench.sim.steptime import StepTimeModel, profile

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
            sim_server(sc, sim_subprocess, engines, Path(tmp)) as sim_url,
            contextlib.AsyncExitStack() as stack,
            aiohttp.ClientSession(timeout=timeout, connector=connector) as session,
        ):
            url = sim_url
            if spec is not None and sidecar_process:
                url = await stack.enter_async_context(
                    sidecar_child(sim_url, spec, Path(tmp), tokenizer)
                )
            elif spec is not None:
                url = await stack.enter_async_context(
                    sidecar_in_loop(sim_url, spec, time_scale, tokenizer)
                )
            client = Client(session, url, time_scale, chat, priority)
            mml = ctx.engine.max_model_len
            defaults = [
                engine_default_max_tokens(r, mml)
                if spec is None
                else min(KvgateMaxTokensArm.DEFAULT_MAX_TOKENS, max(1, mml - r.prompt_tokens))
                for r in schedule.requests
            ]
            client.t0 = client.loop.time() + 0.05 * time_scale  # time to create the tasks
            sampler = asyncio.create_task(sample_kv(session, sim_url, client, kv_busy))
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
