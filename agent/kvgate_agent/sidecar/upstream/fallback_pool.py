"""Degrading to another pool: a request this pod cannot take goes to a smaller model's Service.

``overload.degrade.fallback: {model, upstream}`` names the Service of a smaller or quantized model
with its own kvgate sidecar (and so its own admission). When admission answers
``fallback_pool`` (:class:`~kvgate_agent.admission.Reason`), the request is sent there with its
``model`` rewritten and ``x-kvgate-degraded: model=NAME``; nothing is reserved on this pod. The
pool's sidecar sees the header and never sends the request on again (no loops between two pools
that name each other). When the pool refuses (429, 503), fails (5xx) or cannot be reached, the
client gets this pod's own refusal with its Retry-After (``Decision.refusal``), so a degraded path
never answers worse than no fallback would have.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import aiohttp
from multidict import CIMultiDict

from kvgate_agent.admission import Decision
from kvgate_agent.contract.policy import RateLimitPolicySpec
from kvgate_agent.sidecar.edge import (
    ClientRequest,
    Reply,
    dropped,
    identity_names,
    new_stream,
)
from kvgate_agent.sidecar.reading import ApiTraits, ParsedRequest, responses

log = logging.getLogger("kvgate.sidecar")

#: The header that marks a request (and its answer) as degraded; on a request it means another
#: pod's sidecar already sent it here, so it is never sent on.
DEGRADED_HEADER = "x-kvgate-degraded"


#: Statuses of the pool that mean "it cannot take it either": the client gets this pod's
#: refusal. 4xx other than 429 are the request's own fault and are relayed as they are.
_POOL_REFUSED = frozenset({429, 500, 502, 503, 504})


def already_degraded(headers: Mapping[str, str]) -> bool:
    """The request carries ``x-kvgate-degraded``: another sidecar sent it here."""
    return DEGRADED_HEADER in headers


def _relayed(headers: Mapping[str, str], also: frozenset[str] = frozenset()) -> dict[str, str]:
    """``headers`` as relayed on either leg: never the hop-by-hop ones (RFC 9110 §7.6.1, those
    its ``Connection`` names too), those recomputed per leg, the content type (set for the body
    sent), nor ``also``."""
    drop = dropped(headers, also | {"content-type"})
    return {k: v for k, v in headers.items() if k.lower() not in drop}


async def send_to_pool(
    session: aiohttp.ClientSession,
    request: ClientRequest,
    upstream: str,
    body: bytes,
    d: Decision,
    api: ApiTraits,
    headers: dict[str, str],
    drop: frozenset[str] = frozenset(),
) -> tuple[Reply, bool]:
    """Send ``request`` (its path and query kept, ``body`` already rewritten to the pool's model)
    to the pool at ``upstream`` and relay its answer, streamed as it comes.

    Args:
        session: the sidecar's client session (its connect and read timeouts apply).
        upstream: the pool's base URL (``http://HOST:PORT``).
        d: the ``fallback_pool`` decision; ``d.refusal`` is answered when the pool refuses.
        api: the request's API, for the refusal's error body.
        headers: kvgate's own headers for the answer (decision, reason, mode...).
        drop: the client's header fields (lower case) not sent to the pool (its tenant and
            priority where the tenant is named by credentials: the pool's sidecar checks them).

    Returns:
        (the answer, whether the pool took the request). Never raises for the pool's faults:
        a connection error, timeout or refusing status gives this pod's refusal and False.
    """
    assert d.refusal is not None and d.model is not None
    out = _relayed(request.headers, drop)
    out[DEGRADED_HEADER] = f"model={d.model}"
    out["Content-Type"] = "application/json"
    url = upstream.rstrip("/") + request.path_qs
    try:
        async with session.post(url, data=body, headers=out) as resp:
            if resp.status in _POOL_REFUSED:
                log.debug("fallback pool %s answered %d: this pod's refusal", upstream, resp.status)
                return responses.refusal(d.refusal, api), False
            relayed = CIMultiDict(_relayed(resp.headers))
            relayed.update(headers)
            relayed[DEGRADED_HEADER] = f"model={d.model}"
            if ct := resp.headers.get("Content-Type"):
                relayed["Content-Type"] = ct
            answer = new_stream(request, resp.status, relayed)
            await answer.prepare(request)
            try:
                async for chunk in resp.content.iter_any():
                    await answer.write(chunk)
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                # The pool failed mid-answer, or the client went away: the status is sent, so
                # end as is; closing the pool's connection stops its generation.
                log.info("fallback pool %s answer cut: %s", upstream, exc)
                resp.close()
                return answer, True
            await answer.write_eof()
            return answer, True
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        log.info("fallback pool %s unreachable (%s): this pod's refusal", upstream, exc)
        return responses.refusal(d.refusal, api), False


async def degrade_to_pool(
    session: aiohttp.ClientSession,
    request: ClientRequest,
    spec: RateLimitPolicySpec,
    parsed: ParsedRequest,
    raw: bytes,
    d: Decision,
    mode: str | None,
    count: Callable[[Decision], None],
) -> Reply:
    """Send a request this pod cannot take (``d``, reason ``fallback_pool``) to ``spec``'s
    fallback pool, its body (``raw``, parsed as ``parsed``) rewritten to the pool's model;
    ``count`` is called once with the decision that stands: ``d`` when the pool takes it, this
    pod's own refusal when it does not (or when the policy lost its pool while it waited).
    ``mode``: the ``x-kvgate-thresholds`` value, if any."""
    assert d.refusal is not None
    refusal = d.refusal
    degrade = spec.overload.degrade
    if degrade is None or degrade.fallback is None:
        count(refusal)
        return responses.refusal(refusal, parsed.api)
    body = parsed.upstream_body(max_tokens=d.max_tokens, model=d.model) or raw
    headers = responses.admitted_headers(d, mode, False)
    drop = identity_names(spec.tenants.header, spec.priority.header)
    resp, taken = await send_to_pool(
        session, request, degrade.fallback.upstream, body, d, parsed.api, headers, drop
    )
    count(d if taken else refusal)
    return resp
