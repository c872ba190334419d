"""A real ``redis-server`` on a loopback port in a temporary directory, for the tests and the
fleet benchmark of shared limits (``scripts/install-redis`` installs Debian's package; the tests
find it through ``KVGATE_REDIS_SERVER`` or ``PATH``).

No persistence (``save ""``, no AOF): a restart starts empty, as a Redis that lost its data would.
Optional password (``requirepass``) and TLS (the server's own ``tls-port``, certificates made
with :mod:`kvgate_bench.kit.certs`).
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from kvgate_bench.kit.certs import issue, new_ca
from kvgate_bench.kit.processes import stop
from kvgate_bench.kit.toolkit import free_port, wait_port


def find_redis_server(explicit: str | None = None) -> str | None:
    """``explicit``, else ``KVGATE_REDIS_SERVER``, else ``redis-server`` on PATH; None if none."""
    path = explicit or os.environ.get("KVGATE_REDIS_SERVER") or shutil.which("redis-server")
    return path if path and os.access(path, os.X_OK) else None


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of a test CA and the server's certificate for 127.0.0.1/localhost."""

    ca: Path
    cert: Path
    key: Path


def make_tls(directory: Path) -> TlsFiles:
    """A fresh CA and a server certificate signed by it, written under ``directory``."""
    now = dt.datetime.now(dt.UTC)
    ca = new_ca(now, common_name="kvgate test redis CA", lifetime=dt.timedelta(days=1))
    leaf = issue(
        ca,
        now,
        dt.timedelta(days=1),
        common_name="localhost",
        hosts=["127.0.0.1", "localhost"],
        server=True,
    )
    files = TlsFiles(directory / "ca.pem", directory / "server.pem", directory / "server.key")
    files.ca.write_bytes(ca.cert_pem)
    files.cert.write_bytes(leaf.cert_pem)
    files.key.write_bytes(leaf.key_pem)
    return files


class RedisServer:
    """One ``redis-server`` process.

    Args:
        binary: the redis-server executable.
        directory: its working directory (config, log).
        password: ``requirepass`` when given.
        tls: serve TLS only (``port 0``, ``tls-port``) with these files.
    """

    def __init__(
        self,
        binary: str,
        directory: Path,
        password: str | None = None,
        tls: TlsFiles | None = None,
    ) -> None:
        self.binary = binary
        self.directory = directory
        self.password = password
        self.tls = tls
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        directory.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0`` (``rediss://`` with TLS)."""
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://127.0.0.1:{self.port}/0"

    def _config(self) -> str:
        lines = [
            "bind 127.0.0.1",
            f"dir {self.directory}",
            'save ""',
            "appendonly no",
            f"logfile {self.directory / 'redis.log'}",
            "protected-mode yes",
        ]
        if self.tls is not None:
            lines += [
                "port 0",
                f"tls-port {self.port}",
                f"tls-cert-file {self.tls.cert}",
                f"tls-key-file {self.tls.key}",
                f"tls-ca-cert-file {self.tls.ca}",
                "tls-auth-clients no",
            ]
        else:
            lines.append(f"port {self.port}")
        if self.password is not None:
            lines.append(f"requirepass {self.password}")
        return "\n".join(lines) + "\n"

    def start(self) -> RedisServer:
        """Start (again, on the same port) and wait until it accepts connections."""
        conf = self.directory / "redis.conf"
        conf.write_text(self._config())
        self.proc = subprocess.Popen(
            [self.binary, str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        wait_port(self.port, self.proc)
        return self

    def kill(self) -> None:
        """SIGKILL the server (a crash: nothing is saved) and wait for it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # the port is free again once the socket closed
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.1).close()
            except OSError:
                return
            time.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM and wait (SIGKILL after 10 s)."""
        stop(self.proc)
        self.proc = None
