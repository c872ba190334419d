"""Configuration edges a new user hit (issue 36, item 7), on the real ``kvgate-agent`` command
and over real HTTP on loopback: a policy or keys file that repeats a YAML key is refused (exit
2 at start, the one in force kept on SIGHUP), not read as its last value; a JWT whose claim
names a tenant kvgate keeps for itself is refused; ``tenants.jwt`` without keys to verify
tokens with exits 2 instead of answering 401 to everything; a keys file's undeclared ``class``
is reported when the file or the policy is loaded (in agent mode: when the node agent's
thresholds arrive), and when SIGHUP re-reads it (a bad file keeping the one in force), never
at the key's first request; an empty keys file's error says what is wrong in the file's own
terms; ``--help`` is plain text and ``--version`` answers."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from kvgate_bench.kit.processes import Proc, start_sidecar
from kvgate_bench.kit.toolkit import free_port, poll_until_async, wait_until_async
from tests.conftest import SidecarFactory, policy_doc
from tests.identity_keys import AUDIENCE, ISSUER, jwks, rsa_key, write_keys
from tests.sync_answers import serve_thresholds
from tests.upstream import CHAT, Upstream

JWT_SPEC = {"tenants": {"header": "authorization", "jwt": {"issuer": ISSUER, "audience": AUDIENCE}}}


def run_cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``kvgate-agent ARGV`` to its end (a sidecar that would start is a failure here)."""
    return subprocess.run(
        [sys.executable, "-m", "kvgate_agent", *argv],
        capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})},
    )  # fmt: skip


