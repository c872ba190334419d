"""The main port's ``GET /metrics``: the model server's own exposition, read for each scrape,
with kvgate's router gauges appended (:mod:`kvgate_agent.sidecar.engine.router_signals`), so a
router that scrapes the pod's serving port (llm-d's endpoint picker scrapes the InferencePool's
``targetPort``, the sidecar's) reads the engine's metrics and kvgate's alike.

When the engine's ``/metrics`` cannot be read (refused, an error status, too slow), the answer
is still a 200 with the two gauges, computed without the engine's figures, and a comment line
saying why; so a router keeps reading kvgate's gauges while the engine's are missing.
kvgate's own metrics stay at ``/kvgate/metrics`` and on the admin port.
"""

from __future__ import annotations

import logging

import aiohttp

from kvgate_agent.admission import AsyncAdmission
from kvgate_agent.admission.limits import ENGINE_KV_TTL_S
from kvgate_agent.engines.scrape import parse_engine_metrics
from kvgate_agent.sidecar.edge import Answer, ClientRequest
from kvgate_agent.sidecar.engine.router_signals import (
    TEXT_FORMAT,
    core_lines,
    router_gauges,
    with_gauges,
)
from kvgate_agent.sidecar.reading import DECISION_HEADER
from kvgate_agent.sidecar.upstream import ModelServer

log = logging.getLogger("kvgate.sidecar")

#: Bound on reading the engine's ``/metrics`` for one scrape, seconds: past it the gauges are
#: served alone (a figure older than its own lifetime is of no use to a router either).
SCRAPE_TIMEOUT = aiohttp.ClientTimeout(total=ENGINE_KV_TTL_S)
#: The scraper's headers passed on to the engine: the format it accepts, its credentials.
_PASSED = ("Accept", "Authorization")


class RouterMetrics:
    """The handler of the main port's ``GET /metrics`` (and ``HEAD``).

    Args:
        model_server: the engine's connections (its pass-through client reads ``/metrics``).
        admission: the admission state the gauges are computed from.
    """

    def __init__(self, model_server: ModelServer, admission: AsyncAdmission) -> None:
        self.model_server = model_server
        self.admission = admission
        self.failing = False

    async def handle(self, request: ClientRequest) -> Answer:
        """The engine's exposition (its content type; the client's query, ``Accept`` and
        ``Authorization`` passed on) with the gauges appended; the gauges alone, as text
        format 0.0.4, when the engine's cannot be read. ``x-kvgate-decision: passthrough``, as
        on every path the sidecar passes on."""
        text, content_type, problem = await self._engine(request)
        sample = None if text is None else parse_engine_metrics(core_lines(text))
        a = self.admission
        gauges = router_gauges(a.stats(), sample, a.engine_waiting())
        body = with_gauges(text or "", gauges, problem)
        headers = {"Content-Type": content_type, DECISION_HEADER: "passthrough"}
        return Answer(body=body.encode(), headers=headers)

    async def _engine(self, request: ClientRequest) -> tuple[str | None, str, str | None]:
        """(the engine's exposition, its content type, None), or (None, text format 0.0.4, why
        it could not be read)."""
        headers = {k: request.headers[k] for k in _PASSED if k in request.headers}
        url = self.model_server.url + "/metrics"
        try:
            session = self.model_server.session()
            async with session.get(
                url, params=request.rel_url.query, headers=headers, timeout=SCRAPE_TIMEOUT
            ) as resp:
                if resp.status != 200:
                    return self._failed(f"the model server's /metrics answered {resp.status}")
                text = await resp.text()
                return self._read(text, resp.headers.get("Content-Type") or TEXT_FORMAT)
        except (TimeoutError, aiohttp.ClientError, UnicodeDecodeError, RuntimeError) as exc:
            return self._failed(f"the model server's /metrics failed: {type(exc).__name__}")

    def _read(self, text: str, content_type: str) -> tuple[str, str, None]:
        if self.failing:
            log.info("the model server's /metrics answers again")
        self.failing = False
        return text, content_type, None

    def _failed(self, why: str) -> tuple[None, str, str]:
        if not self.failing:
            log.info("%s: serving kvgate's router gauges alone (silent until it recovers)", why)
        self.failing = True
        return None, TEXT_FORMAT, why
