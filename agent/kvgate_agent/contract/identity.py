"""The policy's identity fields under ``tenants`` (:class:`UnknownKeys`, :class:`JwtSpec`): how
the sidecar names a request's tenant from a credential it can check rather than a header the
client sets.

``tenants.header`` names the request header that names the tenant, taken as sent: it trusts
whoever sets it (a gateway, which alone should reach the sidecar). Its special value
``authorization`` names the tenant by the bearer token: the tenant of the token's entry in the
sidecar's keys file (``--api-keys-file``, listed by SHA-256), else per ``unknownKeys``; or the
claim of a verified JWT (``jwt``). With neither a keys file nor ``jwt`` (and ``unknownKeys:
Pool``), each token is its own tenant, ``key-<SHA-256 of the token>`` (never the raw token),
which trusts a model server that checks keys itself (vLLM ``--api-key``).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import AfterValidator, Field, ValidationInfo

from kvgate_agent.contract.base import ContractModel


class UnknownKeys(StrEnum):
    """``tenants.unknownKeys``: with ``tenants.header: authorization``, what a request whose API
    key is not in the sidecar's keys file (``--api-keys-file``), or that sends none, gets.

    ``Refuse``: 401 with an OpenAI error, code ``invalid_api_key``, before admission and the model
    server see it (without a keys file, every request). ``Pool`` (the default): all of them are
    one tenant, ``unknown``, so a client making up keys never gets a fresh share per key; without
    a keys file (and without ``jwt``), each key is its own tenant, as the engine checks keys.
    With ``tenants.jwt``, a token not in the keys file must be a valid JWT: this does not apply.
    """

    REFUSE = "Refuse"
    POOL = "Pool"


class JwtSpec(ContractModel):
    """``tenants.jwt``: the tenant is a claim of a verified JSON Web Token (RFC 7519,
    https://www.rfc-editor.org/rfc/rfc7519) sent as the bearer token (``Authorization: Bearer
    <JWT>``); needs ``tenants.header: authorization``.

    The signature is checked against the keys of the sidecar's JWKS file (RFC 7517; flag
    ``--jwks-file``, a Secret in a cluster), chosen by the token's ``kid``; ``iss`` must equal
    ``issuer``, ``aud`` must contain ``audience``, and ``exp`` must be present and not past (30
    seconds of leeway for clock skew). ``claim``: the claim naming the tenant (default ``sub``;
    a string, values over 128 characters hashed, or an integer). Anything else gets 401.
    """

    issuer: Annotated[str, Field(min_length=1)]
    audience: Annotated[str, Field(min_length=1)]
    claim: Annotated[str, Field(min_length=1)] = "sub"


def _bearer_only(jwt: JwtSpec | None, info: ValidationInfo) -> JwtSpec | None:
    header = info.data.get("header")
    if jwt is not None and (not isinstance(header, str) or header.lower() != "authorization"):
        raise ValueError("jwt needs header: authorization (the token is the bearer token)")
    return jwt


JwtField = Annotated[JwtSpec | None, AfterValidator(_bearer_only)]
"""``tenants.jwt``'s type: :class:`JwtSpec` or None, only with ``tenants.header:
authorization`` (checked against the header validated before it)."""
