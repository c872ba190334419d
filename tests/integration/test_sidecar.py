"""The sidecar over real HTTP on loopback, against upstreams that record what reached them."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from kvgate_bench.kit.toolkit import free_port, poll_until_async, wait_until_async
from kvgate_bench.sim.config import SimConfig
from kvgate_bench.sim.server import start_sim
from tests.conftest import ADMIN, ADMIN_URLS, SidecarFactory, gauges
from tests.upstream import CHAT, Upstream


def assert_openai_error(body: dict[str, Any]) -> None:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]


# ---------------------------------------------------------------- happy path and headers


async def test_admitted_request_is_forwarded_and_settled(
    upstream: Upstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    url, _ = await sidecar_factory(upstream.url, {})
    async with client.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 9}) as r:
        assert r.status == 200
        assert r.headers["x-kvgate-decision"] == "admitted"
        assert (await r.json())["usage"]["completion_tokens"] == 3
    assert upstream.bodies == [{**CHAT, "max_tokens": 9}]
    g = await gauges(client, url)
    assert g['kvgate_tokens_total{kind="completion",tenant="anonymous"}'] == 3
    assert g["kvgate_in_flight_requests"] == 0


async def test_missing_max_tokens_is_charged_at_the_default_and_sent_upstream(
    upstream: Upstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    url, sc = await sidecar_factory(
        upstream.url,
        {
            "tenants": {"defaultMaxTokens": 77},
            "capacity": {"kvCacheTokens": 100000},
            "model": {"blockSize": 1},
        },
    )
    upstream.hold = asyncio.Event()  # in flight until the reservation was read, however slowly
    task = asyncio.create_task(client.post(url + "/v1/chat/completions", json=CHAT))
    try:
        await wait_until_async(lambda: upstream.bodies, 10, "the request upstream")
        # While in flight, the reservation is prompt + the default 77 tokens.
        prompt_estimate = sc.counter.count(CHAT).tokens
        assert sc.admission.stats().kv_reserved_tokens == prompt_estimate + 77
    finally:
        upstream.hold.set()
    r = await task
    r.release()
    assert upstream.bodies[0]["max_tokens"] == 77


async def test_other_paths_pass_through_untouched(
    upstream: Upstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    url, _ = await sidecar_factory(upstream.url, {"concurrency": {"maxRequests": 1}})
    async with client.post(url + "/tokenize?x=1", data=b"raw \xff bytes") as r:
        got = await r.json()
        assert r.headers["x-kvgate-decision"] == "passthrough"
    assert got == {"path": "/tokenize", "method": "POST", "body": "raw \ufffd bytes"}
    async with client.get(url + "/metrics") as r:  # the engine's own, with the router gauges
        body = await r.text()
        assert r.headers["x-kvgate-decision"] == "passthrough"
    echo, _, gauges_text = body.partition("\n")
    assert json.loads(echo)["path"] == "/metrics"
    assert gauges_text.startswith("# HELP kvgate_queue_depth ")


async def test_stream_accounting_survives_one_byte_writes_and_strips_injected_usage(
    upstream: Upstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    upstream.byte_by_byte = True
    upstream.tokens = 5
    url, _ = await sidecar_factory(upstream.url, {})
    async with client.post(
        url + "/v1/chat/completions", json={**CHAT, "stream": True, "max_tokens": 50}
    ) as r:
        data = await r.read()
    assert upstream.bodies[0]["stream_options"] == {"include_usage": True}  # added upstream
    assert b'"choices":[]' not in data  # ... and stripped before the client saw it
    assert data.count(b"data: ") == 6 and data.endswith(b"data: [DONE]\n\n")
    g = await gauges(client, url)
    assert g['kvgate_tokens_total{kind="completion",tenant="anonymous"}'] == 5
    assert g['kvgate_tokens_total{kind="prompt",tenant="anonymous"}'] == 7  # server's count
    # A client that asked for usage gets it, exactly once.
    async with client.post(
        url + "/v1/chat/completions",
        json={**CHAT, "stream": True, "max_tokens": 50, "stream_options": {"include_usage": True}},
    ) as r:
        data = await r.read()
    assert data.count(b'"choices":[]') == 1


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        (b'["a list"]', 400, None),
        (json.dumps({**CHAT, "max_tokens": 0}).encode(), 400, "max_tokens"),
        (json.dumps({**CHAT, "max_tokens": "10"}).encode(), 400, "max_tokens"),
        (json.dumps({**CHAT, "max_tokens": True}).encode(), 400, "max_tokens"),
        (json.dumps({**CHAT, "max_tokens": 5000}).encode(), 400, "max_tokens"),
        (json.dumps({**CHAT, "stream": "yes"}).encode(), 400, "stream"),
        (json.dumps({"model": "m"}).encode(), 400, "messages"),
        (json.dumps({**CHAT, "pad": "x" * 5000}).encode(), 413, None),
    ],
)
async def test_bad_input_gets_openai_error_and_never_reaches_upstream(
    upstream: Upstream,
    sidecar_factory: SidecarFactory,
    client: aiohttp.ClientSession,
    body: bytes,
    status: int,
    param: str | None,
) -> None:
    url, sc = await sidecar_factory(
        upstream.url, {"model": {"maxModelLen": 4096}}, max_body_bytes=4096
    )
    async with client.post(
        url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    ) as r:
        assert r.status == status
        assert r.headers["x-kvgate-decision"] == "rejected"
        err = await r.json()
    assert_openai_error(err)
    assert err["error"]["param"] == param
    assert upstream.bodies == []
    assert sc.admission.stats().in_flight == 0 and sc.admission.stats().kv_reserved_tokens == 0


async def test_chunked_body_over_the_limit_gets_413(
    upstream: Upstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    url, _ = await sidecar_factory(upstream.url, {}, max_body_bytes=1000)

    async def gen() -> AsyncIterator[bytes]:
        for _ in range(20):
            yield b" " * 100

    async with client.post(
        url + "/v1/chat/completions", data=gen(), headers={"Content-Type": "application/json"}
    ) as r:
        assert r.status == 413
        assert_openai_error(await r.json())
    assert upstream.bodies == []


@pytest.mark.parametrize(
    ("forward_to", "sent"), [("vLLM", [-5, 0, 3]), ("SGLang", [5, 0, -3]), ("None", None)]
)
async def test_priority_reaches_the_engine_in_its_own_order(
    upstream: Upstream,
    sidecar_factory: SidecarFactory,
    client: aiohttp.ClientSession,
    forward_to: str,
    sent: list[int] | None,
) -> None:
    """``priority.forwardTo`` writes kvgate's priority (the policy's header, set by a trusted
    gateway) into the forwarded body in the engine's order (vLLM lower first: negated; SGLang
    higher first: as is), in place of the client's own body ``priority``, which never reaches
    the engine."""
    url, _ = await sidecar_factory(
        upstream.url,
        {"priority": {"header": "x-prio", "forwardTo": forward_to, "trusted": True}},
    )
    for header in ("5", None, "-3"):
        headers = {} if header is None else {"x-prio": header}
        body = {**CHAT, "max_tokens": 4, "priority": 77}
        async with client.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status == 200
    got = [b.get("priority") for b in upstream.bodies]
    assert got == ([None] * 3 if sent is None else sent)
    assert all(b["max_tokens"] == 4 and b["messages"] == CHAT["messages"] for b in upstream.bodies)


async def test_bad_priority_header_is_400(
    upstream: Upstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    url, _ = await sidecar_factory(upstream.url, {})
    async with client.post(
        url + "/v1/chat/completions", json=CHAT, headers={"x-kvgate-priority": "urgent"}
    ) as r:
        assert r.status == 400
        assert (await r.json())["error"]["param"] == "x-kvgate-priority"


# ---------------------------------------------------------------- refusals


async def test_429_carries_retry_after_and_ratelimit_headers(
    upstream: Upstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    url, _ = await sidecar_factory(
        upstream.url,
        {
            "rateLimits": [{"name": "per-tenant", "requestsPerMinute": 30, "burstRequests": 1}],
            "overload": {"actions": ["Reject"]},
        },
    )
    async with client.post(url + "/v1/chat/completions", json=CHAT) as r:
        assert r.status == 200
    async with client.post(url + "/v1/chat/completions", json=CHAT) as r:
        assert r.status == 429
        assert r.headers["x-kvgate-decision"] == "rejected"
        assert r.headers["x-kvgate-reason"] == "rate_limit_requests"
        assert 1 <= int(r.headers["Retry-After"]) <= 2  # 30/min refills one in 2 s
        assert r.headers["RateLimit-Policy"] == '"per-tenant";q=1;w=2;qu="requests"'
        assert re.fullmatch(r'"per-tenant";r=0;t=[12]', r.headers["RateLimit"])
        err = await r.json()
    assert_openai_error(err)
    assert err["error"]["code"] == "rate_limit_exceeded"
    # Another tenant is not affected.
    async with client.post(
        url + "/v1/chat/completions", json=CHAT, headers={"x-kvgate-tenant": "other"}
    ) as r:
        assert r.status == 200


async def test_cost_above_capacity_is_refused_at_once_with_400(
    upstream: Upstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    url, _ = await sidecar_factory(
        upstream.url,
        {
            "tenants": {"defaultMaxTokens": 50},
            "rateLimits": [{"name": "t", "tokensPerMinute": 100, "burstTokens": 100}],
        },
    )
    t0 = time.monotonic()
    async with client.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 500}) as r:
        assert r.status == 400
        assert "Retry-After" not in r.headers
        assert r.headers["x-kvgate-reason"] == "exceeds_capacity"
        assert_openai_error(await r.json())
    # At once, not after a wait in the queue (30 s by default): the bound is the point, so it
    # is generous (10 s) for a busy machine, still well under the queue's wait.
    assert time.monotonic() - t0 < 10
    assert upstream.bodies == []


async def test_degraded_response_says_what_changed(
    upstream: Upstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    url, _ = await sidecar_factory(
        upstream.url,
        {
            "capacity": {"kvCacheTokens": 256},
            "model": {"blockSize": 16},
            "overload": {"actions": ["Degrade", "Reject"], "degrade": {"minMaxTokens": 16}},
        },
    )
    async with client.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 1000}) as r:
        assert r.status == 200
        assert r.headers["x-kvgate-decision"] == "degraded"
        clamp = int(r.headers["x-kvgate-degraded"].removeprefix("max_tokens="))
    assert upstream.bodies[0]["max_tokens"] == clamp < 256


async def test_fallback_model_rewrite(
    upstream: Upstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    url, _ = await sidecar_factory(
        upstream.url,
        {
            "rateLimits": [{"name": "t", "requestsPerMinute": 1, "burstRequests": 1}],
            "overload": {"actions": ["Degrade", "Reject"], "degrade": {"fallbackModel": "small"}},
        },
    )
    for _ in range(2):
        async with client.post(url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 200
    assert r.headers["x-kvgate-degraded"] == "model=small"
    assert [b["model"] for b in upstream.bodies] == ["m", "small"]


async def test_queued_request_is_admitted_when_capacity_frees(
    upstream: Upstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    upstream.headers_delay = 0.2  # each request holds the one slot 0.2 s at least
    upstream.hold = asyncio.Event()  # ...and the first until the other two are queued
    url, sc = await sidecar_factory(upstream.url, {"concurrency": {"maxRequests": 1}})
    sent = asyncio.gather(*(client.post(url + "/v1/chat/completions", json=CHAT) for _ in range(3)))
    try:
        # Queued (seen, not assumed from arriving within 0.2 s), then 0.2 s more at least:
        # the second waits >= 0.2 s, the third >= 0.4 s (behind the second's 0.2 s).
        await wait_until_async(lambda: sc.admission.stats().queue_length == 2, 10, "two queued")
        await asyncio.sleep(0.2)
    finally:
        upstream.hold.set()
    rs = await sent
    decisions = sorted(r.headers["x-kvgate-decision"] for r in rs)
    assert decisions == ["admitted", "queued", "queued"]
    assert all(r.status == 200 for r in rs)
    waits = sorted(int(r.headers.get("x-kvgate-queue-wait-ms", 0)) for r in rs)
    assert waits[1] >= 150 and waits[2] >= 350
    for r in rs:
        r.release()
    g = await gauges(client, url)
    assert g["kvgate_queue_wait_seconds_count"] == 2


async def test_authorization_tenant_is_hashed_never_exported_raw(
    upstream: Upstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    url, _ = await sidecar_factory(upstream.url, {"tenants": {"header": "authorization"}}, **ADMIN)
    async with client.post(
        url + "/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer sk-secret-123"}
    ) as r:
        assert r.status == 200
    async with client.get(ADMIN_URLS[url] + "/metrics") as r:  # the admin port's: per tenant
        text = await r.text()
    assert "sk-secret-123" not in text
    assert re.search(r'tenant="key-[0-9a-f]{16}"', text)


# ---------------------------------------------------------------- client disconnects


async def _disconnect_after(
    url: str, body: dict[str, Any], after_bytes: int, delay: float = 0.0
) -> float:
    """Send a request on a raw socket, read ``after_bytes`` of the response (0 = none), wait
    ``delay``, then close. Returns the close time (monotonic)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
    raw = json.dumps(body).encode()
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
        b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(raw), raw)
    )
    await writer.drain()
    got = b""
    while len(got) < after_bytes:
        part = await reader.read(after_bytes - len(got))
        if not part:
            break
        got += part
    await asyncio.sleep(delay)
    writer.close()
    return time.monotonic()


