"""The one owner of the sidecar's connections to its model server: opened and closed together,
and no client handed out before it is open or after it is closed."""

from __future__ import annotations

import pytest

from kvgate_agent.sidecar.upstream.model_server import ModelServer
from kvgate_agent.sidecar.upstream.upstream import UpstreamConnectError


def server() -> ModelServer:
    return ModelServer("http://127.0.0.1:9/", connect_timeout=1.0, upstream_timeout=5.0)


async def test_clients_exist_only_between_open_and_close() -> None:
    s = server()
    assert s.url == "http://127.0.0.1:9" and s.opened_session() is None
    with pytest.raises(RuntimeError, match="not open"):
        s.session()
    with pytest.raises(RuntimeError, match="not open"):
        s.probe()
    await s.open()
    session, probe = s.session(), s.probe()
    assert s.opened_session() is session and session is not probe
    assert probe.connector is not None and probe.connector.force_close  # nothing left behind
    assert session.connector is not None and not session.connector.force_close
    await s.open()  # again: the same clients
    assert s.session() is session
    await s.close()
    assert session.closed and probe.closed and s.opened_session() is None
    with pytest.raises(RuntimeError, match="closed for good"):
        await s.open()


async def test_the_pool_is_closed_with_the_rest() -> None:
    s = server()
    await s.open()
    await s.close()
    with pytest.raises(UpstreamConnectError, match="closed"):
        await s.pool.request("POST", "/v1/chat/completions", [], b"{}")


def test_a_base_url_that_is_not_http_is_refused() -> None:
    with pytest.raises(ValueError, match="http"):
        ModelServer("unix:///tmp/x", connect_timeout=1.0, upstream_timeout=None)
