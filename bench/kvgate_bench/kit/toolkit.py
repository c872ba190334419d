"""Helpers shared by the tests and the benchmarks: a clock moved by hand, waiting with a
deadline, free loopback ports, reading Prometheus text, CPU time and memory of a process, and
the one percentile definition every figure uses.

Invariant: nothing here sleeps on the real clock except the ``wait_*`` helpers, and every one
of those has a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import math
import os
import platform
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from ssl import SSLContext
from typing import Literal, TypeVar

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

T = TypeVar("T")

__all__ = [
    "FakeClock",
    "FakeUtcClock",
    "ProcUsage",
    "Sample",
    "cpu_seconds",
    "fetch_text",
    "free_port",
    "memory_kib",
    "parse_samples",
    "percentile",
    "percentile_of",
    "poll_until",
    "poll_until_async",
    "proc_usage",
    "rss_mib",
    "sample_sum",
    "sample_value",
    "samples_by_labels",
    "series",
    "wait_http",
    "wait_port",
    "wait_until",
    "wait_until_async",
]

# ---------------------------------------------------------------------------------------- clocks


class FakeClock:
    """A monotonic clock in seconds that only moves when told to.

    Pass the object itself (it is callable) or its :meth:`monotonic` / :meth:`time` where code
    takes a clock, and :meth:`sleep` where it takes a sleep function (sleeping advances it).
    ``now`` may also be set or incremented directly.
    """

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move the clock forward by ``seconds``."""
        self.now += seconds

    def sleep(self, seconds: float) -> None:
        """Return at once, having advanced the clock by ``seconds``."""
        self.now += seconds


class FakeUtcClock:
    """A wall clock (timezone-aware ``datetime``) that only moves when told to; callable."""

    def __init__(self, now: dt.datetime) -> None:
        self.now = now

    def __call__(self) -> dt.datetime:
        return self.now

    def advance(self, delta: dt.timedelta) -> None:
        self.now += delta


# --------------------------------------------------------------------------------------- waiting


def wait_until(
    cond: Callable[[], T | Literal[False] | None], timeout: float, what: str, interval: float = 0.05
) -> T:
    """Call ``cond`` every ``interval`` seconds until it returns something truthy; return that.

    Raises:
        TimeoutError: nothing truthy within ``timeout`` seconds (the message names ``what``).
    """
    got = poll_until(cond, bool, timeout, interval)
    if not got:
        raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
    return got


async def wait_until_async(
    cond: Callable[[], Awaitable[object] | object], within: float, what: str, interval: float = 0.01
) -> None:
    """Call ``cond`` every ``interval`` seconds until it returns something truthy, the event
    loop running between calls; ``cond`` may be a plain or a coroutine function.

    Raises:
        TimeoutError: nothing truthy within ``within`` seconds.
    """

    async def fetch() -> object:
        got = cond()
        return await got if isinstance(got, Awaitable) else got

    if not await poll_until_async(fetch, bool, within, interval):
        raise TimeoutError(f"timed out after {within}s waiting for {what}")


def poll_until(
    fetch: Callable[[], T], done: Callable[[T], bool], timeout: float, interval: float = 0.02
) -> T:
    """Call ``fetch`` until ``done`` holds for its result or ``timeout`` seconds pass; return the
    last result either way (the caller asserts on it)."""
    deadline = time.monotonic() + timeout
    while True:
        got = fetch()
        if done(got) or time.monotonic() > deadline:
            return got
        time.sleep(interval)


async def poll_until_async(
    fetch: Callable[[], Awaitable[T]],
    done: Callable[[T], bool],
    within: float,
    interval: float = 0.02,
) -> T:
    """As :func:`poll_until` in an event loop, ``fetch`` a coroutine function: the last result,
    once ``done`` holds for it or ``within`` seconds have passed."""
    deadline = time.monotonic() + within
    while True:
        got = await fetch()
        if done(got) or time.monotonic() > deadline:
            return got
        await asyncio.sleep(interval)


def _exited(proc: subprocess.Popen[bytes] | None, what: str) -> None:
    if proc is not None and proc.poll() is not None:
        raise RuntimeError(f"{proc.args!r} exited with {proc.returncode} before {what}")


