"""Property-based fuzzing of the sidecar over real HTTP on loopback (hypothesis).

One sidecar and one recording upstream serve the whole run, on an event loop in a background
thread; each case is one request on a fresh connection, sent byte for byte as generated
(``http.client``): every generation path and other paths, every method, content types right and
wrong, bodies that are malformed JSON, not UTF-8, with duplicate keys, ``NaN``/``Infinity``
literals, ``1e400``, huge, negative, missing and wrongly typed lengths, giant prompts, bodies
over the limit, unknown fields; framed by ``Content-Length``, by chunks, by both (request
smuggling), or by a ``Content-Length`` of 10 GB over a short body; and sent by a client that
half-closes its side once the request is out (``shutdown(SHUT_WR)``).

Asserted for every case: no 5xx from the sidecar (the upstream never fails); a refused request
(any 4xx) never reached the upstream (each request carries its case number in a header the
upstream records). At the end: every gauge (in flight, KV reserved, queue, concurrency) is back
to zero. The case count and the status histogram are printed (``pytest -s`` shows them).

``KVGATE_FUZZ_EXAMPLES`` sets the number of cases (default 5,000: about 23 s on two shared
cores, where 4,000 took 18 s and the former 2,200 17 s).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import socket
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from kvgate_agent.contract.policy import parse_policy
from kvgate_agent.sidecar.app import Sidecar, SidecarSettings
from kvgate_agent.sidecar.reading.endpoints import GENERATION_PATHS
from kvgate_agent.sidecar.server import SidecarServer
from kvgate_bench.kit.toolkit import free_port, parse_samples, series
from tests.conftest import policy_doc

EXAMPLES = int(os.environ.get("KVGATE_FUZZ_EXAMPLES", "5000"))
MAX_BODY = 32 * 1024
CASE_HEADER = "x-fuzz-case"
UPSTREAM_HEADER = "x-fuzz-upstream"  # on every answer of the upstream, never on the sidecar's

# ---------------------------------------------------------------- the servers, in one thread


@dataclass
class Recorder:
    """The upstream: answers everything with 200 (JSON, or an SSE stream when asked) and records
    the case number of every request that reached it."""

    cases: list[str] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        case = request.headers.get(CASE_HEADER)
        if case is not None:
            self.cases.append(case)
        raw = await request.read()
        try:
            body = json.loads(raw) if raw else {}
        except (ValueError, RecursionError):
            body = {}
        usage = {"prompt_tokens": 3, "completion_tokens": 2}
        if isinstance(body, dict) and body.get("stream") is True:
            resp = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", UPSTREAM_HEADER: "1"}
            )
            await resp.prepare(request)
            await resp.write(b'data: {"choices":[{"index":0,"text":"a"}]}\n\n')
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        return web.json_response(
            {"choices": [{"text": "ab"}], "usage": usage}, headers={UPSTREAM_HEADER: "1"}
        )


class Servers:
    """The sidecar and the recorder on an event loop in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.recorder = Recorder()
        self.runners: list[Any] = []
        self.sidecar: Sidecar | None = None
        self.port = 0
        self.call(self._start())

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    async def _start(self) -> None:
        up = web.Application()
        up.router.add_route("*", "/{tail:.*}", self.recorder.handle)
        up_port = await self._serve(up)
        spec = {
            "capacity": {"kvCacheTokens": 200000},
            "model": {"maxModelLen": 8192, "blockSize": 16},
            "tenants": {"maxTokensCap": 4096, "defaultMaxTokens": 256},
            "concurrency": {"maxRequests": 64},
        }
        self.sidecar = Sidecar(
            SidecarSettings(
                upstream=f"http://127.0.0.1:{up_port}",
                policy=parse_policy(policy_doc(spec)),
                max_body_bytes=MAX_BODY,
                engine_usage_seconds=0,
            )
        )
        # Served as the CLI serves it (header deadline, OpenAI answers to malformed HTTP).
        server = SidecarServer(self.sidecar)
        await server.start(("127.0.0.1", 0), None)
        self.runners.append(server)
        self.port = server.port

    async def _serve(self, app: web.Application | web.AppRunner) -> int:
        runner = (
            app
            if isinstance(app, web.AppRunner)
            else web.AppRunner(app, handler_cancellation=True, access_log=None)
        )
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        self.runners.append(runner)
        return port

    async def _stop(self) -> None:
        for r in reversed(self.runners):
            await r.cleanup()

    def close(self) -> None:
        self.call(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    s = Servers()
    yield s
    s.close()


# ---------------------------------------------------------------- what is sent

PATHS = [
    *GENERATION_PATHS,
    "/v1/embeddings",
    "/tokenize",
    "/v1/models",
    "/",
    "/sleep",
    "/v1/./chat/completions",
    "/v1/x/../responses",
    "//generate",
    "/v1/%63ompletions",
    "/generate?x=1",
    # absolute-form targets (RFC 9112 §3.2.2): routed by their path, the host never used
    "http://evil/v1/models",
    "http://x/tokenize",
    "http://x/v1/chat/completions",
    "http://x/v1/./completions",
    "http://x",
]
METHODS = ["POST"] * 8 + ["GET", "HEAD", "PUT", "DELETE", "PATCH", "OPTIONS"]
CONTENT_TYPES = [
    "application/json",
    "application/json",
    "application/json",
    "application/json; charset=utf-8",
    None,
    "text/plain",
    "application/x-www-form-urlencoded",
    "application/vnd.x+json",
]

#: A valid body per generation API, mutated by the strategies; :data:`BASE_PATHS` its paths.
BASES: list[dict[str, Any]] = [
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
    {"model": "m", "prompt": "hi", "max_tokens": 8},
    {"model": "m", "input": "hi", "max_output_tokens": 8},
    {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
    {"inputs": "hi", "parameters": {"max_new_tokens": 8}},
    {"text": "hi", "sampling_params": {"max_new_tokens": 8}},
    {"prompt": "hi", "n_predict": 8},
]
BASE_PATHS: list[list[str]] = [
    ["/v1/chat/completions", "/chat/completions"],
    ["/v1/completions"],
    ["/v1/responses"],
    ["/v1/messages"],
    ["/generate", "/generate_stream"],
    ["/generate"],
    ["/completion", "/completions", "/infill"],
]
LENGTH_KEYS = [
    "max_tokens",
    "max_completion_tokens",
    "max_output_tokens",
    "n",
    "best_of",
    "n_predict",
    "n_cmpl",
    "stream",
    "stream_options",
    "model",
    "messages",
    "prompt",
    "input",
    "inputs",
    "text",
    "input_ids",
    "parameters",
    "sampling_params",
    "system",
    "background",
    "unknown_field",
]

numbers = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2, 128, 129, 2048, 8192, 8193, 10**6, 2**63]),
    st.floats(allow_nan=False, allow_infinity=False),
)
json_values = st.recursive(
    st.none() | st.booleans() | numbers | st.text(max_size=20),
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def mutated_body(draw: st.DrawFn, base: int | None = None) -> bytes:
    """A valid API body (``BASES[base]``, else any) with fields replaced, removed, nested or
    added."""
    i = draw(st.integers(0, len(BASES) - 1)) if base is None else base
    body: dict[str, Any] = json.loads(json.dumps(BASES[i]))
    for _ in range(draw(st.integers(0, 3))):
        key = draw(st.sampled_from(LENGTH_KEYS))
        action = draw(st.sampled_from(["set", "set", "del", "nest"]))
        if action == "del":
            body.pop(key, None)
        elif action == "nest":
            inner = draw(st.sampled_from(["max_new_tokens", "best_of", "n", "max_tokens"]))
            body[draw(st.sampled_from(["parameters", "sampling_params"]))] = {
                inner: draw(json_values)
            }
        else:
            body[key] = draw(json_values)
    return json.dumps(body).encode()


@st.composite
def textual_trick(draw: st.DrawFn) -> bytes:
    """JSON that Python's encoder would never write: non-finite literals, 1e400, duplicate keys,
    truncation, a giant prompt."""
    base = json.dumps(draw(st.sampled_from(BASES)))
    kind = draw(st.sampled_from(["nan", "inf", "1e400", "dup", "truncate", "giant", "deep"]))
    key = draw(st.sampled_from(["max_tokens", "n", "n_predict", "max_output_tokens"]))
    if kind == "nan":
        return (base[:-1] + f', "{key}": NaN}}').encode()
    if kind == "inf":
        return (base[:-1] + f', "{key}": -Infinity}}').encode()
    if kind == "1e400":
        return (base[:-1] + f', "{key}": 1e400}}').encode()
    if kind == "dup":
        return (base[:-1] + f', "{key}": 1, "{key}": 1000000}}').encode()
    if kind == "truncate":
        return base[: draw(st.integers(0, len(base) - 1))].encode()
    if kind == "deep":
        depth = draw(st.integers(10, 3000))
        return b'{"model":"m","prompt":' + b"[" * depth + b"]" * depth + b"}"
    size = draw(st.sampled_from([1000, 20000, MAX_BODY, MAX_BODY * 3]))
    return json.dumps({"model": "m", "prompt": "x" * size, "inputs": "y"}).encode()


raw_bytes = st.one_of(
    st.binary(max_size=200),
    st.binary(max_size=50).map(lambda b: b'{"model":"m","prompt":"' + b + b'"}'),
    st.sampled_from([b"", b"null", b"[]", b'"x"', b"\xff\xfe{}", b'{"prompt":"\xed\xa0\x80"}']),
)
bodies = st.one_of(mutated_body(), mutated_body(), textual_trick(), raw_bytes)


#: How a case's body is framed and sent: ``length`` (``Content-Length``), ``both``
#: (``Content-Length`` and ``Transfer-Encoding: chunked``: request smuggling, refused),
#: ``chunked``, ``overstated`` (a ``Content-Length`` of 10 GB over the short body: 413 at once)
#: and ``half_close`` (``Content-Length``, then the client shuts its sending side).
FRAMINGS = ["length"] * 10 + [
    "both",
    "chunked",
    "chunked",
    "overstated",
    "half_close",
    "half_close",
]


@dataclass(frozen=True)
class Case:
    method: str
    path: str
    content_type: str | None
    body: bytes
    framing: str  # one of FRAMINGS


any_case = st.builds(
    Case,
    st.sampled_from(METHODS),
    st.sampled_from(PATHS),
    st.sampled_from(CONTENT_TYPES),
    bodies,
    st.sampled_from(FRAMINGS),
)


@st.composite
def api_case(draw: st.DrawFn) -> Case:
    """A POST of one API's mutated body to one of that API's paths, declared as JSON: the cases
    that reach the deepest parsing and admission."""
    i = draw(st.integers(0, len(BASES) - 1))
    body = draw(mutated_body(i))
    if draw(st.integers(0, 9)) == 0:  # a giant prompt in that API's own field
        big = json.loads(json.dumps(BASES[i]))
        key = next(k for k in ("messages", "prompt", "input", "inputs", "text") if k in big)
        size = draw(st.sampled_from([MAX_BODY // 2, MAX_BODY + 1, MAX_BODY * 4]))
        big[key] = [{"role": "user", "content": "x" * size}] if key == "messages" else "x" * size
        body = json.dumps(big).encode()
    framing = draw(st.sampled_from(["length"] * 6 + ["chunked", "half_close"]))
    return Case("POST", draw(st.sampled_from(BASE_PATHS[i])), "application/json", body, framing)


cases = st.one_of(api_case(), any_case)


def send(port: int, case: Case, number: int) -> tuple[int, bool, bool]:
    """Send ``case`` on a fresh connection; (the response status, it came from the
    upstream, its body is an OpenAI error object)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.putrequest(case.method, case.path, skip_host=False, skip_accept_encoding=True)
        conn.putheader(CASE_HEADER, str(number))
        if case.content_type is not None:
            conn.putheader("Content-Type", case.content_type)
        chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(case.body), case.body)
        if not case.body:
            chunked = b"0\r\n\r\n"
        if case.framing in ("both", "chunked"):
            if case.framing == "both":
                conn.putheader("Content-Length", str(len(case.body)))
            conn.putheader("Transfer-Encoding", "chunked")
            conn.endheaders()
            conn.send(chunked)
        else:
            overstated = case.framing == "overstated"
            conn.putheader("Content-Length", str(10 * 2**30 if overstated else len(case.body)))
            conn.endheaders()
            conn.send(case.body)
            if case.framing == "half_close":
                assert conn.sock is not None
                conn.sock.shutdown(socket.SHUT_WR)  # the answer must still come
        resp = conn.getresponse()  # skips an interim 100 Continue
        data = resp.read()
        try:
            openai_error = isinstance(json.loads(data).get("error"), dict)
        except (ValueError, AttributeError):
            openai_error = False
        return resp.status, resp.getheader(UPSTREAM_HEADER) == "1", openai_error
    finally:
        conn.close()


# ---------------------------------------------------------------- the property


def test_fuzzed_requests_never_5xx_never_leak_refusals_upstream_and_free_everything(
    servers: Servers,
) -> None:
    statuses: Counter[int] = Counter()
    by_path: Counter[tuple[str, int]] = Counter()
    by_framing: Counter[tuple[str, int]] = Counter()
    leaked: list[tuple[int, Case]] = []
    errors: list[tuple[int, int, Case]] = []
    not_openai: list[tuple[int, int, Case]] = []
    counter = iter(range(10**9))

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases)
    def run(case: Case) -> None:
        number = next(counter)
        status, relayed, openai_error = send(servers.port, case, number)
        statuses[status] += 1
        route = GENERATION_PATHS.get(case.path.split("?")[0])
        by_path[(route.name if route is not None else "other", status)] += 1
        by_framing[(case.framing, status)] += 1
        if status >= 500 and not relayed:
            errors.append((number, status, case))
        elif status >= 400 and str(number) in servers.recorder.cases:
            leaked.append((number, case))
        if status >= 400 and not relayed and not openai_error and case.method != "HEAD":
            not_openai.append((number, status, case))

    run()
    sc = servers.sidecar
    assert sc is not None
    c = sc.admission.core
    total = sum(statuses.values())
    print(f"\nfuzz: {total} cases; statuses {dict(sorted(statuses.items()))}")
    print(f"fuzz: reached the upstream: {len(set(servers.recorder.cases))}")
    print(f"fuzz: by kind and status: {dict(sorted(by_path.items()))}")
    print(f"fuzz: by framing and status: {dict(sorted(by_framing.items()))}")
    assert total >= EXAMPLES
    assert errors == [], errors[:5]
    assert leaked == [], leaked[:5]
    assert not_openai == [], not_openai[:5]  # every refusal has an OpenAI error body
    assert (c.stats().in_flight, c.stats().kv_reserved_tokens, c.stats().queue_length) == (0, 0, 0)
    gauges = servers.call(_gauges(sc))
    for name in ("kvgate_in_flight_requests", "kvgate_kv_reserved_tokens", "kvgate_queue_length"):
        assert gauges.get(name, 0.0) == 0.0, (name, gauges.get(name))


async def _gauges(sc: Sidecar) -> dict[str, float]:
    return series(parse_samples(generate_latest(sc.metrics.registry).decode()))