@pytest.mark.parametrize("phase", ["before_headers", "first_token", "mid_stream"])
async def test_client_gone_closes_upstream_at_once_and_releases_everything(
    upstream: Upstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession, phase: str
) -> None:
    upstream.tokens = 300
    upstream.token_delay = 0.1  # a 30 s stream
    if phase == "before_headers":
        upstream.headers_delay = 30
    elif phase == "first_token":
        upstream.first_token_delay = 30
    url, sc = await sidecar_factory(
        upstream.url,
        {
            "capacity": {"kvCacheTokens": 10000},
            "rateLimits": [{"name": "t", "tokensPerMinute": 0.001, "burstTokens": 5000}],
        },
    )
    body = {**CHAT, "stream": True, "max_tokens": 1000}
    after = {"before_headers": 0, "first_token": 1, "mid_stream": 600}[phase]
    task = asyncio.create_task(_disconnect_after(url, body, after, delay=0.2))
    await wait_until_async(lambda: upstream.bodies, 10, "the request upstream")
    closed = await task
    await wait_until_async(lambda: upstream.closed_at, 5.0, "the upstream connection to close")
    # At once (expected: milliseconds), not at the end of the 30 s wait or stream: the bound
    # is the point, so it is generous (5 s) for a busy machine, still well under 30 s.
    assert upstream.closed_at[0] - closed < 5.0
    c = sc.admission.core
    await wait_until_async(
        lambda: (
            c.stats().in_flight == 0
            and c.stats().kv_reserved_tokens == 0
            and c.stats().queue_length == 0
        ),
        10,
        "everything released",
    )
    assert (await gauges(client, url))["kvgate_client_disconnects_total"] == 1
    # Charged only for what was produced (what the model server sent, however long that took
    # on a busy machine): the 5000 burst is nearly whole again.
    (level,) = [lvl for _, unit, _, lvl, _ in c.tenant_stats().bucket_levels if unit == "cost"]
    produced = upstream.events_sent
    assert phase == "mid_stream" or produced == 0
    assert level >= 5000 - sc.counter.count(CHAT).tokens - produced - 1


