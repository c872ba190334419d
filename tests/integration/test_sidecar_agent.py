"""The sidecar taking its thresholds from a node agent, over real HTTP on loopback.

A small aiohttp server plays the agent's ``POST /v1/sync`` per the contract
(:mod:`kvgate_agent.contract.sync`): it checks the bearer token, records every report, answers
200 with an ETag or 304 on a matching If-None-Match, and can be told to change its answer or to
fail. Syncs every 0.1 s and TTLs under a second keep each test short.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvgate_agent import cli
from kvgate_agent.contract.policy import FailureMode
from kvgate_agent.contract.sync import SYNC_PATH, SyncAnswer, SyncReport
from kvgate_agent.sidecar.app import Sidecar, SidecarSettings
from kvgate_agent.sidecar.node_link.agent_link import AgentSettings
from kvgate_agent.sidecar.node_link.sync_state import Mode
from kvgate_bench.kit.toolkit import free_port, poll_until_async, wait_until_async
from tests.conftest import gauges, serve_sidecar
from tests.upstream import CHAT, Upstream

INTERVAL = 0.1
#: The thresholds' TTL in the agent's answers: 30 syncs, so that a busy machine's pauses never
#: turn a live sidecar stale or fail-open by accident, and checks made "within the TTL" after
#: a failed sync have seconds to spare.
TTL = 3.0


class FakeAgent:
    """The node agent's sync endpoint, scripted by the test."""

    def __init__(self, token: str = "tok-1") -> None:
        self.token = token
        self.url = ""
        self.generation = 0  # of the policy in the current answer
        self.pod: dict[str, Any] | None = None
        self.safety_net: dict[str, Any] = {"open": True}
        self.ttl = TTL
        self.fail_status: int | None = None  # answer every sync with this error status
        self.reports: list[dict[str, Any]] = []
        self.auth: list[str | None] = []
        self.if_none_match: list[str | None] = []
        self.statuses: list[int] = []
        self._n = 0
        self.set_thresholds({})

    def set_thresholds(self, thresholds: dict[str, Any] | None) -> None:
        """Answer with these thresholds from now on (None: no policy selects the pod), from
        the policy's next generation."""
        self.generation += 1
        self.pod = (
            None
            if thresholds is None
            else {
                "namespace": "ns",
                "name": "model-0",
                "uid": "uid-0",
                "policy": {"namespace": "ns", "name": "pol", "generation": self.generation},
                "thresholds": thresholds,
            }
        )
        self._n += 1

    def set_safety_net(self, net: dict[str, Any]) -> None:
        self.safety_net = net
        self._n += 1

    @property
    def etag(self) -> str:
        return f"e{self._n}"

    def answer(self) -> dict[str, Any]:
        return SyncAnswer.model_validate(
            {
                "etag": self.etag,
                "pod": self.pod,
                "safetyNet": self.safety_net,
                "ttlSeconds": self.ttl,
                "syncIntervalSeconds": INTERVAL,
            }
        ).model_dump(by_alias=True, mode="json")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        auth = request.headers.get("Authorization")
        self.auth.append(auth)
        self.if_none_match.append(request.headers.get("If-None-Match"))
        status, resp = self._answer(auth, await request.read(), request)
        self.statuses.append(status)
        return resp

    def _answer(
        self, auth: str | None, body: bytes, request: web.Request
    ) -> tuple[int, web.StreamResponse]:
        def error(status: int, code: str) -> tuple[int, web.StreamResponse]:
            body = {"error": {"message": code, "type": "error", "code": code}}
            return status, web.json_response(body, status=status)

        if self.fail_status is not None:
            return error(self.fail_status, "scripted_failure")
        if auth != f"Bearer {self.token}":
            return error(401, "unauthorized")
        report = SyncReport.model_validate_json(body)  # the contract, strictly
        if (report.namespace, report.name) != ("ns", "model-0"):
            return error(403, "forbidden")
        self.reports.append(report.model_dump(by_alias=True))
        if request.headers.get("If-None-Match", "").strip() == self.etag:
            return 304, web.Response(status=304, headers={"ETag": self.etag})
        return 200, web.json_response(self.answer(), headers={"ETag": self.etag})


@pytest.fixture
async def agent() -> AsyncIterator[FakeAgent]:
    fake = FakeAgent()
    app = web.Application()
    app.router.add_post(SYNC_PATH, fake.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.2)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    fake.url = f"http://127.0.0.1:{port}"
    yield fake
    await runner.cleanup()


