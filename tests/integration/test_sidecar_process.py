"""The real ``kvgate-agent sidecar`` process: start-up errors, SIGTERM drain."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from tests.conftest import free_port
from tests.upstream import CHAT, Upstream


def test_invalid_policy_file_fails_with_the_field_named(tmp_path: Path) -> None:
    bad = tmp_path / "p.yaml"
    bad.write_text(
        "apiVersion: kvgate.io/v1alpha1\nkind: RateLimitPolicy\n"
        "metadata: {name: x}\nspec:\n  rateLimits:\n  - name: a\n"
        "    tokensPerMinute: -5\n"
    )
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvgate_agent",
            "sidecar",
            "--upstream",
            "http://127.0.0.1:1",
            "--policy",
            str(bad),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2
    assert "spec.rateLimits[0].tokensPerMinute" in r.stderr


async def test_sigterm_stops_accepting_drains_in_flight_and_exits_0(
    upstream: Upstream, sidecar_process
) -> None:
    upstream.tokens = 10
    upstream.token_delay = 0.1  # a 1 s stream
    proc = sidecar_process(upstream.url, {}, "--drain-seconds", "10")
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            proc.url + "/v1/chat/completions", json={**CHAT, "stream": True, "max_tokens": 20}
        ) as r,
    ):
        first = await r.content.readany()
        assert first.startswith(b"data: ")
        proc.popen.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        with pytest.raises(aiohttp.ClientConnectionError):  # no longer accepting
            async with aiohttp.ClientSession() as fresh:
                await fresh.get(proc.url + "/healthz")
        rest = await r.read()
    assert (first + rest).endswith(b"data: [DONE]\n\n")  # the in-flight stream finished
    assert (first + rest).count(b"data: ") == 11
    loop = asyncio.get_running_loop()
    code = await loop.run_in_executor(None, proc.popen.wait, 10)
    assert code == 0


def test_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    import socket

    port = free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        pol = tmp_path / "p.yaml"
        pol.write_text(
            "apiVersion: kvgate.io/v1alpha1\nkind: RateLimitPolicy\nmetadata: {name: x}\n"
        )
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvgate_agent",
                "sidecar",
                "--upstream",
                "http://127.0.0.1:1",
                "--policy",
                str(pol),
                "--listen",
                f"127.0.0.1:{port}",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert r.returncode == 1
    assert f"cannot serve on 127.0.0.1:{port}" in r.stderr
    assert "Traceback" not in r.stderr
