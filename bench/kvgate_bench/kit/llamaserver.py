"""llama.cpp's real ``llama-server`` (built by ``scripts/build-llama``) on a loopback port: the one
set of flags the tests and the smoke check start it with, and the smoke check itself.

``python -m kvgate_bench.kit.llamaserver SERVER MODEL`` starts it, waits for ``/health`` 200 (the
model loaded), asks for one token and stops it; it exits 1 with what the server printed when any
step fails, so the test command stops on a broken build in seconds rather than at every
real-engine test's set-up. A server killed by a signal is named (``SIGSEGV``, ``SIGILL``: a
build for instructions this CPU does not run).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from kvgate_bench.kit.processes import stop
from kvgate_bench.kit.toolkit import free_port

__all__ = ["LLAMA_MODEL", "LlamaServerError", "llama_args", "smoke", "wait_loaded"]

#: llama-server's model name in answers (``--alias``).
LLAMA_MODEL = "gemma-3-270m"


class LlamaServerError(RuntimeError):
    """llama-server exited, or did not load its model or answer in time."""


def llama_args(
    binary: str,
    model: str,
    port: int,
    parallel: int = 2,
    ctx: int = 1024,
    *extra: str,
    alias: str = LLAMA_MODEL,
    threads: int = 2,
) -> list[str]:
    """The command line: ``parallel`` slots of ``ctx / parallel`` tokens each (``--no-kv-unified``),
    ``--metrics`` and ``--slots`` on, ``threads`` threads (``-t``), no warm-up run, ``--alias``
    ``alias`` (default :data:`LLAMA_MODEL`), listening on 127.0.0.1:``port``; ``extra`` flags
    appended."""
    return [
        binary,
        *("-m", model, "--alias", alias, "--host", "127.0.0.1", "--port", str(port)),
        *("--parallel", str(parallel), "-c", str(ctx), "--no-kv-unified"),
        *("--metrics", "--slots", "-t", str(threads), "--no-warmup", *extra),
    ]


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def wait_loaded(popen: subprocess.Popen[bytes], url: str, log: Path, timeout: float = 60.0) -> None:
    """Wait until ``url``/health answers 200 (503 "Loading model" while it loads).

    Raises:
        LlamaServerError: the process exited first (with its exit status or signal and the last
            2,000 characters of ``log``), or ``timeout`` seconds (wall clock) passed.
    """
    deadline = time.monotonic() + timeout
    while True:
        code = popen.poll()
        if code is not None:
            raise LlamaServerError(
                f"llama-server {_exit_text(code)} before it served: {log.read_text()[-2000:]}"
            )
        try:
            urllib.request.urlopen(url + "/health", timeout=2).close()
            return
        except OSError:  # refused while binding; 503 "Loading model" is an HTTPError
            pass
        if time.monotonic() > deadline:
            raise LlamaServerError(
                f"llama-server did not load its model in {timeout:.0f} s: {log.read_text()[-2000:]}"
            )
        time.sleep(0.1)


def smoke(binary: str, model: str, log: Path, timeout: float = 120.0) -> str:
    """Start llama-server, wait for ``/health``, generate one token, stop it; returns the text.

    Raises:
        LlamaServerError: any step failed (the message says which, with the server's output).
    """
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as fh:
        try:
            popen = subprocess.Popen(
                llama_args(binary, model, port, 1, 512), stdout=fh, stderr=subprocess.STDOUT
            )
        except OSError as e:  # missing, not executable, not a program for this machine
            raise LlamaServerError(f"cannot start {binary}: {e}") from None
        try:
            wait_loaded(popen, url, log, timeout)
            body = json.dumps({"prompt": "Hello", "n_predict": 1}).encode()
            req = urllib.request.Request(
                url + "/completion", body, {"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(req, timeout=timeout) as r:
                    answer = json.loads(r.read())
            except (OSError, ValueError) as e:
                code = popen.poll()
                why = f" (llama-server {_exit_text(code)})" if code is not None else ""
                raise LlamaServerError(
                    f"llama-server did not generate a token: {e!r}{why}: {log.read_text()[-2000:]}"
                ) from None
            if int(answer.get("tokens_predicted", 0)) != 1:
                raise LlamaServerError(f"llama-server answered without a token: {answer!r}")
            return str(answer.get("content", ""))
        finally:
            stop(popen)


def main(argv: list[str] | None = None) -> int:
    """``SERVER MODEL [LOG]``: the smoke check; 0 when one token came back, else 1."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (2, 3):
        print("usage: python -m kvgate_bench.kit.llamaserver SERVER MODEL [LOG]", file=sys.stderr)
        return 2
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvgate-llama-") as tmp:
        log = Path(args[2]) if len(args) == 3 else Path(tmp) / "smoke.log"
        try:
            text = smoke(args[0], args[1], log)
        except LlamaServerError as e:  # the message holds the server's output
            print(f"llama-server smoke check failed ({args[0]}): {e}", file=sys.stderr)
            return 1
    took = time.monotonic() - start
    print(
        f"llama-server smoke check: /health 200, one token {text!r} in {took:.1f} s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
