"""A finished answer: the status, headers and body bytes a handler returns and the server leg
writes whole (:func:`~kvgate_agent.sidecar.edge.client_request.response_bytes`). kvgate's own
type, so that what the sidecar answers with names no HTTP library's (it was aiohttp's
``web.Response`` while aiohttp's server leg could serve it: retired, issue 35). Here, in the
bottom room, as every answer the sidecar builds itself (:mod:`.responses`) is one; the edge
re-exports it beside its other neutral types.
"""

from __future__ import annotations

from collections.abc import Mapping

from multidict import CIMultiDict

__all__ = ["Answer"]


class Answer:
    """``status``, ``headers`` (case-insensitive, mutable: a step may add one before it is
    written) and ``body`` (bytes); :meth:`force_close` asks the leg to close the connection
    after it (``keep_alive`` False; None: the connection's own rule). ``text`` gives the body
    as UTF-8 with ``Content-Type: text/plain; charset=utf-8``; ``content_type`` sets
    ``Content-Type`` (neither may be given with a ``Content-Type`` in ``headers``, as aiohttp's
    response refused).

    Raises:
        ValueError: both ``body`` and ``text``, or a ``Content-Type`` given twice.
    """

    __slots__ = ("body", "headers", "keep_alive", "status")

    def __init__(
        self,
        status: int = 200,
        *,
        body: bytes | None = None,
        text: str | None = None,
        headers: Mapping[str, str] | None = None,
        content_type: str | None = None,
    ) -> None:
        if body is not None and text is not None:
            raise ValueError("give body or text, not both")
        self.status = status
        self.headers: CIMultiDict[str] = CIMultiDict(headers or {})
        if text is not None:
            content_type = (content_type or "text/plain") + "; charset=utf-8"
            body = text.encode()
        if content_type is not None:
            if "Content-Type" in self.headers:
                raise ValueError("Content-Type given twice")
            self.headers["Content-Type"] = content_type
        self.body = b"" if body is None else body
        self.keep_alive: bool | None = None

    def force_close(self) -> None:
        """Close the client's connection once this answer is written."""
        self.keep_alive = False

    @property
    def text(self) -> str:
        """The body as text (UTF-8)."""
        return self.body.decode()

    def __repr__(self) -> str:
        return f"<Answer {self.status} {len(self.body)} bytes>"
