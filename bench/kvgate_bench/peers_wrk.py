"""The load of ``kvgate_bench.peers``: wrk (https://github.com/wg/wrk) with a Lua script that
POSTs one chat body, and the parsing of its ``--latency`` report.

A cell is one arm × one body size × one concurrency: ``wrk -t1 -c C -d S --latency -s post.lua``,
pinned to the load generator's CPU with ``taskset``. wrk prints the latency distribution with
its own units (``85.00us``, ``1.23ms``, ``2.00s``, ``1.00m``); :func:`parse_wrk` turns them into
microseconds. wrk measures each request from its send to its response (no coordinated-omission
correction: wrk2's ``-R`` would add it; at fixed concurrency the closed loop is what is asked).
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
TENANT = "bench"

_UNITS_US = {"us": 1.0, "ms": 1e3, "s": 1e6, "m": 60e6, "h": 3600e6}
_TIME = re.compile(r"^\s*([0-9.]+)\s*(us|ms|s|m|h)\s*$")
_PCT = re.compile(r"^\s*(50|75|90|99)(?:\.0+)?%\s+(\S+)\s*$", re.MULTILINE)
_RPS = re.compile(r"^Requests/sec:\s+([0-9.]+)", re.MULTILINE)
_TOTAL = re.compile(r"^\s*(\d+) requests in ", re.MULTILINE)
_NON2XX = re.compile(r"^\s*Non-2xx or 3xx responses:\s+(\d+)", re.MULTILINE)
_SOCKERR = re.compile(
    r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", re.MULTILINE
)


class WrkError(ValueError):
    """wrk's output lacks what the report needs (it failed, or its format changed)."""


@dataclass(frozen=True, slots=True)
class WrkResult:
    """One wrk run: latency percentiles (microseconds), throughput (requests/s) and errors."""

    p50_us: float
    p99_us: float
    rps: float
    requests: int
    non2xx: int
    socket_errors: int

    @property
    def errors(self) -> int:
        """Non-2xx responses plus socket errors (connect, read, write, timeout)."""
        return self.non2xx + self.socket_errors


def parse_time_us(text: str) -> float:
    """``"85.00us"`` → 85.0, ``"1.23ms"`` → 1230.0, ``"2.00s"`` → 2e6 (wrk's units).

    Raises:
        WrkError: not one of wrk's time formats.
    """
    m = _TIME.match(text)
    if m is None:
        raise WrkError(f"not a wrk time: {text!r}")
    return float(m.group(1)) * _UNITS_US[m.group(2)]


def parse_wrk(output: str) -> WrkResult:
    """Parse ``wrk --latency`` output (its default report, no Lua ``done`` hook).

    Raises:
        WrkError: no latency distribution or no ``Requests/sec`` line in ``output``.
    """
    pcts = {int(k): parse_time_us(v) for k, v in _PCT.findall(output)}
    rps, total = _RPS.search(output), _TOTAL.search(output)
    if 50 not in pcts or 99 not in pcts or rps is None or total is None:
        raise WrkError("wrk output without a latency distribution or Requests/sec:\n" + output)
    non2xx = _NON2XX.search(output)
    sock = _SOCKERR.search(output)
    return WrkResult(
        p50_us=pcts[50],
        p99_us=pcts[99],
        rps=float(rps.group(1)),
        requests=int(total.group(1)),
        non2xx=int(non2xx.group(1)) if non2xx else 0,
        socket_errors=sum(int(g) for g in sock.groups()) if sock else 0,
    )


def chat_body(size_bytes: int, *, stream: bool = False, max_tokens: int = 16) -> bytes:
    """A chat completion body of about ``size_bytes`` (within a few bytes): a system and a user
    message, the user's text padded with words to the size."""
    head: dict[str, object] = {"model": MODEL, "max_tokens": max_tokens}
    if stream:
        head["stream"] = True

    def build(pad: int) -> bytes:
        words = ("lorem ipsum dolor sit amet " * (pad // 27 + 1))[:pad]
        body = {
            **head,
            "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Summarise this text: " + words},
            ],
        }
        return json.dumps(body, separators=(",", ":")).encode()

    base = len(build(0))
    return build(max(0, size_bytes - base))


def lua_script(body_file: Path) -> str:
    """wrk's Lua script: POST the bytes of ``body_file`` as JSON, tenant header set."""
    return (
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        f'wrk.headers["x-kvgate-tenant"] = "{TENANT}"\n'
        f'local f = assert(io.open("{body_file}", "rb"))\n'
        "wrk.body = f:read('*a')\n"
        "f:close()\n"
    )


def wrk_command(
    wrk: str, url: str, script: Path, *, connections: int, seconds: float, cpu: int
) -> list[str]:
    """``taskset -c CPU wrk -t1 -cN -dS --latency -s SCRIPT URL`` (one thread: one CPU; a
    30 s request timeout, so that the slowest arm's latencies at 256 connections are not cut)."""
    return [
        "taskset", "-c", str(cpu), wrk, "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s",
        "--timeout", "30s", "--latency", "-s", str(script), url,
    ]  # fmt: skip


def run_wrk(cmd: list[str], *, timeout: float, save: Path | None = None) -> WrkResult:
    """Run one wrk command and parse its report (its raw output written to ``save``).

    Raises:
        WrkError: wrk failed or printed no report (its output is in the message).
    """
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise WrkError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr}{done.stdout}")
    if save is not None:
        save.write_text(" ".join(cmd) + "\n" + done.stdout)
    return parse_wrk(done.stdout)
