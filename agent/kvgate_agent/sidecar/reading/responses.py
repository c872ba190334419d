"""Every answer the sidecar gives itself: an admission decision or an error turned into an HTTP
response with its ``x-kvgate-*``, ``Retry-After`` and ``RateLimit*`` headers.

Invariant: every refusal carries ``x-kvgate-decision`` and ``x-kvgate-reason`` and an
OpenAI-style error body (:mod:`kvgate_agent.sidecar.reading.openai_errors`), so clients and SDKs see
kvgate's refusals like the model server's own.
"""

from __future__ import annotations

from kvgate_agent.admission import Decision, Outcome, Reason
from kvgate_agent.sidecar.reading.answer import Answer
from kvgate_agent.sidecar.reading.apis.openai import CHAT
from kvgate_agent.sidecar.reading.apis.traits import ApiTraits
from kvgate_agent.sidecar.reading.openai_errors import (
    INVALID_REQUEST_ERROR,
    RATE_LIMIT_ERROR,
    RATE_LIMIT_EXCEEDED,
    SERVER_ERROR,
    SERVICE_UNAVAILABLE,
    RequestError,
    error_body,
    headers_too_slow,
)

JSON = "application/json"
#: Response header naming the thresholds mode (see ``sync_state.Mode``) when a node agent is used.
THRESHOLDS_HEADER = "x-kvgate-thresholds"
DECISION_HEADER = "x-kvgate-decision"
REASON_HEADER = "x-kvgate-reason"
#: On a refusal by a fleet-wide budget (``Decision.fleet_wide``): Envoy does not retry a
#: response carrying it (unless its retry policy says otherwise), and another replica would
#: refuse the same; never on "this replica is full", which a proxy should retry elsewhere.
ENVOY_RATELIMITED_HEADER = "x-envoy-ratelimited"
#: llm-d's header naming why a request was dropped before it reached a model server
#: (``RequestDroppedReasonHeaderKey`` in llm-d-router's ``pkg/common/error/error.go``,
#: https://github.com/llm-d/llm-d-router/blob/main/pkg/common/error/error.go), set beside
#: ``x-kvgate-reason`` on every refusal by admission (:data:`LLMD_DROPPED_REASONS`).
LLMD_DROPPED_HEADER = "x-llm-d-request-dropped-reason"
#: kvgate's refusal reasons as llm-d's dropped reasons (docs/routers.md, "Refusal semantics"):
#: what this replica cannot take now (its capacity, its queue, a tenant's budget here, the GPU
#: safety net) is ``rejected-saturated``; a wait in the queue that ran out,
#: ``rejected-ttl-expired``; the drain, ``rejected-shutting-down``; thresholds kvgate cannot
#: trust (``fail_closed``), ``rejected-internal``. A request's own fault (4xx but 429) and the
#: model server's failures carry no such header: they were not dropped by admission.
LLMD_DROPPED_REASONS = {
    Reason.CONCURRENCY: "rejected-saturated",
    Reason.KV_CAPACITY: "rejected-saturated",
    Reason.QUEUE_FULL: "rejected-saturated",
    Reason.SHEDDABLE: "rejected-saturated",
    Reason.SLO: "rejected-saturated",
    Reason.RATE_LIMIT_REQUESTS: "rejected-saturated",
    Reason.RATE_LIMIT_TOKENS: "rejected-saturated",
    Reason.GPU_MEMORY_LOW: "rejected-saturated",
    Reason.QUEUE_TIMEOUT: "rejected-ttl-expired",
    Reason.DRAINING: "rejected-shutting-down",
    Reason.FAIL_CLOSED: "rejected-internal",
}


def json_response(status: int, body: bytes, headers: dict[str, str] | None = None) -> Answer:
    """A response with a JSON ``body`` (already serialised)."""
    return Answer(status=status, body=body, content_type=JSON, headers=headers)


