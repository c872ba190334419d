"""Faults around the sidecar, really injected over loopback: clients that abort (TCP reset) in
every phase of a request or send too slowly (slow-loris), and model servers that refuse,
reset, hang, fail or send garbage. After each: every reservation, slot and queue entry is
free, and the upstream saw its streams cancelled.

``KVGATE_FAULTS_ABORTS`` sets how many client aborts the abort test injects (default 1000).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import socket
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from kvgate_agent.contract.policy import parse_policy
from kvgate_agent.sidecar.app import Sidecar, SidecarSettings
from kvgate_agent.sidecar.edge.client_listener import KEEPALIVE_TIMEOUT_S, ClientListener
from kvgate_agent.sidecar.upstream import relay
from kvgate_bench.kit.toolkit import free_port, poll_until_async, wait_until_async
from tests.conftest import gauges, policy_doc, raw_exchange, serve_sidecar
from tests.upstream import CHAT, Faulty, serve_faulty

ABORTS = int(os.environ.get("KVGATE_FAULTS_ABORTS", "1000"))
STREAM = {**CHAT, "stream": True, "max_tokens": 100}


@pytest.fixture
async def faulty() -> AsyncIterator[Faulty]:
    async with serve_faulty() as up:
        yield up


Start = Callable[..., Awaitable[tuple[str, Sidecar]]]


@pytest.fixture
async def start() -> AsyncIterator[Start]:
    """``url, sidecar = await start(upstream, spec, **settings)``: a sidecar served the way
    the CLI serves it (:meth:`Sidecar.runner`: header deadline included)."""
    runners: list[Any] = []

    async def make(upstream: str, spec: dict[str, Any], **settings: Any) -> tuple[str, Sidecar]:
        sc = Sidecar(
            SidecarSettings(upstream=upstream, policy=parse_policy(policy_doc(spec)), **settings)
        )
        return await serve_sidecar(sc, runners), sc

    yield make
    for r in runners:
        await r.cleanup()


async def all_free(client: aiohttp.ClientSession, url: str, sc: Sidecar) -> dict[str, float]:
    """Wait (up to 10 s) until nothing is in flight, reserved or queued; return the gauges."""
    g = await poll_until_async(
        lambda: gauges(client, url),
        lambda g: (
            g["kvgate_in_flight_requests"] == 0
            and g["kvgate_queue_length"] == 0
            and g["kvgate_kv_reserved_tokens"] == 0
        ),
        10.0,
    )
    c = sc.admission.core
    assert (g["kvgate_in_flight_requests"], g["kvgate_queue_length"]) == (0, 0)
    assert (g["kvgate_kv_reserved_tokens"], c.stats().in_flight, c.stats().queue_length) == (
        0,
        0,
        0,
    )
    assert c.stats().kv_reserved_tokens == 0
    return g


# ---------------------------------------------------------------- clients that abort


def request_bytes(body: dict[str, Any], fault: str = "ok", tenant: str = "t") -> bytes:
    raw = json.dumps(body).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"x-test-fault: %s\r\nx-kvgate-tenant: %s\r\nContent-Length: %d\r\n\r\n%s"
        % (fault.encode(), tenant.encode(), len(raw), raw)
    )


def reset(writer: asyncio.StreamWriter) -> None:
    """Abort the connection with a TCP RST (SO_LINGER 0), as a crashed client would."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def read_until(reader: asyncio.StreamReader, marker: bytes) -> bytes:
    """Read until ``marker`` has arrived (bytes read so far)."""
    got = b""
    while marker not in got:
        part = await reader.read(65536)
        assert part, f"connection closed before {marker!r}: {got[-300:]!r}"
        got += part
    return got


