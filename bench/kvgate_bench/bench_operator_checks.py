"""``bench_operator``'s checks and processes: desired against observed state, the operator as a
subprocess with its log parsed per pass, and one in-process pass timed and profiled."""

from __future__ import annotations

import cProfile
import datetime as dt
import io
import pstats
import re
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvgate_agent.contract.api import GROUP, VERSION
from kvgate_bench.bench_operator_cluster import Http, Specs, Statuses
from kvgate_bench.kit import processes
from kvgate_bench.kit.controlplane import ControlPlane
from kvgate_bench.kit.toolkit import free_port

# ----------------------------------------------------------------------------------------------
# Desired vs observed


def strip_status(st: Mapping[str, Any] | None) -> dict[str, Any]:
    """A policy status without condition timestamps (as the operator compares them)."""
    out = dict(st or {})
    out["conditions"] = [
        {k: v for k, v in c.items() if k != "lastTransitionTime"}
        for c in out.get("conditions") or []
    ]
    out.setdefault("conflicts", [])
    return out


def policy_statuses(http: Http) -> Statuses:
    """Every policy's status without condition times."""
    return {
        (p["metadata"]["namespace"], p["metadata"]["name"]): strip_status(p.get("status"))
        for p in http.list(f"/apis/{GROUP}/{VERSION}/ratelimitpolicies")
    }


def node_specs(http: Http) -> Specs:
    """Every NodeAdmission's spec by name."""
    return {
        n["metadata"]["name"]: n.get("spec")
        for n in http.list(f"/apis/{GROUP}/{VERSION}/nodeadmissions")
    }


def node_admission_versions(http: Http) -> dict[str, str]:
    return {
        n["metadata"]["name"]: n["metadata"]["resourceVersion"]
        for n in http.list(f"/apis/{GROUP}/{VERSION}/nodeadmissions")
    }


def differences(want: tuple[Specs, Statuses], got: tuple[Specs, Statuses]) -> str:
    specs = {n for n in want[0].keys() | got[0].keys() if want[0].get(n) != got[0].get(n)}
    stats = {k for k in want[1].keys() | got[1].keys() if want[1].get(k) != got[1].get(k)}
    return (
        f"{len(specs)} NodeAdmission spec(s) differ (e.g. {sorted(specs)[:3]}), "
        f"{len(stats)} policy status(es) differ (e.g. {sorted(stats)[:3]})"
    )


def wait_converged(
    http: Http, want: tuple[Specs, Statuses], timeout: float, poll: float
) -> tuple[float | None, int, str]:
    """Poll until the cluster equals ``want``. Returns (monotonic time of the first equal
    reading, or None on timeout; policy LISTs made; what differed last).

    To load the API server less, each poll LISTs the policies first and the NodeAdmissions
    (~25 KB each at 20 pods per node) only once every status is right: a pass writes the specs
    before the statuses."""
    deadline = time.monotonic() + timeout
    polls = 0
    got: tuple[Specs, Statuses] = ({}, {})
    while time.monotonic() < deadline:
        t = time.monotonic()
        got = (got[0], policy_statuses(http))
        polls += 1
        if got[1] == want[1]:
            got = (node_specs(http), got[1])
            if got[0] == want[0]:
                return time.monotonic(), polls, ""
        time.sleep(max(0.0, poll - (time.monotonic() - t)))
    if not got[0]:
        got = (node_specs(http), got[1])
    return None, polls, differences(want, got)


# ----------------------------------------------------------------------------------------------
# The operator


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
    """``python -m kvgate_operator`` as a child process (as tests/integration/test_operator.py
    runs it)."""

    def __init__(self, cp: ControlPlane, log: Path, debounce: float, resync: float) -> None:
        self.cp, self.log = cp, log
        self.env = {
            **cp.env,
            "KVGATE_OPERATOR_LIVENESS_PORT": str(free_port()),
            "KVGATE_OPERATOR_DEBOUNCE_SECONDS": str(debounce),
            "KVGATE_OPERATOR_RESYNC_SECONDS": str(resync),
            "KVGATE_OPERATOR_WEBHOOK_ENABLED": "false",
        }
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_epoch = 0.0

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> None:
        with self.log.open("ab") as fh:
            self.started_epoch = time.time()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvgate_operator"],
                env=self.env,
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        processes.stop(self.proc, 20)

    def passes(self) -> list[LogPass]:
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            m, t = _RECONCILED.search(line), _LOG_TIME.match(line)
            if m and t:
                when = dt.datetime.strptime(t.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                nodes, statuses, events = (int(m.group(i)) for i in (1, 2, 3))
                out.append(LogPass(when, nodes, statuses, events, float(m.group(4))))
        return out

    def problems(self) -> list[str]:
        return [
            line
            for line in self.log.read_text(errors="replace").splitlines()
            if " WARNING " in line or " ERROR " in line or "Traceback" in line
        ]


# ----------------------------------------------------------------------------------------------
# In-process pass (phase timing and profile)


@dataclass
class PassTiming:
    read: float
    compute: float
    plan: float
    planned_writes: int


def time_pass(cp: ControlPlane, repeat: int) -> PassTiming:
    """Read, compute and plan as the operator's pass does (no writes), best of ``repeat``."""
    from kvgate_operator.desired import compute
    from kvgate_operator.plan import plan
    from kvgate_operator.reader import ClusterReader
    from kvgate_operator.reconciler import _now
    from kvgate_operator.settings import OperatorSettings

    best: PassTiming | None = None
    with cp.api_client() as api:
        rec = ClusterReader(api, OperatorSettings())
        for _ in range(repeat):
            t0 = time.perf_counter()
            observed = rec.read()
            t1 = time.perf_counter()
            desired = compute(observed.snapshot)
            t2 = time.perf_counter()
            todo = plan(desired, observed.node_specs, observed.policy_status, _now())
            t3 = time.perf_counter()
            pt = PassTiming(t1 - t0, t2 - t1, t3 - t2, len(todo))
            if (
                best is None
                or pt.read + pt.compute + pt.plan < best.read + best.compute + best.plan
            ):
                best = pt
    assert best is not None
    return best


def profile_pass(cp: ControlPlane, top: int = 18) -> str:
    """cProfile of one read + compute + plan, by own time."""
    from kvgate_operator.desired import compute
    from kvgate_operator.plan import plan
    from kvgate_operator.reader import ClusterReader
    from kvgate_operator.reconciler import _now
    from kvgate_operator.settings import OperatorSettings

    with cp.api_client() as api:
        rec = ClusterReader(api, OperatorSettings())
        prof = cProfile.Profile()
        prof.enable()
        observed = rec.read()
        desired = compute(observed.snapshot)
        plan(desired, observed.node_specs, observed.policy_status, _now())
        prof.disable()
    out = io.StringIO()
    st = pstats.Stats(prof, stream=out)
    st.sort_stats("tottime").print_stats(top)
    st.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def expected_state(
    cp: ControlPlane, change: Callable[[Any], Any] | None = None
) -> tuple[tuple[Specs, Statuses], Any]:
    """From scratch: read the cluster, optionally edit the snapshot, compute. Returns
    ((node specs, statuses), the Desired)."""
    from kvgate_operator.desired import compute
    from kvgate_operator.reader import ClusterReader
    from kvgate_operator.settings import OperatorSettings

    with cp.api_client() as api:
        snap = ClusterReader(api, OperatorSettings()).read().snapshot
    if change is not None:
        snap = change(snap)
    desired = compute(snap)
    statuses = {k: strip_status(v.status()) for k, v in desired.policies.items()}
    return (desired.node_specs, statuses), (desired, snap)
