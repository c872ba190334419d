"""A request's tenant from credentials the sidecar checks (sidecar/identity/identity.py) and the
files they come from (sidecar/identity/keyfiles.py): parsing, reloading, and every refusal, without
HTTP."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest
from multidict import CIMultiDict

from kvgate_agent.contract.policy import (
    PolicyError,
    RateLimitPolicySpec,
    TenantsSpec,
    parse_policy,
)
from kvgate_agent.sidecar.identity.identity import Authenticator, verify_jwt
from kvgate_agent.sidecar.identity.keyfiles import (
    KeyFileError,
    WatchedFile,
    key_digest,
    parse_api_keys,
    parse_jwks,
)
from kvgate_agent.sidecar.reading.openai_errors import RequestError
from tests.conftest import policy_doc
from tests.identity_keys import (
    AUDIENCE,
    ISSUER,
    SigningKey,
    ec_key,
    ed_key,
    good_claims,
    hand_made,
    jwks,
    rsa_key,
    write_keys,
)

KEY_A = "sk-alpha"
DIGEST_A = hashlib.sha256(KEY_A.encode()).hexdigest()


def bearer(token: str) -> CIMultiDict[str]:
    return CIMultiDict({"Authorization": f"Bearer {token}"})


def tenants(**spec: Any) -> TenantsSpec:
    return TenantsSpec.model_validate({"header": "authorization", **spec})


JWT = {"jwt": {"issuer": ISSUER, "audience": AUDIENCE}}


@pytest.fixture(scope="module")
def rsa() -> SigningKey:
    return rsa_key()


# ---------------------------------------------------------------------------------------------
# The keys file


def test_keys_file_maps_digests_to_tenants_and_keeps_the_class() -> None:
    data = f"keys:\n- sha256: {DIGEST_A.upper()}\n  tenant: team-a\n  class: gold\n".encode()
    keys = parse_api_keys(data, "keys.yaml")
    assert set(keys) == {DIGEST_A}  # stored lowercase, found by the key's hex digest
    entry = keys[key_digest(KEY_A)]
    assert (entry.tenant, entry.tenant_class) == ("team-a", "gold")


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("keys: [", "not YAML"),
        ("[]", "expected a mapping with a list 'keys:' of {sha256, tenant} entries, not a list"),
        ("", "the file is empty"),
        ("keys: [abc]", "keys[0]: expected a mapping with sha256 and tenant"),
        (f"keys:\n- sha256: {DIGEST_A}\n  tenant: a\n  tenant: b\n", "line 4: the key 'tenant'"),
        ("keys:\n- tenant: a\n", "keys[0].sha256: Field required"),
        ("keys:\n- {sha256: abc, tenant: a}\n", "keys[0].sha256: String should match"),
        (
            f"keys:\n- {{sha256: {DIGEST_A}, tenant: a}}\n- {{sha256: {DIGEST_A}, tenant: b}}\n",
            "keys[1].sha256: the same key as keys[0]",
        ),
        (f"keys:\n- {{sha256: {DIGEST_A}, tenant: unknown}}\n", "keys[0].tenant"),
        (f'keys:\n- {{sha256: {DIGEST_A}, tenant: "a\\tb"}}\n', "keys[0].tenant"),
        (f"keys:\n- {{sha256: {DIGEST_A}, tenant: {'x' * 129}}}\n", "keys[0].tenant"),
        (f"keys:\n- {{sha256: {DIGEST_A}, tenant: a, tier: x}}\n", "keys[0].tier"),
    ],
)
def test_a_bad_keys_file_names_the_file_and_the_entry(text: str, names: str) -> None:
    with pytest.raises(KeyFileError) as err:
        parse_api_keys(text.encode(), "/etc/kvgate/keys.yaml")
    assert str(err.value).startswith("/etc/kvgate/keys.yaml: ")
    assert names in str(err.value)


# ---------------------------------------------------------------------------------------------
# The JWKS file


def test_jwks_keys_by_kid_with_their_algorithms(rsa: SigningKey) -> None:
    keys = parse_jwks(jwks(rsa, ec_key(), ed_key()), "jwks.json")
    assert set(keys) == {"rsa-1", "ec-1", "ed-1"}
    assert keys["rsa-1"].algorithms == {"RS256", "RS384", "RS512", "PS256", "PS384", "PS512"}
    assert keys["ec-1"].algorithms == {"ES256"}
    assert keys["ed-1"].algorithms == {"EdDSA"}
    pinned = parse_jwks(json.dumps({"keys": [{**rsa.public_jwk, "alg": "PS256"}]}).encode(), "j")
    assert pinned["rsa-1"].algorithms == {"PS256"}


@pytest.mark.parametrize(
    ("edit", "names"),
    [
        ({"kid": None}, "keys[0]: no kid"),
        ({"kty": "oct", "k": "c2VjcmV0"}, "kty 'oct'"),
        ({"alg": "HS256"}, "alg 'HS256' is not accepted"),
        ({"alg": "none"}, "alg 'none' is not accepted"),
        ({"use": "enc"}, "use 'enc' is not sig"),
        ({"d": "AAAA"}, "private key members ['d']"),
        ({"n": "!!"}, "not a usable key"),
    ],
)
def test_a_bad_jwks_names_the_file_and_the_key(
    rsa: SigningKey, edit: dict[str, Any], names: str
) -> None:
    jwk = {k: v for k, v in {**rsa.public_jwk, **edit}.items() if v is not None}
    with pytest.raises(KeyFileError) as err:
        parse_jwks(json.dumps({"keys": [jwk]}).encode(), "/etc/kvgate/jwks.json")
    assert str(err.value).startswith("/etc/kvgate/jwks.json: keys[0]")
    assert names in str(err.value)


def test_a_jwks_that_is_not_one(rsa: SigningKey) -> None:
    for data, names in (
        (b"{", "not JSON"),
        (b"[]", "expected a JWK Set"),
        (b'{"keys": []}', "holds no key"),
    ):
        with pytest.raises(KeyFileError, match=names):
            parse_jwks(data, "j")
    with pytest.raises(KeyFileError, match="kid 'rsa-1' is given twice"):
        parse_jwks(jwks(rsa, rsa), "j")


# ---------------------------------------------------------------------------------------------
# Reloading


def test_a_changed_file_is_reloaded_and_a_broken_one_keeps_the_old(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "keys.yaml"
    write_keys(path, {KEY_A: "team-a"})
    watched = WatchedFile(str(path), parse_api_keys)
    assert not watched.poll()  # unchanged: nothing re-read
    write_keys(path, {KEY_A: "team-a", "sk-beta": "team-b"})
    assert watched.poll()
    assert {e.tenant for e in watched.value.values()} == {"team-a", "team-b"}
    path.write_text("keys: [")
    with caplog.at_level(logging.ERROR):
        assert not watched.poll()
        assert not watched.poll()  # the broken file is reported once, not every poll
    assert [r.message for r in caplog.records if "not YAML" in r.message] != []
    assert len([r for r in caplog.records if "keeping" in r.message]) == 1
    assert {e.tenant for e in watched.value.values()} == {"team-a", "team-b"}
    path.unlink()
    assert not watched.poll()  # gone: the last keys stay
    write_keys(path, {"sk-gamma": "team-c"})
    assert watched.poll()
    assert [e.tenant for e in watched.value.values()] == ["team-c"]


def test_an_atomic_symlink_swap_is_picked_up(tmp_path: Path) -> None:
    """Kubernetes updates a Secret volume by writing a new directory and renaming the ``..data``
    symlink onto it; the file the sidecar reads is a symlink through ``..data``."""
    mount = tmp_path / "secret"
    mount.mkdir()
    first, second = mount / "..2026_01", mount / "..2026_02"
    first.mkdir()
    second.mkdir()
    write_keys(first / "keys.yaml", {KEY_A: "team-a"})
    write_keys(second / "keys.yaml", {KEY_A: "team-z"})  # same size, same key
    os.symlink("..2026_01", mount / "..data")
    os.symlink("..data/keys.yaml", mount / "keys.yaml")
    watched = WatchedFile(str(mount / "keys.yaml"), parse_api_keys)
    assert watched.value[DIGEST_A].tenant == "team-a"
    os.symlink("..2026_02", mount / "..data_tmp")
    os.replace(mount / "..data_tmp", mount / "..data")
    assert watched.poll()
    assert watched.value[DIGEST_A].tenant == "team-z"


def test_a_missing_or_bad_file_at_start_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match=r"keys\.yaml: cannot read"):
        Authenticator(api_keys_file=str(tmp_path / "keys.yaml"))
    (tmp_path / "jwks.json").write_text("{}")
    with pytest.raises(KeyFileError, match=r"jwks\.json: expected a JWK Set"):
        Authenticator(jwks_file=str(tmp_path / "jwks.json"))


# ---------------------------------------------------------------------------------------------
# Resolving the tenant


@pytest.fixture
def keyed(tmp_path: Path) -> Authenticator:
    path = tmp_path / "keys.yaml"
    write_keys(path, {KEY_A: "team-a"})
    return Authenticator(api_keys_file=str(path))


def test_a_known_key_is_its_tenant_and_unknown_ones_are_one_pool(keyed: Authenticator) -> None:
    spec = tenants()
    assert keyed.tenant(bearer(KEY_A), spec) == "team-a"
    assert keyed.tenant(CIMultiDict({"authorization": f"bearer  {KEY_A} "}), spec) == "team-a"
    seen = {keyed.tenant(bearer(f"sk-{i}"), spec) for i in range(200)}
    assert seen == {"unknown"}
    assert keyed.tenant(CIMultiDict(), spec) == "unknown"


def test_refuse_answers_401_for_unknown_and_missing_keys(keyed: Authenticator) -> None:
    spec = tenants(unknownKeys="Refuse")
    assert keyed.tenant(bearer(KEY_A), spec) == "team-a"
    for headers in (bearer("sk-made-up"), CIMultiDict(), CIMultiDict({"Authorization": " "})):
        with pytest.raises(RequestError) as err:
            keyed.tenant(headers, spec)
        assert (err.value.status, err.value.code, err.value.type) == (
            401,
            "invalid_api_key",
            "invalid_request_error",
        )
        assert err.value.param is None


def test_without_files_authorization_hashes_each_key_and_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    identity = Authenticator()
    spec = tenants()
    with caplog.at_level(logging.WARNING):
        identity.warn(spec)  # the policy loaded
        identity.warn(spec)  # and again (a SIGHUP re-read): said once
        a = identity.tenant(bearer("sk-1"), spec)
        b = identity.tenant(bearer("sk-2"), spec)
    assert a.startswith("key-") and b.startswith("key-") and a != b
    warnings = [r.message for r in caplog.records if "vLLM --api-key" in r.message]
    assert len(warnings) == 1
    # Refuse without a keys file: no key is known, so none passes.
    with pytest.raises(RequestError):
        identity.tenant(bearer("sk-1"), tenants(unknownKeys="Refuse"))


def test_a_keys_class_is_given_and_an_undeclared_one_warned_of_once_per_load(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "keys.yaml"

    def write(cls: str) -> None:
        entries = [{"sha256": DIGEST_A, "tenant": "team-a", "class": cls}]
        path.write_text(json.dumps({"keys": entries}))

    write("ghost")
    identity = Authenticator(api_keys_file=str(path))
    spec = tenants(classes=[{"name": "batch", "priority": -1, "batch": True}])
    with caplog.at_level(logging.WARNING, logger="kvgate.identity"):
        identity.warn(spec)  # the policy loaded: said now, before any request
        assert len([r for r in caplog.records if "'ghost'" in r.message]) == 1
        assert identity.credential(bearer(KEY_A), spec) == ("team-a", "ghost")
        assert identity.credential(bearer(KEY_A), spec) == ("team-a", "ghost")
        assert identity.credential(bearer("sk-other"), spec) == ("unknown", None)
        identity.warn(spec)  # the same policy again, the same file: nothing new
        assert len([r for r in caplog.records if "'ghost'" in r.message]) == 1
        write("ghost")  # a new load of the file: said again, once, at the re-read
        os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
        identity.poll()
        assert len([r for r in caplog.records if "'ghost'" in r.message]) == 2
        identity.credential(bearer(KEY_A), spec)
        assert len([r for r in caplog.records if "'ghost'" in r.message]) == 2
        write("batch")  # declared: nothing to say
        os.utime(path, ns=(time.time_ns(), time.time_ns() + 2 * 10**9))
        identity.poll()
        assert identity.credential(bearer(KEY_A), spec) == ("team-a", "batch")
    assert len(caplog.records) == 2


def test_who_is_one_call_credential_class_and_priority(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    entries = [{"sha256": DIGEST_A, "tenant": "team-a", "class": "batch"}]
    path.write_text(json.dumps({"keys": entries}))
    identity = Authenticator(api_keys_file=str(path))
    spec = RateLimitPolicySpec.model_validate(
        {
            "tenants": {
                "header": "authorization",
                "unknownKeys": "Refuse",
                "classes": [{"name": "batch", "priority": 3, "weight": 2}],
            },
            "priority": {"header": "x-p"},
        }
    )
    who = identity.who(bearer(KEY_A), spec)  # the key's class, its priority
    assert (who.tenant, who.tenant_class.name, who.priority) == ("team-a", "batch", 3)
    lower = CIMultiDict({"Authorization": f"Bearer {KEY_A}", "x-p": "-1"})
    assert identity.who(lower, spec).priority == -1  # untrusted: it may only lower it
    raised = CIMultiDict({"Authorization": f"Bearer {KEY_A}", "x-p": "9"})
    assert identity.who(raised, spec).priority == 3
    with pytest.raises(RequestError) as err:  # the credential first: 401
        identity.who(CIMultiDict({"Authorization": "Bearer sk-other", "x-p": "x"}), spec)
    assert err.value.status == 401
    with pytest.raises(RequestError) as err:  # then the priority header: 400 naming it
        identity.who(CIMultiDict({"Authorization": f"Bearer {KEY_A}", "x-p": "x"}), spec)
    assert (err.value.status, err.value.param) == (400, "x-p")


def test_the_header_mode_ignores_the_keys_file(keyed: Authenticator) -> None:
    spec = TenantsSpec()
    assert keyed.tenant(CIMultiDict({"x-kvgate-tenant": "gw-set"}), spec) == "gw-set"
    assert keyed.tenant(bearer(KEY_A), spec) == "anonymous"


def test_policy_jwt_needs_the_authorization_header() -> None:
    with pytest.raises(PolicyError, match="jwt needs header: authorization"):
        parse_policy(policy_doc({"tenants": JWT}))
    with pytest.raises(PolicyError, match=r"spec\.tenants\.jwt\.audience"):
        parse_policy(policy_doc({"tenants": {"header": "authorization", "jwt": {"issuer": "i"}}}))
    with pytest.raises(PolicyError, match=r"spec\.tenants\.unknownKeys"):
        parse_policy(policy_doc({"tenants": {"unknownKeys": "Allow"}}))
    spec = parse_policy(policy_doc({"tenants": {"header": "Authorization", **JWT}})).spec
    assert spec.tenants.jwt is not None and spec.tenants.jwt.claim == "sub"
    assert spec.tenants.unknown_keys.value == "Pool"


# ---------------------------------------------------------------------------------------------
# JWT


def test_a_valid_token_names_its_claims_tenant(rsa: SigningKey) -> None:
    ec, ed = ec_key(), ed_key()
    keys = parse_jwks(jwks(rsa, ec, ed), "j")
    spec = tenants(**JWT).jwt
    assert spec is not None
    assert verify_jwt(rsa.token(), spec, keys) == "team-a"
    assert verify_jwt(ec.token({"sub": "team-e"}), spec, keys) == "team-e"
    assert verify_jwt(ed.token({"sub": "team-d"}), spec, keys) == "team-d"
    ps = SigningKey(rsa.kid, "PS256", rsa.private, rsa.public_jwk)
    assert verify_jwt(ps.token(), spec, keys) == "team-a"
    org = tenants(jwt={"issuer": ISSUER, "audience": AUDIENCE, "claim": "org"}).jwt
    assert org is not None
    assert verify_jwt(rsa.token({"org": 42}), org, keys) == "42"
    long = verify_jwt(rsa.token({"org": "o" * 300}), org, keys)
    assert long.startswith("h-") and len(long) == 18
    # A token listing several audiences, ours among them, and one just past exp (the leeway).
    assert verify_jwt(rsa.token({"aud": ["other", AUDIENCE]}), spec, keys) == "team-a"
    assert verify_jwt(rsa.token({"exp": int(time.time()) - 5}), spec, keys)


def forged(rsa: SigningKey) -> dict[str, str]:
    other = rsa_key(kid=rsa.kid)  # the same kid, another key
    now = int(time.time())
    claims = good_claims()
    head, _, sig = rsa.token().split(".")
    return {
        "forged signature": other.token(),
        "expired": rsa.token({"exp": now - 3600}),
        "no exp": rsa.token({"exp": None}),
        "not yet valid": rsa.token({"nbf": now + 3600}),
        "wrong audience": rsa.token({"aud": "someone-else"}),
        "no audience": rsa.token({"aud": None}),
        "wrong issuer": rsa.token({"iss": "https://evil.example"}),
        "no sub": rsa.token({"sub": None}),
        "sub not a string": rsa.token({"sub": ["a"]}),
        "unknown kid": rsa.token(kid="rsa-9"),
        "no kid": hand_made({"alg": "RS256"}, good_claims(), None),
        "alg none": hand_made({"alg": "none", "kid": rsa.kid}, good_claims(), None),
        "HS256 with the public key": hand_made(
            {"alg": "HS256", "kid": rsa.kid, "typ": "JWT"}, good_claims(), rsa.public_pem()
        ),
        "ES256 header on an RSA key": hand_made({"alg": "ES256", "kid": rsa.kid}, claims, None)
        + "AAAA",
        "not a JWT": "sk-plain-api-key",
        "tampered claims": ".".join(
            (head, hand_made({}, good_claims(sub="admin"), None).split(".")[1], sig)
        ),
    }


def test_every_bad_token_is_401(rsa: SigningKey) -> None:
    keys = parse_jwks(jwks(rsa), "j")
    spec = tenants(**JWT).jwt
    assert spec is not None
    for what, token in forged(rsa).items():
        with pytest.raises(RequestError) as err:
            verify_jwt(token, spec, keys)
        assert (err.value.status, err.value.code) == (401, "invalid_api_key"), what


def test_jwt_through_identity_with_and_without_a_keys_file(tmp_path: Path, rsa: SigningKey) -> None:
    (tmp_path / "jwks.json").write_bytes(jwks(rsa))
    write_keys(tmp_path / "keys.yaml", {KEY_A: "team-key"})
    both = Authenticator(str(tmp_path / "keys.yaml"), str(tmp_path / "jwks.json"))
    spec = tenants(**JWT)
    assert both.tenant(bearer(rsa.token({"sub": "team-jwt"})), spec) == "team-jwt"
    assert both.tenant(bearer(KEY_A), spec) == "team-key"
    for headers in (bearer("sk-made-up"), CIMultiDict()):
        with pytest.raises(RequestError):
            both.tenant(headers, spec)
    with pytest.raises(RequestError):  # a policy asking for JWT, a sidecar without a JWKS
        Authenticator().tenant(bearer(rsa.token()), spec)
