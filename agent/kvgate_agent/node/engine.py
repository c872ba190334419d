"""The node agent's view of each pod's engine: the last good :class:`EngineSample` per pod and
its age.

Invariant: a sample older than ``max_age_seconds`` is unknown, never idle nor saturated (stale
metrics scored as saturated blocked dispatch, stale "idle" ones attracted a flood:
https://github.com/llm-d/llm-d-router/pull/2547). Pure: the caller scrapes and passes the text
and the time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from kvgate_agent.engines.scrape import EngineSample, parse_engine_metrics

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class EngineReading:
    """What :meth:`EngineView.reading` knows about one pod at time ``now``.

    Attributes:
        sample: the last good sample if it is at most ``max_age_seconds`` old, else None.
        reason: why ``sample`` is None: ``"never_scraped"`` (no scrape recorded),
            ``"scrape_failed:<error>"`` (the latest scrape failed and no good sample is fresh
            enough), ``"stale"`` (the last good sample is too old and no failure since: the
            scraper itself is behind). None when ``sample`` is given.
        age_seconds: now − the time of the last good sample (seconds, >= 0), None if never.
        last_good_at: clock time of the last good sample, None if never.
        last_error: the error of the latest scrape when it failed, else None (a failed scrape
            does not hide a sample that is still fresh enough, but shows here).
    """

    sample: EngineSample | None
    reason: str | None
    age_seconds: float | None
    last_good_at: float | None
    last_error: str | None


@dataclass(slots=True)
class _PodState:
    good: EngineSample | None = None
    good_at: float | None = None
    error: str | None = None
    error_at: float | None = None


class EngineView:
    """The last engine sample per pod, with staleness. Pure: time comes from ``clock`` or the
    ``now``/``at`` arguments (seconds, monotonic); not thread-safe (one scraper loop owns it).

    A sample older than ``max_age_seconds`` is invalid, never idle nor saturated. A single
    failed scrape does not hide a sample that is still within the age limit, so one slow
    scrape does not flip admission.

    Args:
        scrape_interval: seconds between scrapes, > 0.
        max_age_seconds: how old a good sample may be; default 3 × ``scrape_interval``.
        clock: monotonic seconds, used when ``now``/``at`` are not given.

    Raises:
        ValueError: a non-positive interval or max age.
    """

    def __init__(
        self,
        scrape_interval: float = 5.0,
        max_age_seconds: float | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        if not scrape_interval > 0:
            raise ValueError("scrape_interval must be > 0")
        max_age = 3 * scrape_interval if max_age_seconds is None else max_age_seconds
        if not max_age > 0:
            raise ValueError("max_age_seconds must be > 0")
        self.scrape_interval = scrape_interval
        self.max_age_seconds = max_age
        self.clock = clock
        self._pods: dict[str, _PodState] = {}

    def record(self, pod: str, sample: EngineSample, at: float | None = None) -> None:
        """Record a scrape that returned a body, parsed into ``sample``. A sample that is not
        ``ok`` counts as a failed scrape (``"invalid: <reason>"``). A sample older than the one
        held is ignored (out-of-order scrapes)."""
        if not sample.ok:
            self.record_error(pod, f"invalid: {sample.reason}", at)
            return
        t = self.clock() if at is None else at
        state = self._pods.setdefault(pod, _PodState())
        if state.good_at is not None and t < state.good_at:
            return
        state.good, state.good_at = sample, t
        if state.error_at is not None and state.error_at <= t:
            state.error, state.error_at = None, None

    def record_text(
        self, pod: str, text: str, at: float | None = None, engine: str | None = None
    ) -> EngineSample:
        """Parse ``text`` (see :func:`parse_engine_metrics`, ``engine`` is its hint), record
        it, and return it."""
        sample = parse_engine_metrics(text, engine)
        self.record(pod, sample, at)
        return sample

    def record_error(self, pod: str, error: str, at: float | None = None) -> None:
        """Record a failed scrape (connection refused, timeout, HTTP status...): ``error`` is a
        short label such as ``"timeout"`` or ``"http_503"``."""
        t = self.clock() if at is None else at
        state = self._pods.setdefault(pod, _PodState())
        if state.good_at is not None and t < state.good_at:
            return
        state.error, state.error_at = error, t

    def forget(self, pod: str) -> None:
        """Drop a pod (deleted, or no longer on this node)."""
        self._pods.pop(pod, None)

    def pods(self) -> list[str]:
        """Pods with anything recorded, sorted."""
        return sorted(self._pods)

    def reading(self, pod: str, now: float | None = None) -> EngineReading:
        """What is known about ``pod`` at ``now`` (see :class:`EngineReading`)."""
        t = self.clock() if now is None else now
        state = self._pods.get(pod)
        if state is None:
            return EngineReading(None, "never_scraped", None, None, None)
        age = None if state.good_at is None else max(0.0, t - state.good_at)
        if state.good is not None and age is not None and age <= self.max_age_seconds:
            return EngineReading(state.good, None, age, state.good_at, state.error)
        if state.error is not None:
            reason = f"scrape_failed:{state.error}"
        elif state.good is None:
            reason = "never_scraped"
        else:
            reason = "stale"
        return EngineReading(None, reason, age, state.good_at, state.error)

    def current(self, pod: str, now: float | None = None) -> EngineSample | None:
        """The pod's last good sample if fresh enough, else None (why: :meth:`reading`)."""
        return self.reading(pod, now).sample

    def age_seconds(self, pod: str, now: float | None = None) -> float | None:
        """Seconds since the pod's last good sample (for a metric), None if never."""
        return self.reading(pod, now).age_seconds

    def readings(self, now: float | None = None) -> dict[str, EngineReading]:
        """:meth:`reading` for every recorded pod."""
        t = self.clock() if now is None else now
        return {pod: self.reading(pod, t) for pod in self.pods()}