def refusal(d: Decision, api: ApiTraits = CHAT) -> Answer:
    """The answer to a refused decision (``d.ticket`` is None): its status (400, 429 or 503),
    ``Retry-After`` (seconds) when the decision gives one, ``RateLimit-Policy`` and ``RateLimit``
    when a bucket refused, and an OpenAI error body (a 400 names the offending field as the
    ``api`` calls it, :attr:`~kvgate_agent.sidecar.reading.apis.traits.ApiTraits.prompt_param` and
    :attr:`~kvgate_agent.sidecar.reading.apis.traits.ApiTraits.limit_param`: ``prompt`` is
    ``messages`` for chat, ``max_tokens`` is ``parameters.max_new_tokens`` for TGI...);
    ``x-envoy-ratelimited: true`` when a fleet-wide budget refused it (``d.fleet_wide``), never
    otherwise; and llm-d's ``x-llm-d-request-dropped-reason`` for a 429 or 503
    (:data:`LLMD_DROPPED_REASONS`)."""
    headers = {DECISION_HEADER: d.outcome.value, REASON_HEADER: d.reason.value}
    dropped = LLMD_DROPPED_REASONS.get(d.reason)
    if dropped is not None and d.status in (429, 503):
        headers[LLMD_DROPPED_HEADER] = dropped
    if d.fleet_wide:
        headers[ENVOY_RATELIMITED_HEADER] = "true"
    if d.retry_after is not None:
        headers["Retry-After"] = str(d.retry_after)
    if d.bucket_capacity is not None and d.bucket_window is not None:
        quota = max(1, round(d.bucket_capacity))
        headers["RateLimit-Policy"] = (
            f'"{d.limit}";q={quota};w={max(1, round(d.bucket_window))};qu="{d.unit}"'
        )
        remaining = max(0, int(d.bucket_remaining or 0.0))
        headers["RateLimit"] = f'"{d.limit}";r={remaining};t={d.retry_after or 1}'
    if d.status == 400:
        param = d.param or "max_tokens"
        if param == "prompt":
            param = api.prompt_param
        elif param == "max_tokens":
            param = api.limit_param
        body = error_body(d.message, INVALID_REQUEST_ERROR, param, d.reason.value)
    elif d.status == 503:
        body = error_body(d.message, SERVICE_UNAVAILABLE, None, d.reason.value)
    else:
        body = error_body(d.message, RATE_LIMIT_ERROR, None, RATE_LIMIT_EXCEEDED)
    return json_response(d.status, body, headers)


def admitted_headers(d: Decision, mode: str | None, max_tokens_clamped: bool) -> dict[str, str]:
    """Headers added to the model server's answer for an admitted request: the decision, the
    thresholds mode (agent mode), what was degraded (a smaller ``max_tokens`` or another model,
    or the policy's ``max_tokens`` cap) and the queue wait (milliseconds) when it waited."""
    headers = {DECISION_HEADER: d.outcome.value}
    if mode is not None:
        headers[THRESHOLDS_HEADER] = mode
    if d.outcome is Outcome.DEGRADED:
        headers[REASON_HEADER] = d.reason.value
        headers["x-kvgate-degraded"] = (
            f"model={d.model}" if d.model is not None else f"max_tokens={d.max_tokens}"
        )
    elif max_tokens_clamped:
        headers[REASON_HEADER] = "max_tokens_cap"
        headers["x-kvgate-degraded"] = f"max_tokens={d.max_tokens}"
    if d.queue_seconds > 0:
        headers["x-kvgate-queue-wait-ms"] = str(round(d.queue_seconds * 1000))
    return headers


def bad_request(exc: RequestError) -> Answer:
    """A request the sidecar refuses before admission (invalid body, too large, bad header,
    body too slow). After a 408 the connection is closed (the rest of the body is not
    awaited)."""
    resp = json_response(
        exc.status,
        exc.body(),
        {DECISION_HEADER: "rejected", REASON_HEADER: "invalid_request"},
    )
    if exc.status == 408:
        resp.force_close()
    return resp


