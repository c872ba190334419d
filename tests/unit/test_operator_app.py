"""The operator object (kvgate_operator.app) and the thin kopf handlers around it: importing
builds nothing, startup keeps the operator in kopf's memo, events reach it."""

from __future__ import annotations

from typing import Any

import aiohttp
import kopf
import pytest
from kubernetes import client

import kvgate_operator.handlers as handlers
from kvgate_bench.toolkit import free_port
from kvgate_operator.app import Operator
from kvgate_operator.settings import OperatorSettings
from kvgate_operator.triggers import Kind


def settings(**over: Any) -> OperatorSettings:
    # A debounce far beyond the test: the loop runs but never starts a pass (no API server).
    values: dict[str, Any] = {
        "webhook_enabled": False,
        "liveness_port": free_port(),
        "debounce_seconds": 60,
    }
    return OperatorSettings(**(values | over))


class CountingReconciler:
    def __init__(self) -> None:
        self.triggers = 0

    def trigger(self) -> None:
        self.triggers += 1


def test_importing_the_handlers_builds_no_operator() -> None:
    assert handlers.running(kopf.Memo()) is None
    assert not hasattr(handlers, "SETTINGS") and not hasattr(handlers, "METRICS")


def test_events_reach_the_operator_only_when_they_change_something() -> None:
    op = Operator(settings())
    op.on_event(Kind.NODES, {"type": "ADDED", "object": {"metadata": {"uid": "n"}}})  # no loop
    counter = CountingReconciler()
    op.reconciler = counter  # type: ignore[assignment]
    body = {"metadata": {"uid": "n"}}
    op.on_event(Kind.NODES, {"type": "MODIFIED", "object": body})
    assert counter.triggers == 0  # seen before the loop existed: nothing changed
    op.on_event(Kind.NODES, {"type": "DELETED", "object": body})
    assert counter.triggers == 1


def test_the_event_handlers_delegate_to_the_operator_in_the_memo() -> None:
    memo = kopf.Memo()
    handler = handlers._on_event(Kind.PODS)
    handler(event={"type": "ADDED", "object": {}}, memo=memo)  # before startup: ignored
    op = Operator(settings())
    counter = CountingReconciler()
    op.reconciler = counter  # type: ignore[assignment]
    memo[handlers.OPERATOR_KEY] = op
    handler(event={"type": "ADDED", "object": {"metadata": {"uid": "p"}}}, memo=memo)
    assert counter.triggers == 1
    assert handler.__name__ == "trigger_on_pods"


def test_liveness_fails_until_the_loop_runs() -> None:
    with pytest.raises(kopf.PermanentError, match="not running"):
        Operator(settings()).reconciler_alive()


class OfflineOperator(Operator):
    """An operator whose kubernetes client has no server behind it (it never gets to use it)."""

    def __init__(self, settings: OperatorSettings) -> None:
        super().__init__(settings, api_client=client.ApiClient)


async def test_startup_keeps_the_operator_in_the_memo_and_cleanup_stops_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s = settings()
    memo = kopf.Memo({handlers.SETTINGS_KEY: s})
    kopf_settings = kopf.OperatorSettings()
    monkeypatch.setattr(handlers, "Operator", OfflineOperator)
    await handlers.startup(settings=kopf_settings, memo=memo)
    op = handlers.running(memo)
    assert op is not None and op.settings is s and op.reconciler is not None
    assert kopf_settings.watching.server_timeout == s.watch_server_timeout
    assert kopf_settings.watching.client_timeout == s.watch_client_timeout
    assert kopf_settings.persistence.finalizer == "kvgate.io/unused-finalizer"
    assert kopf_settings.admission.server is None  # the webhook is off
    async with aiohttp.ClientSession() as session:
        url = f"http://127.0.0.1:{s.liveness_port}"
        async with session.get(f"{url}/healthz") as r:
            assert r.status == 500
            assert await r.json() == {"reconciler": "no reconcile pass has completed yet"}
        async with session.get(f"{url}/metrics") as r:
            assert r.status == 200 and "kvgate_webhook_uninjected_pods" in await r.text()
    await handlers.cleanup(memo=memo)
    with pytest.raises(kopf.PermanentError, match="not running"):
        op.reconciler_alive()


def test_operator_help_lists_the_settings_and_does_not_start(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvgate_operator.__main__ import main

    with pytest.raises(SystemExit) as help_exit:
        main(["--help"])
    assert help_exit.value.code == 0
    out = capsys.readouterr().out
    assert "KVGATE_OPERATOR_RESYNC_SECONDS  default 300.0" in out
    assert "KVGATE_OPERATOR_LEADER_ELECTION_LEASE_DURATION  default 15.0" in out
    with pytest.raises(SystemExit) as bad:
        main(["--resync", "5"])  # settings are environment variables only
    assert bad.value.code == 2
