"""The sidecar's credential files: the API keys file (``--api-keys-file``) and the JWKS file
(``--jwks-file``), parsed, and re-read when they change on disk (:class:`WatchedFile`).

Keys file (YAML, or JSON)::

    keys:
      - sha256: 3a6eb0790f39ac87c94f3856b2dd2c5d110e6811602261a9a923d3bb23adc8b7  # hex SHA-256
        tenant: team-a                                                             # of the key
        class: interactive   # optional: the class of this key's requests

The file holds digests, never keys: ``printf %s "$KEY" | sha256sum`` gives one. Each key names
its tenant (at most 128 printable characters; ``unknown`` and ``anonymous`` are kvgate's own).
A ``class`` names one of the policy's ``tenants.classes[].name`` (or its default class): the
class of the key's requests, over the classes' match rules; a name the policy does not declare
is ignored (:mod:`kvgate_agent.sidecar.identity.identity` warns when the file or the policy is
loaded, once per load of the file).

JWKS file: a JSON Web Key Set (RFC 7517 §5, https://www.rfc-editor.org/rfc/rfc7517), as an
issuer publishes it at its ``jwks_uri``: ``{"keys": [{"kty", "kid", ...}, ...]}``. Every key
needs a ``kid`` (tokens choose their key by it), is a public signing key (``kty`` RSA, EC or
OKP; no private parts, ``use`` absent or ``sig``) and, when it states an ``alg``, one of
:data:`ALGORITHMS`. Keys are read with PyJWT's ``PyJWK``
(https://pyjwt.readthedocs.io/en/stable/api.html#jwt.PyJWK).

A file that cannot be used raises :class:`KeyFileError` naming the file and the entry; at start
that stops the sidecar, later (a reload) the error is logged and the last good contents kept.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Generic, TypeVar

import jwt
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvgate_agent.contract import yamlfile
from kvgate_agent.sidecar.identity.tenants import ANONYMOUS, MAX_TENANT_LEN, UNKNOWN

log = logging.getLogger("kvgate.identity")

#: The signing algorithms a token may use (RFC 7518 §3.1 names; EdDSA: RFC 8037): public-key
#: ones only. ``none`` and the HMAC family (HS256...) are never accepted: a verifier holding
#: only public keys must not treat one as a shared secret.
ALGORITHMS = frozenset(
    {"RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"}
)
#: The algorithms a key without ``alg`` may verify, by ``kty`` (EC: by ``crv``).
_BY_KEY_TYPE = {
    "RSA": frozenset({"RS256", "RS384", "RS512", "PS256", "PS384", "PS512"}),
    "OKP": frozenset({"EdDSA"}),
}
_BY_CURVE = {"P-256": "ES256", "P-384": "ES384", "P-521": "ES512"}
#: JWK members that only a private key has (RFC 7518 §6.2.2, §6.3.2; RFC 8037 §2).
_PRIVATE_MEMBERS = ("d", "p", "q", "dp", "dq", "qi", "oth", "k")


class KeyFileError(ValueError):
    """A keys or JWKS file that cannot be used; the message names the file and the entry."""


# ----------------------------------------------------------------------------------------------
# API keys


def key_digest(key: str) -> str:
    """The keys file's ``sha256`` of an API key: lowercase hex SHA-256 of its UTF-8 bytes."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


class ApiKey(BaseModel):
    """One entry of the keys file: the key's SHA-256 (64 hex digits, either case), its tenant,
    and optionally the class of its requests (``class`` in the file: a class name of the
    policy's ``tenants.classes``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    sha256: Annotated[str, Field(pattern=r"^[0-9a-fA-F]{64}$")]
    tenant: Annotated[str, Field(min_length=1, max_length=MAX_TENANT_LEN)]
    tenant_class: Annotated[str | None, Field(min_length=1, max_length=63, alias="class")] = None

    @field_validator("tenant")
    @classmethod
    def _tenant_name(cls, v: str) -> str:
        if not v.isprintable() or v != v.strip():
            raise ValueError("a tenant name is printable, without leading or trailing spaces")
        if v in (UNKNOWN, ANONYMOUS):
            raise ValueError(f"{v!r} is kvgate's own tenant name; choose another")
        return v


class _KeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keys: list[ApiKey]


ApiKeys = Mapping[str, ApiKey]
"""The keys file's entries by lowercase hex SHA-256 of the key."""


