"""Client bytes into requests, for kvgate's own server leg: llhttp's request parser
(``httptools``) and the :class:`~kvgate_agent.sidecar.edge.client_request.Request` each message
becomes, its body fed as it arrives.

Refused while parsed (:class:`Refused`, raised out of :meth:`RequestParser.feed`): what llhttp
refuses (a broken request line or header, ``Content-Length`` with ``Transfer-Encoding``: request
smuggling, RFC 9112 §6.3, a bad chunk size) with 400; a request target over ``max_field``
bytes with 414, a header field over it, or a header section over twice it (counted as the
bytes arrive: llhttp holds a field whole until it ends), with 431 (RFC 9110 §15.5.15, RFC 6585
§5); an unknown
``Content-Encoding`` with 415 (RFC 9110 §15.5.16).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn, Protocol

import httptools
from multidict import CIMultiDict

from kvgate_agent.sidecar.edge.client_body import DECODABLE, BodyStream, MalformedBody
from kvgate_agent.sidecar.edge.client_request import Link, Request

__all__ = ["Receiver", "Refused", "RequestParser", "Upgraded"]

#: llhttp paused on an ``Upgrade`` (or ``CONNECT``) request: served as a plain request, after
#: which the connection closes (kvgate switches no protocol).
Upgraded = httptools.HttpParserUpgrade


class Refused(Exception):
    """A request refused while it is parsed: ``status`` (4xx) and the reason."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Receiver(Link, Protocol):
    """What the parser hands its requests to (the connection)."""

    def on_request(self, req: Request) -> None:
        """A request's headers are complete (its body follows through its ``content``)."""
        ...

    def on_complete(self) -> None:
        """A request, its body included, is complete."""
        ...

    def pause_body(self) -> None:
        """A body waits unread: stop reading."""
        ...

    def resume_body(self) -> None:
        """The handler read it: read again."""
        ...

    def send_continue(self) -> None:
        """``Expect: 100-continue``: ask for the body."""
        ...


