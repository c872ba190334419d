"""Every kvgate child process the tests and the benchmarks start, started and stopped here.

:func:`start` spawns a command with its output in a log file and waits until it is ready (a URL
answers, or a port listens); :func:`start_sidecar` is that for ``kvgate-agent sidecar``;
:func:`stop` is the one way to stop one (a signal, a bounded wait, then SIGKILL;
:func:`stop_all` several at once). The command
lines: :func:`sidecar_argv`, :func:`agent_argv` (``kvgate-agent node``), :func:`sim_argv`
(``kvgate-sim``) and :func:`kvgate_agent_argv` (any ``kvgate-agent`` role, e.g. a chart's
``args``); :mod:`kvgate_bench.kit.operator_process` starts the operator with :func:`spawn`.
Event-loop callers run these in a thread (``asyncio.to_thread``).
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvgate_bench.kit.toolkit import free_port, wait_port, wait_until

__all__ = [
    "Proc",
    "agent_argv",
    "kvgate_agent_argv",
    "sidecar_argv",
    "sim_argv",
    "spawn",
    "start",
    "start_sidecar",
    "stop",
    "stop_all",
    "tail",
]

Popen = subprocess.Popen[bytes]


def kvgate_agent_argv(*args: str, profile: Path | None = None) -> list[str]:
    """``python -m kvgate_agent ARGS`` (this interpreter; under cProfile writing ``profile``)."""
    run = ["-m", "cProfile", "-o", str(profile)] if profile is not None else []
    return [sys.executable, *run, "-m", "kvgate_agent", *args]


def sidecar_argv(
    *flags: str,
    upstream: str | None = None,
    policy: Path | None = None,
    port: int | None = None,
    profile: Path | None = None,
) -> list[str]:
    """``kvgate-agent sidecar`` with ``--upstream``, ``--policy`` and ``--listen
    127.0.0.1:port`` where given, then ``flags``."""
    argv = kvgate_agent_argv("sidecar", profile=profile)
    if upstream is not None:
        argv += ["--upstream", upstream]
    if policy is not None:
        argv += ["--policy", str(policy)]
    if port is not None:
        argv += ["--listen", f"127.0.0.1:{port}"]
    return argv + list(flags)


def agent_argv(*flags: str) -> list[str]:
    """``kvgate-agent node`` with ``flags``."""
    return kvgate_agent_argv("node", *flags)


def sim_argv(*flags: str) -> list[str]:
    """``kvgate-sim`` (``python -m kvgate_bench.sim.cli``) with ``flags``."""
    return [sys.executable, "-m", "kvgate_bench.sim.cli", *flags]


def tail(log: Path, chars: int = 2000) -> str:
    """The end of a log file."""
    try:
        return log.read_text(errors="replace")[-chars:]
    except OSError as e:
        return f"<{log}: {e}>"


def spawn(
    args: Sequence[str],
    log: Path,
    env: Mapping[str, str] | None = None,
    *,
    append: bool = False,
    new_session: bool = False,
) -> Popen:
    """Start ``args`` (stdin from /dev/null, stdout and stderr into ``log``, truncated unless
    ``append``) with ``env`` (the whole environment; None: this one's); ``new_session``: in a
    session of its own (a terminal's ^C does not reach it)."""
    with log.open("ab" if append else "wb") as out:
        return subprocess.Popen(
            list(args),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=None if env is None else dict(env),
            start_new_session=new_session,
        )


def stop(proc: Popen | None, timeout: float = 10.0, sig: int = signal.SIGTERM) -> int | None:
    """Send ``sig`` (SIGTERM) to ``proc`` if it runs, wait up to ``timeout`` seconds, SIGKILL it
    if it lingers, reap it; its exit status (None: no process)."""
    stop_all([proc], timeout, sig)
    return None if proc is None else proc.returncode


def stop_all(
    procs: Iterable[Popen | None], timeout: float = 10.0, sig: int = signal.SIGTERM
) -> None:
    """:func:`stop` several at once: ``sig`` to each that runs, then wait for each in turn."""
    running = [p for p in procs if p is not None and p.poll() is None]
    for proc in running:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
    for proc in running:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()


@dataclass
class Proc:
    """A started child process: its :class:`subprocess.Popen`, log and base URL."""

    popen: Popen
    log: Path
    url: str = ""

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stop(self, timeout: float = 10.0, sig: int = signal.SIGTERM) -> int:
        """:func:`stop` it; its exit status."""
        code = stop(self.popen, timeout, sig)
        assert code is not None
        return code


def _answers(url: str, status: int | None) -> bool:
    """``url`` answers a GET (with ``status``; any status when None)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return status is None or int(r.status) == status
    except urllib.error.HTTPError as e:
        return status is None or e.code == status
    except OSError:
        return False


def start(
    args: Sequence[str],
    log: Path,
    *,
    env: Mapping[str, str] | None = None,
    url: str = "",
    ready: str | None = None,
    status: int | None = None,
    port: int | None = None,
    timeout: float = 30.0,
    append: bool = False,
    new_session: bool = False,
    what: str = "",
) -> Proc:
    """:func:`spawn` ``args`` and wait until it is ready: ``url + ready`` answers a GET (with
    ``status``, any when None) and/or ``port`` accepts connections on 127.0.0.1. ``what``
    names it in the error (default: the program, or the module run with ``-m``).

    Raises:
        RuntimeError: it exited or was not ready within ``timeout`` seconds (then it is
            stopped); the message carries the end of its log.
    """
    popen = spawn(args, log, env, append=append, new_session=new_session)
    try:
        if port is not None:
            wait_port(port, popen, timeout)
        if ready is not None:

            def answers() -> bool:
                if popen.poll() is not None:
                    raise RuntimeError(f"exited with {popen.returncode}")
                return _answers(url + ready, status)

            wait_until(answers, timeout, url + ready)
    except (RuntimeError, TimeoutError) as e:
        stop(popen)
        what = what or (Path(args[0]).name if args[0] != sys.executable else " ".join(args[2:4]))
        raise RuntimeError(f"{what} did not start ({e}):\n{tail(log)}") from None
    return Proc(popen, log, url)


def start_sidecar(
    log: Path,
    *flags: str,
    upstream: str | None = None,
    policy: Path | None = None,
    port: int | None = None,
    listen: bool = True,
    env: Mapping[str, str] | None = None,
    profile: Path | None = None,
    timeout: float = 30.0,
    status: int | None = 200,
    append: bool = False,
    new_session: bool = False,
) -> Proc:
    """``kvgate-agent sidecar`` on 127.0.0.1:``port`` (a free one when None) with
    :func:`sidecar_argv`'s flags (``--listen`` unless not ``listen``: ``env``'s
    ``KVGATE_LISTEN`` names the port), once ``/healthz`` answers (with ``status``)."""
    port = free_port() if port is None else port
    argv = sidecar_argv(
        *flags, upstream=upstream, policy=policy, port=port if listen else None, profile=profile
    )
    return start(
        argv,
        log,
        env=env,
        url=f"http://127.0.0.1:{port}",
        ready="/healthz",
        status=status,
        timeout=timeout,
        append=append,
        new_session=new_session,
    )
