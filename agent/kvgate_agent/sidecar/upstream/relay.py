"""Relaying the model server's answer to an admitted request to its client: an SSE stream's
bytes as they come, its usage read and its output tokens told to admission as events pass (see
:func:`relay_stream`), or a whole body read under a cap (:func:`read_capped`); and writes to the
client, whose going away is told apart from an upstream failure (:class:`ClientGone`).

The trip itself (the call upstream, its failures, the settling of the reservation) is
:class:`kvgate_agent.sidecar.upstream.forward.Forwarder`'s; :class:`Exchange` carries what the relay
learns (tokens, whether the answer was read to its end) back to it.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from multidict import CIMultiDict

from kvgate_agent.admission import Ticket
from kvgate_agent.sidecar.edge import ClientRequest, Reply, ResponseStream, new_stream
from kvgate_agent.sidecar.reading import ParsedRequest, StreamAccountant
from kvgate_agent.sidecar.upstream.errors import MalformedStream
from kvgate_agent.sidecar.upstream.upstream import UpstreamResponse

#: Bytes one SSE event of a relayed stream may reach before the stream counts as malformed
#: (held while incomplete; a model server streams one small event per token).
MAX_EVENT_BYTES = 1024 * 1024


#: Bytes a non-streamed answer of the model server to an admitted request may reach (it is held
#: whole, to read its usage): far above any real completion body; a larger one is cut with 502
#: ``upstream_error``.
MAX_UPSTREAM_BODY_BYTES = 64 * 1024 * 1024


async def read_capped(resp: UpstreamResponse) -> bytes:
    """``resp``'s whole body (bytes), at most :data:`MAX_UPSTREAM_BODY_BYTES`.

    Raises:
        MalformedStream: the body (or its declared ``Content-Length``) is larger.
    """
    cap = MAX_UPSTREAM_BODY_BYTES
    if resp.content_length is not None and resp.content_length > cap:
        raise MalformedStream(f"an upstream answer of {resp.content_length} bytes, over {cap}")
    data = await resp.read_all(cap)
    if data is None:
        raise MalformedStream(f"an upstream answer over {cap} bytes")
    return data


class ClientGone(Exception):
    """The client closed its connection while the sidecar was writing to it."""


async def to_client(write: Awaitable[object]) -> None:
    """Await a write to the client; a closed client connection becomes :class:`ClientGone`
    (so it is never mistaken for an upstream failure)."""
    try:
        await write
    except ConnectionResetError as exc:  # aiohttp's ClientConnectionResetError included
        raise ClientGone() from exc


@dataclass(slots=True)
class Exchange:
    """One admitted request's trip upstream, settled when it ends.

    ``completion_tokens``/``prompt_tokens``: what to charge (tokens; prompt None = as reserved);
    ``cached_tokens``: the prompt tokens the engine reported found in its prefix cache (None:
    not reported);
    ``reached``: the engine did GPU work for it; ``clean``: the upstream response was read to its
    end, so its connection may be reused.
    """

    ticket: Ticket
    parsed: ParsedRequest
    headers: dict[str, str]
    started: float  # time.perf_counter() at arrival, seconds
    completion_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    reached: bool = False
    clean: bool = False
    resp: UpstreamResponse | None = None
    out: Reply | None = None


async def relay_stream(
    request: ClientRequest,
    resp: UpstreamResponse,
    out_headers: CIMultiDict[str],
    ex: Exchange,
    observe: Callable[[Ticket, int], object],
    on_first_byte: Callable[[float], object],
) -> ResponseStream:
    """Relay ``resp``'s SSE stream to the client of ``request`` (with ``out_headers``; the
    response is ``ex.out`` once prepared), counting its completion tokens and reading its final
    usage into ``ex`` (the usage chunk is dropped unless the client asked for it);
    ``on_first_byte`` gets the seconds from ``ex.started`` to the first event relayed (TTFT).
    ``ex.clean``: the stream was read to its end.

    Raises :class:`MalformedStream` (an event over :data:`MAX_EVENT_BYTES`),
    :class:`ClientGone`, and what ``resp.read_any`` raises (``UpstreamBroken``,
    ``TimeoutError``).

    As events pass, the controller is told (``observe(ticket, tokens)``) the output tokens
    generated so far (all choices; :attr:`StreamAccountant.completion_tokens_estimate`)
    whenever that count grows: at most once per upstream read, so at most once per SSE event,
    and never a smaller count than the last one (the exact total is settled at release)."""
    acct = StreamAccountant(ex.parsed.usage_injected, ex.parsed.api.event_reader())
    ex.out = out = new_stream(request, resp.status, out_headers)
    await to_client(out.prepare(request))
    first = True
    ticket = ex.ticket
    told = 0  # output tokens last reported to the controller
    write = out.write
    try:
        while chunk := await resp.read_any():
            piece = acct.feed(chunk)
            if acct.pending_bytes > MAX_EVENT_BYTES:
                raise MalformedStream(f"an event stream event over {MAX_EVENT_BYTES} bytes")
            generated = acct.completion_tokens_estimate
            if generated > told:
                told = generated
                observe(ticket, generated)
            if piece:
                try:  # to_client, inlined: once per event
                    await write(piece)
                except ConnectionResetError as exc:
                    raise ClientGone() from exc
                if first:
                    on_first_byte(time.perf_counter() - ex.started)
                    first = False
        tail = acct.finish()
        generated = acct.completion_tokens_estimate
        if generated > told:  # a last event without its blank line
            observe(ticket, generated)
        if tail:
            await to_client(out.write(tail))
        ex.clean = acct.done
    finally:
        ex.completion_tokens = acct.completion_tokens_estimate
        if acct.prompt_tokens is not None:
            ex.prompt_tokens = acct.prompt_tokens
        ex.cached_tokens = acct.cached_tokens
    await to_client(out.write_eof())
    return out