async def test_1000_clients_aborting_in_every_phase_free_everything(
    faulty: Faulty, start: Start, client: aiohttp.ClientSession
) -> None:
    """``ABORTS`` streams, one fifth per phase, each aborted with a TCP reset: while sending
    the request headers, while the model server has not answered, while queued, after the
    response headers but before the first token, and mid-stream. Then nothing is held, and
    every request that reached the model server was cancelled there."""
    per = ABORTS // 5
    url, sc = await start(
        faulty.url,
        {
            "capacity": {"kvCacheTokens": 10_000_000},
            "concurrency": {"maxRequests": per},
            "queue": {"maxLength": 10 * per, "maxWaitSeconds": 120},
        },
    )
    port = int(url.rsplit(":", 1)[1])

    async def connect() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", port)

    async def open_many(n: int, payload: bytes, marker: bytes | None) -> list[asyncio.StreamWriter]:
        async def one() -> asyncio.StreamWriter:
            reader, writer = await connect()
            writer.write(payload)
            await writer.drain()
            if marker is not None:
                await read_until(reader, marker)
            return writer

        return list(await asyncio.gather(*(one() for _ in range(n))))

    # 1. Request headers half sent: nothing may reach the model server.
    half = request_bytes(STREAM)[:40]
    for w in await open_many(per, half, None):
        reset(w)
    # 2. Admitted, the model server has not answered yet.
    ws = await open_many(per, request_bytes(STREAM, "hang_before_headers"), None)
    await wait_until_async(lambda: faulty.active == per, 30, "every request upstream")
    for w in ws:
        reset(w)
    await wait_until_async(lambda: faulty.active == 0, 10, "the upstream to see them go")
    # 3. Queued behind ``per`` long streams that hold every slot.
    # 30 s streams: they still hold every slot while the queue fills on a busy machine.
    holders = await open_many(per, request_bytes(STREAM, "longer"), b"data: ")
    queued = await open_many(per, request_bytes(STREAM, "ok"), None)
    await wait_until_async(
        lambda: sc.admission.stats().queue_length == per, 30, "the queue to fill"
    )
    for w in queued:
        reset(w)
    await wait_until_async(lambda: sc.admission.stats().queue_length == 0, 10, "the queue to empty")
    for w in holders:  # the holders are mid-stream: the fifth phase
        reset(w)
    # 4. Response headers sent, no token yet.
    ws = await open_many(per, request_bytes(STREAM, "hang_before_first_token"), b"\r\n\r\n")
    for w in ws:
        reset(w)

    g = await all_free(client, url, sc)
    await wait_until_async(lambda: faulty.active == 0, 10, "every upstream stream to end")
    print(
        f"{5 * per} resets: {faulty.reached} reached the model server, {faulty.cancelled} "
        f"cancelled there; in flight {g['kvgate_in_flight_requests']:g}, queued "
        f"{g['kvgate_queue_length']:g}, KV reserved {g['kvgate_kv_reserved_tokens']:g}"
    )
    # Only phases 2, 3 (the holders) and 4 reached the model server; all were cancelled there.
    assert faulty.reached == 3 * per
    assert faulty.cancelled == 3 * per and faulty.finished == 0
    assert g["kvgate_client_disconnects_total"] == 3 * per
    assert not any(v for k, v in g.items() if k.startswith("kvgate_upstream_errors_total"))
    async with client.post(url + "/v1/chat/completions", json=STREAM) as r:
        assert r.status == 200  # and it still serves
        assert (await r.read()).endswith(b"data: [DONE]\n\n")


# ---------------------------------------------------------------- slow clients (slow-loris)


