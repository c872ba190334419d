"""The sidecar's cheap, frequent read of the KV tokens its model server has in use and of the
requests waiting in the engine's own queue.

Requests can reach the engine around kvgate (another client, a second sidecar, a restart with
requests still running): the engine's own figure is then larger than kvgate's reservations,
and admission counts it (``LiveCorrection.observe_engine_kv``); the requests it holds in
its own queue are ahead of every newcomer in the expected wait
(``LiveCorrection.observe_engine_waiting``). Each figure counts for
``kvgate_agent.admission.limits.ENGINE_KV_TTL_S`` seconds, so a stalled poll never holds
admission. Read only while a KV capacity or a TTFT SLO is enforced: without either, neither
figure decides anything.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from kvgate_agent.admission import AsyncAdmission
from kvgate_agent.admission.limits import ENGINE_KV_TTL_S
from kvgate_agent.engines.scrape import EngineSample, parse_engine_metrics
from kvgate_agent.tasks import cancel_and_wait

log = logging.getLogger("kvgate.sidecar")

#: Bound on one usage read, seconds: a figure answered later than its own lifetime is of no use.
USAGE_TIMEOUT = aiohttp.ClientTimeout(total=ENGINE_KV_TTL_S)


class EngineLoadPoll:
    """Every ``interval`` seconds (after the previous read ends), ``GET upstream/metrics`` and
    hand ``kv_used_tokens``, ``waiting`` and ``running``
    (:func:`~kvgate_agent.engines.scrape.parse_engine_metrics`) to
    ``AsyncAdmission.observe_engine_usage``, which reconsiders waiting requests at once (the
    engine may have freed KV); None when the engine does not report one or the read fails. A
    failed read is logged at debug once per outage, and its recovery once.

    Args:
        upstream: model server base URL, e.g. ``http://127.0.0.1:8000``.
        admission: the admission state fed.
        interval: seconds between reads (> 0).
    """

    def __init__(
        self,
        upstream: str,
        admission: AsyncAdmission,
        interval: float,
    ) -> None:
        if not interval > 0:
            raise ValueError(f"the usage poll interval must be > 0 seconds, not {interval}")
        self.upstream = upstream
        self.admission = admission
        self.interval = interval
        self.failing = False
        self._task: asyncio.Task[None] | None = None

    def start(self, session: aiohttp.ClientSession) -> None:
        """Start polling in the background with ``session``."""
        self._task = asyncio.create_task(self._run(session))

    async def stop(self) -> None:
        """Stop polling (waits for the task to end)."""
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def read(self, session: aiohttp.ClientSession) -> EngineSample | None:
        """One read: the engine's metrics (KV tokens in use, requests waiting), or None
        (unread)."""
        try:
            async with session.get(self.upstream + "/metrics", timeout=USAGE_TIMEOUT) as resp:
                if resp.status != 200:
                    raise aiohttp.ClientResponseError(
                        resp.request_info, (), status=resp.status, message=resp.reason or ""
                    )
                text = await resp.text()
        except (TimeoutError, aiohttp.ClientError, UnicodeDecodeError) as exc:
            if not self.failing:
                log.debug("cannot read the engine's KV usage (silent until it recovers): %s", exc)
            self.failing = True
            return None
        if self.failing:
            log.debug("reading the engine's KV usage again")
        self.failing = False
        return parse_engine_metrics(text)

    async def _run(self, session: aiohttp.ClientSession) -> None:
        a = self.admission
        while True:
            if a.config.kv_capacity_tokens is not None or a.config.ttft_slo_seconds is not None:
                sample = await self.read(session)
                if sample is None:
                    a.observe_engine_usage(None, None, None)
                else:
                    a.observe_engine_usage(sample.kv_used_tokens, sample.waiting, sample.running)
            await asyncio.sleep(self.interval)