def wait_http(url: str, timeout: float = 15.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Wait until ``url`` answers with any HTTP status.

    Raises:
        RuntimeError: ``proc`` exited first.
        TimeoutError: no answer within ``timeout`` seconds.
    """

    def answers() -> bool:
        _exited(proc, f"{url} answered")
        try:
            urllib.request.urlopen(url, timeout=1).close()
        except urllib.error.HTTPError:
            return True
        except OSError:
            return False
        return True

    wait_until(answers, timeout, url)


def wait_port(
    port: int, proc: subprocess.Popen[bytes] | None = None, timeout: float = 20.0
) -> None:
    """Wait until something accepts TCP connections on 127.0.0.1:``port``.

    Raises:
        RuntimeError: ``proc`` exited first.
        TimeoutError: nothing listening within ``timeout`` seconds.
    """

    def listening() -> bool:
        _exited(proc, f"port {port} listened")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return True
        return False

    wait_until(listening, timeout, f"a listener on port {port}")


# ----------------------------------------------------------------------------------------- ports


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (another binder may take it before the caller does)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------------------------ Prometheus


def http_status(url: str, timeout: float = 2.0) -> int:
    """The HTTP status of a GET of ``url`` (an error status included); 0 when nothing answers
    (refused, reset, timed out)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return 0


def fetch_text(url: str, timeout: float = 10.0, context: SSLContext | None = None) -> str:
    """The body of a GET of ``url`` as text; HTTP errors and connection failures raise."""
    with urllib.request.urlopen(url, timeout=timeout, context=context) as r:
        return str(r.read().decode())


def parse_samples(text: str, names: Iterable[str] | None = None) -> list[Sample]:
    """Every sample of a Prometheus text exposition (``prometheus_client.parser``), or only
    those called one of ``names`` (sample names: ``x_total``, ``x_sum``, ``x_bucket``)."""
    if names is not None:
        wanted = set(names)
        text = "\n".join(
            line
            for line in text.splitlines()
            if line.startswith("#") or line.partition("{")[0].partition(" ")[0] in wanted
        )
    samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
    return samples if names is None else [s for s in samples if s.name in wanted]


def _matches(s: Sample, name: str, labels: dict[str, str]) -> bool:
    return s.name == name and all(s.labels.get(k) == v for k, v in labels.items())


def sample_value(samples: Iterable[Sample], name: str, **labels: str) -> float | None:
    """The value of the first sample ``name`` whose labels include ``labels``; None if none."""
    return next((float(s.value) for s in samples if _matches(s, name, labels)), None)


def sample_sum(samples: Iterable[Sample], name: str, **labels: str) -> float:
    """The sum of the samples ``name`` whose labels include ``labels``; 0 when none."""
    return sum(float(s.value) for s in samples if _matches(s, name, labels))


def samples_by_labels(
    samples: Iterable[Sample],
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(name, sorted label pairs): value}``."""
    return {(s.name, tuple(sorted(s.labels.items()))): float(s.value) for s in samples}


def series(samples: Iterable[Sample]) -> dict[str, float]:
    """``{'name{label="value",...}': value}``, labels in exposition order (a sample without
    labels is keyed by its bare name)."""
    out: dict[str, float] = {}
    for s in samples:
        labels = ",".join(f'{k}="{v}"' for k, v in s.labels.items())
        out[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
    return out


# ----------------------------------------------------------------------------------------- /proc

_CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class ProcUsage:
    """One reading of a process: CPU time (user + system, seconds, its threads included) and
    memory (``VmRSS`` now and its peak ``VmHWM``, bytes)."""

    cpu_seconds: float
    rss_bytes: int
    peak_rss_bytes: int


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """User + system CPU seconds of process ``pid`` (``/proc/<pid>/stat``), or of its thread
    ``tid`` only; 0.0 when the process is gone."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        stat = Path(path).read_text()
    except OSError:
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()  # the command name may hold spaces and parens
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def memory_kib(pid: int, field: str) -> int:
    """A memory field of ``/proc/<pid>/status`` (``VmRSS``, ``VmHWM``...), KiB; 0 when the
    process or the field is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def rss_mib(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of process ``pid``, MiB (0 when gone)."""
    return memory_kib(pid, "VmRSS") / 1024, memory_kib(pid, "VmHWM") / 1024


def proc_usage(pid: int) -> ProcUsage:
    """CPU time and memory of process ``pid`` now."""
    return ProcUsage(
        cpu_seconds(pid), memory_kib(pid, "VmRSS") * 1024, memory_kib(pid, "VmHWM") * 1024
    )


def machine() -> list[tuple[str, str]]:
    """The machine a benchmark ran on, as ``(what, value)`` rows: the CPU model (``/proc/cpuinfo``)
    and vCPU count, memory in GiB (``/proc/meminfo``), the kernel and Python versions."""
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem = int(Path("/proc/meminfo").read_text().split()[1]) // 1024 // 1024
    return [
        ("CPU", f"{cpu}, {os.cpu_count()} vCPUs"),
        ("memory", f"{mem} GiB"),
        ("kernel", platform.release()),
        ("Python", platform.python_version()),
    ]


# ------------------------------------------------------------------------------------ statistics


def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) of ``values``: linear interpolation between the two
    closest ranks, rank ``(n - 1) * q / 100`` of the sorted values (NumPy's default "linear"
    method; the median is ``q = 50``). None for no values. Every benchmark figure uses this.

    Raises:
        ValueError: ``q`` outside [0, 100].
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def percentile_of(values: Iterable[float], q: float) -> float:
    """:func:`percentile` of values known not to be empty.

    Raises:
        ValueError: no values, or ``q`` outside [0, 100].
    """
    got = percentile(values, q)
    if got is None:
        raise ValueError("percentile of no values")
    return got


# ----------------------------------------------------------------------------------- binaries


def find_k8s_bin(explicit: str | None = None) -> Path | None:
    """The directory holding executable ``kube-apiserver`` and ``etcd``: ``explicit``, else
    $KVGATE_K8S_BIN, else $KUBEBUILDER_ASSETS, else the newest build under
    ``$KVGATE_CACHE/k8s/*/`` (default ``~/.cache/kvgate/k8s/*/``, what scripts/build-k8s makes);
    None when there is none.

    Raises:
        ValueError: a directory named explicitly or by a variable lacks either binary.
    """

    def usable(d: Path) -> bool:
        return all(os.access(d / tool, os.X_OK) for tool in ("kube-apiserver", "etcd"))

    named = [("--bin-dir", explicit)] + [
        (var, os.environ.get(var)) for var in ("KVGATE_K8S_BIN", "KUBEBUILDER_ASSETS")
    ]
    for source, value in named:
        if value:
            if not usable(Path(value)):
                raise ValueError(f"{source}={value} has no executable kube-apiserver and etcd")
            return Path(value)
    cache = Path(os.environ.get("KVGATE_CACHE", Path.home() / ".cache" / "kvgate")) / "k8s"
    found = sorted(d for d in cache.glob("*/") if usable(d))
    return found[-1] if found else None
