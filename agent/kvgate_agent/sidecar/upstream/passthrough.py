"""Pass-through: a request on a path that is not a generation path, which the routes let
through (``RequestPipeline.other``: GET, HEAD and OPTIONS anywhere, another method on the
allowlist), forwarded to the model server as is over its kept-alive client, its body streamed
both ways within the body bounds. Nothing is admitted or reserved.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

import aiohttp
from prometheus_client import Counter
from yarl import URL

from kvgate_agent.sidecar.edge import (
    Answer,
    ClientRequest,
    Reply,
    StreamedBody,
    forward_headers,
    new_stream,
    too_large,
)
from kvgate_agent.sidecar.reading import body_too_slow, responses
from kvgate_agent.sidecar.upstream.errors import UPSTREAM_FAILURES
from kvgate_agent.sidecar.upstream.metrics import UpstreamMetrics
from kvgate_agent.sidecar.upstream.model_server import ModelServer
from kvgate_agent.sidecar.upstream.relay import ClientGone, to_client

log = logging.getLogger("kvgate.sidecar")


class PassMetrics(Protocol):
    """What pass-through counts (the sidecar's
    :class:`~kvgate_agent.sidecar.metrics.SidecarMetrics` is one): the upstream room's own
    metrics (:class:`~kvgate_agent.sidecar.upstream.metrics.UpstreamMetrics`), the clients'
    and the decisions."""

    @property
    def upstream(self) -> UpstreamMetrics: ...
    @property
    def client_timeouts(self) -> Counter: ...
    @property
    def client_disconnects(self) -> Counter: ...
    def count_decision(self, outcome: str, reason: str, tenant_label: str) -> None: ...


async def pass_through(
    request: ClientRequest,
    server: ModelServer,
    metrics: PassMetrics,
    *,
    max_body: int,
    body_seconds: float,
) -> Reply:
    """``request`` forwarded as is to ``server`` (the raw path, not re-normalised), body
    streamed both ways. An absolute-form target (``GET http://host/v1/models``, RFC 9112
    §3.2.2) is sent as its path and query: the upstream is always the sidecar's own. The body
    must be complete within ``body_seconds`` (0: no limit) of the handler's start, else the
    upstream request is aborted and the client gets 408 (``client_timeouts{phase="body"}``) and
    is closed. A body over ``max_body`` bytes (0: no limit) gets 413: at once when its
    ``Content-Length`` says so (never sent upstream; counted as an ``invalid_request``
    refusal), else when the bytes streamed pass it (the upstream request aborted)."""
    if max_body and (request.content_length or 0) > max_body:
        metrics.count_decision("rejected", "invalid_request", "")
        return responses.bad_request(too_large(max_body))
    rel = request.rel_url  # request.raw_path is the whole URL of an absolute-form target
    raw_path = rel.raw_path + (f"?{rel.raw_query_string}" if rel.raw_query_string else "")
    fwd = forward_headers(request.headers)
    fwd.popall("Content-Encoding", None)  # the body is decoded on the way in
    loop = asyncio.get_running_loop()
    body = StreamedBody(request, body_seconds, loop.time(), max_body)
    data = body.chunks() if request.body_exists else None
    url = URL(server.url + raw_path, encoded=True)
    try:
        resp = await server.session().request(request.method, url, headers=fwd, data=data)
    except aiohttp.ClientConnectorError:
        metrics.upstream.errors.labels("connect").inc()
        return responses.passthrough_unreachable()
    except UPSTREAM_FAILURES as exc:
        if body.expired or body.too_large:
            return _body_refused(metrics, body)
        metrics.upstream.errors.labels("upstream_error").inc()
        return responses.passthrough_failed(exc)
    return await _relay(request, resp, body, metrics)


def _body_refused(metrics: PassMetrics, body: StreamedBody) -> Answer:
    """408 for a pass-through body that came too slowly (``client_timeouts{phase="body"}``;
    the connection is closed), 413 for one that grew past ``--max-body-bytes``."""
    if body.too_large:
        resp = responses.bad_request(too_large(body.limit))
        resp.force_close()  # the rest of the body is not read
        return resp
    metrics.client_timeouts.labels("body").inc()
    return responses.bad_request(body_too_slow())


async def _relay(
    request: ClientRequest, resp: aiohttp.ClientResponse, body: StreamedBody, metrics: PassMetrics
) -> Reply:
    """The model server's answer ``resp`` relayed to the client as it comes."""
    clean = False
    try:
        out_headers = forward_headers(resp.headers)
        out_headers[responses.DECISION_HEADER] = "passthrough"
        out = new_stream(request, resp.status, out_headers, resp.content_length)
        await to_client(out.prepare(request))
        async for chunk in resp.content.iter_any():
            await to_client(out.write(chunk))
        await to_client(out.write_eof())
        clean = True
        return out
    except ClientGone:
        metrics.client_disconnects.inc()
        return out
    except UPSTREAM_FAILURES as exc:
        if (body.expired or body.too_large) and not out.prepared:
            return _body_refused(metrics, body)
        if body.expired or body.too_large:
            if body.expired:
                metrics.client_timeouts.labels("body").inc()
            out.force_close()
        else:
            metrics.upstream.errors.labels("upstream_error").inc()
            log.warning("upstream failed during pass-through: %r", exc)
        return out
    finally:
        if clean:
            resp.release()
        else:
            resp.close()
