"""What the request pipeline needs of a client's request and of the answer it streams, as kvgate's
own server leg (:mod:`kvgate_agent.sidecar.edge.client_conn`, llhttp through ``httptools``)
presents them: the edge's neutral request/answer types (as uvicorn presents ASGI's), the only
server leg since the aiohttp one was retired.

:class:`ClientRequest` and :class:`ResponseStream` are structural: the own leg's
:class:`~kvgate_agent.sidecar.edge.client_request.Request` and
:class:`~kvgate_agent.sidecar.edge.client_request.StreamOut` satisfy them. A handler answers with
a finished :class:`Answer` (kvgate's plain holder of status, headers and body, defined in the
bottom room, :mod:`kvgate_agent.sidecar.reading.answer`, and re-exported here: the leg writes it
itself) or with the stream it opened with :func:`new_stream`; one that has more to do once the
client has its finished answer (an admitted request's release) writes it first with
:func:`answer_now`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Protocol

from multidict import CIMultiDictProxy
from yarl import URL

from kvgate_agent.sidecar.reading import Answer


class BodyReader(Protocol):
    """A request body as it arrives (decoded from its ``Content-Encoding``), bytes."""

    async def readany(self) -> bytes:
        """The next bytes that came (b"" at the end)."""
        ...

    def iter_any(self) -> AsyncIterator[bytes]:
        """The bytes as they come, until the end."""
        ...

    def read_nowait(self, n: int = -1) -> bytes:
        """What is buffered now (at most ``n`` bytes; -1: all)."""
        ...

    def is_eof(self) -> bool:
        """The whole body has been received (some of it may still be buffered)."""
        ...


class ClientRequest(Protocol):
    """A client's request as the pipeline reads it (the own leg's
    :class:`~kvgate_agent.sidecar.edge.client_request.Request`)."""

    @property
    def method(self) -> str: ...

    @property
    def path(self) -> str:
        """The request target's path, as sent."""
        ...

    @property
    def path_qs(self) -> str:
        """The path and the query, ``/a?b=c``."""
        ...

    @property
    def rel_url(self) -> URL:
        """The target as sent, relative (an absolute-form target's path and query)."""
        ...

    @property
    def headers(self) -> CIMultiDictProxy[str]: ...

    @property
    def content(self) -> BodyReader: ...

    @property
    def content_length(self) -> int | None:
        """The declared ``Content-Length`` (bytes), None when not given (chunked, no body)."""
        ...

    @property
    def body_exists(self) -> bool:
        """The request carries a body (a length or chunked framing was declared)."""
        ...

    def new_stream(
        self, status: int, headers: Mapping[str, str], content_length: int | None
    ) -> ResponseStream:
        """A streamed answer to this request, not yet sent (see :func:`new_stream`)."""
        ...

    def respond(self, resp: Answer) -> ResponseStream:
        """Write ``resp`` (finished) now (see :func:`answer_now`)."""
        ...


class ResponseStream(Protocol):
    """A streamed answer the pipeline returns: one it opened with :func:`new_stream` and wrote
    (the own leg's :class:`~kvgate_agent.sidecar.edge.client_request.StreamOut`), or what
    :func:`answer_now` gave back for a finished :class:`Answer` already written."""

    @property
    def prepared(self) -> bool:
        """The status line and headers were sent."""
        ...

    @property
    def headers(self) -> Any: ...

    async def prepare(self, request: Any) -> Any:
        """Send the status line and headers."""
        ...

    async def write(self, data: bytes) -> None:
        """Send ``data`` (a body part); raises ``ConnectionResetError`` when the client is gone."""
        ...

    async def write_eof(self, data: bytes = b"") -> None:
        """Send ``data`` and end the body."""
        ...

    def force_close(self) -> None:
        """Close the client's connection once this answer ends."""
        ...


#: What a handler answers with: a finished :class:`Answer` (the leg writes it whole), or the
#: stream it opened with :func:`new_stream` and wrote.
Reply = Answer | ResponseStream

#: A handler of the clients' port: a request in, its answer out.
Handler = Callable[[Any], Awaitable[Reply]]


def new_stream(
    request: ClientRequest,
    status: int,
    headers: Mapping[str, str],
    content_length: int | None = None,
) -> ResponseStream:
    """A streamed answer to ``request`` with ``status`` and ``headers`` (``content_length``
    bytes when known, else chunked), not yet sent: ``await out.prepare(request)`` sends its
    head. The request's own writer (no per-chunk objects)."""
    out: ResponseStream = request.new_stream(status, headers, content_length)
    return out


def answer_now(request: ClientRequest, resp: Answer) -> ResponseStream:
    """Write ``resp`` (finished) to the client of ``request`` now, before the handler goes on
    (an admitted request's release then costs the client nothing), and answer with what this
    returns: the bytes it would have written after the handler, written by the request
    (:meth:`~kvgate_agent.sidecar.edge.client_request.Request.respond`; raises
    ``ConnectionResetError`` when the client is gone)."""
    out: ResponseStream = request.respond(resp)
    return out
