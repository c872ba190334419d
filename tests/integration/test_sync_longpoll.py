"""Held syncs (long polls) between a real sidecar and a real node agent, over HTTP on loopback.

The agent is :class:`~kvgate_agent.node.service.NodeAgent` served by uvicorn as ``kvgate-agent
node`` serves it, in this event loop; its NodeAdmission comes from :meth:`NodeAgent.on_spec`
(what the watch calls) and its TokenReviews from a stand-in reviewer (the TokenReview path is
tested against a real API server in ``test_node_agent.py``). The sidecar is a real
:class:`~kvgate_agent.sidecar.app.Sidecar` in agent mode with the production 30 s TTL, so it
long-polls (waits of 25 s): every figure below would take a whole wait without the long poll.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import uvicorn

from kvgate_agent.contract.nodeadmission import NodeAdmissionSpec
from kvgate_agent.contract.sync import SYNC_PATH, SyncReport
from kvgate_agent.gpu.fake import FakeGpu, FakeGpuBackend
from kvgate_agent.gpu.monitor import GpuMonitor
from kvgate_agent.node.api import build_app
from kvgate_agent.node.auth import Authenticator, PodIdentity, Review
from kvgate_agent.node.service import NodeAgent, NodeSettings
from kvgate_agent.sidecar.app import Sidecar, SidecarSettings
from kvgate_agent.sidecar.node_link.agent_link import AgentSettings
from kvgate_agent.sidecar.node_link.sync_state import Mode
from kvgate_bench.kit.toolkit import free_port, wait_until_async
from tests.conftest import serve_sidecar
from tests.upstream import CHAT, Upstream

NS, POD, UID, TOKEN = "ns", "model-0", "uid-0", "tok-model-0"


def review(token: str) -> Review:
    if token == TOKEN:
        return Review(PodIdentity(NS, POD, UID, "default"))
    return Review(None, 401, "invalid_token", "token not accepted")


def spec(cap: int) -> NodeAdmissionSpec:
    return NodeAdmissionSpec.model_validate(
        {
            "nodeName": "n1",
            "pods": [
                {
                    "namespace": NS,
                    "name": POD,
                    "uid": UID,
                    "policy": {"namespace": NS, "name": "pol", "generation": cap},
                    "thresholds": {"tenants": {"maxTokensCap": cap, "defaultMaxTokens": cap}},
                }
            ],
        }
    )


class Served:
    """A node agent served over HTTP in this loop; ``stop()`` shuts it down as the CLI does."""

    def __init__(self, agent: NodeAgent, server: uvicorn.Server, task: asyncio.Task[None]) -> None:
        self.agent, self.server, self.task = agent, server, task
        self.url = f"http://127.0.0.1:{server.config.port}"

    async def stop(self) -> None:
        if self.task.done():
            return
        self.server.should_exit = True
        self.agent.syncs.release_all()
        await self.task
        await self.agent.stop()


@pytest.fixture
async def node() -> AsyncIterator[Served]:
    settings = NodeSettings(node_name="n1", gpu_poll_seconds=3600, scrape_seconds=3600)
    monitor = GpuMonitor(FakeGpuBackend([FakeGpu("GPU-0", 0)]))
    agent = NodeAgent(settings, monitor, Authenticator(review))
    await agent.start()
    agent.on_spec(spec(8), None)
    config = uvicorn.Config(
        build_app(agent), host="127.0.0.1", port=free_port(), log_level="warning", lifespan="off"
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    served = Served(agent, server, task)
    yield served
    await served.stop()
    monitor.close()


@pytest.fixture
async def sidecar(
    node: Served, upstream: Upstream, tmp_path: Path
) -> AsyncIterator[tuple[str, Sidecar]]:
    (tmp_path / "token").write_text(TOKEN)
    settings = AgentSettings(
        url=node.url,
        pod_namespace=NS,
        pod_name=POD,
        pod_uid=UID,
        token_file=str(tmp_path / "token"),
        sync_interval=0.2,  # the least time between two reports; 1 s in production
        sync_timeout=0.5,
    )
    runners: list[Any] = []
    sc = Sidecar(SidecarSettings(upstream=upstream.url, agent=settings))
    url = await serve_sidecar(sc, runners)
    yield url, sc
    for r in runners:
        await r.cleanup()


async def until(cond: Callable[[], bool], within: float = 5.0) -> None:
    await wait_until_async(cond, within, "the condition")


def syncs(agent: NodeAgent) -> float:
    return sum(float(agent.metrics.syncs.labels(r)._value.get()) for r in ("ok", "not_modified"))


def waits(agent: NodeAgent, outcome: str) -> float:
    return float(agent.metrics.sync_waits.labels(outcome)._value.get())


async def test_a_change_reaches_a_held_sidecar_at_once_and_idle_syncs_are_rare(
    node: Served, sidecar: tuple[str, Sidecar]
) -> None:
    _, sc = sidecar
    agent = node.agent
    await until(lambda: sc.policy.mode is Mode.LIVE and len(agent.syncs.waiters) == 1)
    n = syncs(agent)
    await asyncio.sleep(1.5)  # idle: polling every 0.2 s would be ~7 syncs
    assert syncs(agent) == n and len(agent.syncs.waiters) == 1
    assert agent.state.connected(agent.clock()) == 1
    for i, cap in enumerate((9, 10)):
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        agent.on_spec(spec(cap), None)  # what the NodeAdmission watch does
        await until(lambda: sc.policy.spec.tenants.max_tokens_cap == cap, 10.0)  # noqa: B023
        # Not the 25 s hold: a bound on time is the point, generous for a busy machine.
        assert loop.time() - t0 < 10.0
        assert waits(agent, "changed") == i + 1  # the held call was woken by the change
        # Held again, on the new ETag, before the next change (on a busy machine the sidecar's
        # next call can come after it, and is then answered at once, not woken).
        await until(lambda: len(agent.syncs.waiters) == 1, 10.0)
    assert sc.policy.sync_state is not None and sc.policy.sync_state.agent_holds


async def test_a_busy_sidecar_reports_without_waiting_out_the_hold(
    node: Served, sidecar: tuple[str, Sidecar], upstream: Upstream, client: aiohttp.ClientSession
) -> None:
    url, sc = sidecar
    agent = node.agent
    await until(lambda: sc.policy.mode is Mode.LIVE and len(agent.syncs.waiters) == 1)
    upstream.hold = asyncio.Event()  # one request in flight until the agent saw it

    def in_flight() -> int:
        rec = agent.state.reports().get((NS, POD))
        return -1 if rec is None else rec[0].in_flight

    slow = asyncio.create_task(client.post(url + "/v1/chat/completions", json=CHAT))
    try:
        await until(lambda: upstream.active == 1, 10.0)
        # Idle -> busy is material: sent within ~1 s, not at the end of the 25 s hold. The
        # bound is the point, so it is generous (10 s) for a busy machine, still under the hold.
        await until(lambda: in_flight() == 1, 10.0)
    finally:
        upstream.hold.set()
    resp = await slow
    assert resp.status == 200
    resp.release()
    await until(lambda: in_flight() == 0, 10.0)  # busy -> idle: the same
    # The abandoned held calls were cleaned up on the agent: one held call, for this pod.
    await until(lambda: len(agent.syncs.waiters) == 1)
    assert waits(agent, "disconnected") + waits(agent, "superseded") >= 1


async def test_a_client_that_goes_away_leaves_no_waiter(node: Served) -> None:
    agent = node.agent
    report = SyncReport(namespace=NS, name=POD, uid=UID).model_dump_json(by_alias=True)
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    async with aiohttp.ClientSession() as s:
        async with s.post(node.url + SYNC_PATH, data=report, headers=headers) as r:
            etag = r.headers["ETag"]
        held = {**headers, "If-None-Match": etag, "Prefer": "wait=20"}
        for _ in range(3):  # each time: held, then the client closes the connection
            call = asyncio.create_task(s.post(node.url + SYNC_PATH, data=report, headers=held))
            await until(lambda: len(agent.syncs.waiters) == 1)
            call.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await call
            await until(lambda: len(agent.syncs.waiters) == 0)
        assert waits(agent, "disconnected") == 3
        assert not agent.state.is_held((NS, POD))
        # A held call times out into a 304 that says it was held.
        short = {**held, "Prefer": "wait=0.3"}
        async with s.post(node.url + SYNC_PATH, data=report, headers=short) as r:
            assert r.status == 304 and r.headers["Preference-Applied"] == "wait=0.3"
        assert waits(agent, "timeout") == 1 and len(agent.syncs.waiters) == 0
        # Without a wait preference the answer comes at once, as before.
        plain = {**headers, "If-None-Match": etag}
        async with s.post(node.url + SYNC_PATH, data=report, headers=plain) as r:
            assert r.status == 304 and "Preference-Applied" not in r.headers


async def test_agent_shutdown_answers_held_syncs_and_the_sidecar_goes_stale(
    node: Served, sidecar: tuple[str, Sidecar]
) -> None:
    _, sc = sidecar
    agent = node.agent
    await until(lambda: sc.policy.mode is Mode.LIVE and len(agent.syncs.waiters) == 1)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await asyncio.wait_for(node.stop(), 20)  # the server does not wait out a 25 s hold
    # A bound on time is the point: at once, not the 25 s hold; generous for a busy machine.
    assert loop.time() - t0 < 15.0
    assert waits(agent, "released") == 1 and len(agent.syncs.waiters) == 0
    # The agent is gone: the next sync fails at once, the last thresholds stay (within the 30 s
    # TTL: a bound well under it, generous for a busy machine).
    await until(lambda: sc.policy.mode is Mode.STALE, 15.0)


@pytest.mark.parametrize("wait", [1.0, 0.0])
async def test_a_held_sync_that_hangs_past_its_wait_is_a_failed_sync(
    upstream: Upstream, tmp_path: Path, wait: float
) -> None:
    """An agent that answers once, then holds every call forever (frozen, or cut off without a
    reset): each call fails at its wait + the sync timeout, held (long poll) or not."""
    from aiohttp import web

    from kvgate_agent.contract.sync import SyncAnswer
    from kvgate_agent.sidecar.node_link.sync_state import SyncResult

    calls: list[str | None] = []
    hang = asyncio.Event()

    async def handle(request: web.Request) -> web.StreamResponse:
        calls.append(request.headers.get("Prefer"))
        await request.read()
        if hang.is_set():
            await asyncio.sleep(3600)
        body = SyncAnswer(etag='"e1"', ttl_seconds=30).model_dump(mode="json", by_alias=True)
        return web.json_response(body, headers={"ETag": '"e1"'})

    app = web.Application()
    app.router.add_post(SYNC_PATH, handle)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    (tmp_path / "token").write_text(TOKEN)
    settings = AgentSettings(
        url=f"http://127.0.0.1:{port}",
        pod_namespace=NS,
        pod_name=POD,
        token_file=str(tmp_path / "token"),
        sync_interval=0.2,
        sync_timeout=0.5,
        sync_wait=wait,
    )
    sc = Sidecar(SidecarSettings(upstream=upstream.url, agent=settings))
    runners: list[Any] = [runner]
    try:
        await serve_sidecar(sc, runners)
        link = sc.policy.sync_state
        assert link is not None
        await until(lambda: link.counts[SyncResult.OK] >= 1)
        hang.set()
        # Each within 1.5 s (the wait + the 0.5 s sync timeout), not a call held forever: the
        # bound is generous (20 s for the two) for a busy machine.
        await until(lambda: link.counts[SyncResult.TIMEOUT] >= 2, 20.0)
        assert link.last_result is SyncResult.TIMEOUT
        assert ("wait=1" in calls) is (wait > 0)
    finally:
        for r in runners[::-1]:
            await r.cleanup()
