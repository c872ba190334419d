"""Tenants the fair queue can trust, over real HTTP on loopback: API keys from a keys file
(pooled or refused when unknown, reloaded on change) and verified JWTs, in front of a recording
upstream that must never see a refused request."""

from __future__ import annotations

import asyncio
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

from kvgate_agent.sidecar.identity.keyfiles import key_digest
from kvgate_bench.kit.toolkit import free_port, wait_until_async
from tests.conftest import ADMIN, SidecarFactory, gauges
from tests.identity_keys import (
    AUDIENCE,
    ISSUER,
    SigningKey,
    good_claims,
    hand_made,
    jwks,
    random_key,
    rsa_key,
    write_keys,
)
from tests.upstream import CHAT, Upstream

KEYED = {
    "tenants": {"header": "authorization"},
    "rateLimits": [{"name": "t", "requestsPerMinute": 1e6}],
}
JWT = {"tenants": {"header": "authorization", "jwt": {"issuer": ISSUER, "audience": AUDIENCE}}}


async def chat(client: aiohttp.ClientSession, url: str, key: str | None) -> tuple[int, Any]:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    async with client.post(url + "/v1/chat/completions", json=CHAT, headers=headers) as r:
        return r.status, (await r.json(), dict(r.headers))


def tenant_labels(g: dict[str, float]) -> set[str]:
    """Every tenant label value in the sidecar's series."""
    return {m for name in g for m in re.findall(r'tenant="([^"]*)"', name)}


async def many(client: aiohttp.ClientSession, url: str, keys: list[str]) -> list[int]:
    gate = asyncio.Semaphore(16)

    async def one(key: str) -> int:
        async with gate:
            return (await chat(client, url, key))[0]

    return list(await asyncio.gather(*(one(k) for k in keys)))


def assert_401(body: Any) -> None:
    err, headers = body
    assert err == {
        "error": {
            "message": err["error"]["message"],
            "type": "invalid_request_error",
            "code": "invalid_api_key",
            "param": None,
        }
    }
    assert headers["x-kvgate-decision"] == "rejected"
    assert headers["x-kvgate-reason"] == "invalid_api_key"
    assert headers["WWW-Authenticate"].startswith("Bearer")


# ---------------------------------------------------------------------------------------------
# API keys


async def test_200_fresh_random_keys_are_one_pooled_tenant(
    tmp_path: Path,
    upstream: Upstream,
    sidecar_factory: SidecarFactory,
    client: aiohttp.ClientSession,
) -> None:
    write_keys(tmp_path / "keys.yaml", {"sk-known": "team-a"})
    url, _ = await sidecar_factory(
        upstream.url, KEYED, api_keys_file=str(tmp_path / "keys.yaml"), **ADMIN
    )
    statuses = await many(client, url, [random_key() for _ in range(200)])
    assert statuses == [200] * 200
    assert (await chat(client, url, "sk-known"))[0] == 200
    assert (await chat(client, url, None))[0] == 200  # no key at all: the pool too
    g = await gauges(client, url)
    assert tenant_labels(g) == {"unknown", "team-a"}
    assert (
        g['kvgate_admission_decisions_total{outcome="admitted",reason="ok",tenant="unknown"}']
        == 201
    )
    assert g["kvgate_tenants_tracked"] == 2
    assert len(upstream.bodies) == 202


async def test_200_fresh_random_keys_are_all_refused_and_never_forwarded(
    tmp_path: Path,
    upstream: Upstream,
    sidecar_factory: SidecarFactory,
    client: aiohttp.ClientSession,
) -> None:
    write_keys(tmp_path / "keys.yaml", {"sk-known": "team-a"})
    spec = {**KEYED, "tenants": {"header": "authorization", "unknownKeys": "Refuse"}}
    url, sc = await sidecar_factory(
        upstream.url, spec, api_keys_file=str(tmp_path / "keys.yaml"), **ADMIN
    )
    statuses = await many(client, url, [random_key() for _ in range(200)])
    assert statuses == [401] * 200
    status, body = await chat(client, url, None)
    assert status == 401
    assert_401(body)
    assert upstream.bodies == []
    assert "/v1/chat/completions" not in upstream.paths  # (the engine probe's GETs only)
    assert sc.admission.stats().in_flight == 0
    g = await gauges(client, url)
    assert (
        g['kvgate_admission_decisions_total{outcome="rejected",reason="invalid_api_key",tenant=""}']
        == 201
    )
    assert tenant_labels(g) <= {""}
    assert (await chat(client, url, "sk-known"))[0] == 200
    assert len(upstream.bodies) == 1