MakeSidecar = Callable[..., Awaitable[tuple[str, Sidecar]]]


@pytest.fixture
async def agent_sidecar(tmp_path: Path) -> AsyncIterator[MakeSidecar]:
    """``url, sidecar = await make(upstream_url, agent_url, **agent_settings)``: a sidecar in
    cluster mode (token file ``tmp_path/token`` holding ``tok-1`` unless told otherwise)."""
    runners: list[Any] = []

    async def make(upstream: str, agent_url: str, **kw: Any) -> tuple[str, Sidecar]:
        if "token_file" not in kw:
            (tmp_path / "token").write_text("tok-1\n")
            kw["token_file"] = str(tmp_path / "token")
        settings = AgentSettings(
            url=agent_url,
            pod_namespace="ns",
            pod_name="model-0",
            pod_uid="uid-0",
            sync_interval=INTERVAL,
            sync_timeout=0.5,
            **kw,
        )
        sc = Sidecar(SidecarSettings(upstream=upstream, agent=settings))
        return await serve_sidecar(sc, runners), sc

    yield make
    for r in runners:
        await r.cleanup()


async def until(cond: Callable[[], bool], within: float = 10.0) -> None:
    await wait_until_async(cond, within, "the condition")


async def post(client: aiohttp.ClientSession, url: str, **extra: Any) -> tuple[int, Any, Any]:
    async with client.post(url + "/v1/chat/completions", json={**CHAT, **extra}) as r:
        return r.status, r.headers, await r.read()


# ---------------------------------------------------------------- thresholds from the agent


async def test_thresholds_from_the_agent_are_enforced_and_syncs_are_cheap(
    upstream: Upstream,
    agent: FakeAgent,
    agent_sidecar: MakeSidecar,
    client: aiohttp.ClientSession,
    tmp_path: Path,
) -> None:
    agent.set_thresholds({"concurrency": {"maxRequests": 1}, "overload": {"actions": ["Reject"]}})
    url, sc = await agent_sidecar(upstream.url, agent.url)
    await until(lambda: sc.policy.mode is Mode.LIVE)
    live_at = time.monotonic()
    upstream.hold = asyncio.Event()  # in flight until the checks below saw it so
    slow = asyncio.create_task(post(client, url, max_tokens=8))
    try:
        await until(lambda: upstream.active == 1)
        status, headers, _ = await post(client, url, max_tokens=8)
        assert status == 429 and headers["x-kvgate-reason"] == "concurrency"
        assert headers["x-kvgate-thresholds"] == "live"
        await until(lambda: any(r["inFlight"] == 1 for r in agent.reports))  # reported busy
    finally:
        upstream.hold.set()
    status, headers, _ = await slow
    assert status == 200 and headers["x-kvgate-thresholds"] == "live"
    # The token is re-read before every sync (projected tokens rotate).
    agent.token = "tok-2"
    (tmp_path / "token").write_text("tok-2")
    n = len(agent.auth)
    await until(lambda: len(agent.auth) > n + 1 and agent.auth[-1] == "Bearer tok-2")
    # Unchanged answers cost a 304: one 200, then If-None-Match with its ETag.
    assert agent.statuses.count(200) == 1 and 304 in agent.statuses
    assert agent.if_none_match[-1] == agent.etag
    last = agent.reports[-1]
    assert (last["namespace"], last["name"], last["uid"]) == ("ns", "model-0", "uid-0")
    assert last["thresholdsEtag"] == agent.etag and last["inFlight"] == 0
    assert last["decisions"] == {"admitted": 1, "rejected": 1}
    m = await gauges(client, url)
    assert m['kvgate_thresholds_mode{mode="live"}'] == 1
    assert m['kvgate_thresholds_mode{mode="stale"}'] == 0
    assert m['kvgate_agent_sync_total{result="ok"}'] == 1
    assert m['kvgate_agent_sync_total{result="not_modified"}'] >= 1
    assert m['kvgate_policy_generation{name="pol",namespace="ns"}'] == agent.generation
    # The age counts from the last sync (the 304s since), not from the first answer: an event
    # order (the token checks above saw syncs after live_at), not a wall-clock figure.
    assert 0 <= m["kvgate_thresholds_age_seconds"] < time.monotonic() - live_at


