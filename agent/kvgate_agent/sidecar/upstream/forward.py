"""Forwarding to the model server: the admitted request (its trip upstream, its failures, the
reservation settled; the answer relayed by :mod:`kvgate_agent.sidecar.upstream.relay`), and
pass-through for every other path.

Invariant: an admitted request releases exactly what it reserved on every path (success,
upstream error, timeout, client disconnect before or during the stream, cancellation): the
release sits in one ``finally`` and is idempotent, so no slot leaks when a streaming client
cancels (https://github.com/BerriAI/litellm/issues/27955). When the client goes away the upstream
connection is closed at once, so the model server stops generating into a dead socket
(https://github.com/BerriAI/litellm/issues/30244). At the drain deadline
(:meth:`Forwarder.end_all`), what is still running ends cleanly: a stream with a terminal error
event, a request not yet answered with 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
from aiohttp import web
from prometheus_client import Counter, Histogram
from yarl import URL

from kvgate_agent.admission import AsyncAdmission, Ticket
from kvgate_agent.sidecar.edge import HOP_BY_HOP as HOP_BY_HOP  # re-exported
from kvgate_agent.sidecar.edge import (
    ClientRequest,
    ResponseStream,
    admitted_request_headers,
    forward_headers,
    new_stream,
    too_large,
)
from kvgate_agent.sidecar.reading import (
    ParsedRequest,
    PrefixNaming,
    PromptCount,
    PromptCounter,
    body_too_slow,
    responses,
)
from kvgate_agent.sidecar.upstream.engine_stall import EngineStall
from kvgate_agent.sidecar.upstream.model_server import Flag, ModelServer
from kvgate_agent.sidecar.upstream.relay import (
    ClientGone,
    Exchange,
    read_capped,
    relay_stream,
    to_client,
)
from kvgate_agent.sidecar.upstream.upstream import UpstreamConnectError

log = logging.getLogger("kvgate.sidecar")


class _BodyTooSlow(Exception):
    """A pass-through request's body did not arrive within the body deadline, or grew past the
    body limit (not an ``OSError``, unlike ``TimeoutError``, so aiohttp's client reports it as
    a payload error)."""


class ForwardMetrics(Protocol):
    """What forwarding counts and sets (the sidecar's
    :class:`~kvgate_agent.sidecar.metrics.SidecarMetrics` is one)."""

    @property
    def ttft(self) -> Histogram: ...
    @property
    def upstream_errors(self) -> Counter: ...
    @property
    def upstream_ok(self) -> Flag: ...
    @property
    def client_timeouts(self) -> Counter: ...
    @property
    def client_disconnects(self) -> Counter: ...
    @property
    def prefix_cached_tokens(self) -> Counter: ...
    def count_decision(self, outcome: str, reason: str, tenant_label: str) -> None: ...
    def count_tokens(self, kind: str, tenant_label: str, tokens: int) -> None: ...


@dataclass(slots=True)
class _BodyDeadline:
    """A pass-through request body streamed upstream, ending with :class:`_BodyTooSlow` when
    it is not complete ``timeout`` seconds (0: no limit) after ``start`` (``loop.time()``:
    ``expired``) or grows past ``limit`` bytes (0: no limit; ``too_large``)."""

    request: ClientRequest
    timeout: float
    start: float
    limit: int = 0
    expired: bool = False
    too_large: bool = False

    async def chunks(self) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        size = 0
        while True:
            left = self.start + self.timeout - loop.time() if self.timeout > 0 else None
            try:
                async with asyncio.timeout(left):
                    chunk = await self.request.content.readany()
            except TimeoutError:
                self.expired = True
                raise _BodyTooSlow() from None
            if not chunk:
                return
            size += len(chunk)
            if self.limit and size > self.limit:
                self.too_large = True
                raise _BodyTooSlow()
            yield chunk


def _is_error_object(data: bytes) -> bool:
    """``data`` is an OpenAI-style error body (``{"error": {...}}``)."""
    try:
        return isinstance(json.loads(data).get("error"), dict)
    except (ValueError, AttributeError):
        return False


class Forwarder:
    """Sends requests to the model server (``server``: admitted ones over its pool, pass-through
    ones over its kept-alive client)."""

    def __init__(
        self,
        server: ModelServer,
        metrics: ForwardMetrics,
        admission: AsyncAdmission,
        counter: PromptCounter,
        *,
        body_timeout: float = 0.0,
        max_body: int = 0,
        stall: EngineStall | None = None,
    ) -> None:
        self.server = server
        self.max_body = max_body  # bytes a pass-through body may hold; 0: no limit
        #: What the engine produced, for the stall watch (a disabled one when not given).
        self.stall = EngineStall(0.0, lambda _: None) if stall is None else stall
        self.body_timeout = body_timeout  # seconds a pass-through body may take; 0: no limit
        self.metrics = metrics
        self.admission = admission
        self.counter = counter
        self._running: set[asyncio.Task[Any]] = set()  # admitted requests' handler tasks
        self._ending = False
        self._loop: asyncio.AbstractEventLoop | None = None  # the serving loop, once known
        #: Whether prompts' blocks are named for admission: opened by the first positive count
        #: of cached prompt tokens the engine reports (read by the request pipeline).
        self.prefixes = PrefixNaming()

    def _set_loop(self) -> asyncio.AbstractEventLoop:
        self._loop = asyncio.get_running_loop()
        return self._loop

    async def end_all(self, grace: float) -> None:
        """The drain deadline: end every admitted request still running (streams with a
        terminal ``shutting_down`` error event, unanswered requests with 503), waiting up to
        ``grace`` seconds for them to finish doing so."""
        self._ending = True
        tasks = list(self._running)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=grace)

    # ------------------------------------------------------------------ admitted requests

    async def admitted(
        self,
        request: ClientRequest,
        body: bytes,
        ticket: Ticket,
        parsed: ParsedRequest,
        headers: dict[str, str],
        *,
        prompt: PromptCount,
        tenant_label: str,
        started: float,
        decided: Mapping[str, str] | None = None,
    ) -> ResponseStream:
        """Forward an admitted request (``body`` as it goes upstream, with the header fields of
        ``decided`` in place of the client's own of those names: :func:`~kvgate_agent.sidecar.
        hop_headers.identity_headers`) and relay the answer with ``headers`` added; then
        release ``ticket`` with what the engine reported (without a report, what was
        reserved). ``started`` is ``time.perf_counter()`` at arrival (seconds). Upstream
        failures become 502/504 (mid-stream: an in-band error event)."""
        ex = Exchange(ticket, parsed, headers, started)
        m = self.metrics
        # The loop named: asyncio.current_task() would look it up, a getpid() call each time
        # on Python 3.11 (asyncio.events._get_running_loop).
        loop = self._loop or self._set_loop()
        task = asyncio.current_task(loop)
        if task is not None:
            self._running.add(task)
        stream = parsed.stream
        if stream:
            self.stall.begin_stream()
        try:
            return await self._exchange(request, body, ex, decided)
        except asyncio.CancelledError:
            if self._ending and task is not None and task.uncancel() == 0:
                return await self._shutting_down(ex)
            m.client_disconnects.inc()
            raise
        except ClientGone:
            m.client_disconnects.inc()
            assert ex.out is not None
            return ex.out  # nobody to answer; the finally below releases everything
        except (TimeoutError, aiohttp.ClientError) as exc:
            return await self._failed(ex, exc)
        finally:
            if task is not None:
                self._running.discard(task)
            self.stall.end(stream)
            self._settle(ex, tenant_label, prompt)

    async def _shutting_down(self, ex: Exchange) -> ResponseStream:
        """End ``ex`` because the sidecar stops (see :meth:`end_all`)."""
        out = ex.out
        if out is None:
            return responses.draining()
        with contextlib.suppress(ConnectionResetError, RuntimeError):
            await out.write(responses.shutting_down_event())
            await out.write_eof()
        return out

    async def _exchange(
        self, request: ClientRequest, body: bytes, ex: Exchange, decided: Mapping[str, str] | None
    ) -> ResponseStream:
        m = self.metrics
        fwd = admitted_request_headers(request.headers, decided)
        target = request.path_qs  # a generation path, canonical, and its query as sent
        # From here the engine may be working on it: a cancellation (the drain deadline) or
        # a failure before the answer still charges the prompt.
        ex.reached = True
        try:
            ex.resp = resp = await self.server.pool.request("POST", target, fwd, body)
        except UpstreamConnectError as exc:
            ex.reached = False  # never connected: no work to charge
            m.upstream_errors.labels("connect").inc()
            m.upstream_ok.value = False
            log.warning("upstream connect failed: %s", exc)
            return responses.upstream_unreachable(ex.headers)
        m.upstream_ok.value = True
        out_headers = forward_headers(resp.headers)
        out_headers.update(ex.headers)
        if resp.status >= 500:
            m.upstream_errors.labels("status_5xx").inc()
        if ex.parsed.stream and resp.status == 200 and resp.content_type == "text/event-stream":
            ttft = self.metrics.ttft.observe
            admission_observe, stall = self.admission.observe_tokens, self.stall

            def observe(ticket: Ticket, generated: int) -> None:
                stall.events += 1  # a token from the engine (EngineStall.token, inlined)
                admission_observe(ticket, generated)

            return await relay_stream(request, resp, out_headers, ex, observe, ttft)
        data = await read_capped(resp)
        ex.clean = True
        if resp.status == 200:
            ex.prompt_tokens, reported, ex.cached_tokens = ex.parsed.api.body_usage(data)
            # No usage reported: charge what was reserved rather than nothing.
            t = ex.ticket
            ex.completion_tokens = t.max_tokens * t.n if reported is None else reported
        elif 400 <= resp.status < 500:
            ex.reached = False  # the engine refused it: no GPU work to charge
        elif resp.status >= 500 and not _is_error_object(data):
            # The client gets an OpenAI body instead: keep what the model server said here.
            log.warning("the model server answered %d: %r", resp.status, data[:300])
            kept = {k: v for k, v in resp.headers.items() if k.lower() == "retry-after"}
            return responses.upstream_error_status(resp.status, {**kept, **ex.headers})
        return web.Response(status=resp.status, body=data, headers=out_headers)

    async def _failed(
        self, ex: Exchange, exc: TimeoutError | aiohttp.ClientError
    ) -> ResponseStream:
        """The model server failed (or timed out) after the connection was made."""
        m = self.metrics
        timeout = isinstance(exc, TimeoutError)
        m.upstream_errors.labels("timeout" if timeout else "upstream_error").inc()
        m.upstream_ok.value = False
        log.warning("upstream failed mid-request: %r", exc)
        out = ex.out
        if out is None:  # nothing sent yet: a proper error response
            return responses.upstream_failed(timeout, ex.headers)
        # Mid-stream: tell the client in-band, as vLLM does, then end the stream.
        with contextlib.suppress(ConnectionResetError, RuntimeError):
            await out.write(responses.upstream_failed_event(timeout))
            await out.write_eof()
        return out

    def _settle(self, ex: Exchange, tenant_label: str, prompt: PromptCount) -> None:
        """Close or release the upstream response, release the ticket (with the cached prompt
        tokens the engine reported, which settle its expected prefix), count the tokens
        (``kvgate_prefix_cached_tokens_total{source="reported"}`` too) and calibrate the prompt
        estimate with the reported usage."""
        if ex.resp is not None:
            if ex.clean:
                ex.resp.release()
            else:
                ex.resp.close()  # drop the connection: the engine sees the peer go away
        ticket = ex.ticket
        self.admission.release(
            ticket,
            completion_tokens=ex.completion_tokens,
            prompt_tokens=ex.prompt_tokens,
            reached_upstream=ex.reached,
            cached_tokens=ex.cached_tokens if ex.reached else None,
        )
        if ex.reached:
            m = self.metrics
            if ex.cached_tokens is not None:
                self.prefixes.observe(ex.cached_tokens)
                m.prefix_cached_tokens.labels("reported").inc(ex.cached_tokens)
            settled_prompt = ticket.prompt_tokens if ex.prompt_tokens is None else ex.prompt_tokens
            m.count_tokens("prompt", tenant_label, settled_prompt)
            m.count_tokens("completion", tenant_label, ex.completion_tokens)
            if ex.prompt_tokens is not None and not prompt.exact:
                self.counter.observe(prompt.text_bytes, ex.prompt_tokens, prompt.overhead_tokens)

    # ------------------------------------------------------------------ pass-through

    async def passthrough(self, request: ClientRequest) -> ResponseStream:
        """A request the routes let through (see ``RequestPipeline.other``): forwarded as is
        (the raw path, not re-normalised), body streamed both ways. An absolute-form target
        (``GET http://host/v1/models``, RFC 9112 §3.2.2) is sent as its path and query: the
        upstream is always the sidecar's own. The body must be complete within
        :attr:`body_timeout` seconds of the handler's start, else the upstream request is
        aborted and the client gets 408 (``client_timeouts{phase="body"}``) and is closed. A
        body over :attr:`max_body` bytes gets 413: at once when its ``Content-Length`` says so
        (never sent upstream; counted as an ``invalid_request`` refusal), else when the bytes
        streamed pass it (the upstream request aborted)."""
        if self.max_body and (request.content_length or 0) > self.max_body:
            self.metrics.count_decision("rejected", "invalid_request", "")
            return responses.bad_request(too_large(self.max_body))
        rel = request.rel_url  # request.raw_path is the whole URL of an absolute-form target
        raw_path = rel.raw_path + (f"?{rel.raw_query_string}" if rel.raw_query_string else "")
        fwd = forward_headers(request.headers)
        fwd.popall("Content-Encoding", None)  # the body is decoded on the way in
        loop = asyncio.get_running_loop()
        body = _BodyDeadline(request, self.body_timeout, loop.time(), self.max_body)
        data = body.chunks() if request.body_exists else None
        url = URL(self.server.url + raw_path, encoded=True)
        try:
            resp = await self.server.session().request(request.method, url, headers=fwd, data=data)
        except aiohttp.ClientConnectorError:
            self.metrics.upstream_errors.labels("connect").inc()
            return responses.passthrough_unreachable()
        except (TimeoutError, aiohttp.ClientError) as exc:
            if body.expired or body.too_large:
                return self._body_refused(body)
            self.metrics.upstream_errors.labels("upstream_error").inc()
            return responses.passthrough_failed(exc)
        return await self._relay_passthrough(request, resp, body)

    def _body_refused(self, body: _BodyDeadline) -> web.Response:
        """408 for a pass-through body that came too slowly (``client_timeouts{phase="body"}``;
        the connection is closed), 413 for one that grew past ``--max-body-bytes``."""
        if body.too_large:
            resp = responses.bad_request(too_large(self.max_body))
            resp.force_close()  # the rest of the body is not read
            return resp
        self.metrics.client_timeouts.labels("body").inc()
        return responses.bad_request(body_too_slow())

    async def _relay_passthrough(
        self, request: ClientRequest, resp: aiohttp.ClientResponse, body: _BodyDeadline
    ) -> ResponseStream:
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
            self.metrics.client_disconnects.inc()
            return out
        except (TimeoutError, aiohttp.ClientError) as exc:
            if (body.expired or body.too_large) and not out.prepared:
                return self._body_refused(body)
            if body.expired or body.too_large:
                if body.expired:
                    self.metrics.client_timeouts.labels("body").inc()
                out.force_close()
            else:
                self.metrics.upstream_errors.labels("upstream_error").inc()
                log.warning("upstream failed during pass-through: %r", exc)
            return out
        finally:
            if clean:
                resp.release()
            else:
                resp.close()
