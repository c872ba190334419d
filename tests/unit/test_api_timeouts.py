"""Bounded calls to the API server: the operator's client (default timeouts, idle and failed
pooled connections not reused), the agent's contact record and its liveness, and the defaults
that size them (a silent connection noticed well within a minute). Clocks are fake; no
network."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from urllib3.exceptions import ReadTimeoutError

from kvgate_agent.gpu.fake import FakeGpuBackend
from kvgate_agent.gpu.monitor import GpuMonitor
from kvgate_agent.node import kube
from kvgate_agent.node.auth import Authenticator
from kvgate_agent.node.service import NodeAgent, NodeSettings
from kvgate_bench.kit.toolkit import FakeClock
from kvgate_operator.kubeclient import POOL_IDLE_SECONDS, BoundedApiClient, default_api_client
from kvgate_operator.settings import OperatorSettings


class Recorder:
    """Stands in for the REST layer: records each call's timeout, or raises ``fail``."""

    def __init__(self) -> None:
        self.timeouts: list[Any] = []
        self.cleared = 0
        self.fail: Exception | None = None

    def request(self, *_: Any, _request_timeout: Any = None, **__: Any) -> str:
        self.timeouts.append(_request_timeout)
        if self.fail is not None:
            raise self.fail
        return "answer"

    def clear(self) -> None:
        self.cleared += 1


@pytest.fixture
def bounded() -> tuple[BoundedApiClient, Recorder, FakeClock]:
    clock = FakeClock(100.0)
    api = BoundedApiClient(client.Configuration(host="https://127.0.0.1:1"), (10.0, 30.0), clock)
    rec = Recorder()
    api.rest_client.request = rec.request  # type: ignore[method-assign]
    api.rest_client.pool_manager.clear = rec.clear  # type: ignore[method-assign]
    return api, rec, clock


def test_calls_without_a_timeout_get_the_default(
    bounded: tuple[BoundedApiClient, Recorder, FakeClock],
) -> None:
    api, rec, _ = bounded
    assert api.call_api("GET", "https://127.0.0.1:1/api/v1/pods") == "answer"
    api.call_api("GET", "https://127.0.0.1:1/api/v1/pods", _request_timeout=1.5)
    assert rec.timeouts == [(10.0, 30.0), 1.5]


def test_idle_pooled_connections_are_not_reused(
    bounded: tuple[BoundedApiClient, Recorder, FakeClock],
) -> None:
    api, rec, clock = bounded
    api.call_api("GET", "https://127.0.0.1:1/version")
    clock.advance(POOL_IDLE_SECONDS - 1)
    api.call_api("GET", "https://127.0.0.1:1/version")
    assert rec.cleared == 0  # busy enough: connections reused
    clock.advance(POOL_IDLE_SECONDS + 1)
    api.call_api("GET", "https://127.0.0.1:1/version")
    assert rec.cleared == 1


def test_a_failed_call_empties_the_pool(
    bounded: tuple[BoundedApiClient, Recorder, FakeClock],
) -> None:
    api, rec, _ = bounded
    rec.fail = ReadTimeoutError(None, "/api/v1/pods", "read timed out")  # type: ignore[arg-type]
    with pytest.raises(ReadTimeoutError):
        api.call_api("GET", "https://127.0.0.1:1/api/v1/pods")
    assert rec.cleared == 1


def test_the_operator_refuses_a_watch_read_timeout_not_above_the_server_timeout() -> None:
    """A client timeout at or below the server's would abandon every healthy, quiet watch."""
    with pytest.raises(ValueError, match="must exceed"):
        OperatorSettings(watch_server_timeout=30, watch_client_timeout=30)


KUBECONFIG = """apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:1"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
"""


def test_both_clients_probe_an_idle_connection_and_drop_it_dead_within_25_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent's and the operator's clients put the same TCP keep-alive on their sockets:
    first probe after 10 s idle, every 5 s, dead after 3 unanswered."""
    path = tmp_path / "kubeconfig"
    path.write_text(KUBECONFIG)
    from kubernetes.config import kube_config

    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(path))  # read at import
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    agent = kube.load_api_client(str(path))
    operator = default_api_client(10.0, 30.0)
    for api in (agent, operator):
        opts = {(level, name): value for level, name, value in api.configuration.socket_options}
        assert opts[(socket.SOL_SOCKET, socket.SO_KEEPALIVE)] == 1
        idle = opts[(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE)]
        interval = opts[(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL)]
        count = opts[(socket.IPPROTO_TCP, socket.TCP_KEEPCNT)]
        assert (idle, interval, count) == (10, 5, 3)


def test_api_contact_age() -> None:
    clock = FakeClock(5.0)
    contact = kube.ApiContact(clock)
    assert contact.age() is None
    contact.ok()
    clock.advance(7)
    assert contact.age() == 7


def test_agent_liveness_fails_past_its_bound_without_an_answer_and_recovers() -> None:
    clock = FakeClock(1000.0)
    agent = NodeAgent(
        NodeSettings(node_name="n", api_liveness_seconds=120),
        GpuMonitor(FakeGpuBackend([]), clock=clock),
        Authenticator(lambda token: None),  # type: ignore[arg-type,return-value]
        clock=clock,
    )
    assert agent.live() == (True, "ok")  # no cluster: only the loops count
    contact = kube.ApiContact(clock)
    alive = [True]
    agent.api_contact_age, agent.watch_alive = contact.age, lambda: alive[0]
    clock.advance(100)
    assert agent.live()[0]  # never answered yet, but within the bound since start
    clock.advance(30)
    ok, why = agent.live()
    assert not ok and "no answer from the API server for 130s" in why
    contact.ok()
    assert agent.live()[0]
    clock.advance(121)
    assert not agent.live()[0]
    contact.ok()
    alive[0] = False
    assert agent.live() == (False, "the NodeAdmission watch stopped")