async def test_slow_loris_is_cut_while_legitimate_traffic_is_served(
    faulty: Faulty, start: Start, client: aiohttp.ClientSession
) -> None:
    """Slow-header and slow-body connections get 408 and are closed at their deadline (1 s
    here; 10 s and 30 s by default), silent ones are closed, while a well-behaved client
    keeps getting 200s; a kept-alive connection idle past the header deadline still serves
    its next request."""
    url, sc = await start(faulty.url, {}, header_timeout_seconds=1.0, body_timeout_seconds=1.0)
    port = int(url.rsplit(":", 1)[1])
    stop = asyncio.Event()
    served: list[int] = []

    async def good_client() -> None:
        async with aiohttp.ClientSession() as s:
            while not stop.is_set():
                async with s.post(url + "/v1/chat/completions", json=CHAT) as r:
                    served.append(r.status)
                    await r.read()
                await asyncio.sleep(0.05)

    async def slow(kind: str) -> tuple[float, bytes]:
        """Trickle one request; return (seconds until the sidecar closed, what it sent)."""
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        t0 = time.monotonic()
        payload = request_bytes(CHAT)
        head, _, body = payload.partition(b"\r\n\r\n")
        if kind == "body":
            writer.write(head + b"\r\n\r\n")
        trickle = {"headers": head, "body": body, "silent": b""}[kind]

        async def drip() -> None:
            for i in range(len(trickle)):  # 0.5 s a byte: the whole trickle takes over 30 s
                writer.write(trickle[i : i + 1])
                await asyncio.sleep(0.5)

        async def read_all() -> bytes:
            # Chunk by chunk: the sidecar closes with the rest of the trickle unread, so the
            # kernel may answer the next dripped byte with a reset; what came before it counts.
            got = b""
            try:
                while chunk := await reader.read(65536):
                    got += chunk
            except ConnectionResetError:
                pass
            return got

        dripping = asyncio.ensure_future(drip())
        got = await asyncio.wait_for(read_all(), 30)
        dripping.cancel()
        writer.close()
        return time.monotonic() - t0, got

    legit = asyncio.ensure_future(good_client())
    kinds = ["headers"] * 40 + ["body"] * 40 + ["silent"] * 20
    results = await asyncio.gather(*(slow(k) for k in kinds))
    # Served while the slow connections were held: a count reached, not a rate (a sidecar
    # starved by them would serve none).
    served_meanwhile = len(served)
    assert served_meanwhile >= 1
    # A kept-alive connection, idle for longer than the header deadline, is not cut.
    async with aiohttp.ClientSession() as s:
        for _ in range(2):
            async with s.post(url + "/v1/chat/completions", json=CHAT) as r:
                assert r.status == 200
            await asyncio.sleep(1.5)
    # However slow the machine, the well-behaved client gets 10 answers (not: within a time).
    await wait_until_async(lambda: len(served) >= 10, 60, "10 well-behaved requests")
    stop.set()
    await legit

    for kind in ("headers", "body", "silent"):
        held = [sec for k, (sec, _) in zip(kinds, results, strict=True) if k == kind]
        print(f"slow {kind}: {len(held)} connections held {min(held):.2f}-{max(held):.2f} s")
    print(
        f"well-behaved client: {served_meanwhile} requests while they were held, "
        f"{len(served)} in all, statuses {set(served)}"
    )
    for kind, (seconds, got) in zip(kinds, results, strict=True):
        # Cut at the deadline (1 s; 2 s for a body, aiohttp lingers 1 s), not held until the
        # trickle ends (30 s): the bound is the point, so it is generous for a busy machine.
        assert seconds < 12, f"{kind}: held {seconds:.1f} s"
        assert got.startswith(b"HTTP/1.1 408") if kind != "silent" else got == b"", (
            kind,
            got[:100],
        )
    assert served and set(served) == {200}
    assert len(served) >= 10
    g = await all_free(client, url, sc)
    assert g['kvgate_client_timeouts_total{phase="headers"}'] == 60
    assert g['kvgate_client_timeouts_total{phase="body"}'] == 40
    assert faulty.faults == ["ok"] * faulty.reached  # no slow request reached the model
    assert faulty.reached == len(served) + 2


