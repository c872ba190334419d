"""The sidecar's documented client interface (README's "What a client sees" and its counting of
refusals before admission; docs/routers.md's refusal table), checked over real HTTP on
loopback: what external checks rely on is what the sidecar does."""

from __future__ import annotations

import json
import re

import aiohttp
import pytest

from kvgate_bench.kit.toolkit import free_port
from tests.conftest import REPO, SidecarFactory, gauges, raw_exchange
from tests.upstream import CHAT, Upstream

INVALID = 'kvgate_admission_decisions_total{outcome="rejected",reason="invalid_request",tenant=""}'


def post(target: str, body: bytes, extra: bytes = b"") -> bytes:
    """A POST of ``body`` to ``target`` (sent as given), ``Connection: close``."""
    return (
        b"POST " + target.encode() + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\n"
        + extra
        + b"Content-Length: %d\r\n\r\n" % len(body)
        + body
    )


def header(head: bytes, name: str) -> str | None:
    """The value of header ``name`` (any case) in a response head, or None."""
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name.encode():
            return value.strip().decode()
    return None


RAW = json.dumps(CHAT).encode()
#: Requests refused with 400 before admission: README says each counts in
#: ``reason="invalid_request"`` and carries ``x-kvgate-decision``.
EARLY_400S = {
    "repeated slash": post("/v1//chat/completions", RAW),
    "escaped dot segment": post("/v1/%2e%2e/chat/completions", RAW),
    "dot segment to an allowlisted path": post("/v1/../tokenize", RAW),
    "GET of a non-canonical generation path": b"GET /v1//completions HTTP/1.1\r\nHost: x\r\n"
    b"Connection: close\r\n\r\n",
    # Refused by aiohttp's HTTP parser before any handler runs (``code: malformed_http``).
    "Content-Length with Transfer-Encoding": post(
        "/v1/chat/completions",
        b"%x\r\n%s\r\n0\r\n\r\n" % (len(RAW), RAW),
        b"Transfer-Encoding: chunked\r\n",
    ),
    "broken header line": post("/v1/chat/completions", RAW, b"Bad Header\r\n"),
}


@pytest.mark.parametrize("name", list(EARLY_400S))
async def test_every_400_before_admission_is_counted_and_carries_the_decision(
    upstream: Upstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession, name: str
) -> None:
    url, _ = await sidecar_factory(upstream.url, {})
    before = (await gauges(client, url)).get(INVALID, 0.0)
    head, _ = await raw_exchange(url, EARLY_400S[name])
    assert head.startswith(b"HTTP/1.") and head.split(b" ", 2)[1] == b"400", head
    assert header(head, "x-kvgate-decision") == "rejected", head
    assert header(head, "x-kvgate-reason") == "invalid_request", head
    assert (await gauges(client, url))[INVALID] == before + 1
    assert upstream.bodies == []


async def test_a_header_deadline_408_carries_the_decision(
    upstream: Upstream, sidecar_factory: SidecarFactory
) -> None:
    """README: every response to a client request carries ``x-kvgate-decision``; the 408 of a
    request whose headers came too slowly too (docs/routers.md: ``invalid_request``)."""
    url, _ = await sidecar_factory(upstream.url, {}, header_timeout_seconds=0.3)
    head, _ = await raw_exchange(url, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), head
    assert header(head, "x-kvgate-decision") == "rejected", head
    assert header(head, "x-kvgate-reason") == "invalid_request", head
    assert upstream.bodies == []


def refusal_table() -> dict[str, set[str]]:
    """docs/routers.md's refusal table: each ``x-kvgate-reason`` -> the ``x-kvgate-decision``
    values its row documents."""
    text = (REPO / "docs" / "routers.md").read_text()
    section = text.split("## Refusal semantics", 1)[1]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    columns = [c.strip() for c in rows[0].strip("|").split("|")]
    decision = columns.index("`x-kvgate-decision`")
    out: dict[str, set[str]] = {}
    for row in rows[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        reasons = re.findall(r"`([a-z_]+)`", cells[0].split("(", 1)[0])
        values = set(re.findall(r"`([a-z_]+)`", cells[decision]))
        for reason in reasons:
            out.setdefault(reason, set()).update(values)
    return out


async def test_refusals_carry_the_decision_docs_routers_md_documents(
    upstream: Upstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    """A model server's failure comes after admission: its answer keeps admission's decision
    (``admitted``), so a router tells it from a load refusal; kvgate's own refusals say
    ``rejected``. Each as docs/routers.md's table says."""
    table = refusal_table()
    dead, _ = await sidecar_factory(f"http://127.0.0.1:{free_port()}", {})
    live, _ = await sidecar_factory(upstream.url, {"capacity": {"kvCacheTokens": 64}})
    cases = [  # (base URL, path, expected status, expected reason)
        (dead, "/v1/chat/completions", 502, "upstream_unreachable"),
        (live, "/v1/chat/completions", 400, "exceeds_capacity"),  # max_tokens 1000 > 64
        (live, "/not/a/generation/path", 404, "unknown_endpoint"),
    ]
    for url, path, status, reason in cases:
        async with client.post(url + path, json={**CHAT, "max_tokens": 1000}) as r:
            assert (r.status, r.headers.get("x-kvgate-reason")) == (status, reason)
            assert r.headers["x-kvgate-decision"] in table[reason], (reason, table[reason])
    assert table["upstream_unreachable"] == {"admitted", "queued", "degraded"}
    assert table["exceeds_capacity"] == table["unknown_endpoint"] == {"rejected"}
