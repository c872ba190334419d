"""``python -m kvgate_operator`` as a child process against the local control plane, its log
read per writing pass (:class:`Operator`, :class:`LogPass`): as tests/integration/test_operator.py
runs it, and the operator benchmark and the fault tests.
"""

from __future__ import annotations

import datetime as dt
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kvgate_bench.kit.controlplane import ControlPlane
from kvgate_bench.kit.processes import Popen, spawn, stop
from kvgate_bench.kit.toolkit import free_port

_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
_RECONCILED = re.compile(
    r"reconciled: (\d+) NodeAdmission writes, (\d+) policy status writes, (\d+) events"
    r"(?:, \d+ missed-injection events)? in ([\d.]+)s"
)


@dataclass
class LogPass:
    """A pass that wrote something, from the operator's log."""

    when: float  # epoch seconds (the log line's time: the pass's end)
    nodes: int
    statuses: int
    events: int
    seconds: float


class Operator:
    """``python -m kvgate_operator`` as a child process against ``cp`` (as
    tests/integration/test_operator.py runs it; the operator benchmark and the fault tests
    start it so), its output appended to ``log``; ``debounce`` and ``resync`` in seconds, the
    webhook off. ``env`` may be changed before :meth:`start`."""

    def __init__(self, cp: ControlPlane, log: Path, debounce: float, resync: float) -> None:
        self.cp, self.log = cp, log
        self.env = {
            **cp.env,
            "KVGATE_OPERATOR_LIVENESS_PORT": str(free_port()),
            "KVGATE_OPERATOR_DEBOUNCE_SECONDS": str(debounce),
            "KVGATE_OPERATOR_RESYNC_SECONDS": str(resync),
            "KVGATE_OPERATOR_WEBHOOK_ENABLED": "false",
        }
        self.proc: Popen | None = None
        self.started_epoch = 0.0

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> None:
        self.started_epoch = time.time()
        self.proc = spawn(
            [sys.executable, "-m", "kvgate_operator"], self.log, self.env, append=True
        )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        stop(self.proc, 20)

    def passes(self) -> list[LogPass]:
        """The writing passes its log names so far (``reconciled: ...`` lines)."""
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            m, t = _RECONCILED.search(line), _LOG_TIME.match(line)
            if m and t:
                when = dt.datetime.strptime(t.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                nodes, statuses, events = (int(m.group(i)) for i in (1, 2, 3))
                out.append(LogPass(when, nodes, statuses, events, float(m.group(4))))
        return out

    def problems(self) -> list[str]:
        """Its log's WARNING, ERROR and traceback lines."""
        return [
            line
            for line in self.log.read_text(errors="replace").splitlines()
            if " WARNING " in line or " ERROR " in line or "Traceback" in line
        ]