def sidecar_cli(policy: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return run_cli(
        "sidecar", "--policy", str(policy), "--upstream", f"http://127.0.0.1:{free_port()}",
        "--listen", f"127.0.0.1:{free_port()}", *extra,
    )  # fmt: skip


def write_policy(path: Path, spec: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(policy_doc(spec)))
    return path


def assert_config_error(r: subprocess.CompletedProcess[str], *said: str) -> None:
    """Exit 2 with one line on stderr that says each of ``said``."""
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    for text in said:
        assert text in lines[0], r.stderr


# ---------------------------------------------------------------------------------------------
# A YAML file that repeats a key


POLICY_REPEATING_A_KEY = """\
apiVersion: kvgate.io/v1alpha1
kind: RateLimitPolicy
metadata: {name: twice}
spec:
  rateLimits:
    - {name: strict, requestsPerMinute: 1}
  concurrency: {maxRequests: 4}
  rateLimits:
    - {name: lax, requestsPerMinute: 100000}
"""


def test_a_policy_that_repeats_a_key_exits_2_naming_the_key_and_its_lines(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY_REPEATING_A_KEY)
    r = sidecar_cli(policy)
    assert_config_error(r, str(policy), "line 8", "'rateLimits' is given twice", "line 5")


def test_a_nested_repeated_key_is_refused_too(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "apiVersion: kvgate.io/v1alpha1\nkind: RateLimitPolicy\nmetadata: {name: x}\n"
        "spec:\n  queue:\n    maxWaitSeconds: 1\n    maxWaitSeconds: 60\n"
    )
    assert_config_error(sidecar_cli(policy), "'maxWaitSeconds' is given twice")


def test_a_keys_file_that_repeats_a_key_exits_2(tmp_path: Path) -> None:
    digest = hashlib.sha256(b"sk-a").hexdigest()
    keys = tmp_path / "keys.yaml"
    keys.write_text(f"keys:\n- sha256: {digest}\n  tenant: team-a\n  tenant: team-b\n")
    policy = write_policy(tmp_path / "policy.yaml", {"tenants": {"header": "authorization"}})
    r = sidecar_cli(policy, "--api-keys-file", str(keys))
    assert_config_error(r, str(keys), "line 4", "'tenant' is given twice")


async def test_on_sighup_a_policy_that_repeats_a_key_keeps_the_one_in_force(
    tmp_path: Path, upstream: Upstream, sidecar_process: Any
) -> None:
    proc = sidecar_process(upstream.url, {})
    policy = tmp_path / "policy-0.yaml"  # the fixture's file for its first sidecar
    policy.write_text(POLICY_REPEATING_A_KEY)
    proc.popen.send_signal(signal.SIGHUP)

    async def said() -> bool:
        return "'rateLimits' is given twice" in proc.log.read_text()

    assert await poll_until_async(said, bool, 10.0), proc.log.read_text()
    assert "keeping the policy in force" in proc.log.read_text()
    async with aiohttp.ClientSession() as s:
        for _ in range(3):  # the old policy (no limit), not the first or the last rate limit
            async with s.post(proc.url + "/v1/chat/completions", json=CHAT) as r:
                assert r.status == 200
    assert proc.popen.poll() is None


# ---------------------------------------------------------------------------------------------
# JWT: a claim naming kvgate's own tenants; no keys to verify with


@pytest.mark.parametrize("claim", ["unknown", "anonymous", " unknown "])
async def test_a_jwt_claim_naming_a_tenant_kvgate_keeps_is_refused(
    claim: str,
    tmp_path: Path,
    upstream: Upstream,
    sidecar_factory: SidecarFactory,
    client: aiohttp.ClientSession,
) -> None:
    signer = rsa_key()
    (tmp_path / "jwks.json").write_bytes(jwks(signer))
    url, _ = await sidecar_factory(upstream.url, JWT_SPEC, jwks_file=str(tmp_path / "jwks.json"))

    async def post(sub: str) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {signer.token({'sub': sub})}"}
        async with client.post(url + "/v1/chat/completions", json=CHAT, headers=headers) as r:
            return r.status, await r.json()

    status, body = await post(claim)
    assert status == 401, body
    assert body["error"]["code"] == "invalid_api_key"
    assert "a tenant kvgate keeps" in body["error"]["message"]
    assert upstream.bodies == []
    assert (await post("unknown-team"))[0] == 200  # a name merely like it is a tenant


def test_tenants_jwt_without_a_jwks_file_exits_2(tmp_path: Path) -> None:
    policy = write_policy(tmp_path / "policy.yaml", JWT_SPEC)
    assert_config_error(sidecar_cli(policy), "tenants.jwt needs --jwks-file")


@pytest.mark.parametrize("how", ["--jwks-file", "KVGATE_JWKS_FILE"])
def test_an_empty_jwks_exits_2(how: str, tmp_path: Path) -> None:
    policy = write_policy(tmp_path / "policy.yaml", JWT_SPEC)
    empty = tmp_path / "jwks.json"
    empty.write_text('{"keys": []}')
    args, env = ([how, str(empty)], {}) if how.startswith("--") else ([], {how: str(empty)})
    r = run_cli(
        "sidecar", "--policy", str(policy), "--upstream", f"http://127.0.0.1:{free_port()}",
        "--listen", f"127.0.0.1:{free_port()}", *args, env=env,
    )  # fmt: skip
    assert_config_error(r, str(empty), "holds no key")


async def test_on_sighup_a_policy_asking_for_jwts_without_a_jwks_file_is_not_enforced(
    tmp_path: Path, upstream: Upstream, sidecar_process: Any
) -> None:
    proc = sidecar_process(upstream.url, {})
    write_policy(tmp_path / "policy-0.yaml", JWT_SPEC)
    proc.popen.send_signal(signal.SIGHUP)

    async def said() -> bool:
        return "tenants.jwt needs --jwks-file" in proc.log.read_text()

    assert await poll_until_async(said, bool, 10.0), proc.log.read_text()
    async with (
        aiohttp.ClientSession() as s,
        s.post(proc.url + "/v1/chat/completions", json=CHAT) as r,
    ):
        assert r.status == 200  # the policy in force, not 401 for everyone


# ---------------------------------------------------------------------------------------------
# The keys file: an undeclared class reported at load; an empty file


async def test_an_undeclared_class_is_reported_when_the_keys_file_is_loaded(
    tmp_path: Path,
    upstream: Upstream,
    sidecar_factory: SidecarFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    keys = tmp_path / "keys.yaml"
    digest = hashlib.sha256(b"sk-a").hexdigest()

    def write(cls: str) -> None:
        new = tmp_path / "keys.new"
        new.write_text(json.dumps({"keys": [{"sha256": digest, "tenant": "t", "class": cls}]}))
        os.replace(new, keys)

    write("gold")
    spec = {"tenants": {"header": "authorization", "classes": [{"name": "gold", "priority": 5}]}}
    with caplog.at_level(logging.WARNING, logger="kvgate.identity"):
        await sidecar_factory(
            upstream.url, spec, api_keys_file=str(keys), identity_poll_seconds=0.05
        )
        await asyncio.sleep(0.2)
        assert not [r for r in caplog.records if "names no class" in r.getMessage()]
        write("golden")  # a typo, no request sent with that key (nor any other)

        def warned() -> list[str]:
            return [r.getMessage() for r in caplog.records if "'golden'" in r.getMessage()]

        await wait_until_async(warned, 10, "the undeclared class reported at load")
    assert "names no class of the policy's tenants.classes" in warned()[0]
    assert upstream.bodies == []


@pytest.mark.parametrize("mode", ["standalone", "agent"])
async def test_an_undeclared_class_is_reported_at_load_and_on_sighup_in_every_mode(
    mode: str, tmp_path: Path, upstream: Upstream
) -> None:
    """The real ``kvgate-agent sidecar``, standalone (``--policy``) or taking the same policy
    from a node agent: the keys file's undeclared class is in the log once the policy is known
    (at start; in agent mode once its thresholds arrive), with no request sent; SIGHUP reports
    a re-read file's, and a bad file keeps the keys in force and says why."""
    keys = tmp_path / "keys.yaml"

    def write(text: str) -> None:
        new = tmp_path / "keys.new"
        new.write_text(text)
        os.replace(new, keys)

    def entry(cls: str) -> str:
        digest = hashlib.sha256(b"sk-a").hexdigest()
        return json.dumps({"keys": [{"sha256": digest, "tenant": "team-a", "class": cls}]})

    write(entry("golden"))
    spec = {"tenants": {"header": "authorization", "unknownKeys": "Refuse",
                        "classes": [{"name": "gold", "priority": 5}]}}  # fmt: skip
    policy: Path | None = None
    env = dict(os.environ)
    runner: web.AppRunner | None = None
    if mode == "standalone":
        policy = write_policy(tmp_path / "policy.yaml", spec)
    else:
        agent_url, runner = await serve_thresholds(spec)
        (tmp_path / "token").write_text("tok")
        env.update(KVGATE_AGENT_URL=agent_url, KVGATE_POD_NAMESPACE="ns",
                   KVGATE_POD_NAME="model-0", KVGATE_POD_UID="u-1",
                   KVGATE_TOKEN_FILE=str(tmp_path / "token"))  # fmt: skip
    proc: Proc = await asyncio.to_thread(
        start_sidecar, tmp_path / "sidecar.log", "--api-keys-file", str(keys),
        upstream=upstream.url, policy=policy, env=env, status=None, timeout=20.0,
    )  # fmt: skip
    try:

        def said(text: str) -> bool:
            return text in proc.log.read_text()

        await wait_until_async(lambda: said("'golden'"), 10, "the undeclared class at load")
        assert said("class 'golden' names no class of the policy's tenants.classes")
        # Agent mode: the spec before the thresholds (no policy yet) is not judged.
        assert not said("not authorization"), proc.log.read_text()
        assert upstream.bodies == []  # no request was needed to say it

        write(entry("silver"))  # SIGHUP re-reads the keys file: its undeclared class is said
        proc.popen.send_signal(signal.SIGHUP)
        await wait_until_async(lambda: said("'silver'"), 10, "the re-read file's class")
        write("keys: [abc]\n")  # a bad file: the keys in force stay, and the log says why
        proc.popen.send_signal(signal.SIGHUP)
        await wait_until_async(
            lambda: said("keeping what was loaded before"), 10, "the bad file refused"
        )
        async with aiohttp.ClientSession() as s:
            for key, status in (("sk-a", 200), ("sk-b", 401)):
                headers = {"Authorization": f"Bearer {key}"}
                async with s.post(
                    proc.url + "/v1/chat/completions", json=CHAT, headers=headers
                ) as r:
                    assert r.status == status, (key, await r.text())
        assert proc.popen.poll() is None  # SIGHUP never ended it
    finally:
        await asyncio.to_thread(proc.stop)
        if runner is not None:
            await runner.cleanup()


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("", "the file is empty: expected a mapping with a list 'keys:'"),
        ("# no keys yet\n", "the file is empty"),
        ("- a\n- b\n", "expected a mapping with a list 'keys:' of {sha256, tenant} entries"),
        ("keys: [abc]\n", "keys[0]: expected a mapping with sha256 and tenant"),
    ],
    ids=["empty", "comment", "a list", "an entry not a mapping"],
)
def test_a_keys_file_of_the_wrong_shape_says_so_in_its_own_terms(
    text: str, said: str, tmp_path: Path
) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text(text)
    policy = write_policy(tmp_path / "policy.yaml", {"tenants": {"header": "authorization"}})
    r = sidecar_cli(policy, "--api-keys-file", str(keys))
    assert_config_error(r, str(keys), said)
    assert "_KeysFile" not in r.stderr and "ApiKey" not in r.stderr and "instance" not in r.stderr


# ---------------------------------------------------------------------------------------------
# --help and --version


def test_help_is_plain_text_and_version_answers() -> None:
    for argv in ([], ["sidecar"], ["node"]):
        r = run_cli(*argv, "--help")
        assert r.returncode == 0, r.stderr
        for markup in ("``", ":mod:", ":class:", ":func:", ":data:", ":attr:", ":meth:"):
            assert markup not in r.stdout, (argv, markup, r.stdout)
    r = run_cli("--version")
    assert r.returncode == 0, r.stderr
    from importlib.metadata import version

    assert r.stdout.strip() == f"kvgate-agent {version('kvgate')}"


def test_tenants_jwt_without_a_jwks_file_exits_2_beside_a_keys_file(tmp_path: Path) -> None:
    write_keys(tmp_path / "keys.yaml", {"sk-a": "team-a"})
    policy = write_policy(tmp_path / "policy.yaml", JWT_SPEC)
    # The keys file is fine; only the JWKS is missing: the error names that, not the keys.
    r = sidecar_cli(policy, "--api-keys-file", str(tmp_path / "keys.yaml"))
    assert_config_error(r, "tenants.jwt needs --jwks-file")