async def test_the_keys_file_is_reloaded_a_symlink_swap_too_and_a_broken_one_is_ignored(
    tmp_path: Path,
    upstream: Upstream,
    sidecar_factory: SidecarFactory,
    client: aiohttp.ClientSession,
) -> None:
    """The mount as Kubernetes writes a Secret volume: ``keys.yaml -> ..data/keys.yaml``,
    ``..data -> ..<timestamp>``, updated by renaming a new ``..data`` over the old."""
    mount = tmp_path / "secret"
    (mount / "..v1").mkdir(parents=True)
    write_keys(mount / "..v1" / "keys.yaml", {"sk-a": "team-a"})
    os.symlink("..v1", mount / "..data")
    os.symlink("..data/keys.yaml", mount / "keys.yaml")
    spec = {**KEYED, "tenants": {"header": "authorization", "unknownKeys": "Refuse"}}
    url, _ = await sidecar_factory(
        upstream.url,
        spec,
        api_keys_file=str(mount / "keys.yaml"),
        identity_poll_seconds=0.05,
        **ADMIN,
    )
    assert (await chat(client, url, "sk-a"))[0] == 200
    assert (await chat(client, url, "sk-b"))[0] == 401

    async def becomes(key: str, status: int) -> None:
        async def ok() -> bool:
            return (await chat(client, url, key))[0] == status

        await wait_until_async(ok, 10, f"{key} answered {status}")

    # The Secret updated: a new directory, then an atomic rename of ..data onto it.
    (mount / "..v2").mkdir()
    write_keys(mount / "..v2" / "keys.yaml", {"sk-b": "team-b"})
    os.symlink("..v2", mount / "..data_tmp")
    os.replace(mount / "..data_tmp", mount / "..data")
    await becomes("sk-b", 200)
    assert (await chat(client, url, "sk-a"))[0] == 401
    # A broken file: logged, the keys loaded before still hold.
    (mount / "..v3").mkdir()
    (mount / "..v3" / "keys.yaml").write_text("keys: [{sha256: nope, tenant: x}]")
    os.symlink("..v3", mount / "..data_tmp")
    os.replace(mount / "..data_tmp", mount / "..data")
    await asyncio.sleep(0.3)  # several polls of the broken file
    assert (await chat(client, url, "sk-b"))[0] == 200
    # Rewritten in place (not a symlink swap), fixed again.
    write_keys(mount / "..v3" / "keys.yaml", {"sk-c": "team-c"})
    await becomes("sk-c", 200)
    assert (await chat(client, url, "sk-b"))[0] == 401
    g = await gauges(client, url)
    assert {"team-a", "team-b", "team-c"} <= tenant_labels(g)


