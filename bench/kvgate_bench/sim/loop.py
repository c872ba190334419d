"""kvgate-sim's engine on the real clock: :class:`EngineLoop` steps
:class:`~kvgate_bench.sim.engine.SimEngine` in a background task while it has work, hands each
request's new tokens to its queue, and keeps the engine's Prometheus metrics (vLLM's names) and
the loop's own figures (steps, lag behind the step deadlines, preemptions per request).

Each iteration lasts the duration the engine's step-time model gives it
(:mod:`kvgate_bench.sim.steptime`: the ``constant`` profile's ``decode_ms`` plus
``prefill_us_per_token`` per prefilled token by default, or a realistic profile's ``a + b*P +
c*D + d*K``) times ``time_scale``, paced on the real clock to deadlines (step ``k`` ends at the
start of the busy period plus the scaled durations of steps ``1..k``, so the loop's own CPU time
does not stretch it; a lag over :data:`MAX_LAG_S` is written off and counted in ``late_s``), then
the tokens it produced go to the waiting handlers; when idle it sleeps on an
:class:`asyncio.Event` (no polling). The HTTP side is :mod:`kvgate_bench.sim.server`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge

from kvgate_bench.sim.config import SimConfig
from kvgate_bench.sim.engine import SimEngine
from kvgate_bench.sim.sequences import StepResult

logger = logging.getLogger(__name__)

#: How far (real seconds) the engine loop may fall behind its step deadlines and catch up
#: (shorter sleeps); beyond it the lag is written off (``/sim/stats`` ``late_s``).
MAX_LAG_S = 0.25
#: Preempted requests whose counts ``/sim/preemptions`` keeps (the most recent).
PREEMPTED_KEPT = 100_000


class EngineLoop:
    """The engine of ``config`` stepped on the real clock, its metrics in :attr:`registry`.

    A request is :meth:`open`-ed after the engine took it (its queue then gets each new token's
    0-based index, or None when the server aborts it) and :meth:`close`-d when its handler ends
    (the engine drops it, freeing its KV blocks). Should the engine raise (a bug), in-flight
    requests are aborted and :attr:`closing` is set, as vLLM's server dies with its engine core.
    """

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.engine = SimEngine(config.engine_config(), config.steptime)
        #: Set once aborting (shutdown, or the engine died): no new request is taken.
        self.closing = False
        self._queues: dict[str, asyncio.Queue[int | None]] = {}
        self._wake = asyncio.Event()
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

    # -- requests ---------------------------------------------------------------

    def open(self, rid: str, tenant: str) -> asyncio.Queue[int | None]:
        """The token queue of request ``rid`` (just submitted to the engine by ``tenant``);
        wakes the loop."""
        self.requests_total.labels(tenant=tenant).inc()
        queue: asyncio.Queue[int | None] = asyncio.Queue()
        self._queues[rid] = queue
        self._wake.set()
        return queue

    def close(self, rid: str) -> None:
        """Request ``rid`` ended (finished, failed or its client left): drop its queue and
        cancel it in the engine."""
        del self._queues[rid]
        self.engine.cancel(rid)

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
            self.abort_all()

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

    def abort_all(self) -> None:
        """End every request in flight (their queues get None) and refuse new ones."""
        self.closing = True
        for queue in self._queues.values():
            queue.put_nowait(None)
