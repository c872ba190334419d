"""SIGHUP re-reads the standalone sidecar's policy, keys and JWKS files, over real HTTP to the
real ``kvgate-agent sidecar`` process: a stream in flight goes on, the new policy is enforced,
a broken file keeps the one in force and the log says why; the process never ends on it. And
the startup line names the admin port."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from kvgate_bench.kit.toolkit import free_port, poll_until_async
from tests.conftest import policy_doc
from tests.identity_keys import write_keys
from tests.upstream import CHAT, Upstream


async def status_of(url: str, headers: dict[str, str] | None = None) -> int:
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + "/v1/chat/completions", json=CHAT, headers=headers) as r,
    ):
        await r.read()
        return r.status


async def becomes(url: str, status: int, headers: dict[str, str] | None = None) -> bool:
    async def now() -> bool:
        return await status_of(url, headers) == status

    return bool(await poll_until_async(now, bool, 10.0))


async def test_sighup_re_reads_the_policy_keeps_streams_and_a_bad_file_keeps_the_old_one(
    tmp_path: Path, upstream: Upstream, sidecar_process: Any
) -> None:
    write_keys(tmp_path / "keys.yaml", {"sk-a": "team-a"})
    proc = sidecar_process(upstream.url, {}, "--api-keys-file", str(tmp_path / "keys.yaml"))
    policy = tmp_path / "policy-0.yaml"  # the fixture's file for its first sidecar
    assert await status_of(proc.url) == 200  # no identity: anyone

    upstream.tokens, upstream.token_delay = 20, 0.1  # a 2 s stream across the reload
    refusing = {"tenants": {"header": "authorization", "unknownKeys": "Refuse"}}
    async with (
        aiohttp.ClientSession() as s,
        s.post(proc.url + "/v1/chat/completions", json={**CHAT, "stream": True}) as r,
    ):
        first = await r.content.readany()
        policy.write_text(yaml.safe_dump(policy_doc(refusing)))
        proc.popen.send_signal(signal.SIGHUP)
        upstream.token_delay = 0.0
        assert await becomes(proc.url, 401), "the new policy was not enforced"
        rest = await r.read()
    assert (first + rest).endswith(b"data: [DONE]\n\n")  # the stream went on
    assert proc.popen.poll() is None
    assert await status_of(proc.url, {"Authorization": "Bearer sk-a"}) == 200

    # A broken policy: the one in force stays, the log says why.
    policy.write_text("apiVersion: kvgate.io/v1alpha1\nkind: RateLimitPolicy\nspec: [\n")
    proc.popen.send_signal(signal.SIGHUP)

    async def said_why() -> bool:
        return "keeping the policy in force" in proc.log.read_text()

    assert await poll_until_async(said_why, bool, 10.0)
    assert "not valid YAML" in proc.log.read_text()
    assert await status_of(proc.url) == 401
    assert proc.popen.poll() is None

    # The keys file changed: re-read on SIGHUP.
    write_keys(tmp_path / "keys.yaml", {"sk-b": "team-b"})
    proc.popen.send_signal(signal.SIGHUP)
    assert await becomes(proc.url, 200, {"Authorization": "Bearer sk-b"})
    assert await status_of(proc.url, {"Authorization": "Bearer sk-a"}) == 401
    assert proc.stop() == 0


async def test_the_startup_line_names_the_admin_port(
    upstream: Upstream, sidecar_process: Any
) -> None:
    port = free_port()
    proc = sidecar_process(upstream.url, {}, "--admin-listen", f"127.0.0.1:{port}")
    line = proc.log.read_text()
    assert f"admin on http://127.0.0.1:{port}" in line, line
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/healthz") as r:
        assert r.status == 200 and r.headers["Server"] == "kvgate"
