"""Edges of the sidecar's connections a new user hit, over real HTTP on loopback in front of a
recording upstream (issue 36, item 7): the 408 of slow headers carries an OpenAI error body like
every other refusal."""

from __future__ import annotations

import json

import pytest

from tests.conftest import ADMIN, ADMIN_URLS, SidecarFactory, raw_exchange
from tests.upstream import CHAT, Upstream

LEGS = ["kvgate", "aiohttp"]


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


@pytest.mark.parametrize("leg", LEGS)
async def test_the_408_of_slow_headers_has_an_openai_error_body(
    leg: str, upstream: Upstream, sidecar_factory: SidecarFactory
) -> None:
    url, _ = await sidecar_factory(
        upstream.url, {}, server_leg=leg, header_timeout_seconds=0.3, **ADMIN
    )
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
