"""Signing keys, JWKS files, tokens and keys files for the identity tests (generated with
``cryptography``; tokens signed with PyJWT, or by hand for the forged shapes PyJWT refuses to
make)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from jwt.algorithms import ECAlgorithm, OKPAlgorithm, RSAAlgorithm

ISSUER = "https://idp.example"
AUDIENCE = "kvgate"


@dataclass
class SigningKey:
    """A private key, its ``kid`` and algorithm, and its public JWK."""

    kid: str
    alg: str
    private: Any
    public_jwk: dict[str, Any]

    def public_pem(self) -> bytes:
        return bytes(
            self.private.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )

    def token(self, claims: dict[str, Any] | None = None, **header: Any) -> str:
        """A token this key signs: issuer, audience, ``sub`` and an ``exp`` an hour away unless
        ``claims`` override them (a value None drops the claim)."""
        now = int(time.time())
        body = {"iss": ISSUER, "aud": AUDIENCE, "sub": "team-a", "iat": now, "exp": now + 3600}
        body.update(claims or {})
        body = {k: v for k, v in body.items() if v is not None}
        return jwt.encode(
            body, self.private, algorithm=self.alg, headers={"kid": self.kid, **header}
        )


def rsa_key(kid: str = "rsa-1", alg: str = "RS256") -> SigningKey:
    private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    public = json.loads(RSAAlgorithm.to_jwk(private.public_key()))
    return SigningKey(kid, alg, private, {**public, "kid": kid, "use": "sig"})


def ec_key(kid: str = "ec-1") -> SigningKey:
    private = ec.generate_private_key(ec.SECP256R1())
    public = json.loads(ECAlgorithm.to_jwk(private.public_key()))
    return SigningKey(kid, "ES256", private, {**public, "kid": kid})


def ed_key(kid: str = "ed-1") -> SigningKey:
    private = ed25519.Ed25519PrivateKey.generate()
    public = json.loads(OKPAlgorithm.to_jwk(private.public_key()))
    return SigningKey(kid, "EdDSA", private, {**public, "kid": kid})


def jwks(*keys: SigningKey) -> bytes:
    return json.dumps({"keys": [k.public_jwk for k in keys]}).encode()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def hand_made(header: dict[str, Any], claims: dict[str, Any], sign: bytes | None) -> str:
    """A token assembled by hand: ``sign`` is the HMAC-SHA256 key (None: no signature)."""
    head = _b64(json.dumps(header).encode()) + "." + _b64(json.dumps(claims).encode())
    if sign is None:
        return head + "."
    return head + "." + _b64(hmac.new(sign, head.encode(), hashlib.sha256).digest())


def good_claims(**over: Any) -> dict[str, Any]:
    now = int(time.time())
    return {"iss": ISSUER, "aud": AUDIENCE, "sub": "team-a", "exp": now + 3600, **over}


def random_key() -> str:
    return "sk-" + os.urandom(16).hex()


def write_keys(path: Path, keys: dict[str, str]) -> None:
    """Write a keys file mapping each API key (hashed here) to its tenant."""
    entries = [
        {"sha256": hashlib.sha256(k.encode()).hexdigest(), "tenant": t} for k, t in keys.items()
    ]
    path.write_text(yaml.safe_dump({"keys": entries}))
