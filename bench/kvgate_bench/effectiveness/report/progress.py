"""A progress display on stderr for the effectiveness benchmark and the virtual-time demo.

Shared by ``python -m kvgate_bench.effectiveness`` and ``python -m kvgate_bench.demo.virtual``.
Times are seconds on an injected monotonic clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TextIO


class Progress:
    """A progress display on ``stream``: phase, done / total, elapsed (since the display was
    made) and ETA (the phase's mean time per item so far x the items left), seconds.

    ``live``: one line rewritten in place (a terminal); otherwise a line per tenth of a phase
    and at its end. ``clock``: monotonic seconds (injected by the tests).
    """

    def __init__(
        self, stream: TextIO, live: bool, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.stream, self.live, self.clock = stream, live, clock
        self.started = clock()
        self._phase = ""
        self._phase_started = self.started

    def line(self, phase: str, done: int, total: int) -> str:
        """The text shown for ``done`` of ``total`` in ``phase``."""
        now = self.clock()
        if phase != self._phase:
            self._phase, self._phase_started = phase, now
        elapsed = now - self.started
        text = f"{phase} {done}/{total}, elapsed {elapsed:.0f} s"
        if 0 < done < total:
            eta = (now - self._phase_started) / done * (total - done)
            text += f", ETA {eta:.0f} s"
        return text

    def __call__(self, phase: str, done: int, total: int) -> None:
        text = self.line(phase, done, total)
        if self.live:
            end = "\n" if done >= total else ""
            self.stream.write(f"\r\x1b[K{text}{end}")
        elif done >= total or done % max(1, total // 10) == 0:
            self.stream.write(text + "\n")
        self.stream.flush()

    def phase(self, name: str) -> Callable[[int, int], None]:
        """A (done, total) callback for ``name``."""
        return lambda done, total: self(name, done, total)