class RequestParser:
    """The requests of one connection as their bytes come (see the module docstring).

    ``partial``: a request has begun whose headers are not complete; ``reading``: the request
    whose body is arriving (None between requests).

    Args:
        receiver: the connection.
        max_field: bytes of a request target, or of one header field (name and value).
        decoded_limit: bytes of a decoded (gzip, deflate) body kept at most.
    """

    __slots__ = (
        "_decoded_limit",
        "_head",
        "_headers",
        "_max_field",
        "_max_head",
        "_parser",
        "_receiver",
        "_upgrade_body",
        "_url",
        "partial",
        "reading",
    )

    def __init__(self, receiver: Receiver, max_field: int, decoded_limit: int) -> None:
        self._receiver = receiver
        self._max_field = max_field
        self._decoded_limit = decoded_limit
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self.partial = False
        self.reading: Request | None = None
        self._head = 0  # bytes fed while a request's headers were incomplete
        self._max_head = 2 * max_field
        self._upgrade_body = 0  # bytes of an Upgrade request's body still to come

    def feed(self, data: bytes) -> None:
        """Parse ``data``, handing requests to the receiver as their headers complete.

        Raises:
            Refused: a request (or a body's framing) is malformed; nothing more is parsed.
            Upgraded: an ``Upgrade`` request ended the parse.
        """
        was_partial = self.partial
        if was_partial:
            self._head += len(data)
            if self._head > self._max_head:  # llhttp holds a field until it ends: bound it here
                self._refuse(self._too_long())
        try:
            self._parser.feed_data(data)
            if self.partial and not was_partial:
                self._head += len(data)  # an upper bound: the chunk may hold earlier requests
                if self._head > self._max_head:
                    raise self._too_long()
        except Refused as refused:
            self._refuse(refused)
        except httptools.HttpParserUpgrade:
            raise
        except httptools.HttpParserError as exc:
            ctx = exc.__context__
            self._refuse(ctx if isinstance(ctx, Refused) else Refused(400, str(exc) or "bad HTTP"))

    def _too_long(self) -> Refused:
        """The refusal of a request whose line or headers grew past the bound while they came:
        414 while its target is still arriving (llhttp hands it over whole), else 431."""
        if not self._url:
            return Refused(414, f"the request target is over {self._max_field} bytes")
        return Refused(431, f"the request's headers are over {self._max_head} bytes")

    def _refuse(self, refused: Refused) -> NoReturn:
        """Stop parsing: ``refused`` goes to the connection (and to a body being read: its
        handler answers it when it reads the body)."""
        self.partial = False
        body_req = self.reading
        if body_req is not None:
            self.reading = None
            body_req.content.set_exception(MalformedBody(str(refused), refused.status))
        raise refused from None

    def feed_upgraded(self, data: bytes) -> None:
        """Bytes after an Upgrade request's headers (llhttp stopped there): its body, up to its
        Content-Length; what follows is dropped (the connection closes after the answer)."""
        req, left = self.reading, self._upgrade_body
        if req is None or left <= 0:
            return
        piece = data[:left]
        self._upgrade_body = left - len(piece)
        if piece:
            req.content.feed_data(piece)
        if self._upgrade_body == 0:
            req.content.feed_eof()
            self.reading = None
            self._receiver.on_complete()

    # ---------------------------------------------------------------- llhttp callbacks

    def on_message_begin(self) -> None:
        self.partial = True
        self._head = 0
        self._url = b""
        self._headers = []

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > self._max_field:
            raise Refused(414, f"the request target is over {self._max_field} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) + len(value) > self._max_field:
            raise Refused(431, f"a header field is over {self._max_field} bytes")
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        p = self._parser
        r = self._receiver
        headers: CIMultiDict[str] = CIMultiDict(
            (k.decode("utf-8", "surrogateescape"), v.decode("utf-8", "surrogateescape"))
            for k, v in self._headers
        )
        length_text = headers.get("Content-Length")
        length = None if length_text is None else int(length_text)  # llhttp checked it
        chunked = "chunked" in headers.get("Transfer-Encoding", "").lower()
        encoding = headers.get("Content-Encoding", "").strip().lower()
        if encoding not in ("", "identity") and encoding not in DECODABLE:
            raise Refused(415, f"unsupported Content-Encoding {encoding[:40]!r}")
        http10 = p.get_http_version() == "1.0"
        if not http10 and "Host" not in headers:
            raise Refused(400, "an HTTP/1.1 request needs a Host header (RFC 9112 §3.2)")
        upgrade = "Upgrade" in headers and "upgrade" in headers.get("Connection", "").lower()
        if upgrade and chunked:
            raise Refused(400, "an Upgrade request with a chunked body is not served")
        expect = not http10 and "100-continue" in headers.get("Expect", "").lower()
        ask: Callable[[], None] | None = r.send_continue if expect else None
        body = BodyStream(encoding, self._decoded_limit, r.pause_body, r.resume_body, ask)
        path, query = target(self._url)
        req = Request(
            r,
            p.get_method().decode("ascii", "replace"),
            path,
            query,
            headers,
            body,
            http10=http10,
            keep_alive=p.should_keep_alive(),
            content_length=length,
            has_body=chunked or bool(length),
        )
        self.partial = False
        self.reading = req
        # llhttp hands an Upgrade request on without its body (it stops parsing there): its
        # Content-Length bytes come through feed_upgraded (the upgrade itself is ignored).
        self._upgrade_body = (length or 0) if upgrade else 0
        r.on_request(req)

    def on_body(self, data: bytes) -> None:
        if self.reading is not None:
            self.reading.content.feed_data(data)

    def on_message_complete(self) -> None:
        if self._upgrade_body:
            return  # the body follows the upgrade: feed_upgraded
        if self.reading is not None:
            self.reading.content.feed_eof()
            self.reading = None
        self._receiver.on_complete()


def target(url: bytes) -> tuple[str, str]:
    """(path, query) of a request target as sent, without a fragment: origin-form ``/a?b``, or
    absolute-form ``http://host/a?b`` (RFC 9112 §3.2.2: its path, "/" when empty); anything else
    (``*``, CONNECT's authority-form) as is, which no route serves.

    Raises:
        Refused: 400, an absolute-form target that is not a URL.
    """
    url = url.partition(b"#")[0]
    if url[:1] == b"/":
        path, _, query = url.partition(b"?")
        return path.decode("latin-1"), query.decode("latin-1")
    if b"://" not in url:
        return url.decode("latin-1"), ""
    try:
        # Any: httptools' stub types the URL's parts as bytes, but an absent part is None
        # (``http://host``: no path), which compiled code (mypyc) would refuse as a TypeError.
        parsed: Any = httptools.parse_url(url)
    except httptools.HttpParserInvalidURLError:
        raise Refused(400, "the request target is not a URL") from None
    return (parsed.path or b"/").decode("latin-1"), (parsed.query or b"").decode("latin-1")
