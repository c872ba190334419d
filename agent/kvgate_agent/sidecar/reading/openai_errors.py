"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}``.

The shape is the one the OpenAI API returns (https://platform.openai.com/docs/guides/error-codes)
and that vLLM's OpenAI-compatible server mirrors, so existing client libraries surface our
rejections like the server's own. Pure JSON logic: no HTTP framework.
"""

from __future__ import annotations

import json

__all__ = [
    "INVALID_REQUEST_ERROR",
    "RATE_LIMIT_ERROR",
    "RATE_LIMIT_EXCEEDED",
    "SERVER_ERROR",
    "SERVICE_UNAVAILABLE",
    "RequestError",
    "error_body",
]

INVALID_REQUEST_ERROR = "invalid_request_error"
"""``type`` for malformed or unsatisfiable requests (HTTP 400, 413, 422)."""
RATE_LIMIT_ERROR = "rate_limit_error"
"""``type`` for HTTP 429; pair it with ``code`` :data:`RATE_LIMIT_EXCEEDED`."""
RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"
"""``code`` OpenAI uses on HTTP 429 responses."""
SERVER_ERROR = "server_error"
"""``type`` for upstream or internal failures (HTTP 500, 502)."""
SERVICE_UNAVAILABLE = "service_unavailable"
"""``type`` for shedding load or an unavailable upstream (HTTP 503)."""


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> bytes:
    """Serialize an OpenAI error object: compact JSON, UTF-8, all four keys always present.

    Example: ``error_body("bad", "invalid_request_error", "n")`` ->
    ``b'{"error":{"message":"bad","type":"invalid_request_error","param":"n","code":null}}'``.
    """
    obj = {"error": {"message": message, "type": type, "param": param, "code": code}}
    try:
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
    except UnicodeEncodeError:  # a lone surrogate: keep it as a valid JSON escape
        return json.dumps(obj, separators=(",", ":")).encode()


class RequestError(Exception):
    """A request the sidecar answers itself with an OpenAI-style error.

    Attributes mirror the constructor: ``status`` (HTTP status code), ``message``, ``type``,
    ``param`` (the offending request field, e.g. ``"max_tokens"``, or None) and ``code``.
    """

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = INVALID_REQUEST_ERROR,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> bytes:
        """The JSON response body (see :func:`error_body`)."""
        return error_body(self.message, self.type, self.param, self.code)

    def __repr__(self) -> str:
        return f"RequestError({self.status}, {self.message!r}, param={self.param!r})"


def body_too_slow() -> RequestError:
    """408 for a request body that did not arrive within the body deadline
    (``--body-timeout-seconds``), on an admitted or a pass-through path alike."""
    return RequestError(408, "the request body arrived too slowly", code="request_timeout")


def headers_too_slow() -> RequestError:
    """408 for a connection whose request headers did not all arrive within the header deadline
    (``--header-timeout-seconds``, counted from the connection's opening or from the first byte
    of a later request); the connection is closed after it."""
    return RequestError(408, "the request headers arrived too slowly", code="request_timeout")
