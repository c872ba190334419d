"""Forwarding to the model server: the admitted request (its trip upstream, its failures, the
reservation settled; the answer relayed by :mod:`kvgate_agent.sidecar.upstream.relay`), the
degraded one (to the fallback pool: :mod:`kvgate_agent.sidecar.upstream.fallback_pool`), and
pass-through for every other path (its allowlist); every forwarded body within the same bounds.

Invariant: an admitted request releases exactly what it reserved on every path (success,
upstream error, timeout, client disconnect before or during the stream, cancellation): the
release sits in one ``finally`` and is idempotent, so no slot leaks when a streaming client
cancels (https://github.com/BerriAI/litellm/issues/27955). It comes after the client's answer
was written: a stream's last write, or a finished answer written from the handler
(:func:`~kvgate_agent.sidecar.edge.wire.answer_now`), so the release is off the client's
latency. When the client goes
away the upstream connection is closed at once, so the model server stops generating into a dead
socket (https://github.com/BerriAI/litellm/issues/30244). At the drain deadline
(:meth:`Forwarder.end_all`), what is still running ends cleanly: a stream with a terminal error
event, a request not yet answered with 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from aiohttp import ClientError
from prometheus_client import Counter, Histogram

from kvgate_agent.admission import AsyncAdmission, Decision, Ticket
from kvgate_agent.contract.policy import RateLimitPolicySpec
from kvgate_agent.sidecar.edge import HOP_BY_HOP as HOP_BY_HOP  # re-exported
from kvgate_agent.sidecar.edge import (
    Answer,
    ClientRequest,
    Reply,
    admitted_request_headers,
    answer_now,
    forward_headers,
    read_body,
)
from kvgate_agent.sidecar.reading import (
    ParsedRequest,
    Passthrough,
    PrefixNaming,
    PromptCount,
    PromptCounter,
    responses,
)
from kvgate_agent.sidecar.upstream.engine_stall import EngineStall
from kvgate_agent.sidecar.upstream.errors import (
    UPSTREAM_FAILURES,
    UpstreamConnectError,
    UpstreamError,
)
from kvgate_agent.sidecar.upstream.fallback_pool import degrade_to_pool
from kvgate_agent.sidecar.upstream.model_server import ModelServer
from kvgate_agent.sidecar.upstream.passthrough import PassMetrics, pass_through
from kvgate_agent.sidecar.upstream.relay import (
    ClientGone,
    Exchange,
    read_capped,
    relay_stream,
)

log = logging.getLogger("kvgate.sidecar")


class ForwardMetrics(PassMetrics, Protocol):
    """What forwarding counts and sets: pass-through's (:class:`PassMetrics`) and the admitted
    requests' (the sidecar's :class:`~kvgate_agent.sidecar.metrics.SidecarMetrics` is one)."""

    @property
    def ttft(self) -> Histogram: ...
    @property
    def prefix_cached_tokens(self) -> Counter: ...
    def count_tokens(self, kind: str, tenant_label: str, tokens: int) -> None: ...


def _is_error_object(data: bytes) -> bool:
    """``data`` is an OpenAI-style error body (``{"error": {...}}``)."""
    try:
        return isinstance(json.loads(data).get("error"), dict)
    except (ValueError, AttributeError):
        return False


def _written(request: ClientRequest, ex: Exchange, resp: Answer) -> Reply:
    """``resp`` written to the client now (:func:`~kvgate_agent.sidecar.edge.wire.answer_now`),
    before :meth:`Forwarder.admitted`'s ``finally`` releases ``ex``'s ticket; what the handler
    answers with. Raises :class:`ClientGone` (then ``ex.out`` is ``resp``, to answer with)."""
    ex.out = resp
    try:
        return answer_now(request, resp)
    except ConnectionResetError as exc:
        raise ClientGone() from exc


class Forwarder:
    """Sends requests to the model server (``server``: admitted ones over its pool, pass-through
    ones over its kept-alive client, degraded ones to the fallback pool over its client): the
    upstream room's object for the request pipeline.

    Args:
        allowlist: the paths a mutating pass-through request may take (:meth:`allows`).
        body_timeout: seconds a forwarded body may take to arrive; 0: no limit.
        max_body: bytes a forwarded body may hold; 0: no limit (a pass-through body's only).
    """

    def __init__(
        self,
        server: ModelServer,
        metrics: ForwardMetrics,
        admission: AsyncAdmission,
        counter: PromptCounter,
        *,
        allowlist: Passthrough | None = None,
        body_timeout: float = 0.0,
        max_body: int = 0,
        stall: EngineStall | None = None,
    ) -> None:
        self.server = server
        self.allowlist = Passthrough.of() if allowlist is None else allowlist
        self.max_body = max_body
        #: What the engine produced, for the stall watch (a disabled one when not given).
        self.stall = EngineStall(0.0, lambda _: None) if stall is None else stall
        self.body_timeout = body_timeout
        self.metrics = metrics
        self._body_timeouts = metrics.client_timeouts.labels("body")
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

    # ------------------------------------------------------------------ what goes upstream

    def allows(self, path: str) -> bool:
        """Whether a mutating request may pass through to ``path`` (canonical): the allowlist
        (:class:`~kvgate_agent.sidecar.reading.endpoints.Passthrough`)."""
        return self.allowlist.allows(path)

    async def read_body(self, request: ClientRequest) -> bytes:
        """A generation request's body (bytes), read whole within :attr:`max_body` bytes and
        :attr:`body_timeout` seconds (a timeout counts in ``kvgate_client_timeouts_total{phase=
        "body"}``).

        Raises:
            RequestError: 413 over the limit, 408 past the deadline.
        """
        return await read_body(request, self.max_body, self.body_timeout, self._body_timeouts.inc)

    async def degrade(
        self,
        request: ClientRequest,
        spec: RateLimitPolicySpec,
        parsed: ParsedRequest,
        raw: bytes,
        d: Decision,
        mode: str | None,
        count: Callable[[Decision], None],
    ) -> Reply:
        """Send a request admission answered ``fallback_pool`` (``d``) to the pool over the
        pass-through client (:func:`~kvgate_agent.sidecar.upstream.fallback_pool.
        degrade_to_pool`: ``raw`` is its body as received, ``mode`` the thresholds header,
        ``count`` counts the decision that stands)."""
        session = self.server.session()
        return await degrade_to_pool(session, request, spec, parsed, raw, d, mode, count)

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
    ) -> Reply:
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
        except UPSTREAM_FAILURES as exc:
            return await self._failed(ex, exc)
        finally:
            if task is not None:
                self._running.discard(task)
            self.stall.end(stream)
            self._settle(ex, tenant_label, prompt)

    async def _shutting_down(self, ex: Exchange) -> Reply:
        """End ``ex`` because the sidecar stops (see :meth:`end_all`)."""
        out = ex.out
        if out is None:
            return responses.draining()
        if isinstance(out, Answer):  # a finished answer, written already: nothing to add
            return out
        with contextlib.suppress(ConnectionResetError, RuntimeError):
            await out.write(responses.shutting_down_event())
            await out.write_eof()
        return out

    async def _exchange(
        self, request: ClientRequest, body: bytes, ex: Exchange, decided: Mapping[str, str] | None
    ) -> Reply:
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
            m.upstream.errors.labels("connect").inc()
            m.upstream.ok.value = False
            log.warning("upstream connect failed: %s", exc)
            return _written(request, ex, responses.upstream_unreachable(ex.headers))
        m.upstream.ok.value = True
        out_headers = forward_headers(resp.headers)
        out_headers.update(ex.headers)
        if resp.status >= 500:
            m.upstream.errors.labels("status_5xx").inc()
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
            answer = responses.upstream_error_status(resp.status, {**kept, **ex.headers})
            return _written(request, ex, answer)
        return _written(request, ex, Answer(status=resp.status, body=data, headers=out_headers))

    async def _failed(self, ex: Exchange, exc: TimeoutError | UpstreamError | ClientError) -> Reply:
        """The model server failed (or timed out) after the connection was made."""
        m = self.metrics
        timeout = isinstance(exc, TimeoutError)
        m.upstream.errors.labels("timeout" if timeout else "upstream_error").inc()
        m.upstream.ok.value = False
        log.warning("upstream failed mid-request: %r", exc)
        out = ex.out
        if out is None:  # nothing sent yet: a proper error response
            return responses.upstream_failed(timeout, ex.headers)
        if isinstance(out, Answer):  # a finished answer, written already: nothing to add
            return out
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

    async def passthrough(self, request: ClientRequest) -> Reply:
        """A request the routes let through (see ``RequestPipeline.other``), forwarded as is
        within :attr:`max_body` bytes and :attr:`body_timeout` seconds
        (:func:`~kvgate_agent.sidecar.upstream.passthrough.pass_through`)."""
        return await pass_through(
            request,
            self.server,
            self.metrics,
            max_body=self.max_body,
            body_seconds=self.body_timeout,
        )
