"""The node agent's engine scraper: each synced pod's engine ``/metrics``, read from the address
its sidecar reported, into the :class:`~kvgate_agent.node.engine.EngineView` and the
:class:`~kvgate_agent.node.state.NodeState`'s engine facts.

Invariant: the agent scrapes only a sidecar's own address (:func:`metrics_url_allowed`), never
an address a pod merely names, and never buffers a page over :data:`MAX_SCRAPE_BYTES`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Callable
from urllib.parse import urlsplit

import aiohttp

from kvgate_agent.engines.scrape import parse_engine_metrics
from kvgate_agent.node.engine import EngineView
from kvgate_agent.node.metrics import NodeMetrics
from kvgate_agent.node.state import EngineFacts, NodeState, PodKey

log = logging.getLogger("kvgate.node")

#: Largest engine ``/metrics`` page read, bytes. vLLM's exposition is tens of KB; a page beyond
#: this is refused (the scrape counts as failed) rather than buffered.
MAX_SCRAPE_BYTES = 4 * 1024 * 1024


class _TooLarge(Exception):
    pass


def metrics_url_allowed(url: str, peer: str | None) -> bool:
    """Whether the agent may scrape ``url`` reported by a sidecar connecting from ``peer``: only
    plain HTTP to the sidecar's own address (its pod IP), or loopback when the sidecar itself is
    on loopback. The agent never fetches an address a pod merely names (no request forgery
    towards the node or the cluster)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname
        if parts.scheme != "http" or host is None or peer is None:
            return False
        h = ipaddress.ip_address(host)
        p = ipaddress.ip_address(peer)
    except ValueError:
        return False
    return h == p


class EngineScraper:
    """Scrapes the engines of the pods that sync with this agent.

    Holds each pod's scrape target (the ``metricsUrl`` of its last sync, kept only when
    :func:`metrics_url_allowed`), the HTTP session (opened by :meth:`open`, closed by
    :meth:`close`; 2 s per scrape) and :attr:`engines`, the last good sample per pod with its
    age. A pod whose report expired loses its target and its samples.

    Args:
        state: the node's state; its reports expire here and its engine facts are set here.
        metrics: counts scrapes by result.
        scrape_seconds: seconds between scrapes (the caller's loop), > 0.
        max_age_seconds: how old a good sample may be before it is unknown (None: 3 scrapes).
        clock: monotonic seconds.
    """

    def __init__(
        self,
        state: NodeState,
        metrics: NodeMetrics,
        scrape_seconds: float,
        max_age_seconds: float | None,
        clock: Callable[[], float],
    ) -> None:
        self.state = state
        self.metrics = metrics
        self.clock = clock
        self.engines = EngineView(scrape_seconds, max_age_seconds, clock=clock)
        self._targets: dict[PodKey, str] = {}
        self._session: aiohttp.ClientSession | None = None

    def open(self) -> None:
        """Open the HTTP session (on the running event loop)."""
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0))

    async def close(self) -> None:
        """Close the HTTP session, if open."""
        if self._session is not None:
            await self._session.close()

    def set_target(self, key: PodKey, url: str | None, peer: str | None) -> None:
        """A sync from ``key`` (connecting from ``peer``) reported ``url``: scrape it from now on
        if it is the sidecar's own address, else (or when None) scrape nothing for the pod."""
        if url is not None and metrics_url_allowed(url, peer):
            self._targets[key] = url
            return
        if url is not None:
            log.warning(
                "%s/%s: not scraping %s (not the sidecar's own address %s)", *key, url, peer
            )
        self._targets.pop(key, None)

    def ages(self, now: float) -> dict[PodKey, float | None]:
        """Seconds since each scraped pod's last good engine sample."""
        out: dict[PodKey, float | None] = {}
        for pod, reading in self.engines.readings(now).items():
            ns, _, name = pod.partition("/")
            out[(ns, name)] = reading.age_seconds
        return out

    async def scrape_all(self) -> None:
        """Expire the pods not heard from, then scrape every target once, concurrently, each
        bounded in time, and set each pod's engine facts in the state (None: no fresh sample)."""
        for key in self.state.expire(self.clock()):
            self._targets.pop(key, None)
            self.engines.forget(f"{key[0]}/{key[1]}")
        await asyncio.gather(*(self._scrape(k, u) for k, u in list(self._targets.items())))
        for key in list(self._targets):
            sample = self.engines.current(f"{key[0]}/{key[1]}")
            self.state.set_engine(
                key,
                None
                if sample is None
                else EngineFacts(sample.kv_capacity_tokens, sample.kv_used_tokens),
            )

    async def _scrape(self, key: PodKey, url: str) -> None:
        assert self._session is not None
        pod = f"{key[0]}/{key[1]}"
        try:
            async with self._session.get(url) as resp:
                if resp.status != 200:
                    self.engines.record_error(pod, f"http_{resp.status}")
                    self.metrics.scrapes.labels("error").inc()
                    return
                if (resp.content_length or 0) > MAX_SCRAPE_BYTES:
                    raise _TooLarge()
                raw = bytearray()
                async for chunk in resp.content.iter_chunked(65536):
                    raw += chunk
                    if len(raw) > MAX_SCRAPE_BYTES:
                        raise _TooLarge()
        except _TooLarge:
            self.engines.record_error(pod, "too_large")
            self.metrics.scrapes.labels("error").inc()
            return
        except (TimeoutError, aiohttp.ClientError) as exc:
            self.engines.record_error(
                pod, "timeout" if isinstance(exc, TimeoutError) else "connect"
            )
            self.metrics.scrapes.labels("error").inc()
            return
        # Parsing a big exposition takes a while: off the loop, so syncs are never delayed.
        text = raw.decode("utf-8", errors="replace")
        sample = await asyncio.to_thread(parse_engine_metrics, text)
        self.engines.record(pod, sample)
        self.metrics.scrapes.labels("ok" if sample.ok else "invalid").inc()
