"""A client's request body within the sidecar's size and time bounds (``--max-body-bytes``,
``--body-timeout-seconds``): read whole for an admission-controlled request (:func:`read_body`),
streamed on for a pass-through one (:class:`StreamedBody`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from kvgate_agent.sidecar.edge.wire import ClientRequest
from kvgate_agent.sidecar.reading import RequestError, body_too_slow


def too_large(limit: int) -> RequestError:
    """413 for a request body over ``limit`` bytes (``--max-body-bytes``), declared or read."""
    return RequestError(413, f"request body exceeds {limit} bytes", code="body_too_large")


async def read_body(
    request: ClientRequest, limit: int, seconds: float, on_timeout: Callable[[], None]
) -> bytes:
    """The request body (bytes), at most ``limit`` bytes decoded, arriving within ``seconds``
    (0: no deadline; ``on_timeout`` is called when it passes).

    Raises:
        RequestError: 413 above ``limit``, 408 when the body takes longer than ``seconds``.
    """
    content = request.content
    if content.is_eof() and request.content_length is not None:
        # The whole body came with the headers (a small request): no waiting, no deadline.
        # The size checked is the decoded one, as below (a compressed body may grow).
        data = content.read_nowait(-1)
        if request.content_length > limit or len(data) > limit:
            raise too_large(limit)
        return data
    try:
        async with asyncio.timeout(seconds or None):
            return await _read_unbounded(request, limit)
    except TimeoutError:
        on_timeout()
        raise body_too_slow() from None


async def _read_unbounded(request: ClientRequest, limit: int) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise too_large(limit)
    chunks = []
    size = 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


class BodyTooSlow(Exception):
    """A pass-through request's body did not arrive within the body deadline, or grew past the
    body limit (not an ``OSError``, unlike ``TimeoutError``, so aiohttp's client reports it as
    a payload error)."""


@dataclass(slots=True)
class StreamedBody:
    """A pass-through request body streamed upstream (:meth:`chunks`), ending with
    :class:`BodyTooSlow` when it is not complete ``timeout`` seconds (0: no limit) after
    ``start`` (``loop.time()``, seconds: ``expired``) or grows past ``limit`` bytes (0: no
    limit; ``too_large``)."""

    request: ClientRequest
    timeout: float
    start: float
    limit: int = 0
    expired: bool = False
    too_large: bool = False

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's chunks (bytes) as they arrive."""
        loop = asyncio.get_running_loop()
        size = 0
        while True:
            left = self.start + self.timeout - loop.time() if self.timeout > 0 else None
            try:
                async with asyncio.timeout(left):
                    chunk = await self.request.content.readany()
            except TimeoutError:
                self.expired = True
                raise BodyTooSlow() from None
            if not chunk:
                return
            size += len(chunk)
            if self.limit and size > self.limit:
                self.too_large = True
                raise BodyTooSlow()
            yield chunk
