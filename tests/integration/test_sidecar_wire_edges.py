"""Edges of the sidecar's connections a new user hit, over real HTTP on loopback in front of a
recording upstream (issue 36, items 7 and 8): the 408 of slow headers carries an OpenAI error
body like every other refusal; a client that half-closes its side after its request still gets
the answer; a request whose body completes after the drain began is refused as the drain
refuses; a declared body over the limit is refused at once on every path; an engine that does
not answer its ``/metrics`` is logged when that changes, with a count, not every second."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvgate_agent.contract.policy import parse_policy
from kvgate_agent.sidecar.app import Sidecar, SidecarSettings
from kvgate_agent.sidecar.server import SidecarServer
from kvgate_bench.kit.toolkit import free_port, wait_until_async
from tests.conftest import ADMIN, ADMIN_URLS, SidecarFactory, gauges, policy_doc, raw_exchange
from tests.upstream import CHAT, Upstream


def header(head: bytes, name: str) -> str | None:
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == name.lower().encode():
            return v.strip().decode()
    return None


def chat_request(body: bytes | None = None, *, extra: bytes = b"") -> bytes:
    body = json.dumps(CHAT).encode() if body is None else body
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: kvgate\r\n"
        b"Content-Type: application/json\r\n%bContent-Length: %d\r\n\r\n%b"
        % (extra, len(body), body)
    )


# ---------------------------------------------------------------------------------------------
# 7. The 408 of slow headers has an OpenAI error body


async def test_the_408_of_slow_headers_has_an_openai_error_body(
    upstream: Upstream, sidecar_factory: SidecarFactory
) -> None:
    url, _ = await sidecar_factory(upstream.url, {}, header_timeout_seconds=0.3, **ADMIN)
    for base, client_port in ((url, True), (ADMIN_URLS[url], False)):
        head, body = await raw_exchange(base, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        assert head.startswith(b"HTTP/1.1 408 "), head
        assert header(head, "Content-Type") == "application/json", head
        assert header(head, "Content-Length") == str(len(body)), head
        assert header(head, "Connection") == "close", head
        error = json.loads(body)["error"]
        assert error["type"] == "invalid_request_error"
        assert error["code"] == "request_timeout"
        assert "too slowly" in error["message"]
        # The clients' port says the refusal as every other does; the admin port never does.
        assert (header(head, "x-kvgate-reason") == "invalid_request") is client_port, head
    assert upstream.bodies == []


# ---------------------------------------------------------------------------------------------
# 8. A half-closed client, a body that completes after SIGTERM, a declared 10 GB body


CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


async def half_closed_exchange(url: str, request: bytes) -> bytes:
    """Send ``request``, shut the sending side (``shutdown(SHUT_WR)``: a FIN, the receiving
    side open), and read until the sidecar closes; what came, less the interim ``100
    Continue`` a client skips (RFC 9110 §15.2: the sidecar's question whether the client is
    still there), at most one."""
    reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
    writer.write(request)
    await writer.drain()
    writer.write_eof()
    got = b""
    try:
        while chunk := await asyncio.wait_for(reader.read(65536), 10):
            got += chunk
    finally:
        writer.close()
    return got.removeprefix(CONTINUE)


@pytest.mark.parametrize(
    "what", ["json", "stream", "queued", "pipelined", "refused"], ids=lambda w: w
)
async def test_a_half_closed_client_gets_its_answer(
    what: str,
    upstream: Upstream,
    sidecar_factory: SidecarFactory,
    client: aiohttp.ClientSession,
) -> None:
    upstream.token_delay = 0.05
    url, sc = await sidecar_factory(upstream.url, {"concurrency": {"maxRequests": 1}})
    holder: asyncio.Future[Any] | None = None
    if what == "queued":  # behind a request holding the one slot
        upstream.hold = asyncio.Event()
        holder = asyncio.ensure_future(client.post(url + "/v1/chat/completions", json=CHAT))
        await wait_until_async(lambda: upstream.active == 1, 10, "the first request upstream")
    body = {**CHAT, "stream": what == "stream"}
    request = chat_request(json.dumps(body).encode())
    if what == "pipelined":
        request += b"GET /v1/models HTTP/1.1\r\nHost: kvgate\r\n\r\n"
    if what == "refused":
        request = chat_request(b'{"model": "m", "messages": []}')
    answer = asyncio.ensure_future(half_closed_exchange(url, request))
    if what == "queued":
        await wait_until_async(lambda: sc.admission.stats().queue_length == 1, 10, "queued")
        await asyncio.sleep(0.3)  # half-closed and queued: still waiting, not dropped
        assert sc.admission.stats().queue_length == 1 and not answer.done()
        assert upstream.hold is not None
        upstream.hold.set()
    got = await answer
    if holder is not None:
        (await holder).release()
    if what == "refused":
        assert got.startswith(b"HTTP/1.1 400 "), got[:200]
        assert upstream.bodies == []
    else:
        assert got.startswith(b"HTTP/1.1 200 "), got[:200]
    if what == "stream":
        assert b"data: [DONE]" in got and got.endswith(b"\r\n0\r\n\r\n"), got[-200:]
    if what == "pipelined":
        assert got.count(b"HTTP/1.1 200 ") == 2, got
    c = sc.admission.core
    await wait_until_async(lambda: c.stats().in_flight == 0, 10, "everything released")
    assert (c.stats().kv_reserved_tokens, c.stats().queue_length) == (0, 0)
    assert (await gauges(client, url))["kvgate_client_disconnects_total"] == 0


async def test_a_half_closed_client_of_the_sidecar_process_gets_its_answer(
    upstream: Upstream, sidecar_process: Any
) -> None:
    """The real ``kvgate-agent sidecar`` (on uvloop, which reports the client's FIN again when
    reading resumes): the answer still comes."""
    upstream.token_delay = 0.05
    proc = await asyncio.to_thread(sidecar_process, upstream.url, {})
    for stream in (False, True):
        got = await half_closed_exchange(
            proc.url, chat_request(json.dumps({**CHAT, "stream": stream}).encode())
        )
        assert got.startswith(b"HTTP/1.1 200 "), (stream, got[:200])
        assert not stream or got.endswith(b"\r\n0\r\n\r\n"), got[-200:]
    assert len(upstream.bodies) == 2


async def test_a_client_gone_while_queued_is_still_dropped_at_once(
    upstream: Upstream,
    sidecar_factory: SidecarFactory,
    client: aiohttp.ClientSession,
) -> None:
    """A FIN can be a half-close or a close: the sidecar asks (an interim ``100 Continue``, which
    a closed socket answers with a reset) and drops the queued request of a client that is gone,
    without waiting for its turn."""
    upstream.hold = asyncio.Event()
    url, sc = await sidecar_factory(upstream.url, {"concurrency": {"maxRequests": 1}})
    holder = asyncio.ensure_future(client.post(url + "/v1/chat/completions", json=CHAT))
    try:
        await wait_until_async(lambda: upstream.active == 1, 10, "the first request upstream")
        _, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
        writer.write(chat_request())
        await writer.drain()
        await wait_until_async(lambda: sc.admission.stats().queue_length == 1, 10, "queued")
        writer.close()  # the whole socket: a FIN, then a reset for whatever comes
        await wait_until_async(
            lambda: sc.admission.stats().queue_length == 0, 5, "the queued request dropped"
        )
        assert len(upstream.bodies) == 1
    finally:
        upstream.hold.set()
    (await holder).release()


async def test_a_body_completed_after_the_drain_began_is_refused_as_the_drain_refuses(
    upstream: Upstream, client: aiohttp.ClientSession
) -> None:
    sc = Sidecar(SidecarSettings(upstream=upstream.url, policy=parse_policy(policy_doc({}))))
    server = SidecarServer(sc)
    await server.start(("127.0.0.1", 0), None)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        request = chat_request()
        writer.write(request[:-5])  # the headers and most of the body
        await writer.drain()
        await asyncio.sleep(0.2)  # its handler runs, reading the body
        drain = asyncio.ensure_future(server.drain(10.0, asyncio.Event()))
        await wait_until_async(lambda: sc.pipeline.draining, 5, "the drain to begin")
        writer.write(request[-5:])  # the body completes after SIGTERM
        await writer.drain()
        got = await asyncio.wait_for(reader.read(65536), 10)
        writer.close()
        await asyncio.wait_for(drain, 15)
    finally:
        await server.cleanup()
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 "), got[:300]
    assert header(head, "Retry-After") == "1"
    assert header(head, "x-kvgate-reason") == "draining"
    assert header(head, "x-llm-d-request-dropped-reason") == "rejected-shutting-down"
    assert json.loads(body)["error"]["code"] == "draining"
    assert upstream.bodies == []
    stats = sc.admission.stats()
    assert (stats.in_flight, stats.kv_reserved_tokens, stats.queue_length) == (0, 0, 0)


@pytest.mark.parametrize(
    "target",
    [
        "POST /v1/chat/completions",
        "POST /tokenize",
        "OPTIONS /v1/chat/completions",
        "GET /version",
    ],
)
async def test_a_declared_body_over_the_limit_is_refused_at_once(
    target: str, upstream: Upstream, sidecar_factory: SidecarFactory
) -> None:
    """A 10 GB ``Content-Length`` gets 413 as soon as its headers are in, on a generation path,
    an allowlisted one or one passed through alike (it was held for the body deadline, 30 s,
    then 408 on the others), and never reaches the model server."""
    method, path = target.split()
    url, _ = await sidecar_factory(upstream.url, {}, body_timeout_seconds=30)
    reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
    started = time.monotonic()
    writer.write(
        b"%b %b HTTP/1.1\r\nHost: kvgate\r\nContent-Type: application/json\r\n"
        b"Content-Length: 10737418240\r\n\r\n{" % (method.encode(), path.encode())
    )
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    seconds = time.monotonic() - started
    length = int(header(head, "Content-Length") or 0)
    body = await asyncio.wait_for(reader.readexactly(length), 10)
    writer.close()
    assert head.startswith(b"HTTP/1.1 413 "), head
    assert json.loads(body)["error"]["code"] == "body_too_large"
    assert header(head, "x-kvgate-reason") == "invalid_request"
    assert seconds < 5, seconds  # at once (milliseconds), not at the body deadline (30 s)
    assert path not in upstream.paths


async def test_a_chunked_pass_through_body_over_the_limit_is_cut_with_413(
    upstream: Upstream, sidecar_factory: SidecarFactory
) -> None:
    url, _ = await sidecar_factory(upstream.url, {}, max_body_bytes=1000)
    chunk = b"x" * 600
    head, body = await raw_exchange(
        url,
        b"POST /tokenize HTTP/1.1\r\nHost: kvgate\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        + b"%x\r\n%b\r\n" % (len(chunk), chunk) * 3
        + b"0\r\n\r\n",
    )
    assert head.startswith(b"HTTP/1.1 413 "), head
    assert json.loads(body)["error"]["code"] == "body_too_large"


# ---------------------------------------------------------------------------------------------
# 8. An engine whose /metrics does not answer: logged on change, with a count


async def test_an_unreadable_engine_metrics_is_logged_on_change_with_a_count(
    sidecar_factory: SidecarFactory, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()  # nothing listens there yet: the engine is down
    spec = {"capacity": {"fromEngineMetrics": True, "kvCacheTokens": 4096}}
    with caplog.at_level(logging.DEBUG, logger="kvgate.sidecar"):
        await sidecar_factory(f"http://127.0.0.1:{port}", spec)
        await asyncio.sleep(3.5)  # the capacity is re-read every second while unknown

        def said(text: str) -> list[str]:
            return [r.getMessage() for r in caplog.records if text in r.getMessage()]

        down = said("cannot read engine /metrics")
        assert len(down) == 1, down  # once, not once a second
        assert [r.levelno for r in caplog.records if r.getMessage() in down] == [logging.WARNING]

        async def metrics(request: web.Request) -> web.Response:
            return web.Response(
                text='vllm:cache_config_info{block_size="16",num_gpu_blocks="1024"} 1\n'
                "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
                "vllm:kv_cache_usage_perc 0\n"
            )

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            await wait_until_async(lambda: said("answers again"), 10, "the recovery logged")
        finally:
            await runner.cleanup()
    (back,) = said("answers again")
    failed = int(back.split("after ")[1].split(" ")[0])
    assert failed >= 3, back  # the count of the reads that failed meanwhile
    assert len(said("cannot read engine /metrics")) == 1