async def test_a_change_propagates_and_in_flight_requests_finish(
    upstream: Upstream, agent: FakeAgent, agent_sidecar: MakeSidecar, client: aiohttp.ClientSession
) -> None:
    limits = {"overload": {"actions": ["Reject"]}, "tenants": {"defaultMaxTokens": 16}}
    agent.set_thresholds({**limits, "concurrency": {"maxRequests": 1}})
    url, sc = await agent_sidecar(upstream.url, agent.url)
    await until(lambda: sc.policy.mode is Mode.LIVE)
    upstream.tokens = 60
    upstream.token_delay = 0.1  # a 6 s stream (sped up below, once the change is checked)
    stream = await client.post(
        url + "/v1/chat/completions", json={**CHAT, "stream": True, "max_tokens": 20}
    )
    assert stream.status == 200
    await stream.content.readany()
    assert (await post(client, url))[0] == 429
    agent.set_thresholds({**limits, "concurrency": {"maxRequests": 3}})
    await until(lambda: sc.admission.config.max_concurrency == 3)
    assert sc.admission.stats().in_flight == 1  # the stream survived the change
    upstream.token_delay = 0.0
    results = await asyncio.gather(post(client, url), post(client, url))
    assert [r[0] for r in results] == [200, 200]
    body = await stream.read()
    assert body.endswith(b"data: [DONE]\n\n") and body.count(b"data: ") >= 6
    stream.release()
    await until(lambda: sc.admission.stats().in_flight == 0)
    assert sc.admission.stats().kv_reserved_tokens == 0
    m = await gauges(client, url)
    assert m['kvgate_policy_generation{name="pol",namespace="ns"}'] == agent.generation


# ---------------------------------------------------------------- the agent going away


async def test_agent_down_keeps_the_last_thresholds_for_the_ttl_then_fails_open(
    upstream: Upstream, agent: FakeAgent, agent_sidecar: MakeSidecar, client: aiohttp.ClientSession
) -> None:
    agent.set_thresholds(
        {
            "rateLimits": [
                {"name": "rpm", "per": "Pod", "requestsPerMinute": 0.01, "burstRequests": 1}
            ],
            "overload": {"actions": ["Reject"]},
            "failureMode": "FailOpen",
        }
    )
    url, sc = await agent_sidecar(upstream.url, agent.url)
    await until(lambda: sc.policy.mode is Mode.LIVE)
    assert (await post(client, url))[0] == 200
    agent.fail_status = 503
    await until(lambda: sc.policy.mode is Mode.STALE)
    status, headers, _ = await post(client, url)
    assert status == 429 and headers["x-kvgate-reason"] == "rate_limit_requests"
    assert headers["x-kvgate-thresholds"] == "stale"
    await until(lambda: sc.policy.mode is Mode.FAIL_OPEN, TTL + 10)  # pushed: no request
    status, headers, _ = await post(client, url)  # local caps only: the rate limit is lifted
    assert status == 200 and headers["x-kvgate-thresholds"] == "fail_open"
    m = await gauges(client, url)
    assert m['kvgate_thresholds_mode{mode="fail_open"}'] == 1
    assert m['kvgate_agent_sync_total{result="error"}'] >= 1
    assert m["kvgate_thresholds_age_seconds"] > TTL
    agent.fail_status = None  # back: the thresholds apply again
    await until(lambda: sc.policy.mode is Mode.LIVE)
    assert (await post(client, url))[0] == 200  # a fresh bucket after the lifted limit
    assert (await post(client, url))[0] == 429


async def test_agent_down_past_the_ttl_under_fail_closed_gives_503(
    upstream: Upstream, agent: FakeAgent, agent_sidecar: MakeSidecar, client: aiohttp.ClientSession
) -> None:
    agent.set_thresholds({"failureMode": "FailClosed"})
    url, sc = await agent_sidecar(upstream.url, agent.url)
    await until(lambda: sc.policy.mode is Mode.LIVE)
    agent.fail_status = 500
    await until(lambda: sc.policy.mode is Mode.STALE)
    assert (await post(client, url))[0] == 200  # within the TTL
    await until(lambda: sc.policy.mode is Mode.FAIL_CLOSED, TTL + 10)  # pushed: no request
    n = len(upstream.bodies)
    async with client.post(url + "/v1/chat/completions", json=CHAT) as r:
        assert r.status == 503
        assert int(r.headers["Retry-After"]) >= 1
        assert r.headers["x-kvgate-reason"] == "fail_closed"
        assert r.headers["x-kvgate-thresholds"] == "fail_closed"
        err = (await r.json())["error"]
        assert err["type"] == "service_unavailable" and err["code"] == "fail_closed"
    assert len(upstream.bodies) == n  # never reached the model server
    agent.fail_status = None
    await until(lambda: sc.policy.mode is Mode.LIVE)
    assert (await post(client, url))[0] == 200


