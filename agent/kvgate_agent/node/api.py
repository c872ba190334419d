"""The node agent's HTTP API (FastAPI), for the sidecars of its node and for Prometheus.

Routes only translate HTTP to calls of :class:`~kvgate_agent.node.service.NodeAgent` and its
:class:`~kvgate_agent.node.sync.SyncHandler`:

- ``POST /v1/sync``: a sidecar's report in, its thresholds out (see
  :mod:`kvgate_agent.contract.sync`; ``304`` when ``If-None-Match`` matches; held until the
  answer changes when the sidecar sends ``Prefer: wait=N``, ended early when it disconnects).
- ``GET /metrics``: Prometheus exposition.
- ``GET /healthz``: liveness (the process serves HTTP, its loops and watch run, and the API
  server answered recently: :meth:`~kvgate_agent.node.service.NodeAgent.live`); 503 with the
  reason otherwise.
- ``GET /readyz``: readiness (NodeAdmission read, at least one usable GPU); 503 with the
  reason otherwise.
"""

from __future__ import annotations

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from starlette.types import Receive

from kvgate_agent.contract.sync import PREFER_HEADER, SYNC_PATH, parse_wait
from kvgate_agent.node.service import NodeAgent

#: Largest sync report accepted, bytes (a report is a few hundred bytes).
MAX_REPORT_BYTES = 64 * 1024


async def disconnected(receive: Receive) -> None:
    """Returns once the client has gone (ASGI ``http.disconnect``); call it only after the
    request body was read whole (then the server's next message is the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def build_app(agent: NodeAgent) -> FastAPI:
    """The FastAPI application serving ``agent``."""
    app = FastAPI(title="kvgate node agent", docs_url=None, redoc_url=None, openapi_url=None)

    too_large = {
        "error": {
            "message": f"report larger than {MAX_REPORT_BYTES} bytes",
            "type": "invalid_request_error",
            "code": "too_large",
        }
    }

    @app.post(SYNC_PATH)
    async def sync(request: Request) -> Response:
        # Never buffer more than the limit: Content-Length first, then the stream itself.
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > MAX_REPORT_BYTES):
            return JSONResponse(too_large, status_code=413)
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_REPORT_BYTES:
                return JSONResponse(too_large, status_code=413)
            chunks.append(chunk)
        body = b"".join(chunks)
        result = await agent.syncs.handle(
            body,
            request.headers.get("authorization"),
            request.headers.get("if-none-match"),
            request.client.host if request.client else None,
            wait=parse_wait(request.headers.get(PREFER_HEADER)),
            disconnected=lambda: disconnected(request.receive),
        )
        if result.body is None:
            return Response(status_code=result.status, headers=result.headers)
        return JSONResponse(result.body, status_code=result.status, headers=result.headers)

    @app.get("/metrics")
    async def metrics() -> Response:
        # What generate_latest writes is text format 0.0.4 and is labelled so, as the sidecar's
        # is; prometheus_client 0.22's CONTENT_TYPE_LATEST says version=1.0.0 for the same bytes.
        return Response(
            generate_latest(agent.metrics.registry), media_type=CONTENT_TYPE_PLAIN_0_0_4
        )

    @app.get("/healthz")
    async def healthz() -> Response:
        ok, reason = agent.live()
        return PlainTextResponse(reason, status_code=200 if ok else 503)

    @app.get("/readyz")
    async def readyz() -> Response:
        ok, reason = agent.ready()
        return PlainTextResponse(reason, status_code=200 if ok else 503)

    return app
