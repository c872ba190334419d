"""The upstream room's errors: what kvgate's own leg to the model server (the pool of
kept-alive connections for admitted requests, and the relay of their answers) raises, under one
base of its own, :class:`UpstreamError`, that subclasses no HTTP library's.

* :class:`UpstreamConnectError`: the connection could not be opened (refused, unreachable, or
  not within the connect timeout): the model server never saw the request.
* :class:`UpstreamBroken`: the model server closed the connection before the answer was
  complete, or sent what is not HTTP.
* :class:`MalformedStream`: the model server's event stream cannot be SSE (an event over
  :data:`~kvgate_agent.sidecar.upstream.relay.MAX_EVENT_BYTES`), or its non-streamed answer is
  over :data:`~kvgate_agent.sidecar.upstream.relay.MAX_UPSTREAM_BODY_BYTES`.

A timeout is Python's ``TimeoutError``. The aiohttp client (pass-through, the fallback pool)
still raises aiohttp's own errors: :data:`UPSTREAM_FAILURES` names both kinds, for the
``except`` of a trip that may meet either.
"""

from __future__ import annotations

from typing import Final

import aiohttp


class UpstreamError(Exception):
    """A failure of kvgate's own leg to the model server."""


class UpstreamConnectError(UpstreamError):
    """The connection to the model server could not be opened."""


class UpstreamBroken(UpstreamError):
    """The model server closed the connection mid-answer or answered with malformed HTTP."""


class MalformedStream(UpstreamError):
    """The model server's event stream cannot be SSE, or its non-streamed answer is too large."""


#: What a trip to the model server may fail with, on either client: a timeout, kvgate's own
#: leg's errors, aiohttp's client's.
UPSTREAM_FAILURES: Final = (TimeoutError, UpstreamError, aiohttp.ClientError)
