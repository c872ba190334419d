"""A client request's body as kvgate's own server leg receives it: bytes buffered as llhttp
hands them over, decoded from ``gzip`` or ``deflate`` (``Content-Encoding``, RFC 9110 §8.4.1),
read by the handler as they come, with flow control back to the connection.

The decoded size is bounded (``decoded_limit`` bytes, the sidecar's request body limit + 1): a
compressed body that would inflate past it stops being decoded and reads as one byte over the
limit, so the handler's size check refuses it (413) and a decompression bomb never reaches
memory (https://cwe.mitre.org/data/definitions/409.html).
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import AsyncIterator, Callable
from typing import Any

__all__ = ["DECODABLE", "BodyStream", "MalformedBody"]

#: ``Content-Encoding`` values decoded on the way in (``x-gzip`` is gzip, RFC 9110 §8.4.1.3).
DECODABLE = frozenset({"gzip", "x-gzip", "deflate"})

#: Buffered body bytes above which the connection stops reading until the handler reads.
READ_HIGH_WATER = 256 * 1024


class MalformedBody(ValueError):
    """The body cannot be read as sent: bad chunked framing (llhttp's reason), or an encoding
    that does not decode. ``status``: the 4xx the client gets."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class BodyStream:
    """One request's body (see the module docstring).

    Args:
        encoding: the request's ``Content-Encoding`` (lower case; "" or ``identity``: none);
            one of :data:`DECODABLE` or none (the connection refuses others before).
        decoded_limit: bytes of decoded body kept at most (for an encoded body).
        pause: called when more than :data:`READ_HIGH_WATER` bytes wait unread.
        resume: called when the handler has read them.
        on_first_read: called once, when the handler first waits for the body (``Expect:
            100-continue``: the interim answer is sent then), or None.
    """

    __slots__ = (
        "_chunks",
        "_decoder",
        "_discard",
        "_encoding",
        "_eof",
        "_error",
        "_limit",
        "_on_first_read",
        "_pause",
        "_paused",
        "_resume",
        "_size",
        "_waiter",
        "decoded",
        "total_bytes",
    )

    def __init__(
        self,
        encoding: str,
        decoded_limit: int,
        pause: Callable[[], None],
        resume: Callable[[], None],
        on_first_read: Callable[[], None] | None = None,
    ) -> None:
        self._chunks: list[bytes] = []
        self._size = 0  # bytes buffered
        self._eof = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self._pause = pause
        self._resume = resume
        self._on_first_read = on_first_read
        self._limit = decoded_limit
        self._discard = False
        self._encoding = encoding if encoding in DECODABLE else ""
        self._decoder: Any = None  # a zlib decompressor, made on the first bytes
        #: Bytes of body received on the wire (before decoding).
        self.total_bytes = 0
        #: Bytes of body after decoding (at most ``decoded_limit`` + 1 for an encoded body).
        self.decoded = 0

    # ---------------------------------------------------------------- the connection's side

    def feed_data(self, data: bytes) -> None:
        """Bytes of the body from the wire."""
        self.total_bytes += len(data)
        if self._discard:
            return
        if self._encoding:
            data = self._decode(data)
            if not data:
                return
        self.decoded += len(data)
        self._chunks.append(data)
        self._size += len(data)
        if self._size > READ_HIGH_WATER and not self._paused:
            self._paused = True
            self._pause()
        self._wake()

    def _decode(self, data: bytes) -> bytes:
        room = self._limit + 1 - self.decoded
        if room <= 0:
            return b""  # already over the limit: the handler refuses it
        if self._decoder is None and data:
            self._decoder = zlib.decompressobj(_wbits(self._encoding, data[0]))
        try:
            out = self._decoder.decompress(data, room) if self._decoder is not None else data
            # A gzip body may hold several members, one after another (RFC 1952 §2.2).
            while self._decoder is not None and self._decoder.eof and self._decoder.unused_data:
                rest = self._decoder.unused_data
                if self._encoding == "deflate":
                    raise zlib.error("bytes after the end of a deflate stream")
                self._decoder = zlib.decompressobj(47)
                out += self._decoder.decompress(rest, max(0, room - len(out)))
        except zlib.error:
            self._malformed("the request body is not valid gzip or deflate")
            return b""
        if len(out) >= room:  # it would grow past the limit: one byte over is what is kept
            out = out[:room]
        return out

    def _malformed(self, message: str) -> None:
        """The encoded body cannot be decoded: what was decoded is dropped, readers get
        :class:`MalformedBody` (400)."""
        self._chunks = []
        self._size = 0
        self.set_exception(MalformedBody(message))

    def discard(self) -> None:
        """Drop what is buffered and what comes (the answer was sent without reading it)."""
        self._discard = True
        self._chunks = []
        self._size = 0
        if self._paused:
            self._paused = False
            self._resume()

    def feed_eof(self) -> None:
        """The body is complete; an encoded one whose stream did not end is refused
        (:class:`MalformedBody` on read), not read as if whole; one already refused keeps its
        first fault (not gzip at all is not a cut stream)."""
        d = self._decoder
        ended = d is None or d.eof or self._error is not None
        if not ended and self.decoded <= self._limit and not self._discard:
            self._malformed("the request body's gzip or deflate stream is cut")
        self._eof = True
        self._wake()

    def set_exception(self, exc: BaseException) -> None:
        """The body cannot complete (the client went away, bad encoding): readers get ``exc``."""
        self._error = exc
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # ---------------------------------------------------------------- the handler's side

    def is_eof(self) -> bool:
        """The whole body has been received (part of it may still be buffered)."""
        return self._eof

    def read_nowait(self, n: int = -1) -> bytes:
        """What is buffered now, all of it (``n`` is accepted for aiohttp's signature; only -1
        is used); with nothing buffered, raises what stopped the body (as aiohttp's reader)."""
        chunks = self._chunks
        if not chunks:
            if self._error is not None:
                raise self._error
            return b""
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._chunks = []
        self._size = 0
        if self._paused:
            self._paused = False
            self._resume()
        return data

    async def readany(self) -> bytes:
        """The next bytes (all that is buffered), b"" at the end; raises what stopped the body
        (``ConnectionResetError`` when the client went away, :class:`MalformedBody`)."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._eof:
                return b""
            if self._on_first_read is not None:
                first, self._on_first_read = self._on_first_read, None
                first()
            self._waiter = w = asyncio.get_running_loop().create_future()
            try:
                await w
            finally:
                self._waiter = None
        return self.read_nowait()

    def iter_any(self) -> AsyncIterator[bytes]:
        """The bytes as they come, until the end."""
        return _Chunks(self)


class _Chunks:
    """:meth:`BodyStream.iter_any`'s iterator: an async iterator class, not an async
    generator, which mypyc does not compile (``scripts/mypyc-modules.txt``)."""

    __slots__ = ("_body",)

    def __init__(self, body: BodyStream) -> None:
        self._body = body

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> bytes:
        chunk = await self._body.readany()
        if not chunk:
            raise StopAsyncIteration
        return chunk


def _wbits(encoding: str, first: int) -> int:
    """zlib's ``wbits`` for a body in ``encoding`` whose first byte is ``first``: gzip or a zlib
    stream detected from the header (47); for ``deflate``, a zlib stream (15) when its first
    byte names the deflate method, else raw deflate (-15), which some clients send as
    ``deflate`` (https://docs.python.org/3/library/zlib.html#zlib.decompressobj; RFC 9110
    §8.4.1.2 names the zlib format)."""
    if encoding == "deflate":
        return 15 if first & 0x0F == 8 else -15
    return 47
