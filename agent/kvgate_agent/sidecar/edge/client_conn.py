"""One client connection of kvgate's own server leg: an asyncio protocol whose requests llhttp
(``httptools``) parses, each handed to its handler as a task, the answers written straight to
the transport in the order the requests came (pipelining, RFC 9112 §9.3.2).

What it guarantees (as the retired aiohttp leg's slow-client guard did):

* **Header deadline** (slow loris): a request's headers must be complete within
  ``header_timeout`` seconds, counted from the connection's opening (first request) or from
  the first byte of a later one (as hyper's ``header_read_timeout``,
  https://github.com/hyperium/hyper/pull/2675); then 408 (kvgate's refusal headers, an OpenAI
  error body) if part of a request came, and the connection closes (silently when nothing
  came, as Go's ``ReadHeaderTimeout``). The body's own deadline is the handler's.
* **Idle keep-alive**: a connection with no request for ``keepalive_timeout`` seconds closes.
* **Malformed HTTP** (a broken request line or header, ``Content-Length`` with
  ``Transfer-Encoding``: request smuggling, RFC 9112 §6.3, a bad chunk size, a request line or
  header field over ``max_field`` bytes, an unknown ``Content-Encoding``): a 4xx with an OpenAI
  error body (``code: malformed_http``), counted, and the connection closed; never handed on.
* **Client gone**: when the connection is lost, the running handler is cancelled at once (its
  reservation released by its own ``finally``) and the bodies being read fail.
* **Flow control**: reading pauses while a body waits unread or pipelined requests queue up;
  a writer waits while the client is slow to take the answer.
* **Answers that end cleanly**: a stream the handler hands back unended, or a handler that
  fails, closes the connection rather than let the client take a cut answer for a whole one.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvgate_agent.sidecar.edge.client_body import MalformedBody
from kvgate_agent.sidecar.edge.client_parse import Refused, RequestParser, Upgraded
from kvgate_agent.sidecar.edge.client_request import (
    Answered,
    Request,
    StreamOut,
    head_bytes,
    response_bytes,
)
from kvgate_agent.sidecar.edge.client_transport import ClientTransport
from kvgate_agent.sidecar.edge.wire import Handler
from kvgate_agent.sidecar.reading import SERVER_ERROR, Answer, error_body, responses

log = logging.getLogger("kvgate.sidecar")

__all__ = ["ClientConnection", "LegConfig"]

#: Requests parsed ahead of the one being answered before reading pauses (pipelining).
MAX_PIPELINED = 16


@dataclass(slots=True)
class LegConfig:
    """What every connection of one listener shares.

    ``route``: the handler of a request; ``header_timeout``/``keepalive_timeout``: seconds (0:
    no header deadline); ``max_field``: bytes of a request line or of one header field;
    ``decoded_limit``: bytes of a decoded (gzip, deflate) body kept at most;
    ``on_timeout``/``on_malformed``: counters' ``inc``; ``connections``: the open ones (the
    drain closes them); ``draining``: answers say ``Connection: close`` once it returns True;
    ``client``: the port serving clients, whose 408 and malformed-HTTP answers carry kvgate's
    refusal headers (False: the admin port, whose answers carry no ``x-kvgate-*``).
    """

    route: Callable[[Request], Handler]
    header_timeout: float
    keepalive_timeout: float
    max_field: int
    decoded_limit: int
    on_timeout: Callable[[], None]
    on_malformed: Callable[[], None]
    draining: Callable[[], bool]
    connections: set[ClientConnection]
    client: bool = True


#: What a connection whose headers came too slowly gets: 408, kvgate's refusal headers and an
#: OpenAI error body; on the admin port the same without the refusal headers.
_TIMEOUT_408 = responses.header_deadline_answer(client=True)
_ADMIN_TIMEOUT_408 = responses.header_deadline_answer(client=False)


class ClientConnection(ClientTransport):
    """One client connection (see the module docstring)."""

    __slots__ = (
        "_broken",
        "_config",
        "_eof",
        "_lingering",
        "_parser",
        "_pending_error",
        "_pipeline_full",
        "_queue",
        "_task",
        "_timer",
        "_timer_headers",
        "_upgraded",
    )

    def __init__(self, config: LegConfig) -> None:
        super().__init__()
        self._config = config
        self._parser = RequestParser(self, config.max_field, config.decoded_limit)
        self._queue: deque[Request] = deque()  # parsed requests; the first is being answered
        self._task: asyncio.Task[None] | None = None  # the first one's handler
        self._timer: asyncio.TimerHandle | None = None  # the header deadline or idle timeout
        self._timer_headers = False  # the timer armed is the header deadline
        self._pending_error: Refused | None = None  # a malformed request behind the current one
        self._upgraded = False
        self._pipeline_full = False
        self._broken = False  # a body's framing broke: nothing more is parsed
        self._lingering = False  # an answered request's unread body is read and dropped
        self._eof = False  # the client shut its side: close once what came is answered

    # ---------------------------------------------------------------- asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._config.connections.add(self)
        self._arm(self._config.header_timeout, headers=True)

    def data_received(self, data: bytes) -> None:
        if self._upgraded:
            self._parser.feed_upgraded(data)
            return
        if self._pending_error is not None or self._broken:
            return  # the connection closes after what is being answered
        try:
            self._parser.feed(data)
        except Upgraded as exc:
            self._upgraded = True  # answered as a plain request; the connection then closes
            self._parser.feed_upgraded(data[exc.args[0] :] if exc.args else b"")
        except Refused as refused:
            self._malformed(refused)
            return
        if (
            self._parser.partial
            and self._task is None
            and not self._queue
            and not self._timer_headers
        ):
            self._arm(self._config.header_timeout, headers=True)

    def eof_received(self) -> bool:
        """The client shut its sending side before its answer began: the complete requests
        received are still answered (then the connection closes), as a client that
        half-closes after sending its request expects; one whose body or headers were cut is
        dropped. A client gone whole sends the same FIN: told apart by
        :meth:`~ClientTransport.watch_half_closed`. A FIN once the answer has begun (a client
        half-closes as soon as it has sent its request) is the client leaving: closed now."""
        reading = self._parser.reading
        if (
            self._task is None
            or self.answer_started
            or self._upgraded
            or self._broken
            or reading is self._queue[0]  # the request being answered lacks its body
        ):
            return False
        if reading is not None and reading in self._queue:  # a pipelined one, cut: dropped
            self._queue.remove(reading)
            reading.content.set_exception(ConnectionResetError("the client closed its side"))
        self._eof = True
        self.watch_half_closed(ask=not self._queue[0].http10)  # no 1xx to HTTP/1.0 (§15.2)
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport_lost()
        self._config.connections.discard(self)
        self._disarm()
        gone = ConnectionResetError("the client closed the connection")
        for req in self._queue:
            req.content.set_exception(gone)
        if self._parser.reading is not None:
            self._parser.reading.content.set_exception(gone)
        if self._task is not None:
            self._task.cancel()  # the handler's finally releases what it holds

    # ---------------------------------------------------------------- parsed requests

    def on_request(self, req: Request) -> None:
        """A request's headers are complete (its body may follow): queue it, serve it if it
        is first."""
        if self._lingering:
            req.content.discard()  # the connection closes once the unread body is in
            return
        self._queue.append(req)
        if len(self._queue) > MAX_PIPELINED and not self._pipeline_full:
            self._pipeline_full = True
            self.pause_body()
        if self._task is None:
            self._disarm()
            self._start()

    def on_complete(self) -> None:
        """A request (its body included) is complete."""
        if self._lingering:
            self.close()

    # ---------------------------------------------------------------- serving

    def _start(self) -> None:
        """Run the handler of the first request queued."""
        req = self._queue[0]
        self.answer_started = False
        self._task = self._loop.create_task(self._serve(req))

    async def _serve(self, req: Request) -> None:
        close = False
        try:
            resp = await self._config.route(req)(req)
            close = self._answer(req, resp)
        except asyncio.CancelledError:
            close = True
            if not self.lost:
                raise
        except MalformedBody as exc:  # its body's framing or encoding broke while read
            close = True
            self._pending_error = None
            if not self.lost:
                self._write_refusal(Refused(exc.status, str(exc)))
        except Exception:
            log.exception("a handler failed on %s %s", req.method, req.path[:200])
            close = True
            self._fail(req)
        finally:
            self._task = None
        self._next(req, close)

    def _answer(self, req: Request, resp: object) -> bool:
        """Write ``resp`` (a finished ``Answer``; a stream, or an answer the handler
        wrote itself, is already written); whether the connection must close after it."""
        if isinstance(resp, StreamOut | Answered):
            if not resp.ended:
                return True  # cut short (the client went away, the model server failed)
            return resp.close or self._closing(req)
        if isinstance(resp, Answer):
            return self.answer(req, resp)
        raise TypeError(f"a handler answered {type(resp).__name__}")

    def answer(self, req: Request, resp: Answer) -> bool:
        """Write ``resp`` (finished) in answer to ``req``, the request being served (by
        :meth:`_answer`, or by its handler: :meth:`Request.respond`); whether the connection
        must close after it (then its head says so)."""
        close = self._closing(req) or resp.keep_alive is False or not req.content.is_eof()
        self.send(response_bytes(resp, req, close))
        return close

    def _closing(self, req: Request) -> bool:
        """Whether the connection closes after ``req``'s answer for its own reasons."""
        return not req.keep_alive or self._upgraded or self._config.draining()

    def _fail(self, req: Request) -> None:
        """A handler failed: 500 with an OpenAI body if nothing was sent yet (a handler that
        wrote its answer, then failed, leaves it whole; the connection closes)."""
        body = error_body(
            "the sidecar failed on this request", SERVER_ERROR, None, "internal_error"
        )
        if not self.lost and not self.answer_started:
            self.send(response_bytes(responses.json_response(500, body), req, True))

    def _next(self, req: Request, close: bool) -> None:
        """After ``req``'s answer: the next pipelined request, the idle timeout, or the end.
        What the handler left unread of its body is dropped (reading resumes if it had
        paused for it)."""
        req.content.discard()
        if self._queue and self._queue[0] is req:
            self._queue.popleft()
        if self.lost:
            return
        if close or self._broken or (self._eof and not self._queue):
            if self._parser.reading is req:
                self._linger(req)
            else:
                self.close()
            return
        if self._pending_error is not None and not self._queue:
            self._write_refusal(self._pending_error)
            return
        if self._pipeline_full and len(self._queue) <= MAX_PIPELINED:
            self._pipeline_full = False
            self.resume_body()
        if self._queue:
            self._start()
        elif self._parser.partial:
            self._arm(self._config.header_timeout, headers=True)
        else:
            self._arm(self._config.keepalive_timeout, headers=False)

    def _linger(self, req: Request) -> None:
        """``req`` was answered (with ``Connection: close``) before its body was read: read the
        rest and drop it, then close, so that the client is not reset while it still sends
        (which could lose it the answer); within the header deadline (10 s when none)."""
        self._lingering = True
        req.content.discard()
        self._arm(self._config.header_timeout or 10.0, headers=False)

    def _malformed(self, refused: Refused) -> None:
        """A request the parser refused: answered once what came before it is answered; a
        body whose framing broke is its handler's to answer (400 when it reads it), and the
        connection closes after."""
        if self._queue and not self._queue[-1].content.is_eof():
            self._broken = True
            return
        if self._lingering:
            self.close()
            return
        if self._task is not None or self._queue:
            self._pending_error = refused
            return
        self._write_refusal(refused)

    def _write_refusal(self, refused: Refused) -> None:
        log.debug("malformed HTTP request: %s", refused)
        self._config.on_malformed()
        resp = responses.malformed_http(refused.status, str(refused), client=self._config.client)
        body = resp.body
        assert isinstance(body, bytes)
        head = head_bytes(
            refused.status, resp.headers, length=len(body), chunked=False, close=True, http10=False
        )
        self.send(head + body)
        self.close()

    def send_continue(self) -> None:
        """``Expect: 100-continue``: the handler reads the body, so ask for it."""
        self.send_interim(b"HTTP/1.1 100 Continue\r\n\r\n")

    # ---------------------------------------------------------------- state

    @property
    def task(self) -> asyncio.Task[None] | None:
        """The handler running now, if any."""
        return self._task

    @property
    def idle(self) -> bool:
        """No request is being answered or parsed."""
        return self._task is None and not self._queue and not self._parser.partial

    def abort(self) -> None:
        """End the connection now: its handler cancelled (what it holds released by its own
        ``finally``), what was written still flushed."""
        if self._task is not None:
            self._task.cancel()
        self.close()

    def close(self) -> None:
        """Close the connection once what was written is sent (the drain's end, an idle one
        while draining, or this connection's own end)."""
        self._disarm()
        self.close_transport()

    # ---------------------------------------------------------------- deadlines

    def _arm(self, seconds: float, *, headers: bool) -> None:
        if headers and seconds <= 0:  # no header deadline: a silent connection still ends
            seconds, headers = self._config.keepalive_timeout, False
        self._disarm()
        self._timer_headers = headers
        if seconds > 0:
            self._timer = self._loop.call_later(seconds, self._expired, headers)

    def _disarm(self) -> None:
        self._timer_headers = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self, headers: bool) -> None:
        """The header deadline (``headers``) or the idle timeout passed."""
        self._timer = None
        self._timer_headers = False
        if self._task is not None or self._queue:
            return  # a request is being answered: its own deadlines apply
        if headers:
            self._config.on_timeout()
            if self._parser.partial:
                self.send(_TIMEOUT_408 if self._config.client else _ADMIN_TIMEOUT_408)
        self.close()
