"""The operator object (kvgate_operator.app) and the thin kopf handlers around it: importing
builds nothing, startup keeps the operator in kopf's memo, events reach it."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import kopf
import pytest
from kubernetes import client

import kvgate_operator.handlers as handlers
from kvgate_bench.kit.toolkit import FakeClock, free_port
from kvgate_operator.app import Operator
from kvgate_operator.metrics import OperatorMetrics
from kvgate_operator.reconciler import Reconciler
from kvgate_operator.settings import OperatorSettings
from kvgate_operator.triggers import Kind
from kvgate_operator.writer import ClusterWriter, NotLeader, PassStats


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
    # The real defaults: no pydantic placeholder, the certificate's names as the README says.
    assert "PydanticUndefined" not in out and "default None" not in out
    assert "KVGATE_OPERATOR_WEBHOOK_HOST  default 'localhost,127.0.0.1'" in out
    assert 'KVGATE_OPERATOR_INJECTION  default {"sidecarImage":' in out
    with pytest.raises(SystemExit) as bad:
        main(["--resync", "5"])  # settings are environment variables only
    assert bad.value.code == 2


class FakeElector:
    """A leader election that always leads; records when the Lease is released."""

    def __init__(self, on_release: Callable[[], None] = lambda: None) -> None:
        self.on_release = on_release
        self.released = False

    def is_leader(self) -> bool:
        return not self.released

    async def release(self) -> None:
        self.on_release()
        self.released = True


def test_liveness_fails_when_the_election_has_stopped() -> None:
    """A replica whose election task ended can neither renew nor campaign: its liveness must
    fail so that the kubelet restarts it."""
    loop = asyncio.new_event_loop()
    try:
        op = Operator(settings())
        r = Reconciler(client.ApiClient(), op.settings, clock=FakeClock())
        r.started_leading()
        op.reconciler = r
        op.elector = FakeElector()  # type: ignore[assignment]
        op._task = loop.create_task(asyncio.sleep(3600))
        done: asyncio.Future[None] = loop.create_future()
        done.set_result(None)
        op._elector_task = done  # type: ignore[assignment]
        with pytest.raises(kopf.PermanentError, match="leader election is not running"):
            op.reconciler_alive()
        op._elector_task = loop.create_task(asyncio.sleep(3600))
        assert "leading for" in op.reconciler_alive()
    finally:
        for task in asyncio.all_tasks(loop):
            task.cancel()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()


def test_a_new_leaders_liveness_counts_from_the_takeover() -> None:
    """A follower runs no pass: on taking over, its liveness is stale-checked from the takeover
    (not "no pass yet", nor its last pass as a leader long ago) until its first pass."""
    clock = FakeClock(1000.0)
    s = settings(liveness_stale_seconds=60)
    r = Reconciler(client.ApiClient(), s, clock=clock)
    assert r.healthy() == (False, "no reconcile pass has completed yet")
    r.started_leading()
    assert r.healthy()[0]
    clock.advance(61)
    ok, why = r.healthy()
    assert not ok and "leading for 61s" in why
    r.last_pass_ok = clock()  # passed: counts from the pass
    clock.advance(30)
    r.started_leading()  # lost and won again 30 s after the pass
    clock.advance(59)
    assert r.healthy()[0]  # 89 s after the pass, 59 s after the takeover
    clock.advance(2)
    assert not r.healthy()[0]


async def test_a_clean_stop_releases_the_lease_only_after_the_pass_in_flight_ended() -> None:
    """Cancelling the loop does not stop a pass's worker thread: the stop makes it stop
    writing, waits for it, and only then releases the Lease."""
    op = Operator(settings())
    running, ended = threading.Event(), threading.Event()

    class SlowPass(Reconciler):
        def _pass(self) -> PassStats:
            running.set()
            while self.may_write():  # a pass writing, one write after another
                time.sleep(0.001)
            time.sleep(0.05)  # the write in flight when writes stopped
            ended.set()
            raise NotLeader("stopped")

    r = SlowPass(client.ApiClient(), op.settings, may_write=op.may_write)
    op.reconciler = r
    released_after_pass: list[bool] = []
    op.elector = FakeElector(lambda: released_after_pass.append(ended.is_set()))  # type: ignore[assignment]
    op._task = asyncio.create_task(r.reconcile_once())  # type: ignore[arg-type]
    await asyncio.to_thread(running.wait, 10)
    await op.stop()
    assert released_after_pass == [True]


def test_events_name_the_replica_that_reported_them() -> None:
    """``reportingInstance`` is the replica's identity (its pod name), as the operator's
    User-Agent, so that of several replicas the one that posted an Event is known."""
    from kvgate_operator.missed import MissedPod

    posted: list[Any] = []

    class Core:
        def create_namespaced_event(self, ns: str, body: Any) -> None:
            posted.append(body)

    op = Operator(settings(pod_name="kvgate-operator-7d9-x2"))
    w = ClusterWriter(client.ApiClient(), OperatorMetrics(), lambda: True, op.identity)
    w.core = Core()  # type: ignore[assignment]
    w._event("ns", "policy", "uid", "Warning", "Reason", "message")
    w._pod_event(MissedPod("ns", "pod", "uid", "pod label"))
    assert [e.reporting_instance for e in posted] == ["kvgate-operator-7d9-x2"] * 2