def unauthorized(exc: RequestError) -> Answer:
    """401 for a credential the sidecar refuses (:mod:`kvgate_agent.sidecar.identity.identity`),
    with ``WWW-Authenticate: Bearer`` (RFC 6750 §3); reason ``invalid_api_key``."""
    return json_response(
        401,
        exc.body(),
        {
            "WWW-Authenticate": 'Bearer realm="kvgate"',
            DECISION_HEADER: "rejected",
            REASON_HEADER: "invalid_api_key",
        },
    )


def draining() -> Answer:
    """503 for a request while the sidecar shuts down (new, queued, or in flight and not yet
    answered at the drain deadline): ``code: draining``, as the queued refusal has it."""
    return json_response(
        503,
        error_body("sidecar is shutting down", SERVICE_UNAVAILABLE, None, "draining"),
        {
            "Retry-After": "1",
            DECISION_HEADER: "rejected",
            REASON_HEADER: Reason.DRAINING.value,
            LLMD_DROPPED_HEADER: LLMD_DROPPED_REASONS[Reason.DRAINING],
        },
    )


def non_canonical_path() -> Answer:
    """400 for a path that only normalises to an admission-controlled or allowlisted one."""
    return json_response(
        400,
        error_body(
            "use the canonical path (no dot segments, repeated slashes or escapes)",
            INVALID_REQUEST_ERROR,
            None,
            "non_canonical_path",
        ),
        {DECISION_HEADER: "rejected", REASON_HEADER: "invalid_request"},
    )


def not_a_path(target: str) -> Answer:
    """400 for a request target that is not a path (``*``, an authority): the sidecar serves
    and passes on paths only (RFC 9112 §3.2)."""
    return json_response(
        400,
        error_body(
            f"the request target {target[:100]!r} is not a path",
            INVALID_REQUEST_ERROR,
            None,
            "invalid_target",
        ),
        {DECISION_HEADER: "rejected", REASON_HEADER: "invalid_request"},
    )


def method_not_allowed(method: str, path: str) -> Answer:
    """405 with ``Allow`` for a generation path asked with another method than POST (RFC 9110
    §15.5.6); never forwarded."""
    return json_response(
        405,
        error_body(
            f"{method} is not allowed on {path}: use POST",
            INVALID_REQUEST_ERROR,
            None,
            "method_not_allowed",
        ),
        {"Allow": "POST, OPTIONS", DECISION_HEADER: "rejected", REASON_HEADER: "invalid_request"},
    )


def unsupported_media_type(content_type: str) -> Answer:
    """415 for a generation request whose body is not declared as JSON (RFC 9110 §15.5.16)."""
    return json_response(
        415,
        error_body(
            f"the request body must be application/json, got {content_type[:100]!r}",
            INVALID_REQUEST_ERROR,
            None,
            "unsupported_media_type",
        ),
        {"Accept": JSON, DECISION_HEADER: "rejected", REASON_HEADER: "invalid_request"},
    )


#: The headers of a client's request refused before admission for its own fault.
REFUSED_INVALID = {DECISION_HEADER: "rejected", REASON_HEADER: "invalid_request"}