async def test_a_keys_class_decides_the_requests_class_over_the_match_rules(
    tmp_path: Path,
    upstream: Upstream,
    sidecar_factory: SidecarFactory,
    client: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The keys file's ``class``: ``sk-batch-1``'s class ``batch`` (sheddable, matched by no
    rule) gets 429 ``sheddable`` while one request holds the one slot; a key naming a class the
    policy does not declare falls back to the match rules, with one warning per load."""
    keys = tmp_path / "keys.yaml"
    entries = [
        ("sk-team-a", "team-a", None),
        ("sk-batch-1", "batch-jobs", "batch"),
        ("sk-ghost", "ghosts", "ghost"),  # no such class: the default class, priority 0
    ]
    keys.write_text(
        yaml.safe_dump(
            {
                "keys": [
                    {"sha256": key_digest(k), "tenant": t, **({"class": c} if c else {})}
                    for k, t, c in entries
                ]
            }
        )
    )
    spec = {
        "tenants": {
            "header": "authorization",
            "classes": [{"name": "batch", "priority": -1, "batch": True}],
        },
        "concurrency": {"maxRequests": 1},
    }
    with caplog.at_level(logging.WARNING, logger="kvgate.identity"):
        url, sc = await sidecar_factory(upstream.url, spec, api_keys_file=str(keys))
        upstream.hold = asyncio.Event()  # the one slot held until the refusals were seen
        held = asyncio.create_task(chat(client, url, "sk-team-a"))
        try:
            await wait_until_async(lambda: sc.admission.stats().in_flight == 1, 10, "in flight")
            status, (body, headers) = await chat(client, url, "sk-batch-1")
            assert status == 429, body
            assert headers["x-kvgate-reason"] == "sheddable"
            ghost = asyncio.create_task(chat(client, url, "sk-ghost"))  # queued, not shed
            await wait_until_async(lambda: sc.admission.stats().queue_length == 1, 10, "queued")
        finally:
            upstream.hold.set()
        assert (await held)[0] == 200
        assert (await ghost)[0] == 200
    said = [r.message for r in caplog.records if "'ghost'" in r.message]
    assert len(said) == 1 and str(keys) in said[0]
    assert not [r for r in caplog.records if "'batch'" in r.message]


async def test_without_a_keys_file_each_key_is_its_own_tenant(
    upstream: Upstream,
    sidecar_factory: SidecarFactory,
    client: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Today's behaviour, kept: it trusts an engine that checks keys (vLLM --api-key), and the
    sidecar says so once at start."""
    with caplog.at_level(logging.WARNING, logger="kvgate.identity"):
        url, _ = await sidecar_factory(upstream.url, KEYED, **ADMIN)
        assert (await chat(client, url, "sk-0"))[0] == 200
    said = [r.message for r in caplog.records if "vLLM --api-key" in r.message]
    assert len(said) == 1
    assert await many(client, url, ["sk-1", "sk-2", "sk-1"]) == [200] * 3
    labels = tenant_labels(await gauges(client, url))
    assert len(labels) == 3 and all(t.startswith("key-") for t in labels)  # sk-0, 1, 2


# ---------------------------------------------------------------------------------------------
# JWT


@pytest.fixture(scope="module")
def signer() -> SigningKey:
    return rsa_key()


async def test_a_valid_jwt_is_its_claims_tenant_and_every_bad_one_never_reaches_the_engine(
    tmp_path: Path,
    signer: SigningKey,
    upstream: Upstream,
    sidecar_factory: SidecarFactory,
    client: aiohttp.ClientSession,
) -> None:
    (tmp_path / "jwks.json").write_bytes(jwks(signer))
    url, _ = await sidecar_factory(
        upstream.url, JWT, jwks_file=str(tmp_path / "jwks.json"), **ADMIN
    )
    assert (await chat(client, url, signer.token({"sub": "team-jwt"})))[0] == 200
    assert len(upstream.bodies) == 1
    now = int(time.time())
    claims = good_claims()
    bad = {
        "forged signature": rsa_key(kid=signer.kid).token(),
        "expired": signer.token({"exp": now - 3600}),
        "wrong audience": signer.token({"aud": "another-service"}),
        "wrong issuer": signer.token({"iss": "https://evil.example"}),
        "alg none": hand_made({"alg": "none", "kid": signer.kid}, claims, None),
        "unknown kid": signer.token(kid="who-knows"),
        "HS256 signed with the public key": hand_made(
            {"alg": "HS256", "kid": signer.kid}, claims, signer.public_pem()
        ),
        "not a JWT": "sk-some-key",
        "none at all": None,
    }
    for what, token in bad.items():
        status, body = await chat(client, url, token)
        assert status == 401, what
        assert_401(body)
    assert len(upstream.bodies) == 1  # the engine saw the valid one only
    g = await gauges(client, url)
    assert tenant_labels(g) == {"team-jwt", ""}
    assert g[
        'kvgate_admission_decisions_total{outcome="rejected",reason="invalid_api_key",tenant=""}'
    ] == len(bad)


async def test_the_jwks_file_is_reloaded(
    tmp_path: Path,
    signer: SigningKey,
    upstream: Upstream,
    sidecar_factory: SidecarFactory,
    client: aiohttp.ClientSession,
) -> None:
    (tmp_path / "jwks.json").write_bytes(jwks(signer))
    url, _ = await sidecar_factory(
        upstream.url, JWT, jwks_file=str(tmp_path / "jwks.json"), identity_poll_seconds=0.05
    )
    rotated = rsa_key(kid="rsa-2")
    assert (await chat(client, url, rotated.token()))[0] == 401
    tmp = tmp_path / "jwks.json.new"
    tmp.write_bytes(jwks(signer, rotated))
    os.replace(tmp, tmp_path / "jwks.json")

    async def accepted() -> bool:
        return (await chat(client, url, rotated.token()))[0] == 200

    await wait_until_async(accepted, 10, "the rotated key accepted")
    assert (await chat(client, url, signer.token()))[0] == 200


# ---------------------------------------------------------------------------------------------
# The command line


@pytest.mark.parametrize(
    ("how", "names"),
    [
        ("--api-keys-file", "keys.yaml: keys[0].sha256"),
        ("KVGATE_API_KEYS_FILE", "keys.yaml: keys[0].sha256"),
        ("--jwks-file", "jwks.json: not JSON"),
        ("KVGATE_JWKS_FILE", "jwks.json: not JSON"),
    ],
)
def test_a_bad_file_at_start_exits_2_naming_it(tmp_path: Path, how: str, names: str) -> None:
    (tmp_path / "keys.yaml").write_text("keys: [{sha256: x, tenant: a}]")
    (tmp_path / "jwks.json").write_text("{")
    (tmp_path / "policy.yaml").write_text(
        "apiVersion: kvgate.io/v1alpha1\nkind: RateLimitPolicy\nmetadata: {name: x}\n"
    )
    path = str(tmp_path / ("keys.yaml" if "KEYS" in how.upper() else "jwks.json"))
    args, env = ([how, path], {}) if how.startswith("--") else ([], {how: path})
    r = subprocess.run(
        [sys.executable, "-m", "kvgate_agent", "sidecar", "--policy", str(tmp_path / "policy.yaml"),
         "--upstream", "http://127.0.0.1:1", "--listen", f"127.0.0.1:{free_port()}", *args],
        capture_output=True, text=True, timeout=30, env={**os.environ, **env},
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert names in r.stderr and "Traceback" not in r.stderr
