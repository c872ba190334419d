"""Edges a new user hit in front of a recording upstream, over real HTTP on loopback: tenant
data kept off the clients' port where identity is on, the refusal reasons naming what refused
(with llm-d's dropped-reason header), hop-by-hop and identity headers never passed on as the
client sent them, an upstream with a path refused at start, an engine frozen mid-stream, an
empty model, the admin port's Server header (issue 36)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from kvgate_agent.contract.policy import parse_policy
from kvgate_agent.sidecar.app import Sidecar, SidecarSettings
from kvgate_bench.kit.toolkit import (
    free_port,
    parse_samples,
    poll_until_async,
    series,
    wait_until_async,
)
from tests.conftest import ADMIN, ADMIN_URLS, SidecarFactory, policy_doc, raw_exchange
from tests.identity_keys import AUDIENCE, ISSUER, jwks, random_key, rsa_key, write_keys
from tests.upstream import CHAT, Upstream

REFUSE_UNKNOWN = {
    "tenants": {"header": "authorization", "unknownKeys": "Refuse"},
    "rateLimits": [{"name": "t", "requestsPerMinute": 1e6}],
}


async def post(
    client: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], Any]:
    async with client.post(url + "/v1/chat/completions", json=CHAT, headers=headers) as r:
        return r.status, dict(r.headers), await r.json(content_type=None)


async def text(client: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    async with client.get(url) as r:
        return r.status, await r.text()


# ---------------------------------------------------------------------------------------------
# 1. Tenant data is not public on the clients' port


@pytest.mark.parametrize("mode", ["keys", "jwt"])
async def test_with_identity_on_the_clients_port_serves_no_tenant_series_the_admin_port_does(
    mode: str,
    tmp_path: Path,
    upstream: Upstream,
    sidecar_factory: SidecarFactory,
    client: aiohttp.ClientSession,
) -> None:
    signer = rsa_key()
    if mode == "keys":
        write_keys(tmp_path / "keys.yaml", {"sk-a": "team-secret"})
        files: dict[str, Any] = {"api_keys_file": str(tmp_path / "keys.yaml")}
        good = "sk-a"
        spec = REFUSE_UNKNOWN
    else:
        (tmp_path / "jwks.json").write_bytes(jwks(signer))
        files = {"jwks_file": str(tmp_path / "jwks.json")}
        good = signer.token({"sub": "team-secret"})
        spec = {**REFUSE_UNKNOWN, "tenants": {"header": "authorization", "jwt": {
            "issuer": ISSUER, "audience": AUDIENCE}}}  # fmt: skip
    url, _ = await sidecar_factory(upstream.url, spec, **files, **ADMIN)
    assert (await post(client, url, {"Authorization": f"Bearer {good}"}))[0] == 200
    assert (await post(client, url, {"Authorization": f"Bearer {random_key()}"}))[0] == 401

    status, public = await text(client, url + "/kvgate/metrics")  # no credentials at all
    assert status == 200
    assert "team-secret" not in public
    assert not re.search(r'tenant="[^"]', public), "no series of a named tenant"
    got = series(parse_samples(public))
    # The totals and the refusals before admission (no tenant) stay.
    key = 'kvgate_admission_decisions_total{outcome="rejected",reason="invalid_api_key",tenant=""}'
    assert got[key] == 1
    assert "kvgate_in_flight_requests" in got
    # The admin port has every tenant's series; the main port's /metrics its two EPP gauges.
    status, admin = await text(client, ADMIN_URLS[url] + "/metrics")
    assert status == 200 and 'tenant="team-secret"' in admin
    status, router = await text(client, url + "/metrics")
    assert "kvgate_queue_depth" in router and "kvgate_kv_reserved_fraction" in router
    assert "team-secret" not in router


async def test_without_identity_the_clients_port_keeps_its_per_tenant_series(
    upstream: Upstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    url, _ = await sidecar_factory(upstream.url, {}, **ADMIN)
    assert (await post(client, url, {"x-kvgate-tenant": "team-b"}))[0] == 200
    assert 'tenant="team-b"' in (await text(client, url + "/kvgate/metrics"))[1]


# ---------------------------------------------------------------------------------------------
# 2. An upstream with a path is refused at start


def run_cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvgate_agent", *argv],
        capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})},
    )  # fmt: skip


def write_policy(path: Path, spec: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(policy_doc(spec)))
    return path


@pytest.mark.parametrize(
    "base", ["/v1", "/v1/", "/?x=1", "/#frag"], ids=["path", "path-slash", "query", "fragment"]
)
@pytest.mark.parametrize("given", ["flag", "env"])
def test_an_upstream_with_a_path_exits_2_naming_its_root(
    base: str, given: str, tmp_path: Path
) -> None:
    policy = write_policy(tmp_path / "p.yaml", {})
    upstream = f"http://127.0.0.1:{free_port()}{base}"
    flags = ["--upstream", upstream] if given == "flag" else []
    env = {"KVGATE_UPSTREAM": upstream} if given == "env" else {}
    r = run_cli("sidecar", "--policy", str(policy), *flags,
                "--listen", f"127.0.0.1:{free_port()}", env=env)  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    root = upstream.split(base)[0]
    assert f"give the model server's root, {root}, not a path" in r.stderr, r.stderr


async def test_an_upstream_root_with_a_trailing_slash_serves_and_probes_the_same_root(
    upstream: Upstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    url, _ = await sidecar_factory(upstream.url + "/", {"capacity": {"fromEngineMetrics": True}})
    assert (await post(client, url))[0] == 200
    assert "/v1/chat/completions" in upstream.paths and "/metrics" in upstream.paths
    assert not any(p.startswith("//") for p in upstream.paths), upstream.paths


def test_a_sidecar_built_on_an_upstream_with_a_path_is_refused() -> None:
    with pytest.raises(ValueError, match="not a path"):
        Sidecar(SidecarSettings(upstream="http://127.0.0.1:8010/v1", policy=parse_policy(
            policy_doc({}))))  # fmt: skip


# ---------------------------------------------------------------------------------------------
# 3. A refusal names what refused it, with llm-d's dropped reason beside kvgate's


async def chat_small(client: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, str], Any]:
    async with client.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 20}) as r:
        return r.status, dict(r.headers), await r.json(content_type=None)


async def test_under_a_request_rate_limit_alone_the_refusal_names_the_limit_not_an_slo(
    upstream: Upstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    spec = {"rateLimits": [{"name": "only", "requestsPerMinute": 1}]}
    url, _ = await sidecar_factory(upstream.url, spec)
    assert (await chat_small(client, url))[0] == 200
    status, headers, body = await chat_small(client, url)  # its refill is a minute away
    assert status == 429, body
    assert headers["x-kvgate-reason"] == "rate_limit_requests"
    assert headers["x-llm-d-request-dropped-reason"] == "rejected-saturated"
    assert headers["RateLimit-Policy"].startswith('"only"')
    message = body["error"]["message"]
    assert "request rate limit 'only' exceeded" in message
    assert "exceeds the time-to-first-token SLO" not in message
    got = series(parse_samples(await text_of(client, url + "/kvgate/metrics")))
    reason = 'outcome="rejected",reason="rate_limit_requests",tenant="anonymous"'
    assert got[f"kvgate_admission_decisions_total{{{reason}}}"] == 1
    assert not any('reason="slo"' in k for k in got)


async def text_of(client: aiohttp.ClientSession, url: str) -> str:
    return (await text(client, url))[1]


async def test_under_a_ttft_slo_an_expected_wait_past_it_is_still_slo(
    upstream: Upstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    spec = {"rateLimits": [{"name": "only", "requestsPerMinute": 1}], "slo": {"ttftSeconds": 1}}
    url, _ = await sidecar_factory(upstream.url, spec)
    assert (await chat_small(client, url))[0] == 200
    status, headers, body = await chat_small(client, url)
    assert (status, headers["x-kvgate-reason"]) == (429, "slo")
    assert "time-to-first-token SLO" in body["error"]["message"]
    assert headers["x-llm-d-request-dropped-reason"] == "rejected-saturated"


async def test_a_queue_wait_that_runs_out_is_ttl_expired_for_llm_d(
    upstream: Upstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    upstream.hold = asyncio.Event()
    spec = {"concurrency": {"maxRequests": 1}, "queue": {"maxWaitSeconds": 0.3}}
    url, _ = await sidecar_factory(upstream.url, spec)
    first = asyncio.ensure_future(chat_small(client, url))
    await wait_until_async(lambda: upstream.active == 1, 10, "the first request upstream")
    status, headers, _ = await chat_small(client, url)
    upstream.hold.set()
    assert (await first)[0] == 200
    assert (status, headers["x-kvgate-reason"]) == (429, "queue_timeout")
    assert headers["x-llm-d-request-dropped-reason"] == "rejected-ttl-expired"


async def test_a_bad_request_carries_no_llm_d_dropped_reason(
    upstream: Upstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    url, _ = await sidecar_factory(upstream.url, {})
    async with client.post(url + "/v1/chat/completions", json={"messages": []}) as r:
        assert r.status == 400 and "x-llm-d-request-dropped-reason" not in r.headers


# ---------------------------------------------------------------------------------------------
# 6. Hop-by-hop fields named in Connection, and the identity headers where identity is on


def raw_request(path: str, headers: dict[str, str], body: bytes = b"") -> bytes:
    method = "POST" if body else "GET"
    lines = [f"{method} {path} HTTP/1.1", "Host: kvgate"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    if body:
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def test_fields_named_in_connection_never_reach_the_model_server(
    upstream: Upstream, sidecar_factory: SidecarFactory
) -> None:
    url, _ = await sidecar_factory(upstream.url, {})
    sent = {
        "Connection": "close, X-Hop-One,x-hop-two",
        "X-Hop-One": "1",
        "x-hop-two": "2",
        "X-Kept": "3",
    }
    head, _ = await raw_exchange(
        url, raw_request("/v1/chat/completions", sent, json.dumps(CHAT).encode())
    )
    assert head.startswith(b"HTTP/1.1 200"), head
    head, _ = await raw_exchange(url, raw_request("/v1/models", sent))  # passed through
    assert head.startswith(b"HTTP/1.1 200"), head
    for seen in (upstream.headers_seen[-1], upstream.other_headers[-1]):
        names = {k.lower() for k in seen}
        assert "x-kept" in names
        assert not names & {"x-hop-one", "x-hop-two"}, seen


async def test_with_identity_on_the_tenant_and_priority_headers_upstream_are_the_sidecars(
    tmp_path: Path,
    upstream: Upstream,
    sidecar_factory: SidecarFactory,
    client: aiohttp.ClientSession,
) -> None:
    write_keys(tmp_path / "keys.yaml", {"sk-a": "team-a"})
    spec = {"tenants": {"header": "authorization", "classes": [
        {"name": "gold", "priority": 5, "match": {"tenants": ["team-a"]}}]}}  # fmt: skip
    url, _ = await sidecar_factory(upstream.url, spec, api_keys_file=str(tmp_path / "keys.yaml"))
    forged = {
        "Authorization": "Bearer sk-a",
        "x-kvgate-tenant": "team-victim",
        "X-KVGATE-TENANT": "team-victim-2",
        "x-kvgate-priority": "1000",
    }
    assert (await post(client, url, forged))[0] == 200
    seen = [(k.lower(), v) for k, v in upstream.headers_seen[-1].items()]
    assert [v for k, v in seen if k == "x-kvgate-tenant"] == ["team-a"]
    assert [v for k, v in seen if k == "x-kvgate-priority"] == ["5"]  # the class's, not 1000
    # A client that lowers its own priority (allowed: sheddable) is forwarded as applied.
    assert (await post(client, url, {**forged, "x-kvgate-priority": "-3"}))[0] == 200
    assert upstream.headers_seen[-1]["x-kvgate-priority"] == "-3"


async def test_with_a_jwt_the_tenant_header_upstream_is_the_tokens_claim(
    tmp_path: Path,
    upstream: Upstream,
    sidecar_factory: SidecarFactory,
    client: aiohttp.ClientSession,
) -> None:
    signer = rsa_key()
    (tmp_path / "jwks.json").write_bytes(jwks(signer))
    jwt_spec = {"issuer": ISSUER, "audience": AUDIENCE}
    spec = {"tenants": {"header": "authorization", "jwt": jwt_spec}}
    url, _ = await sidecar_factory(upstream.url, spec, jwks_file=str(tmp_path / "jwks.json"))
    token = signer.token({"sub": "team-jwt"})
    headers = {"Authorization": f"Bearer {token}", "x-kvgate-tenant": "someone-else"}
    assert (await post(client, url, headers))[0] == 200
    assert upstream.headers_seen[-1]["x-kvgate-tenant"] == "team-jwt"
    assert upstream.headers_seen[-1]["x-kvgate-priority"] == "0"


async def test_without_identity_the_tenant_header_goes_upstream_as_sent(
    upstream: Upstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    url, _ = await sidecar_factory(upstream.url, {})
    assert (await post(client, url, {"x-kvgate-tenant": "gw-named"}))[0] == 200
    assert upstream.headers_seen[-1]["x-kvgate-tenant"] == "gw-named"
    assert "x-kvgate-priority" not in {k.lower() for k in upstream.headers_seen[-1]}


# ---------------------------------------------------------------------------------------------
# 5. An engine that stops producing tokens while its /health says 200


async def readyz(client: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    return await text(client, url + "/readyz")


@pytest.mark.parametrize("mode", ["FailOpen", "FailClosed"])
async def test_an_engine_frozen_mid_stream_is_not_ready_gets_no_new_work_and_recovers(
    mode: str,
    upstream: Upstream,
    sidecar_factory: SidecarFactory,
    client: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    upstream.freeze = asyncio.Event()
    upstream.tokens = 6
    spec = {"failureMode": mode, "queue": {"maxWaitSeconds": 0.5}}
    url, _ = await sidecar_factory(upstream.url, spec, engine_stall_seconds=0.5)
    assert (await readyz(client, url))[0] == 200
    with caplog.at_level(logging.INFO, logger="kvgate.sidecar"):
        async with client.post(
            url + "/v1/chat/completions", json={**CHAT, "stream": True}
        ) as stream:
            first = await stream.content.readany()  # then the engine freezes
            started = time.monotonic()

            async def not_ready() -> bool:
                return (await readyz(client, url))[0] == 503

            assert await poll_until_async(not_ready, bool, 5.0), "still ready"
            noticed = time.monotonic() - started
            status, why = await readyz(client, url)
            assert "no token" in why
            sent = len(upstream.bodies)
            status, headers, _ = await chat_small(client, url)  # new work: not sent
            assert len(upstream.bodies) == sent, "new work reached the stalled engine"
            if mode == "FailClosed":
                assert (status, headers["x-kvgate-reason"]) == (503, "fail_closed")
            else:  # it queued for its wait budget, then was refused
                assert (status, headers["x-kvgate-reason"]) == (429, "queue_timeout")
            upstream.freeze.set()  # tokens flow again
            rest = await stream.read()
        assert (first + rest).endswith(b"data: [DONE]\n\n")

        async def ready() -> bool:
            return (await readyz(client, url))[0] == 200

        assert await poll_until_async(ready, bool, 5.0), "not ready again"
        assert (await chat_small(client, url))[0] == 200
    said = [r.getMessage() for r in caplog.records if "produced no token" in r.getMessage()]
    assert len(said) == 1, said  # once per stall
    assert any("produces tokens again" in r.getMessage() for r in caplog.records)
    assert 0.5 <= noticed < 3.0, noticed


async def test_a_quiet_engine_with_nothing_in_flight_is_no_stall(
    upstream: Upstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    url, sc = await sidecar_factory(upstream.url, {}, engine_stall_seconds=0.2)
    assert (await post(client, url))[0] == 200
    await asyncio.sleep(0.6)  # several checks with nothing in flight
    assert (await readyz(client, url))[0] == 200 and not sc.stall.stalled


# ---------------------------------------------------------------------------------------------
# 7. Smaller ones


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/messages"])
@pytest.mark.parametrize("model", ["", "   "])
async def test_an_empty_model_is_refused_before_the_model_server(
    path: str,
    model: str,
    upstream: Upstream,
    sidecar_factory: SidecarFactory,
    client: aiohttp.ClientSession,
) -> None:
    url, _ = await sidecar_factory(upstream.url, {})
    body = {"model": model, "messages": CHAT["messages"], "prompt": "hi", "max_tokens": 8}
    async with client.post(url + path, json=body) as r:
        assert r.status == 400
        err = (await r.json())["error"]
    assert err["param"] == "model" and "non-empty" in err["message"]
    assert upstream.bodies == [] and path not in upstream.paths


async def test_the_admin_port_names_no_library_versions(
    upstream: Upstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    url, _ = await sidecar_factory(upstream.url, {}, **ADMIN)
    for path in ("/metrics", "/healthz", "/readyz", "/nowhere"):
        async with client.get(ADMIN_URLS[url] + path) as r:
            assert r.headers.get("Server") == "kvgate", (path, r.headers.get("Server"))


async def test_the_admin_port_answers_its_three_paths_only(
    upstream: Upstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    """The admin port (served by the own leg, as the clients' port): GET and HEAD on
    ``/metrics``, ``/healthz``, ``/readyz``; 405 (``Allow: GET, HEAD``) for another method on
    them, 404 elsewhere (the clients' port's paths included); no ``x-kvgate-*`` header."""
    url, _ = await sidecar_factory(upstream.url, {}, **ADMIN)
    admin = ADMIN_URLS[url]
    async with client.head(admin + "/healthz") as r:
        assert r.status == 200 and await r.read() == b""
    async with client.get(admin + "/metrics?x=1") as r:
        assert r.status == 200 and "kvgate_admission_decisions_total" in await r.text()
    async with client.post(admin + "/metrics", data=b"x") as r:
        assert (r.status, r.headers.get("Allow")) == (405, "GET, HEAD")
    for path in ("/kvgate/metrics", "/v1/chat/completions", "/"):
        async with client.get(admin + path) as r:
            assert r.status == 404, path
            assert not [h for h in r.headers if h.lower().startswith("x-kvgate")], path
    assert not {"/kvgate/metrics", "/v1/chat/completions", "/"} & set(upstream.paths)


async def test_the_metrics_expositions_say_text_format_0_0_4(
    upstream: Upstream, sidecar_factory: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    """The admin port's ``/metrics`` and the clients' ``/kvgate/metrics`` are Prometheus text
    format 0.0.4 (classic metric names) and say so, as the clients' ``/metrics`` fallback does;
    not prometheus_client's ``CONTENT_TYPE_LATEST`` (``version=1.0.0``, the UTF-8 names' format,
    since its 0.22) for the same bytes (found by a new-user review)."""
    url, _ = await sidecar_factory(upstream.url, {}, **ADMIN)
    for endpoint in (ADMIN_URLS[url] + "/metrics", url + "/kvgate/metrics"):
        async with client.get(endpoint) as r:
            assert r.status == 200, endpoint
            ct = r.headers.get("Content-Type")
            assert ct == "text/plain; version=0.0.4; charset=utf-8", (endpoint, ct)
