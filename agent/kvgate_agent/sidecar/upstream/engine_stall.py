"""An engine that stops producing tokens while its ``/health`` still answers 200 (vLLM's
https://github.com/vllm-project/vllm/issues/53130 and SGLang's
https://github.com/sgl-project/sglang/issues/33858 are such hangs): seen from the sidecar as
streams in flight with no token from the engine for ``--engine-stall-seconds``.

:class:`EngineStall` counts what the forwarder sees (a stream begun and ended, each growth of a
stream's token count, any answer's end) with no clock call on that path; :meth:`EngineStall.
check`, run every :meth:`EngineStall.interval` seconds by :meth:`EngineStall.watch`, turns the
counts into a stall and its end. While stalled the sidecar is not ready (``/readyz`` 503) and
sends no new work to the engine (``on_change``, :meth:`~kvgate_agent.sidecar.app.Sidecar.
_engine_stalled`: the policy's ``failureMode`` decides whether new requests queue or are
refused); a stall is logged once, and its end once, when tokens flow again.

Only streams are judged: a non-streamed answer shows no token before its end, so a long one
alone in flight is not a stall (its end still counts as the engine's progress).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from kvgate_agent.tasks import cancel_and_wait

log = logging.getLogger("kvgate.sidecar")


class EngineStall:
    """Whether the engine has stalled: ``streams`` in flight (streamed requests sent to it, not
    yet ended) and no progress (a token, an answer's end) for ``seconds`` (0: never judged).

    Args:
        seconds: seconds without progress, with streams in flight, that make a stall.
        on_change: called with True when a stall begins and False when it ends.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        seconds: float,
        on_change: Callable[[bool], object],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.seconds = seconds
        self.on_change = on_change
        self.clock = clock
        self.streams = 0
        #: Progress events seen (tokens grown, answers ended); compared between checks.
        self.events = 0
        self.stalled = False
        self._seen = 0
        self._since = clock()  # the last progress (or the first stream after none), clock s
        self._task: asyncio.Task[None] | None = None

    def begin_stream(self) -> None:
        """A streamed request is sent to the engine."""
        if self.streams == 0:
            self._since = self.clock()  # a quiet engine has not stalled: its clock starts now
        self.streams += 1

    def end(self, stream: bool) -> None:
        """An answer ended (``stream``: one counted by :meth:`begin_stream`): progress."""
        self.events += 1
        if stream:
            self.streams -= 1

    def token(self) -> None:
        """A stream's token count grew: progress."""
        self.events += 1

    def quiet_seconds(self) -> float:
        """Seconds since the last progress (as of the last :meth:`check`)."""
        return self.clock() - self._since

    def check(self) -> bool:
        """Take the progress seen since the last check; whether stalled now (``on_change`` is
        called on a change, and the change logged)."""
        now = self.clock()
        if self.events != self._seen:
            self._seen = self.events
            self._since = now
        stalled = self.seconds > 0 and self.streams > 0 and now - self._since >= self.seconds
        if stalled != self.stalled:
            self.stalled = stalled
            if stalled:
                log.warning(
                    "the model server has produced no token for %.0fs with %d streams in "
                    "flight (its /health may still answer): not ready, no new work sent to it "
                    "until tokens flow again (--engine-stall-seconds)",
                    now - self._since,
                    self.streams,
                )
            else:
                log.warning("the model server produces tokens again: ready, new work sent to it")
            self.on_change(stalled)
        return stalled

    @property
    def interval(self) -> float:
        """Seconds between checks: a quarter of :attr:`seconds`, at most one."""
        return min(1.0, self.seconds / 4)

    def start(self) -> None:
        """Check every :attr:`interval` seconds in the running event loop (not when disabled)."""
        if self.seconds > 0 and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.watch())

    async def watch(self) -> None:
        """:meth:`check` forever, every :attr:`interval` seconds."""
        while True:
            await asyncio.sleep(self.interval)
            self.check()

    async def stop(self) -> None:
        """Stop checking."""
        task, self._task = self._task, None
        await cancel_and_wait(task)