def header_deadline_answer(*, client: bool) -> bytes:
    """The whole answer, as written to the socket, of a connection whose request headers did
    not arrive within the header deadline: ``408 Request Timeout`` with ``Connection: close``
    and an OpenAI error body (:func:`~kvgate_agent.sidecar.reading.openai_errors.headers_too_slow`,
    ``code: request_timeout``); ``client``: on the port serving clients, so it also carries
    :data:`REFUSED_INVALID` (the admin port's answers carry no ``x-kvgate-*``)."""
    body = headers_too_slow().body()
    extra = "".join(f"{k}: {v}\r\n" for k, v in REFUSED_INVALID.items()) if client else ""
    head = (
        "HTTP/1.1 408 Request Timeout\r\nConnection: close\r\n"
        f"Content-Type: {JSON}\r\n{extra}Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode("ascii") + body


def malformed_http(status: int, message: str, *, client: bool) -> Answer:
    """``status`` (the 4xx the server leg's HTTP parser chose, 400 for a broken request line or
    header, ``Content-Length`` with ``Transfer-Encoding``) for a request the parser refused
    before any handler ran: ``code: malformed_http``, with ``message`` (the parser's reason).
    ``client``: on the port serving clients, so it carries :data:`REFUSED_INVALID` (not on the
    admin port, whose answers carry no ``x-kvgate-*``)."""
    return json_response(
        status,
        error_body(message, INVALID_REQUEST_ERROR, None, "malformed_http"),
        REFUSED_INVALID if client else None,
    )


def not_allowed_path(method: str, path: str) -> Answer:
    """404 for a mutating request on a path that is neither a generation API kvgate admits nor on
    its pass-through allowlist; never forwarded (``--passthrough-path`` adds paths)."""
    return json_response(
        404,
        error_body(
            f"{method} {path[:200]} is not a generation API kvgate admits nor on its "
            "pass-through allowlist (--passthrough-path)",
            INVALID_REQUEST_ERROR,
            None,
            "unknown_endpoint",
        ),
        {DECISION_HEADER: "rejected", REASON_HEADER: "unknown_endpoint"},
    )


def upstream_unreachable(headers: dict[str, str]) -> Answer:
    """502 when the model server cannot be connected to (admitted request); ``headers`` are the
    admission headers already decided."""
    code = "upstream_unreachable"
    return json_response(
        502,
        error_body("model server unreachable", SERVER_ERROR, None, code),
        {**headers, "Retry-After": "1", REASON_HEADER: code},
    )


def upstream_failed_text(timeout: bool) -> tuple[str, str]:
    """(message, code) for a model server that failed while answering (or timed out)."""
    if timeout:
        return "the model server did not answer in time", "upstream_timeout"
    return "the model server failed while answering", "upstream_error"


def upstream_failed(timeout: bool, headers: dict[str, str]) -> Answer:
    """504 (timeout) or 502 when the model server failed before anything was sent on."""
    message, code = upstream_failed_text(timeout)
    return json_response(
        504 if timeout else 502,
        error_body(message, SERVER_ERROR, None, code),
        {**headers, "Retry-After": "1", REASON_HEADER: code},
    )


def upstream_error_status(status: int, headers: dict[str, str]) -> Answer:
    """The model server's own 5xx whose body is not an OpenAI error object (an HTML page from
    a proxy, a crash trace): the same status with an OpenAI-style body, so SDKs surface it."""
    code = "upstream_error"
    return json_response(
        status,
        error_body(f"the model server answered {status}", SERVER_ERROR, None, code),
        {**headers, REASON_HEADER: code},
    )


def upstream_failed_event(timeout: bool) -> bytes:
    """The in-band SSE error event sent when the model server fails mid-stream (as vLLM does)."""
    message, code = upstream_failed_text(timeout)
    return b"data: " + error_body(message, SERVER_ERROR, None, code) + b"\n\n"


def shutting_down_event() -> bytes:
    """The terminal SSE error event of a stream cut at the drain deadline."""
    body = error_body("sidecar is shutting down", SERVICE_UNAVAILABLE, None, "shutting_down")
    return b"data: " + body + b"\n\n"


def passthrough_unreachable() -> Answer:
    """502 when a pass-through request cannot connect to the model server."""
    return json_response(
        502,
        error_body("model server unreachable", SERVER_ERROR, None, "upstream_unreachable"),
        {DECISION_HEADER: "passthrough", "Retry-After": "1"},
    )


def passthrough_failed(exc: BaseException) -> Answer:
    """502 when a pass-through request fails before the model server answered."""
    return json_response(
        502,
        error_body(
            f"model server failed: {type(exc).__name__}", SERVER_ERROR, None, "upstream_error"
        ),
        {DECISION_HEADER: "passthrough"},
    )