@pytest.mark.parametrize("first", ["GET", "POST"])
async def test_a_pipelined_partial_request_gets_the_header_deadline(
    faulty: Faulty, start: Start, first: str
) -> None:
    """A complete request followed, in the same write, by the first bytes of a next one that
    never completes: the first is answered, the second gets 408 at the header deadline (1 s
    here) and the connection is closed, not held until the keep-alive timeout. A complete
    request alone is kept alive past that deadline."""
    url, _ = await start(faulty.url, {}, header_timeout_seconds=1.0)
    port = int(url.rsplit(":", 1)[1])
    complete = (
        request_bytes(CHAT) if first == "POST" else b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.monotonic()
    writer.write(complete + b"GET /healthz HTTP/1.1\r\nHo")
    got = await asyncio.wait_for(reader.read(), 30)  # until the sidecar closes
    held = time.monotonic() - t0
    writer.close()
    assert got.startswith(b"HTTP/1.1 200") and b"HTTP/1.1 408" in got, got[-200:]
    # Closed at the 1 s header deadline, not held until the keep-alive timeout (75 s): the
    # bound is the point, so it is generous (10 s) for a busy machine.
    assert held < 10, held
    # control: the complete request alone leaves an idle kept-alive connection open
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(complete)
    await read_until(reader, b"HTTP/1.1 200")
    await asyncio.sleep(1.6)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert (await asyncio.wait_for(reader.read(), 10)).count(b"HTTP/1.1 200") >= 1
    writer.close()


async def test_a_slow_passthrough_body_is_cut_at_the_body_deadline(
    faulty: Faulty, start: Start, client: aiohttp.ClientSession
) -> None:
    """A body on an allowlisted path (``/tokenize``) that stops half-way gets 408 at the body
    deadline (1 s here) and is closed; its upstream request, under way, is aborted (the model
    server never gets the whole body)."""
    url, sc = await start(faulty.url, {}, header_timeout_seconds=2.0, body_timeout_seconds=1.0)
    reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
    t0 = time.monotonic()
    writer.write(
        b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 100\r\n\r\n{"prompt":'
    )
    got = await asyncio.wait_for(read_until(reader, b"request_timeout"), 15)
    answered = time.monotonic() - t0
    got += await asyncio.wait_for(reader.read(), 15)  # closed (after lingering, as aiohttp does)
    writer.close()
    assert got.startswith(b"HTTP/1.1 408"), got[:200]
    # At the 1 s body deadline, not when the 15 s wait gives up: the bound is the point, so it
    # is generous (8 s) for a busy machine.
    assert 0.9 < answered < 8, answered
    g = await all_free(client, url, sc)
    assert g['kvgate_client_timeouts_total{phase="body"}'] == 1
    assert faulty.reached == 0


async def test_a_request_ended_at_the_drain_deadline_after_it_was_sent_is_charged(
    faulty: Faulty, start: Start, client: aiohttp.ClientSession
) -> None:
    """The drain deadline (``Forwarder.end_all``) cancels a request the model server is
    working on (it hangs before its headers): the client gets 503 and the prompt is charged,
    as the engine prefilled it."""
    url, sc = await start(faulty.url, {})
    pending = asyncio.ensure_future(
        client.post(
            url + "/v1/chat/completions", json=CHAT, headers={"x-test-fault": "hang_before_headers"}
        )
    )
    await wait_until_async(lambda: faulty.reached == 1, 10, "the request to reach the upstream")
    await sc.forwarder.end_all(grace=5.0)
    r = await asyncio.wait_for(pending, 10)
    assert r.status == 503 and r.headers["x-kvgate-reason"] == "draining"
    assert (await r.json())["error"]["code"] == "draining"  # as a queued request's refusal
    g = await all_free(client, url, sc)
    assert g['kvgate_tokens_total{kind="prompt",tenant="anonymous"}'] > 0


async def test_malformed_http_gets_an_openai_error_and_never_reaches_the_model(
    faulty: Faulty, start: Start
) -> None:
    """Requests the server leg's parser refuses before any handler runs (request smuggling with both
    Content-Length and Transfer-Encoding, a broken header line, a bad chunk size) get a 4xx
    with an OpenAI error body and a closed connection; idle kept-alive connections are bounded
    (75 s, not aiohttp's 3630 s)."""
    url, sc = await start(faulty.url, {})
    raw = json.dumps(CHAT).encode()
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    cases = {
        "cl+te": head
        + b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
        % (len(raw), len(raw), raw),
        "header line": head + b"Bad Header\r\nContent-Length: %d\r\n\r\n%s" % (len(raw), raw),
        "chunk size": head + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n%s\r\n0\r\n\r\n" % raw,
    }
    for name, payload in cases.items():
        got, raw_body = await raw_exchange(url, payload)
        status = got.partition(b"\r\n")[0]
        assert status.startswith(b"HTTP/1.") and b" 400 " in status, (name, got[:200])
        body = json.loads(raw_body)
        assert body["error"]["code"] == "malformed_http", (name, body)
        assert body["error"]["type"] == "invalid_request_error"
    assert faulty.reached == 0
    async with aiohttp.ClientSession() as client:
        await all_free(client, url, sc)
        async with client.post(url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 200  # the sidecar serves on
    assert faulty.reached == 1
    keepalive = inspect.signature(ClientListener).parameters["keepalive_timeout"].default
    assert keepalive == KEEPALIVE_TIMEOUT_S == 75.0


# ---------------------------------------------------------------- model servers that misbehave

#: fault, stream?, expected status, expected error code (in the body or the last SSE event).
UPSTREAM_FAULTS = [
    ("refused", False, 502, "upstream_unreachable"),
    ("refused", True, 502, "upstream_unreachable"),
    ("reset_in_body", False, 502, "upstream_error"),
    ("reset_mid_stream", True, 200, "upstream_error"),
    ("hang_before_headers", False, 504, "upstream_timeout"),
    ("hang_before_headers", True, 504, "upstream_timeout"),
    ("hang_before_first_token", True, 200, "upstream_timeout"),
    ("status_500", True, 500, None),  # an OpenAI error body: relayed as it is
    ("status_503_html", False, 503, "upstream_error"),  # HTML: an OpenAI body instead
    ("garbage", True, 200, None),
    ("endless_event", True, 200, "upstream_error"),
    ("endless_event", False, 502, "upstream_error"),  # over the cap on a non-streamed answer
]


#: The ``kvgate_upstream_errors_total`` kind each fault counts (none for garbage).
ERROR_KIND = {
    "refused": "connect",
    "reset_in_body": "upstream_error",
    "reset_mid_stream": "upstream_error",
    "hang_before_headers": "timeout",
    "hang_before_first_token": "timeout",
    "status_500": "status_5xx",
    "status_503_html": "status_5xx",
    "endless_event": "upstream_error",
}


@pytest.mark.parametrize(("fault", "stream", "status", "code"), UPSTREAM_FAULTS)
async def test_upstream_faults_map_to_a_clear_answer_and_free_everything(
    faulty: Faulty,
    start: Start,
    client: aiohttp.ClientSession,
    fault: str,
    stream: bool,
    status: int,
    code: str | None,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(relay, "MAX_UPSTREAM_BODY_BYTES", 4 * 1024 * 1024)  # 64 MiB by default
    upstream = f"http://127.0.0.1:{free_port()}" if fault == "refused" else faulty.url
    url, sc = await start(
        upstream,
        {"capacity": {"kvCacheTokens": 100_000}, "concurrency": {"maxRequests": 4}},
        upstream_timeout=1.0,
    )
    body = {**CHAT, "stream": stream, "max_tokens": 100}
    t0 = time.monotonic()
    async with client.post(
        url + "/v1/chat/completions", json=body, headers={"x-test-fault": fault}
    ) as r:
        assert r.status == status
        assert r.headers["x-kvgate-decision"] == "admitted"
        data = await r.read()  # ends cleanly: no payload error
    elapsed = time.monotonic() - t0
    print(f"{fault} (stream={stream}): {r.status} {code} in {elapsed:.2f} s")
    assert elapsed < 10
    if code is not None and status != 200:
        err = json.loads(data)["error"]
        assert err["code"] == code and err["message"]
        assert r.headers["x-kvgate-reason"] == code
        assert r.headers.get("Retry-After") == (None if status == 503 else "1")
    elif status >= 500:
        assert json.loads(data)["error"]["message"] == "engine died"
    elif code is not None:
        last = [e for e in data.split(b"\n\n") if e][-1]
        assert json.loads(last.removeprefix(b"data: "))["error"]["code"] == code
    if fault == "status_503_html":  # replaced for the client, kept in the log
        assert "the model server answered 503: b'<html>" in caplog.text
    g = await all_free(client, url, sc)
    assert g["kvgate_client_disconnects_total"] == 0
    errors = {k: v for k, v in g.items() if k.startswith("kvgate_upstream_errors_total") and v}
    assert errors == (
        {f'kvgate_upstream_errors_total{{kind="{ERROR_KIND[fault]}"}}': 1.0}
        if fault in ERROR_KIND
        else {}
    )
    if fault != "refused":
        await wait_until_async(lambda: faulty.active == 0, 5, "the upstream request to end")
    if fault == "endless_event":  # cut at 1 MiB: the model server's stream was cancelled
        assert faulty.cancelled == 1 and len(data) < 2 * 1024 * 1024
    async with client.post(url + "/v1/chat/completions", json=CHAT) as r:
        # The sidecar itself is fine: it answers the next request (200, or 502 when refused).
        assert r.status == (502 if fault == "refused" else 200)
