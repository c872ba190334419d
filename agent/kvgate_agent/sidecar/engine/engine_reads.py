"""The engine probe's reads of its model server's endpoints (``/metrics``, ``/props``,
``/slots``), bounded in time, and their failures logged when they change, not at every read.

An engine that is down is read again every second while its KV capacity is unknown
(:mod:`kvgate_agent.sidecar.engine.probe`): a warning per read would fill the log with one line a
second. An endpoint that cannot be read is logged once, with the reason; again only when the
reason changes (with the count of reads that failed the old way) and when it answers again
(with the count of reads that failed meanwhile).
"""

from __future__ import annotations

import logging

import aiohttp

from kvgate_agent.sidecar.upstream import ModelServer

log = logging.getLogger("kvgate.sidecar")

#: Bound on the sidecar's own reads of the model server (metrics, model list): a hung engine
#: endpoint must not stall the capacity check for the request timeout (minutes).
PROBE_TIMEOUT = aiohttp.ClientTimeout(total=5.0)


def _reason(exc: BaseException) -> str:
    """What went wrong, in one line (``TimeoutError`` says nothing by itself)."""
    return str(exc) or type(exc).__name__


class EngineReads:
    """``GET`` the model server's endpoints over ``server``'s probe client (:meth:`get`).

    ``failing``: each endpoint that did not answer its last read, with the reason and how many
    reads in a row failed so.
    """

    def __init__(self, server: ModelServer) -> None:
        self.server = server
        self.failing: dict[str, tuple[str, int]] = {}

    async def get(self, path: str, *, quiet: bool = False) -> tuple[int, bytes] | None:
        """(status, body) of ``GET upstream + path``, None when the engine does not answer
        within :data:`PROBE_TIMEOUT`: logged as a warning (at debug when ``quiet``) when the
        endpoint starts failing or fails for another reason, not at each read; its answering
        again is logged at info (debug when ``quiet``), with the count of reads that failed."""
        try:
            async with self.server.probe().get(
                self.server.url + path, timeout=PROBE_TIMEOUT
            ) as resp:
                got = resp.status, await resp.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            self._failed(path, _reason(exc), quiet)
            return None
        before = self.failing.pop(path, None)
        if before is not None:
            log.log(
                logging.DEBUG if quiet else logging.INFO,
                "the engine's %s answers again after %d failed reads",
                path,
                before[1],
            )
        return got

    def _failed(self, path: str, reason: str, quiet: bool) -> None:
        before = self.failing.get(path)
        if before is not None and before[0] == reason:
            self.failing[path] = (reason, before[1] + 1)
            return
        self.failing[path] = (reason, 1)
        level = logging.DEBUG if quiet else logging.WARNING
        if before is None:
            log.log(level, "cannot read engine %s: %s (said again when that changes)", path, reason)
        else:
            log.log(
                level,
                "cannot read engine %s: %s (after %d failed reads: %s)",
                path,
                reason,
                before[1],
                before[0],
            )