def _yaml_kind(value: Any) -> str:
    """What a YAML value is, in YAML's words (``list``, ``string``...)."""
    if isinstance(value, list):
        return "list"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    return "number" if isinstance(value, int | float) else type(value).__name__


def _where(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


#: What a keys file holds, for the errors about its shape.
_KEYS_SHAPE = "expected a mapping with a list 'keys:' of {sha256, tenant} entries"


def _said(error: Any) -> str:
    """A validation error of the keys file in its own terms (pydantic's message names the
    model class for a value that is not a mapping)."""
    if error["type"] == "model_type":
        return "expected a mapping with sha256 and tenant (and optionally class)"
    if error["type"] == "list_type":
        return "expected a list of {sha256, tenant} entries"
    return str(error["msg"])


def parse_api_keys(data: bytes, source: str) -> ApiKeys:
    """The keys of a keys file's contents ``data`` (``source`` names the file in errors).

    Raises:
        KeyFileError: not YAML (a mapping that repeats a key among them), empty or not a
            mapping with a ``keys`` list, not the shape above, or one digest listed twice, e.g.
            ``/etc/kvgate/keys.yaml: keys[2].sha256: String should match pattern ...``.
    """
    try:
        doc = yamlfile.load_one(data)
    except yamlfile.DuplicateKeyError as exc:
        raise KeyFileError(f"{source}: {exc}") from None
    except yaml.YAMLError as exc:
        raise KeyFileError(f"{source}: not YAML: {exc}") from None
    if doc is None:
        raise KeyFileError(f"{source}: the file is empty: {_KEYS_SHAPE}")
    if not isinstance(doc, dict):
        raise KeyFileError(f"{source}: {_KEYS_SHAPE}, not a {_yaml_kind(doc)}")
    try:
        parsed = _KeysFile.model_validate(doc)
    except ValidationError as exc:
        problems = "; ".join(f"{_where(e['loc'])}: {_said(e)}" for e in exc.errors())
        raise KeyFileError(f"{source}: {problems}") from None
    out: dict[str, ApiKey] = {}
    first: dict[str, int] = {}
    for i, entry in enumerate(parsed.keys):
        digest = entry.sha256.lower()
        if digest in out:
            raise KeyFileError(f"{source}: keys[{i}].sha256: the same key as keys[{first[digest]}]")
        out[digest] = entry
        first[digest] = i
    return out


# ----------------------------------------------------------------------------------------------
# JWKS


@dataclass(frozen=True, slots=True)
class VerifyKey:
    """One key of the JWKS file: PyJWT's ``PyJWK`` and the algorithms it may verify."""

    jwk: jwt.PyJWK
    algorithms: frozenset[str]


Jwks = Mapping[str, VerifyKey]
"""The JWKS file's keys by ``kid``."""


def _verify_key(entry: Any, where: str) -> tuple[str, VerifyKey]:
    if not isinstance(entry, dict):
        raise KeyFileError(f"{where}: expected a JSON object (a JWK)")
    kid = entry.get("kid")
    if not isinstance(kid, str) or not kid:
        raise KeyFileError(f"{where}: no kid (tokens choose their key by kid)")
    kty = entry.get("kty")
    if kty not in ("RSA", "EC", "OKP"):
        raise KeyFileError(f"{where} (kid {kid!r}): kty {kty!r}: only RSA, EC and OKP keys")
    if private := [m for m in _PRIVATE_MEMBERS if m in entry]:
        raise KeyFileError(f"{where} (kid {kid!r}): holds private key members {private}")
    if entry.get("use", "sig") != "sig":
        raise KeyFileError(f"{where} (kid {kid!r}): use {entry['use']!r} is not sig")
    alg = entry.get("alg")
    if alg is not None:
        if alg not in ALGORITHMS:
            raise KeyFileError(f"{where} (kid {kid!r}): alg {alg!r} is not accepted")
        allowed = frozenset({alg})
    elif kty == "EC":
        allowed = frozenset({_BY_CURVE[entry["crv"]]} if entry.get("crv") in _BY_CURVE else ())
    else:
        allowed = _BY_KEY_TYPE[kty]
    try:
        jwk = jwt.PyJWK(entry)
    except (jwt.PyJWKError, jwt.InvalidKeyError, ValueError, KeyError, TypeError) as exc:
        raise KeyFileError(f"{where} (kid {kid!r}): not a usable key: {exc}") from None
    if not allowed:
        raise KeyFileError(f"{where} (kid {kid!r}): curve {entry.get('crv')!r} is not accepted")
    return kid, VerifyKey(jwk, allowed)


def parse_jwks(data: bytes, source: str) -> Jwks:
    """The keys of a JWKS file's contents ``data`` (``source`` names the file in errors).

    Raises:
        KeyFileError: not JSON, no ``keys`` list or an empty one, a key not usable as above,
            or a ``kid`` given twice, e.g. ``/etc/kvgate/jwks.json: keys[1] (kid 'k2'): no
            kid``.
    """
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"{source}: not JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("keys"), list):
        raise KeyFileError(f'{source}: expected a JWK Set, {{"keys": [...]}}')
    out: dict[str, VerifyKey] = {}
    for i, entry in enumerate(doc["keys"]):
        kid, key = _verify_key(entry, f"{source}: keys[{i}]")
        if kid in out:
            raise KeyFileError(f"{source}: keys[{i}]: kid {kid!r} is given twice")
        out[kid] = key
    if not out:
        raise KeyFileError(f"{source}: holds no key: no token could be verified (every request "
                           "would get 401)")  # fmt: skip
    return out


# ----------------------------------------------------------------------------------------------
# Reloading

T = TypeVar("T")


class WatchedFile(Generic[T]):
    """A file's parsed contents, re-read when it changes.

    :meth:`poll` compares the file's ``stat`` (device, inode, size, modification time in ns),
    following symlinks: a file rewritten in place and the atomic swap Kubernetes does for Secret
    and ConfigMap volumes (the ``..data`` symlink moved to a new directory) both change it.

    ``value``: the contents last taken; ``loads``: how many times contents were taken (1 after
    construction, one more per reload).

    Raises:
        KeyFileError: at construction, when the file cannot be read or parsed.
    """

    def __init__(self, path: str, parse: Callable[[bytes, str], T]) -> None:
        self.path = path
        self._parse = parse
        try:
            self._seen = self._signature()
            self.value: T = parse(self._read(), path)
        except OSError as exc:
            raise KeyFileError(f"{path}: cannot read: {exc.strerror or exc}") from None
        self._failed = False
        self.loads = 1

    def _signature(self) -> tuple[int, int, int, int]:
        st = os.stat(self.path)
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def _read(self) -> bytes:
        with open(self.path, "rb") as f:
            return f.read()

    def poll(self) -> bool:
        """Re-read the file if it changed; True when new contents were taken. A file that is
        gone, unreadable or invalid is logged (once per change) and the last contents kept."""
        try:
            seen = self._signature()
            if seen == self._seen:
                return False
            data = self._read()
        except OSError as exc:
            if not self._failed:
                log.error("%s: cannot read (%s); keeping what was loaded before", self.path, exc)
            self._failed = True
            return False
        self._seen = seen
        try:
            value = self._parse(data, self.path)
        except KeyFileError as exc:
            log.error("%s; keeping what was loaded before", exc)
            self._failed = True
            return False
        self.value = value
        self.loads += 1
        self._failed = False
        log.info("%s: reloaded", self.path)
        return True
