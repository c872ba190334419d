"""Which header fields a proxy passes on, either way (pure): never the hop-by-hop ones, neither
the fixed list (RFC 9110 §7.6.1) nor those a message's own ``Connection`` field names ("a proxy
or gateway MUST ... remove any header or trailer field(s) named by the Connection header
field", https://www.rfc-editor.org/rfc/rfc9110#section-7.6.1); and, where the sidecar names a
request's tenant from credentials it checks, never the client's own tenant and priority
headers: the ones it forwards say what it decided (:func:`identity_headers`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import quote

from multidict import CIMultiDict

#: Hop-by-hop headers (RFC 9110 §7.6.1) and those the proxy recomputes; never forwarded.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)

#: The header kvgate's tenant is named by unless the policy names another
#: (``tenants.header``'s default); sent upstream as decided where identity is on.
TENANT_HEADER = "x-kvgate-tenant"


def _pairs(headers: Any) -> Iterable[tuple[str, str]]:
    """``headers`` (a multidict, a mapping or a list of pairs) as (name, value) pairs."""
    return headers.items() if hasattr(headers, "items") else headers  # type: ignore[no-any-return]


def connection_named(headers: Any) -> frozenset[str]:
    """The field names (lower case) every ``Connection`` field of ``headers`` lists, comma
    separated (RFC 9110 §7.6.1); ``close`` and ``keep-alive`` among them are options, not
    fields, and harmless to drop."""
    named: set[str] = set()
    for name, value in _pairs(headers):
        if name.lower() == "connection":
            named.update(t.strip().lower() for t in value.split(",") if t.strip())
    return frozenset(named)


def dropped(headers: Any, also: Iterable[str] = ()) -> frozenset[str]:
    """The names (lower case) not to pass on from ``headers``: :data:`HOP_BY_HOP`, the fields
    its ``Connection`` names, and ``also`` (lower case)."""
    return HOP_BY_HOP | connection_named(headers) | frozenset(also)


def forward_headers(headers: Any) -> CIMultiDict[str]:
    """``headers`` without the hop-by-hop ones (:func:`dropped`)."""
    drop = dropped(headers)
    return CIMultiDict([(k, v) for k, v in _pairs(headers) if k.lower() not in drop])


#: Request headers the sidecar sets itself on an admitted request (besides the hop-by-hop
#: ones): the body is JSON it may have rewritten, decoded and sent as identity, so that the
#: answer can be read for its usage; the body is sent at once (no ``Expect: 100-continue``).
_ADMITTED_DROP = frozenset({"content-type", "content-encoding", "accept-encoding", "expect"})


def admitted_request_headers(
    headers: Any, decided: Mapping[str, str] | None = None
) -> list[tuple[str, str]]:
    """The client's ``headers`` as they go upstream with an admitted request: no hop-by-hop
    header (:func:`dropped`), ``Content-Type: application/json``, no ``Content-Encoding``,
    ``Accept-Encoding`` or ``Expect``; the client's own fields named in ``decided`` (any case)
    replaced by its values (:func:`identity_headers`)."""
    decided = decided or {}
    drop = dropped(headers, _ADMITTED_DROP | {k.lower() for k in decided})
    out = [(k, v) for k, v in _pairs(headers) if k.lower() not in drop]
    out.extend(decided.items())
    out.append(("Content-Type", "application/json"))
    return out


def identity_headers(
    tenants_header: str, priority_header: str, tenant: str, priority: int
) -> dict[str, str]:
    """The tenant and priority headers an admitted request carries upstream where the policy
    names tenants by credentials (``tenants_header`` is ``authorization``: API keys, JWTs): the
    client's own ``x-kvgate-tenant`` and priority header (``priority_header``) replaced by the
    ``tenant`` the sidecar verified (percent-encoded UTF-8 where it is not printable ASCII: a
    header value must be) and the ``priority`` it applied; none (``{}``) elsewhere, where the
    tenant header is the client's (or its gateway's) as sent."""
    if tenants_header.lower() != "authorization":
        return {}
    printable = tenant.isascii() and tenant.isprintable()
    return {
        TENANT_HEADER: tenant if printable else quote(tenant, safe=""),
        priority_header.lower(): str(priority),
    }


def identity_names(tenants_header: str, priority_header: str) -> frozenset[str]:
    """The header names (lower case) :func:`identity_headers` decides under the policy's
    ``tenants_header`` and ``priority_header``: never passed on as the client sent them."""
    return frozenset(identity_headers(tenants_header, priority_header, "", 0))