async def test_gpu_safety_net_closed_gives_503_gpu_memory_low_until_it_reopens(
    upstream: Upstream, agent: FakeAgent, agent_sidecar: MakeSidecar, client: aiohttp.ClientSession
) -> None:
    url, sc = await agent_sidecar(upstream.url, agent.url)
    await until(lambda: sc.policy.mode is Mode.LIVE)
    agent.set_safety_net(
        {
            "open": False,
            "reason": "free memory below the safety margin",
            "gpuUuid": "GPU-0",
            "freeBytes": 10,
            "marginBytes": 100,
            "retryAfterSeconds": 2,
        }
    )
    await until(lambda: sc.admission.core.active_hold() is not None)
    async with client.post(url + "/v1/chat/completions", json=CHAT) as r:
        assert r.status == 503 and r.headers["Retry-After"] == "2"
        assert r.headers["x-kvgate-reason"] == "gpu_memory_low"
        assert r.headers["x-kvgate-thresholds"] == "live"
        err = (await r.json())["error"]
        assert err["code"] == "gpu_memory_low" and "GPU-0" in err["message"]
    agent.set_safety_net({"open": True})
    await until(lambda: sc.admission.core.active_hold() is None)
    assert (await post(client, url))[0] == 200


# ---------------------------------------------------------------- before any answer


