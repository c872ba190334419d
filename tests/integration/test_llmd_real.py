"""The real sidecar CLI in front of the real llm-d inference simulator, driven with the official
``openai`` client, compared byte for byte with talking to the simulator directly.

Facts about llm-d-inference-sim v0.10.2 these tests rely on (read from its source and observed):

- ``--mode echo`` answers the prompt (completions) or the last message (chat) verbatim, one
  stream chunk per token; ``max_tokens`` below the echo length only turns ``finish_reason`` into
  ``"length"``, it does not truncate the text.
- ``id`` (random uuid) and ``created`` (unix seconds) are the only per-request values.
- Request metrics (``vllm:request_success_total``, ``vllm:generation_tokens_total``,
  ``vllm:prompt_tokens_total``, ``vllm:request_params_max_tokens`` - observed only when the request
  carries max_tokens) are recorded together, asynchronously, when a request finishes; requests the
  simulator refuses (400) record nothing, so ``--log-http`` is the witness of what reached it.
- It does not abort generation when its HTTP client goes away: the stream writer fails and logs
  ``Sending stream chunk failed``, but the worker keeps the request "running" until the last
  token (see ``test_disconnect_simulator_keeps_running_request``).
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from kvgate_bench.kit.processes import Proc
from kvgate_bench.kit.toolkit import Sample, parse_samples, poll_until, sample_sum

pytestmark = pytest.mark.llmd

MODEL = "test-model"
TENANT = "acct"
Start = Callable[..., Proc]

_ID = re.compile(rb'"id":"[^"]*"')
_CREATED = re.compile(rb'"created":\d+')


# --------------------------------------------------------------------------------------- helpers


def normalize(body: bytes) -> bytes:
    """Blank the server-generated ``id`` and ``created`` values, nothing else."""
    return _CREATED.sub(b'"created":0', _ID.sub(b'"id":"X"', body))


def client(base: str, retries: int = 0, tenant: str = TENANT) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=base + "/v1",
        api_key="x",
        max_retries=retries,
        timeout=20.0,
        default_headers={"x-kvgate-tenant": tenant},
    )


def scrape(url: str) -> list[Sample]:
    """All samples of a Prometheus text exposition at ``url``."""
    return parse_samples(_get(url))


value = sample_sum  # the sum of the samples ``name`` with ``labels`` (0 when none)


def has_sample(samples: list[Sample], name: str) -> bool:
    return any(s.name == name for s in samples)


def _conn(url: str) -> http.client.HTTPConnection:
    hostport = url.split("/")[2]
    host, port = hostport.rsplit(":", 1)
    return http.client.HTTPConnection(host, int(port), timeout=10)


def post(
    base: str,
    path: str,
    body: bytes,
    headers: dict[str, str] | None = None,
    *,
    chunked: bool = False,
) -> tuple[int, http.client.HTTPMessage, bytes]:
    """POST raw bytes; returns (status, headers, body)."""
    conn = _conn(base)
    try:
        hdrs = {"Content-Type": "application/json", "x-kvgate-tenant": TENANT, **(headers or {})}
        if chunked:
            conn.request("POST", path, body=iter([body]), headers=hdrs, encode_chunked=True)
        else:
            conn.request("POST", path, body=body, headers=hdrs)
        resp = conn.getresponse()
        return resp.status, resp.headers, resp.read()
    finally:
        conn.close()


def sim_quiesced(sim: Proc, successes: float, timeout: float = 5.0) -> list[Sample]:
    """Simulator metrics once ``successes`` requests have been recorded (they are recorded
    asynchronously after the response); scraped once more after that, so every counter the
    simulator updates before the success counter is in too."""
    samples = poll_until(
        lambda: scrape(sim.url + "/metrics"),
        lambda got: value(got, "vllm:request_success_total") >= successes,
        timeout,
    )
    got = value(samples, "vllm:request_success_total")
    assert got == successes, f"simulator recorded {got} successful requests, expected {successes}"
    return scrape(sim.url + "/metrics")


def poll(
    check: Callable[[], tuple[bool, Any]], timeout: float, interval: float = 0.02
) -> tuple[bool, Any, float]:
    """Call ``check`` until it says done or ``timeout`` passes: (done, last detail, seconds)."""
    t0 = time.monotonic()
    while True:
        done, detail = check()
        elapsed = time.monotonic() - t0
        if done or elapsed > timeout:
            return done, detail, elapsed
        time.sleep(interval)


def sidecar_gauges(sidecar: Proc) -> dict[str, float]:
    s = scrape(sidecar.url + "/kvgate/metrics")
    return {
        "in_flight": value(s, "kvgate_in_flight_requests"),
        "kv_reserved": value(s, "kvgate_kv_reserved_tokens"),
        "completion": value(s, "kvgate_tokens_total", kind="completion", tenant=TENANT),
        "prompt": value(s, "kvgate_tokens_total", kind="prompt", tenant=TENANT),
        "client_disconnects": value(s, "kvgate_client_disconnects_total"),
    }


def established_to(port: int) -> int:
    """IPv4/IPv6 TCP connections in state ESTABLISHED whose remote port is ``port``: on loopback,
    the client ends of connections to a server listening on ``port``."""
    n = 0
    for f in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(f).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "01" and int(fields[2].rsplit(":", 1)[1], 16) == port:
                n += 1
    return n


_LOGGED_POST = re.compile(
    r'"HTTP request" method="POST" requestURI="/v1/[^"]*".*?body="((?:[^"\\]|\\.)*)"', re.S
)


def http_requests_logged(sim: Proc) -> int:
    """Requests to /v1/ the simulator logged (``--log-http``)."""
    return len(re.findall(r'"HTTP request" method="POST" requestURI="/v1/', sim.log.read_text()))


def logged_request_bodies(sim: Proc) -> list[dict[str, Any]]:
    """The JSON bodies of the POSTs to /v1/ the simulator logged (``--log-http``), in order.
    The log quotes them Go-style; the prompts here are ASCII."""
    return [
        json.loads(m.encode().decode("unicode_escape"))
        for m in _LOGGED_POST.findall(sim.log.read_text())
    ]


def sse_payloads(body: bytes) -> list[Any]:
    """The ``data:`` payloads of an SSE body: JSON objects, ``"[DONE]"`` kept as a string."""
    assert body.endswith(b"\n\n"), body[-200:]
    out: list[Any] = []
    for event in body.split(b"\n\n")[:-1]:
        assert event.startswith(b"data: "), event
        data = event.removeprefix(b"data: ")
        out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


def assert_openai_error(body: bytes, status: int) -> dict[str, Any]:
    doc = json.loads(body)
    assert set(doc) == {"error"}, doc
    err: dict[str, Any] = doc["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    if status == 429:
        assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded", err
    else:
        assert err["type"] == "invalid_request_error", err
    return err


# ------------------------------------------------------------------- 1 + 2: byte-identical bodies

PROMPT = "the quick brown fox jumps over the lazy dog again and again"


def _request(kind: str, mode: str) -> dict[str, Any]:
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 64}
    if kind == "chat":
        kw["messages"] = [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": PROMPT},
        ]
    else:
        kw["prompt"] = PROMPT
    if mode != "plain":
        kw["stream"] = True
    if mode == "stream+usage":
        kw["stream_options"] = {"include_usage": True}
    return kw


def _raw(c: openai.OpenAI, kind: str, req: dict[str, Any]) -> tuple[bytes, Any]:
    """(body bytes, headers) of one request made with the openai client."""
    api = c.chat.completions if kind == "chat" else c.completions
    if req.get("stream"):
        with api.with_streaming_response.create(**req) as resp:
            assert resp.status_code == 200
            return b"".join(resp.iter_bytes()), resp.headers
    raw = api.with_raw_response.create(**req)
    assert raw.status_code == 200
    return raw.content, raw.headers


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_responses_byte_identical_and_accounted(
    kind: str, llmd_sim: Start, sidecar_process: Start
) -> None:
    sim = llmd_sim("--mode", "echo", "--inter-token-latency", "2ms", "--log-http")
    sidecar = sidecar_process(sim.url, {})
    direct, via = client(sim.url), client(sidecar.url)
    modes = ["plain", "stream", "stream+usage"]

    # Phase 1: straight to the simulator.
    expected: dict[str, tuple[bytes, Any]] = {
        m: _raw(direct, kind, _request(kind, m)) for m in modes
    }
    before = sim_quiesced(sim, len(modes))

    # Phase 2: the same requests through the sidecar, bytes then parsed objects.
    sidecar_requests = 0
    for mode in modes:
        body, headers = _raw(via, kind, _request(kind, mode))
        sidecar_requests += 1
        want_body, want_headers = expected[mode]
        assert headers["x-kvgate-decision"] == "admitted"
        assert headers["content-type"] == want_headers["content-type"]
        assert normalize(body) == normalize(want_body), mode
        # The normalization only blanked server-generated values: ids and timestamps are there.
        assert normalize(body) != body

        if mode == "plain":
            doc = json.loads(body)
            assert doc["usage"]["completion_tokens"] > 0
            continue
        events = sse_payloads(body)
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        usage_chunks = [e for e in events[:-1] if e["choices"] == []]
        if mode == "stream":
            # The sidecar asked upstream for usage; the client did not and must not see it.
            assert usage_chunks == []
            assert all(e["usage"] is None for e in events[:-1])
        else:
            assert len(usage_chunks) == 1 and usage_chunks[0]["usage"]["completion_tokens"] > 0
            assert events[-2] is usage_chunks[0]

    # What reached the simulator: the client's request, plus include_usage on every stream (the
    # sidecar's accounting needs it), nothing else.
    upstream = logged_request_bodies(sim)
    assert len(upstream) == 2 * len(modes)
    for mode, sent, got in zip(modes, upstream[: len(modes)], upstream[len(modes) :], strict=True):
        assert sent == _request(kind, mode)
        if mode == "stream":
            assert got == {**sent, "stream_options": {"include_usage": True}}
        else:
            assert got == sent

    # Parsed objects through the official client.
    if kind == "chat":
        chat = via.chat.completions.create(**_request(kind, "plain"))
        assert chat.choices[0].message.content == PROMPT
        assert chat.choices[0].finish_reason == "stop"
        assert chat.usage is not None and chat.usage.completion_tokens == len(PROMPT.split())
        chunks = list(via.chat.completions.create(**_request(kind, "stream")))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = [c for c in chunks if c.usage is not None]
        chunks_u = list(via.chat.completions.create(**_request(kind, "stream+usage")))
    else:
        cmpl = via.completions.create(**_request(kind, "plain"))
        assert cmpl.choices[0].text == PROMPT
        assert cmpl.usage is not None and cmpl.usage.completion_tokens == len(PROMPT.split())
        chunks = list(via.completions.create(**_request(kind, "stream")))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        usage = [c for c in chunks if c.usage is not None]
        chunks_u = list(via.completions.create(**_request(kind, "stream+usage")))
    sidecar_requests += 3
    assert text == PROMPT
    assert usage == [] and all(c.choices for c in chunks)
    usage_u = [c for c in chunks_u if c.usage is not None]
    assert len(usage_u) == 1 and usage_u[0].choices == []
    assert usage_u[0].usage is not None
    assert usage_u[0].usage.completion_tokens == len(PROMPT.split())

    # Accounting: the sidecar settled exactly what the simulator generated for its requests.
    after = sim_quiesced(sim, len(modes) + sidecar_requests)
    generated = value(after, "vllm:generation_tokens_total") - value(
        before, "vllm:generation_tokens_total"
    )
    prompted = value(after, "vllm:prompt_tokens_total") - value(before, "vllm:prompt_tokens_total")
    assert generated == sidecar_requests * len(PROMPT.split())

    def settled() -> tuple[bool, dict[str, float]]:
        g = sidecar_gauges(sidecar)
        ok = g["completion"] == generated and g["in_flight"] == 0 and g["kv_reserved"] == 0
        return ok, g

    ok, g, _ = poll(settled, timeout=10.0)  # an event awaited, not a bound on time
    assert ok, f"sidecar {g}, simulator generated {generated} (prompt {prompted})"
    assert g["prompt"] == prompted
    text_metrics = _get(sidecar.url + "/kvgate/metrics")
    assert "kvgate_in_flight_requests 0.0" in text_metrics
    assert "kvgate_kv_reserved_tokens 0.0" in text_metrics


def _get(url: str) -> str:
    conn = _conn(url)
    try:
        conn.request("GET", "/" + url.split("/", 3)[3])
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def test_passthrough_models_endpoint(llmd_sim: Start, sidecar_process: Start) -> None:
    sim = llmd_sim("--mode", "echo")
    sidecar = sidecar_process(sim.url, {})
    direct = client(sim.url).models.with_raw_response.list()
    via = client(sidecar.url).models.with_raw_response.list()
    assert via.headers["x-kvgate-decision"] == "passthrough"
    assert normalize(via.content) == normalize(direct.content)
    assert [m.id for m in via.parse()] == [MODEL]


# ------------------------------------------------------------------ 3: 429, Retry-After, retries

TIGHT = {
    "rateLimits": [{"name": "tight", "per": "Tenant", "requestsPerMinute": 60, "burstRequests": 2}],
    "overload": {"actions": ["Reject"]},
}


def test_rate_limited_429_then_openai_client_retries(
    llmd_sim: Start, sidecar_process: Start
) -> None:
    sim = llmd_sim("--mode", "echo")
    sidecar = sidecar_process(sim.url, TIGHT)
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    ).encode()

    def drain(tenant: str) -> None:
        """Spend ``tenant``'s burst of 2: each phase below then runs within milliseconds of an
        empty bucket, far from the 1 s refill, however slow the machine."""
        for _ in range(2):
            status, headers, data = post(
                sidecar.url, "/v1/chat/completions", body, {"x-kvgate-tenant": tenant}
            )
            assert status == 200, data
            assert headers["x-kvgate-decision"] == "admitted"

    drain(TENANT)
    status, headers, data = post(sidecar.url, "/v1/chat/completions", body)
    assert status == 429, data
    assert headers["x-kvgate-decision"] == "rejected"
    assert_openai_error(data, 429)
    retry_after = headers["Retry-After"]
    assert re.fullmatch(r"[1-9][0-9]*", retry_after), retry_after
    # One request refills in 60 s / 60 = 1 s, and the bucket lacks at most one request.
    assert int(retry_after) == 1
    policy = headers["RateLimit-Policy"]
    assert re.fullmatch(r'"tight";q=2;w=\d+;qu="[a-z]+"', policy), policy
    assert headers["RateLimit"] == f'"tight";r=0;t={retry_after}'
    # Another tenant has its own bucket.
    status, headers, _ = post(sidecar.url, "/v1/chat/completions", body, {"x-kvgate-tenant": "b"})
    assert status == 200 and headers["x-kvgate-decision"] == "admitted"

    # Without retries the client surfaces the 429 as RateLimitError with the OpenAI body.
    drain("no-retry")
    with pytest.raises(openai.RateLimitError) as info:
        client(sidecar.url, tenant="no-retry").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    assert info.value.code == "rate_limit_exceeded"
    assert info.value.response.headers["x-kvgate-decision"] == "rejected"
    assert info.value.response.headers["retry-after"] == "1"

    # With retries it waits Retry-After (not its own backoff of at most 0.5 s for the first
    # retry) and then gets through at the first retry: Retry-After was long enough.
    # openai._base_client._calculate_retry_timeout honours retry-after in (0, 120] seconds.
    c = client(sidecar.url, retries=3, tenant="retry")
    drain("retry")
    t0 = time.monotonic()
    raw = c.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    elapsed = time.monotonic() - t0
    assert raw.status_code == 200 and raw.headers["x-kvgate-decision"] == "admitted"
    assert raw.retries_taken == 1
    assert raw.parse().choices[0].message.content == "hi"
    # It waited the 1 s Retry-After (the lower bound is the point); the upper bound only rules
    # out a wait far past it, so it is generous (10 s) for a busy machine.
    assert 1.0 <= elapsed < 10.0, elapsed


# ------------------------------------------------------------------ 4: defaultMaxTokens upstream


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_missing_max_tokens_gets_policy_default_upstream(
    kind: str, llmd_sim: Start, sidecar_process: Start
) -> None:
    sim = llmd_sim("--mode", "echo", "--log-http")
    sidecar = sidecar_process(sim.url, {"tenants": {"defaultMaxTokens": 2}})
    c = client(sidecar.url)
    words = len(PROMPT.split())
    if kind == "chat":
        chat = c.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPT}]
        )
        decision = chat.headers["x-kvgate-decision"]
        finish = chat.parse().choices[0].finish_reason
    else:
        cmpl = c.completions.with_raw_response.create(model=MODEL, prompt=PROMPT)
        decision = cmpl.headers["x-kvgate-decision"]
        finish = cmpl.parse().choices[0].finish_reason
    assert decision == "admitted"
    # Echo mode never truncates, but reports "length" when max_tokens < echo length: the
    # simulator saw a limit of fewer than `words` tokens.
    assert finish == "length"
    samples = sim_quiesced(sim, 1)
    # vllm:request_params_max_tokens is observed only when the request carries max_tokens.
    assert value(samples, "vllm:request_params_max_tokens_count") == 1
    assert value(samples, "vllm:request_params_max_tokens_sum") == 2
    assert value(samples, "vllm:generation_tokens_total") == words
    (logged,) = logged_request_bodies(sim)
    assert logged["max_tokens"] == 2

    # Charged at the default, settled to the 10 tokens actually generated.
    g = sidecar_gauges(sidecar)
    assert g["completion"] == words and g["in_flight"] == 0 and g["kv_reserved"] == 0


# ------------------------------------------------------------------ 5: client disconnect


SLOW_PROMPT = " ".join(f"w{i}" for i in range(200))


def _open_stream(sidecar: Proc) -> socket.socket:
    """Start a 200-token chat stream through the sidecar on a raw socket; return once the first
    SSE event has arrived."""
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": SLOW_PROMPT}],
            "max_tokens": 200,
            "stream": True,
        }
    ).encode()
    port = int(sidecar.url.rsplit(":", 1)[1])
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"x-kvgate-tenant: " + TENANT.encode() + b"\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    got = b""
    while b"data: " not in got:
        piece = s.recv(65536)
        assert piece, got
        got += piece
    head = got.split(b"\r\n\r\n", 1)[0].lower()
    assert head.startswith(b"http/1.1 200") and b"x-kvgate-decision: admitted" in head, head
    return s


@pytest.fixture
def slow_pair(llmd_sim: Start, sidecar_process: Start) -> Iterator[tuple[Proc, Proc]]:
    # 200 tokens 100 ms apart: a 20 s stream, well past the bounds below.
    sim = llmd_sim("--mode", "echo", "--inter-token-latency", "100ms", "--max-model-len", "1024")
    # No engine usage poll: its keep-alive /metrics connection would be counted with the
    # request's upstream connection, which is what these tests follow.
    sidecar = sidecar_process(
        sim.url, {"capacity": {"kvCacheTokens": 100000}}, "--engine-usage-seconds", "0"
    )
    yield sim, sidecar
    # The simulator finishes the abandoned request before exiting on SIGTERM: do not wait 10 s.
    sim.popen.kill()
    sim.popen.wait()


def test_disconnect_mid_stream_releases_and_drops_upstream(slow_pair: tuple[Proc, Proc]) -> None:
    sim, sidecar = slow_pair
    sim_port = int(sim.url.rsplit(":", 1)[1])
    s = _open_stream(sidecar)
    g = sidecar_gauges(sidecar)
    assert g["in_flight"] == 1 and g["kv_reserved"] > 0, g
    assert value(scrape(sim.url + "/metrics"), "vllm:num_requests_running") == 1
    assert established_to(sim_port) == 1  # the sidecar's upstream connection
    assert "Sending stream chunk failed" not in sim.log.read_text()

    s.close()
    t0 = time.monotonic()
    # Each step within 5 s of the client leaving (expected: well under a second), not at the
    # end of the 20 s stream: the bound is the point, so it is generous for a busy machine.
    within = 5.0

    def left() -> float:
        return max(0.0, within - (time.monotonic() - t0))

    def released() -> tuple[bool, dict[str, float]]:
        g = sidecar_gauges(sidecar)
        return g["in_flight"] == 0 and g["kv_reserved"] == 0, g

    ok, g, took = poll(released, timeout=left())
    assert ok, f"sidecar still holds the request {took:.2f}s after the client left: {g}"
    assert g["client_disconnects"] == 1

    # The sidecar closed its upstream connection: the simulator's stream writer fails.
    ok, n, took = poll(lambda: ((n := established_to(sim_port)) == 0, n), timeout=left())
    assert ok, f"{n} upstream connection(s) still open {took:.2f}s after the client left"
    ok, _, took = poll(
        lambda: ("Sending stream chunk failed" in sim.log.read_text(), None),
        timeout=left(),
    )
    assert ok, "the simulator kept streaming to the sidecar after the client left"
    # Only what was streamed before the disconnect was charged, not the 200 tokens.
    assert 0 < g["completion"] < 200, g


@pytest.mark.xfail(
    strict=True,
    reason="llm-d-inference-sim v0.10.2 keeps a request running until its last token after the "
    "HTTP client goes away (no cancellation path; same with a direct client), so "
    "vllm:num_requests_running cannot return to 0 within 1 s",
)
def test_disconnect_simulator_keeps_running_request(slow_pair: tuple[Proc, Proc]) -> None:
    sim, sidecar = slow_pair
    _open_stream(sidecar).close()
    ok, running, _ = poll(
        lambda: (
            (r := value(scrape(sim.url + "/metrics"), "vllm:num_requests_running")) == 0,
            r,
        ),
        timeout=1.0,
    )
    assert ok, f"vllm:num_requests_running is {running} 1 s after the client left"


# ------------------------------------------------------------------ 6: malformed input


def test_malformed_input_never_reaches_the_model_server(
    llmd_sim: Start, sidecar_process: Start
) -> None:
    sim = llmd_sim("--mode", "echo", "--log-http")
    sidecar = sidecar_process(sim.url, {}, "--max-body-bytes", "4096")

    def chat(**kw: Any) -> bytes:
        return json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **kw}
        ).encode()

    big = chat(max_tokens=4, user="x" * 8192)
    cases: list[tuple[str, str, bytes, bool, int, str | None]] = [
        (
            "bad json",
            "/v1/chat/completions",
            b'{"model": "test-model", "messages": [',
            False,
            400,
            None,
        ),
        ("max_tokens 0", "/v1/chat/completions", chat(max_tokens=0), False, 400, "max_tokens"),
        ("max_tokens str", "/v1/chat/completions", chat(max_tokens="5"), False, 400, "max_tokens"),
        (
            "max_tokens 0 cmpl",
            "/v1/completions",
            json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 0}).encode(),
            False,
            400,
            "max_tokens",
        ),
        ("too big", "/v1/chat/completions", big, False, 413, None),
        ("too big chunked", "/v1/chat/completions", big, True, 413, None),
    ]
    for name, path, body, chunked, want, param in cases:
        status, headers, data = post(sidecar.url, path, body, chunked=chunked)
        assert status == want, (name, status, data)
        assert headers["x-kvgate-decision"] == "rejected", name
        err = assert_openai_error(data, status)
        if param is not None:
            assert err["param"] == param, (name, err)

    # The official client surfaces the sidecar's 400 like the server's own.
    with pytest.raises(openai.BadRequestError) as info:
        client(sidecar.url).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=0
        )
    assert info.value.response.headers["x-kvgate-decision"] == "rejected"
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "max_tokens"

    samples = scrape(sim.url + "/metrics")
    assert value(samples, "vllm:request_success_total") == 0
    assert http_requests_logged(sim) == 0

    # Control: a valid request through the same sidecar does reach the simulator and is seen.
    status, headers, _ = post(sidecar.url, "/v1/chat/completions", chat(max_tokens=4))
    assert status == 200 and headers["x-kvgate-decision"] == "admitted"
    sim_quiesced(sim, 1)
    assert http_requests_logged(sim) == 1


# ------------------------------------------------------------------ 7: the engine's context


def test_the_engines_smaller_context_wins_over_the_policys_max_model_len(
    llmd_sim: Start, sidecar_process: Start
) -> None:
    # The policy says 8192 tokens, the engine serves 4096: a prompt of about 5000 tokens gets
    # kvgate's own 400 before the engine, as it does when the policy states no maxModelLen.
    sim = llmd_sim("--mode", "echo", "--log-http", "--max-model-len", "4096")
    spec = {"model": {"maxModelLen": 8192}, "capacity": {"kvCacheTokens": 100000}}
    sidecar = sidecar_process(sim.url, spec)
    long_prompt = "hello " * 5000
    bodies: dict[str, dict[str, Any]] = {
        "/v1/completions": {"prompt": long_prompt},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": long_prompt}]},
    }
    for path, fields in bodies.items():
        body = json.dumps({"model": MODEL, "max_tokens": 4, **fields}).encode()
        status, headers, data = post(sidecar.url, path, body)
        assert status == 400 and headers["x-kvgate-decision"] == "rejected", (path, data)
        err = assert_openai_error(data, 400)
        assert err["code"] == "context_length_exceeded", err
        assert "context length of 4096 tokens" in err["message"], err
    assert http_requests_logged(sim) == 0
    # Said once, at startup: the policy states more than the engine has.
    log = sidecar.log.read_text()
    assert log.count("above the engine's context of 4096 tokens") == 1, log

    # A max_tokens over the engine's context (below the policy's) is still the engine's to
    # answer, as without kvgate: vLLM refuses prompt + max_tokens > max_model_len with 400.
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 6000}).encode()
    status, headers, data = post(sidecar.url, "/v1/completions", body)
    assert status == 400 and headers["x-kvgate-decision"] == "admitted", data
    (logged,) = logged_request_bodies(sim)
    assert logged["max_tokens"] == 6000  # forwarded as sent
    assert sidecar_gauges(sidecar)["kv_reserved"] == 0