async def test_client_gone_while_queued_never_reaches_upstream(
    upstream: Upstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    upstream.hold = asyncio.Event()  # the first request holds the one slot until set
    url, sc = await sidecar_factory(upstream.url, {"concurrency": {"maxRequests": 1}})
    c = sc.admission.core
    first = asyncio.create_task(client.post(url + "/v1/chat/completions", json=CHAT))
    try:
        await wait_until_async(lambda: upstream.bodies, 10, "the request upstream")
        # The second one queued (seen, not slept on), then its client gone.
        _, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
        raw = json.dumps(CHAT).encode()
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
            b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(raw), raw)
        )
        await writer.drain()
        await wait_until_async(lambda: c.stats().queue_length == 1, 10, "the second request queued")
        writer.close()
        await wait_until_async(
            lambda: c.stats().queue_length == 0, 10, "the queued request dropped"
        )
        assert c.stats().in_flight == 1 and len(upstream.bodies) == 1  # dropped, not admitted
    finally:
        upstream.hold.set()
    (await first).release()
    await wait_until_async(lambda: c.stats().in_flight == 0, 10, "the first request to end")
    assert len(upstream.bodies) == 1


async def test_100_streams_cancelled_mid_flight_leave_every_gauge_at_zero(
    sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    runner, port = await start_sim(SimConfig(kv_capacity_tokens=65536, decode_ms=5))
    try:
        sim = f"http://127.0.0.1:{port}"
        url, _ = await sidecar_factory(
            sim,
            {
                "capacity": {"fromEngineMetrics": True},
                "concurrency": {"maxRequests": 40},
                "queue": {"maxLength": 100, "maxWaitSeconds": 30},
                "rateLimits": [{"name": "t", "tokensPerMinute": 1e7}],
            },
        )
        body = {
            "model": "kvgate-sim-model",
            "stream": True,
            "max_tokens": 500,
            "messages": [{"role": "user", "content": "tell me a long story"}],
        }

        async def one(i: int) -> None:
            await _disconnect_after(url, body, 400 if i % 2 else 0, delay=0.05 * (i % 5))

        await asyncio.gather(*(one(i) for i in range(100)))
        g = await poll_until_async(
            lambda: gauges(client, url),
            lambda g: g["kvgate_in_flight_requests"] == 0 and g["kvgate_queue_length"] == 0,
            5.0,
        )
        assert g["kvgate_in_flight_requests"] == 0
        assert g["kvgate_kv_reserved_tokens"] == 0
        assert g["kvgate_queue_length"] == 0
        assert g["kvgate_kv_capacity_tokens"] == 65536  # read from vllm:cache_config_info
        async with client.get(sim + "/sim/stats") as r:
            stats = await r.json()
        assert stats["running"] == 0 and stats["waiting"] == 0 and stats["used_blocks"] == 0
    finally:
        await runner.cleanup()


# ---------------------------------------------------------------- engine capacity, failureMode


async def test_fail_closed_without_engine_capacity_answers_503_with_retry_after(
    sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    url, _ = await sidecar_factory(
        dead, {"capacity": {"fromEngineMetrics": True}, "failureMode": "FailClosed"}
    )
    async with client.post(url + "/v1/chat/completions", json=CHAT) as r:
        assert r.status == 503
        assert int(r.headers["Retry-After"]) >= 1
        assert r.headers["x-kvgate-reason"] == "fail_closed"
        assert_openai_error(await r.json())
    async with client.get(url + "/readyz") as r:
        assert r.status == 503


async def test_fail_open_without_engine_capacity_keeps_local_caps(
    upstream: Upstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    url, sc = await sidecar_factory(
        upstream.url,
        {"capacity": {"fromEngineMetrics": True, "kvCacheTokens": 4096}, "failureMode": "FailOpen"},
    )
    async with client.post(url + "/v1/chat/completions", json=CHAT) as r:
        assert r.status == 200
    assert sc.admission.stats().kv_capacity_tokens == 4096  # the explicit fallback stays enforced


async def test_upstream_unreachable_is_502_and_releases(
    sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    url, sc = await sidecar_factory(
        f"http://127.0.0.1:{free_port()}",
        {"rateLimits": [{"name": "t", "requestsPerMinute": 0.001, "burstRequests": 1}]},
    )
    for _ in range(2):  # the failed attempt is not charged: the second gets the same answer
        async with client.post(url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 502
            assert_openai_error(await r.json())
    assert sc.admission.stats().in_flight == 0


async def test_defaulted_max_tokens_stays_within_the_engines_context(
    sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    # Punctuation-heavy text has far fewer bytes per token than the estimate assumes; the
    # engine's context (learned from /v1/models) must still not be overrun.
    runner, port = await start_sim(SimConfig(max_model_len=1024, decode_ms=0))
    try:
        url, sc = await sidecar_factory(f"http://127.0.0.1:{port}", {})
        await wait_until_async(lambda: sc.engine.max_model_len is not None, 2.0, "/v1/models")
        assert sc.engine.max_model_len == 1024
        body = {
            "model": "kvgate-sim-model",
            "messages": [{"role": "user", "content": "a , b ; c . d " * 40}],
        }
        async with client.post(url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
            usage = (await r.json())["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] <= 1024
    finally:
        await runner.cleanup()


# ---------------------------------------------------------------- hardening


async def _raw_request(url: str, target: str, body: bytes, extra: bytes = b"") -> bytes:
    """One HTTP/1.1 request with a request-target sent exactly as given (no client
    normalisation); the whole response."""
    reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
    writer.write(
        b"POST " + target.encode() + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\n"
        + extra
        + b"Content-Length: %d\r\n\r\n" % len(body)
        + body
    )
    await writer.drain()
    data = await reader.read()
    writer.close()
    return data


@pytest.mark.parametrize(
    "target",
    [
        "/v1/./chat/completions",
        "/v1/x/../chat/completions",
        "/v1/%2e/chat/completions",
        "//v1/chat/completions",
        "/v1/chat%2Fcompletions",
        "/./v1/completions",
    ],
)
async def test_non_canonical_completion_paths_cannot_bypass_admission(
    upstream: Upstream, sidecar_factory: SidecarFactory, target: str
) -> None:
    url, _ = await sidecar_factory(upstream.url, {"concurrency": {"maxRequests": 1}})
    resp = await _raw_request(url, target, json.dumps(CHAT).encode())
    head, _, body = resp.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400")
    assert b"x-kvgate-reason: invalid_request" in head.lower()
    assert json.loads(body)["error"]["code"] == "non_canonical_path"
    assert upstream.bodies == [] and not [p for p in upstream.paths if "completions" in p]


async def test_engine_crash_before_response_is_a_502_openai_error(
    upstream: Upstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    upstream.fail = "before_response"
    url, _ = await sidecar_factory(upstream.url, {})
    async with client.post(url + "/v1/chat/completions", json=CHAT) as r:
        assert r.status == 502
        assert r.headers["Retry-After"] == "1"
        err = await r.json()
    assert_openai_error(err)
    assert err["error"]["code"] == "upstream_error"
    g = await gauges(client, url)
    assert g['kvgate_upstream_errors_total{kind="upstream_error"}'] == 1
    assert g["kvgate_in_flight_requests"] == 0 and g["kvgate_upstream_up"] == 0


async def test_engine_crash_mid_stream_ends_with_an_error_event(
    upstream: Upstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    upstream.fail = "mid_stream"
    upstream.tokens = 10
    url, sc = await sidecar_factory(upstream.url, {})
    async with client.post(
        url + "/v1/chat/completions", json={**CHAT, "stream": True, "max_tokens": 50}
    ) as r:
        assert r.status == 200
        data = await r.read()
    events = [e for e in data.split(b"\n\n") if e]
    assert len(events) == 3
    assert json.loads(events[-1].removeprefix(b"data: "))["error"]["code"] == "upstream_error"
    assert sc.admission.stats().in_flight == 0 and sc.admission.stats().kv_reserved_tokens == 0


async def test_gzip_request_body_is_forwarded_decoded(
    upstream: Upstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    import gzip

    url, _ = await sidecar_factory(upstream.url, {})
    async with client.post(
        url + "/v1/chat/completions",
        data=gzip.compress(json.dumps({**CHAT, "max_tokens": 5}).encode()),
        headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
    ) as r:
        assert r.status == 200
    assert upstream.bodies == [{**CHAT, "max_tokens": 5}]
    assert "Content-Encoding" not in upstream.headers_seen[0]


async def test_client_disconnects_are_not_counted_as_upstream_errors(
    upstream: Upstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    upstream.tokens = 200
    upstream.token_delay = 0.01
    url, _ = await sidecar_factory(upstream.url, {})
    body = {**CHAT, "stream": True, "max_tokens": 500}
    await asyncio.gather(*(_disconnect_after(url, body, 300) for _ in range(10)))
    # Not a fixed sleep: until all ten were handled (counted, nothing left in flight).
    g = await poll_until_async(
        lambda: gauges(client, url),
        lambda g: (
            g["kvgate_client_disconnects_total"] == 10 and g["kvgate_in_flight_requests"] == 0
        ),
        10.0,
    )
    assert g["kvgate_client_disconnects_total"] == 10 and g["kvgate_in_flight_requests"] == 0
    assert not any(v for k, v in g.items() if k.startswith("kvgate_upstream_errors_total"))


async def test_long_prompt_is_not_refused_on_a_cautious_estimate(
    upstream: Upstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    url, sc = await sidecar_factory(upstream.url, {"capacity": {"kvCacheTokens": 4096}})
    text = "The quick brown fox jumps over the lazy dog. " * 300  # 13.5 KB of English
    body: dict[str, Any] = {
        "model": "m",
        "max_tokens": 100,
        "messages": [{"role": "user", "content": text}],
    }
    assert sc.counter.count(body).tokens > 4096  # the cautious estimate alone would refuse
    async with client.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
    # Truly too long (even optimistically): 400 naming the prompt, not max_tokens.
    body["messages"][0]["content"] = text * 3
    async with client.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 400
        assert (await r.json())["error"]["param"] == "messages"


async def test_max_tokens_clamped_by_the_cap_is_announced(
    upstream: Upstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    url, _ = await sidecar_factory(
        upstream.url, {"tenants": {"defaultMaxTokens": 64, "maxTokensCap": 128}}
    )
    async with client.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 5000}) as r:
        assert r.status == 200
        assert r.headers["x-kvgate-degraded"] == "max_tokens=128"
        assert r.headers["x-kvgate-reason"] == "max_tokens_cap"
    assert upstream.bodies[0]["max_tokens"] == 128


async def test_readyz_follows_the_model_server(
    upstream: Upstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    url, _ = await sidecar_factory(upstream.url, {})
    async with client.get(url + "/readyz") as r:
        assert r.status == 200
    dead, _ = await sidecar_factory(f"http://127.0.0.1:{free_port()}", {})
    async with client.get(dead + "/readyz") as r:
        assert r.status == 503
        assert "not answering" in await r.text()
