"""The operator's kubernetes client against a silent API server: a socket that accepts
connections (the kernel's backlog) and never answers, as after a partition. A call is bounded
by its read timeout once, not retried into several (urllib3's default retries a read timeout
three times)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client
from urllib3.exceptions import HTTPError

from kvgate_operator.kubeclient import default_api_client


@pytest.fixture
def silent_server() -> Iterator[socket.socket]:
    """A listening socket whose connections are accepted by the kernel (its backlog) and never
    read or answered; the test may ``accept()`` them afterwards to count them."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield s


def connections(listener: socket.socket) -> int:
    """How many connections wait in ``listener``'s backlog (each accepted and closed)."""
    listener.setblocking(False)
    n = 0
    while True:
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            return n
        conn.close()
        n += 1


def test_a_call_on_a_silent_connection_waits_one_read_timeout(
    silent_server: socket.socket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = silent_server.getsockname()[1]
    path = tmp_path / "kubeconfig"
    path.write_text(
        "apiVersion: v1\nkind: Config\n"
        f'clusters: [{{name: c, cluster: {{server: "http://127.0.0.1:{port}"}}}}]\n'
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: x, context: {cluster: c, user: u}}]\ncurrent-context: x\n"
    )
    from kubernetes.config import kube_config

    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    api = default_api_client(connect_timeout=2.0, read_timeout=1.0)
    t0 = time.monotonic()
    with pytest.raises(HTTPError):
        client.VersionApi(api).get_code()  # the default timeouts: (2 s, 1 s)
    took = time.monotonic() - t0
    # One attempt, not 4 (urllib3's 3 retries, each on a new connection): counted, not timed.
    assert connections(silent_server) == 1
    # It waited its read timeout (1 s), and was bounded by it, not left hanging: the bound is
    # generous (10 s) for a busy machine.
    assert 0.9 <= took < 10, took
