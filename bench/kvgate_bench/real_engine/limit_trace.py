"""The sidecar's adaptive concurrency limit over a ``kvgate`` arm's run: polled from its admin
``/metrics`` (the gauge ``kvgate_concurrency_limit``, requests: the cap it enforces now,
``kvgate_agent.sidecar.metrics``) every :data:`POLL_S` seconds by :class:`LimitPoller`, and
summarised (pure: :func:`summary`).

The summary, per row: ``limit_after_20_completions`` (the last sample at or before the 20th
request to finish, requests; None when fewer finished or nothing was sampled by then),
``completions`` (the requests that finished served),
``limit_first``, ``limit_last``, ``limit_min``, ``limit_max``, ``limit_mean`` (time-weighted
over the samples, each held until the next), ``limit_changes`` (samples that differ from the
one before) and ``limit_samples``; and ``limit_trace``: the samples as [seconds from the
schedule's start, limit], at most :data:`TRACE_POINTS` (thinned evenly, the first and last
kept).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Sequence
from typing import Any

import aiohttp

from kvgate_bench.kit.toolkit import parse_samples, sample_sum

POLL_S = 0.5
GAUGE = "kvgate_concurrency_limit"
#: Completions after which the limit is read for the cold-start target (issue 33).
COLD_START_COMPLETIONS = 20
TRACE_POINTS = 400


def limit_at(trace: Sequence[tuple[float, float]], t: float) -> float | None:
    """The last sample of ``trace`` ((seconds, limit), time order) at or before ``t``."""
    found = None
    for ts, v in trace:
        if ts > t:
            break
        found = v
    return found


def summary(
    trace: Sequence[tuple[float, float]],
    completions_s: Sequence[float],
    after: int = COLD_START_COMPLETIONS,
) -> dict[str, Any]:
    """The module docstring's summary of ``trace`` ((seconds, limit) samples, time order) with
    the requests' finish times ``completions_s`` (seconds, any order)."""
    done = sorted(completions_s)
    at = limit_at(trace, done[after - 1]) if len(done) >= after else None
    out: dict[str, Any] = {
        f"limit_after_{after}_completions": at,
        "completions": len(done),
        "limit_samples": len(trace),
    }
    if not trace:
        out.update(dict.fromkeys(("limit_first", "limit_last", "limit_min", "limit_max",
                                  "limit_mean")), limit_changes=0, limit_trace=[])  # fmt: skip
        return out
    values = [v for _, v in trace]
    held = [(trace[i + 1][0] - trace[i][0], trace[i][1]) for i in range(len(trace) - 1)]
    span = sum(d for d, _ in held)
    mean = sum(d * v for d, v in held) / span if span > 0 else values[-1]
    step = max(1, -(-len(trace) // TRACE_POINTS))
    thin = list(trace[::step])
    if thin[-1] != trace[-1]:
        thin.append(trace[-1])
    out.update(
        limit_first=values[0],
        limit_last=values[-1],
        limit_min=min(values),
        limit_max=max(values),
        limit_mean=mean,
        limit_changes=sum(1 for a, b in itertools.pairwise(values) if a != b),
        limit_trace=[[round(t, 3), v] for t, v in thin],
    )
    return out


class LimitPoller:
    """Reads :data:`GAUGE` from ``url`` (the sidecar's admin ``/metrics``) every ``interval_s``
    seconds, time-stamped by ``clock()`` (seconds from the schedule's start), until stopped;
    a failed or gauge-less scrape is skipped."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str,
        clock: Any,
        interval_s: float = POLL_S,
    ) -> None:
        self.session, self.url, self.clock, self.interval_s = session, url, clock, interval_s
        self.trace: list[tuple[float, float]] = []
        self._task: asyncio.Task[None] | None = None

    async def sample(self) -> None:
        """One scrape; appends (now, limit) when the gauge is there."""
        async with self.session.get(self.url) as r:
            text = await r.text()
        samples = parse_samples(text, [GAUGE])
        if samples:
            self.trace.append((float(self.clock()), sample_sum(samples, GAUGE)))

    async def _loop(self) -> None:
        while True:
            with contextlib.suppress(aiohttp.ClientError, ValueError, asyncio.TimeoutError):
                await self.sample()
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> list[tuple[float, float]]:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        return self.trace
