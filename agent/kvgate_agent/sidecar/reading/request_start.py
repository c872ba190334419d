"""How long a request waited before it reached this pod, from its proxy's ``X-Request-Start``.

Behind a router that retries a refusal on another replica (Envoy's ``previous_hosts``, the
recipe of ``docs/routers.md``), a request arrives here having already spent part of its TTFT
budget: the first replica's answer and the back-off. The proxy stamps the client request's start
once, and every attempt carries the same stamp:

* Envoy: ``request_headers_to_add`` with ``t=%START_TIME(%s.%3f)%`` (the downstream request's
  start; https://www.envoyproxy.io/docs/envoy/latest/configuration/http/http_conn_man/headers#custom-request-response-headers);
* nginx: ``proxy_set_header X-Request-Start "t=${msec}"``;
* the convention's other forms, seconds, milliseconds or microseconds since the epoch, with or
  without ``t=`` (https://docs.newrelic.com/docs/apm/applications-menu/features/request-queuing-tracking-front-end-time/).

The admission core takes the wait off the request's TTFT wait budget
(``AdmissionRequest.waited_seconds``): a retry whose budget is spent is refused at once instead
of queued past its SLO. A clock behind the proxy's (a stamp in the future) counts as no wait;
a stamp more than :data:`MAX_WAIT_S` old, or unreadable, is ignored. A client that sets the
header itself can only shorten its own budget.
"""

from __future__ import annotations

import math

#: The name of the header (case-insensitive on the wire).
HEADER = "x-request-start"
#: Waits longer than this (seconds) are taken for a broken stamp and ignored.
MAX_WAIT_S = 3600.0


def stamp_seconds(value: str) -> float | None:
    """The epoch seconds a ``X-Request-Start`` value names (``t=`` optional; seconds,
    milliseconds or microseconds told apart by magnitude); None when unreadable."""
    text = value.strip()
    if text.startswith("t="):
        text = text[2:]
    try:
        t = float(text)
    except ValueError:
        return None
    if not math.isfinite(t) or t <= 0:
        return None
    if t > 1e14:  # microseconds (a 2026 epoch is about 1.8e15 µs)
        return t / 1e6
    if t > 1e11:  # milliseconds
        return t / 1e3
    return t


def waited_seconds(value: str | None, now: float) -> float:
    """Seconds between the stamp ``value`` (None: no header) and ``now`` (epoch seconds,
    ``time.time()``); 0 for no header, an unreadable one, a stamp in the future (clock skew) or
    one more than :data:`MAX_WAIT_S` old."""
    if value is None:
        return 0.0
    t = stamp_seconds(value)
    if t is None:
        return 0.0
    waited = now - t
    return waited if 0.0 < waited <= MAX_WAIT_S else 0.0
