"""Whose request this is, from credentials the sidecar can check: the tenant of an API key in
the keys file, or a claim of a verified JWT, else the policy's tenant header as sent.

With ``tenants.header: authorization`` (see :class:`~kvgate_agent.contract.policy.TenantsSpec`):

1. a bearer token whose SHA-256 is in the keys file (``--api-keys-file``) is that entry's tenant,
   and the entry's ``class``, when the policy declares it, is the request's class (over the
   classes' match rules; an undeclared one is ignored, and logged when the file or the policy
   is loaded, once per load of the file);
2. else, with ``tenants.jwt``, the token must be a JWT (RFC 7519,
   https://www.rfc-editor.org/rfc/rfc7519) signed by a key of the JWKS file (``--jwks-file``)
   with an accepted algorithm, of the policy's issuer and audience, with an ``exp`` not past
   (:data:`LEEWAY_SECONDS` of leeway); its claim names the tenant. Anything else is 401;
3. else, with a keys file or ``unknownKeys: Refuse``, an unknown or missing key is 401
   (``Refuse``) or the one tenant ``unknown`` (``Pool``): never a tenant per key;
4. else (neither file nor JWT) each token is its own tenant, ``key-<hash>``
   (:func:`~kvgate_agent.sidecar.identity.tenants.tenant_of`): that trusts a model server that
   checks keys itself (vLLM ``--api-key``), and a warning says so at start.

Every refusal is a :class:`~kvgate_agent.sidecar.reading.openai_errors.RequestError` 401 with code
``invalid_api_key`` (OpenAI's code for a bad key, whatever the credential), so the request never
reaches admission or the model server. Verification uses PyJWT
(https://pyjwt.readthedocs.io/en/stable/api.html#jwt.decode).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import jwt

from kvgate_agent.contract.identity import JwtSpec, UnknownKeys
from kvgate_agent.contract.policy import RateLimitPolicySpec, TenantsSpec
from kvgate_agent.sidecar.identity.classes import class_names
from kvgate_agent.sidecar.identity.keyfiles import (
    ALGORITHMS,
    ApiKeys,
    Jwks,
    KeyFileError,
    WatchedFile,
    key_digest,
    parse_api_keys,
    parse_jwks,
)
from kvgate_agent.sidecar.identity.tenants import (
    ANONYMOUS,
    UNKNOWN,
    Identifier,
    Identity,
    bearer_token,
    tenant_name,
    tenant_of,
)
from kvgate_agent.sidecar.reading import RequestError
from kvgate_agent.tasks import cancel_and_wait

log = logging.getLogger("kvgate.identity")

#: Seconds of clock skew allowed on a token's ``exp``, ``nbf`` and ``iat``.
LEEWAY_SECONDS = 30.0
#: How often the keys and JWKS files are checked for changes, seconds.
POLL_SECONDS = 2.0
#: The ``code`` of every 401 (OpenAI's, https://platform.openai.com/docs/guides/error-codes).
INVALID_API_KEY = "invalid_api_key"


def unauthorized(message: str) -> RequestError:
    """401 ``invalid_request_error`` / ``invalid_api_key`` with ``message``."""
    return RequestError(401, message, code=INVALID_API_KEY)


def verify_jwt(token: str, spec: JwtSpec, keys: Jwks, leeway: float = LEEWAY_SECONDS) -> str:
    """The tenant a JWT names: its ``spec.claim``, a string (hashed past 128 characters or when
    not printable, as :func:`~kvgate_agent.sidecar.identity.tenants.tenant_name`) or an integer.

    Raises:
        RequestError: 401 when the token is malformed, uses ``none``, HMAC or another algorithm
            outside :data:`~kvgate_agent.sidecar.identity.keyfiles.ALGORITHMS` or its key's, names
            an unknown ``kid``, fails its signature, lacks ``exp``, ``iss`` or ``aud``, has
            expired or is not yet valid, is of another issuer or audience, lacks the claim, or
            its claim names ``unknown`` or ``anonymous`` (kvgate's own tenants: every unknown
            key's pool under ``unknownKeys: Pool``, and requests without a tenant).
    """
    try:
        header = jwt.get_unverified_header(token)
    except jwt.InvalidTokenError:
        raise unauthorized("the bearer token is not a valid JWT") from None
    alg, kid = header.get("alg"), header.get("kid")
    if not isinstance(alg, str) or alg not in ALGORITHMS:
        raise unauthorized(f"the token's algorithm {str(alg)[:16]!r} is not accepted")
    key = keys.get(kid) if isinstance(kid, str) else None
    if key is None:
        raise unauthorized("the token's signing key (kid) is not known")
    if alg not in key.algorithms:
        raise unauthorized(f"the token's algorithm {alg!r} is not its key's")
    try:
        claims: dict[str, Any] = jwt.decode(
            token,
            key.jwk.key,
            algorithms=[alg],
            audience=spec.audience,
            issuer=spec.issuer,
            leeway=leeway,
            options={"require": ["exp", "iss", "aud"]},
        )
    except jwt.ExpiredSignatureError:
        raise unauthorized("the token has expired") from None
    except jwt.InvalidAudienceError:
        raise unauthorized("the token is not for this audience") from None
    except jwt.InvalidIssuerError:
        raise unauthorized("the token is of another issuer") from None
    except jwt.InvalidTokenError as exc:
        raise unauthorized(f"the token was refused: {exc}") from None
    value = claims.get(spec.claim)
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise unauthorized(f"the token has no claim {spec.claim!r} naming a tenant")
    tenant = tenant_name(value.strip())
    if tenant in (UNKNOWN, ANONYMOUS):  # the keys file refuses them too (keyfiles.ApiKey)
        raise unauthorized(
            f"the token's claim {spec.claim!r} names {tenant!r}, a tenant kvgate keeps for "
            "requests it cannot name"
        )
    return tenant


class Authenticator:
    """The identity room's one entry point: :meth:`who` answers who a request is (its tenant
    from its credential, its class, its priority) under the policy enforced now, from the
    policy's ``tenants`` and ``priority`` and the credential files, which a background task
    re-reads every ``poll_seconds`` while started.

    Raises:
        KeyFileError: a file given cannot be read or parsed at construction.
    """

    def __init__(
        self,
        api_keys_file: str | None = None,
        jwks_file: str | None = None,
        poll_seconds: float = POLL_SECONDS,
    ) -> None:
        self.api_keys: WatchedFile[ApiKeys] | None = (
            None if api_keys_file is None else WatchedFile(api_keys_file, parse_api_keys)
        )
        self.jwks: WatchedFile[Jwks] | None = (
            None if jwks_file is None else WatchedFile(jwks_file, parse_jwks)
        )
        self.poll_seconds = poll_seconds
        self._task: asyncio.Task[None] | None = None
        self._checked: TenantsSpec | None = None  # the policy's tenants last checked
        self._said: set[str] = set()
        self._undeclared: set[tuple[int, str]] = set()  # (keys file load, class) warned of
        self._identify = Identifier()  # the class and priority, its class table per policy

    def check(self, spec: TenantsSpec) -> None:
        """Refuse a policy whose tenants these files cannot name: ``tenants.jwt`` without a
        JWKS file (every request would get 401). At start that stops a standalone sidecar
        (exit 2); a policy re-read on SIGHUP is not enforced (the one in force stays).

        Raises:
            KeyFileError: ``tenants.jwt`` is set and no ``--jwks-file`` was given.
        """
        if spec.jwt is not None and self.jwks is None:
            raise KeyFileError(
                "tenants.jwt needs --jwks-file (KVGATE_JWKS_FILE), the issuer's signing keys: "
                "without them every request would get 401"
            )

    def who(self, headers: Mapping[str, str], spec: RateLimitPolicySpec) -> Identity:
        """Who a request with ``headers`` is under the policy ``spec`` enforced now, in one call:
        its tenant from its credential (:meth:`credential`), its class (its API key's entry's
        ``class`` where the policy declares it, else the classes' match rules) and its priority
        (its class's; the priority header's as sent under ``priority.trusted``, else only ever
        lower): :class:`~kvgate_agent.sidecar.identity.tenants.Identifier`. Reads headers only,
        so the pipeline asks before reading the body.

        Raises:
            RequestError: 401 (code ``invalid_api_key``) for a credential that is refused; 400
                (``param`` the header's name) for a priority header that is not an integer in
                [-1000, 1000].
        """
        tenant, key_class = self.credential(headers, spec.tenants)
        return self._identify(headers, spec, tenant, key_class)

    def tenant(self, headers: Mapping[str, str], spec: TenantsSpec) -> str:
        """The tenant of a request with ``headers`` under the policy's ``spec``.

        Raises:
            RequestError: 401 (code ``invalid_api_key``) for a credential that is refused.
        """
        return self.credential(headers, spec)[0]

    def credential(self, headers: Mapping[str, str], spec: TenantsSpec) -> tuple[str, str | None]:
        """The tenant of a request with ``headers`` under the policy's ``spec`` (as
        :meth:`tenant`) and the ``class`` of its API key's entry in the keys file: None when
        the tenant is not a key's of the file or the entry names no class. The name is the
        file's as is; :class:`~kvgate_agent.sidecar.identity.tenants.Identifier` ignores one the
        policy does not declare (warned of by :meth:`warn` when the policy or the file is loaded,
        not
        here: a request changes nothing of what is said).

        Raises:
            RequestError: 401 (code ``invalid_api_key``) for a credential that is refused.
        """
        if spec.header.lower() != "authorization" or (
            self.api_keys is None and spec.jwt is None and spec.unknown_keys is UnknownKeys.POOL
        ):
            return tenant_of(headers, spec.header), None
        token = bearer_token(headers.get(spec.header))
        if token is not None and self.api_keys is not None:
            found = self.api_keys.value.get(key_digest(token))
            if found is not None:
                return found.tenant, found.tenant_class
        if spec.jwt is not None:
            if token is None:
                raise unauthorized("no bearer token: send Authorization: Bearer <JWT>")
            jwks = {} if self.jwks is None else self.jwks.value
            return verify_jwt(token, spec.jwt, jwks), None
        if spec.unknown_keys is UnknownKeys.REFUSE:
            raise unauthorized("no API key given" if token is None else "unknown API key")
        return UNKNOWN, None

    def warn(self, spec: TenantsSpec) -> None:
        """Log, once each, what about ``spec`` and the files given is weaker than it looks (a
        keys file's ``class`` that ``spec`` does not declare: once per load of the file). Called
        whenever the policy enforced changes (at start standalone, on SIGHUP, when the node
        agent's thresholds arrive) and when the keys file is re-read (:meth:`poll`)."""
        self._checked = spec
        by_key = spec.header.lower() == "authorization"
        if by_key and self.api_keys is None and spec.jwt is None:
            self._say(
                "tenants.header is authorization without --api-keys-file or tenants.jwt: "
                + (
                    "unknownKeys is Refuse, so every request gets 401"
                    if spec.unknown_keys is UnknownKeys.REFUSE
                    else "each bearer token is its own tenant (key-<hash>), which trusts a model "
                    "server that checks keys itself (vLLM --api-key); in front of one that does "
                    "not, a client can split itself across made-up keys"
                )
            )
        if spec.jwt is not None and self.jwks is None:
            self._say("tenants.jwt without --jwks-file: every request gets 401")
        if not by_key and (self.api_keys is not None or self.jwks is not None):
            self._say(
                f"tenants.header is {spec.header}, not authorization: the keys and JWKS files "
                "are not used (the header is trusted as sent)"
            )
        if by_key and self.api_keys is not None:
            self._undeclared_classes(self.api_keys, spec)

    def _undeclared_classes(self, keys: WatchedFile[ApiKeys], spec: TenantsSpec) -> None:
        """Warn of each ``class`` of the keys file that ``spec`` does not declare, once per
        (load of the file, class name)."""
        loads = keys.loads
        named = {k.tenant_class for k in keys.value.values() if k.tenant_class is not None}
        for name in sorted(named - class_names(spec)):
            if (loads, name) not in self._undeclared:
                self._undeclared.add((loads, name))
                log.warning(
                    "%s: class %r names no class of the policy's tenants.classes: its keys' "
                    "requests get the class of the match rules (else the default class)",
                    keys.path,
                    name,
                )

    def _say(self, message: str) -> None:
        if message not in self._said:
            self._said.add(message)
            log.warning("%s", message)

    def poll(self) -> None:
        """Re-read the files that changed (see :meth:`WatchedFile.poll`). A keys file re-read
        is checked against the policy last seen at once (:meth:`warn`: a ``class`` it does not
        declare is logged now, not at that key's first request)."""
        for f in (self.api_keys, self.jwks):
            if f is not None and f.poll() and f is self.api_keys and self._checked is not None:
                self.warn(self._checked)

    def start(self, spec: TenantsSpec | None) -> None:
        """Check ``spec`` (:meth:`warn`; None: the policy is not known yet, as in agent mode
        before the node agent's thresholds, which are checked when they arrive) and, with a
        file given, start re-reading the files in the running event loop."""
        if spec is not None:
            self.warn(spec)
        if self._task is None and (self.api_keys is not None or self.jwks is not None):
            self._task = asyncio.get_running_loop().create_task(self._poll_forever())

    async def stop(self) -> None:
        """Stop re-reading the files."""
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.poll_seconds)
            try:
                await asyncio.to_thread(self.poll)
            except Exception:  # keep polling: the last good contents stay in force
                log.exception("re-reading the keys or JWKS file failed")