async def test_waiting_for_the_agent_readiness_and_the_configured_failure_mode(
    upstream: Upstream, agent_sidecar: MakeSidecar, client: aiohttp.ClientSession
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    url, _ = await agent_sidecar(upstream.url, dead, ttl_override=0.5)
    async with client.get(url + "/readyz") as r:
        assert r.status == 503 and "node agent" in await r.text()
    status, headers, _ = await post(client, url)  # FailOpen by default: no limits yet
    assert status == 200 and headers["x-kvgate-thresholds"] == "waiting"
    await asyncio.sleep(0.5)
    async with client.get(url + "/readyz") as r:  # the TTL passed: Ready anyway
        assert r.status == 200
    # A failed sync counted (awaited, not assumed to have happened within the 0.5 s).
    m = await poll_until_async(
        lambda: gauges(client, url),
        lambda m: m.get('kvgate_agent_sync_total{result="error"}', 0) >= 1,
        10,
    )
    assert m.get('kvgate_agent_sync_total{result="error"}', 0) >= 1
    assert m['kvgate_thresholds_mode{mode="waiting"}'] == 1

    url2, _ = await agent_sidecar(upstream.url, dead, failure_mode=FailureMode.FAIL_CLOSED)
    status, headers, _ = await post(client, url2)
    assert status == 503 and headers["x-kvgate-reason"] == "fail_closed"
    assert headers["x-kvgate-thresholds"] == "waiting"


async def test_unmanaged_pod_enforces_no_limits(
    upstream: Upstream, agent: FakeAgent, agent_sidecar: MakeSidecar, client: aiohttp.ClientSession
) -> None:
    agent.set_thresholds(None)
    url, sc = await agent_sidecar(upstream.url, agent.url)
    await until(lambda: sc.policy.mode is Mode.UNMANAGED)
    upstream.headers_delay = 0.2
    results = await asyncio.gather(*(post(client, url) for _ in range(5)))
    assert all(r[0] == 200 and r[1]["x-kvgate-thresholds"] == "unmanaged" for r in results)
    m = await gauges(client, url)
    assert not any(k.startswith("kvgate_policy_generation") for k in m)


async def test_a_policy_other_than_the_annotated_one_is_flagged(
    upstream: Upstream,
    agent: FakeAgent,
    agent_sidecar: MakeSidecar,
    client: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvgate.sidecar")
    url, sc = await agent_sidecar(upstream.url, agent.url, expected_policy="pol")
    await until(lambda: sc.policy.mode is Mode.LIVE)
    assert (await gauges(client, url))["kvgate_policy_mismatch"] == 0
    agent.set_thresholds(None)  # no policy governs the pod any more
    await until(lambda: sc.policy.mode is Mode.UNMANAGED)
    assert (await gauges(client, url))["kvgate_policy_mismatch"] == 1
    assert "annotated kvgate.io/policy=pol but is governed by no RateLimitPolicy" in caplog.text
    agent.set_thresholds({})
    await until(lambda: sc.policy.mode is Mode.LIVE)
    assert (await gauges(client, url))["kvgate_policy_mismatch"] == 0


async def test_wrong_pod_token_is_counted_and_enforcement_waits(
    upstream: Upstream, agent: FakeAgent, agent_sidecar: MakeSidecar, client: aiohttp.ClientSession
) -> None:
    url, sc = await agent_sidecar(upstream.url, agent.url, token_file="/nonexistent/token")
    await until(lambda: len(agent.auth) >= 2)
    assert agent.auth[0] is None and sc.policy.mode is Mode.WAITING
    m = await gauges(client, url)
    assert m['kvgate_agent_sync_total{result="unauthorized"}'] >= 2


# ---------------------------------------------------------------- the CLI in cluster mode


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        ([], {}, "exactly one of --policy"),
        (["--policy", "p.yaml", "--agent-url", "http://127.0.0.1:9"], {}, "exactly one of"),
        (["--agent-url", "http://127.0.0.1:9"], {}, "needs --pod-namespace and --pod-name"),
        ([], {"KVGATE_AGENT_URL": "http://127.0.0.1:9", "KVGATE_POD_NAME": "p"}, "needs"),
        (["--agent-url", "127.0.0.1:9"], {}, "expected an http:// or https:// URL"),
        (["--failure-mode", "Maybe"], {"KVGATE_AGENT_URL": "http://127.0.0.1:9"}, "Maybe"),
        (["--thresholds-ttl", "0"], {}, "must be a finite number > 0"),
        (
            ["--policy", "p.yaml", "--share-sync", "0.5"],
            {},
            "--share-sync (KVGATE_SHARE_SYNC) needs --store",
        ),
        (["--policy", "p.yaml"], {"KVGATE_SHARE_SYNC": "0.5"}, "needs --store (KVGATE_STORE_URL)"),
        (["--policy", "p.yaml", "--share-sync", "-1"], {}, "expected a number >= 0"),
        (["--policy", "p.yaml", "--share-sync", "5"], {}, "expected seconds below 5"),
    ],
)
def test_cli_mode_errors_are_clear(
    args: list[str],
    env: dict[str, str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for k in [k for k in os.environ if k.startswith("KVGATE_")]:
        monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as exc:
        cli.main(["sidecar", "--upstream", "http://127.0.0.1:1", *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


async def test_cli_sidecar_in_cluster_mode_takes_thresholds_from_the_agent(
    upstream: Upstream, agent: FakeAgent, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    agent.set_thresholds({"concurrency": {"maxRequests": 1}, "overload": {"actions": ["Reject"]}})
    (tmp_path / "token").write_text("tok-1")
    port = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")},
        "KVGATE_AGENT_URL": agent.url,
        "KVGATE_TOKEN_FILE": str(tmp_path / "token"),
        "KVGATE_POD_NAMESPACE": "ns",
        "KVGATE_POD_NAME": "model-0",
        "KVGATE_POD_UID": "uid-0",
        "KVGATE_POD_IP": "127.0.0.1",
        "NVIDIA_VISIBLE_DEVICES": "GPU-0a1b2c3d-1111-2222-3333-444455556666",
    }
    args = [sys.executable, "-m", "kvgate_agent", "sidecar", "--upstream", upstream.url]
    proc = await asyncio.create_subprocess_exec(
        *args,
        "--listen",
        f"127.0.0.1:{port}",
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        await until(lambda: bool(agent.reports) or proc.returncode is not None, within=10)
        assert proc.returncode is None
        report = agent.reports[0]
        assert report["metricsUrl"] == f"http://127.0.0.1:{port}/metrics"
        assert report["gpuUuids"] == ["GPU-0a1b2c3d-1111-2222-3333-444455556666"]
        upstream.hold = asyncio.Event()  # in flight until the second request was refused
        slow = asyncio.create_task(post(client, url))
        try:
            await until(lambda: upstream.active == 1)
            status, headers, _ = await post(client, url)
            assert status == 429 and headers["x-kvgate-thresholds"] == "live"
        finally:
            upstream.hold.set()
        assert (await slow)[0] == 200
    finally:
        if proc.returncode is None:
            proc.terminate()
        _, stderr = await asyncio.wait_for(proc.communicate(), 10)
    assert proc.returncode == 0, stderr.decode()
