"""Sync answers for the sidecar's sync tests: what a node agent answers one pod, and a node
agent's sync endpoint that answers it over HTTP."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from kvgate_agent.contract.sync import SYNC_PATH, SyncAnswer
from kvgate_bench.kit.toolkit import free_port


def answer(
    thresholds: dict[str, Any] | None = None,
    *,
    managed: bool = True,
    etag: str = "e1",
    ttl: float = 10.0,
    interval: float = 1.0,
    safety_net: dict[str, Any] | None = None,
    generation: int = 3,
) -> SyncAnswer:
    """One answer for pod ``ns/model-0`` (``managed``: a policy selects it) with these
    ``thresholds``, ETag, TTL and sync interval (seconds), and safety net."""
    pod = None
    if managed:
        pod = {
            "namespace": "ns",
            "name": "model-0",
            "uid": "u-1",
            "policy": {"namespace": "ns", "name": "pol", "generation": generation},
            "thresholds": thresholds or {},
        }
    return SyncAnswer.model_validate(
        {
            "etag": etag,
            "pod": pod,
            "safetyNet": safety_net or {"open": True},
            "ttlSeconds": ttl,
            "syncIntervalSeconds": interval,
        }
    )


async def serve_thresholds(
    thresholds: dict[str, Any], *, interval: float = 0.2
) -> tuple[str, web.AppRunner]:
    """A node agent's sync endpoint (``POST /v1/sync``) on a free loopback port, answering
    every sync with :func:`answer` of ``thresholds`` (sync interval ``interval`` seconds), for
    a sidecar started in agent mode; its base URL and runner (``cleanup()`` it)."""

    async def sync(request: web.Request) -> web.Response:
        await request.read()
        body = answer(thresholds, interval=interval).model_dump(by_alias=True, mode="json")
        return web.json_response(body, headers={"ETag": "e1"})

    app = web.Application()
    app.router.add_post(SYNC_PATH, sync)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return f"http://127.0.0.1:{port}", runner
