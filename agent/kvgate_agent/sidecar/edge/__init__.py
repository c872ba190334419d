"""The edge: the clients' side of the sidecar. Its own HTTP/1.1 server leg (the listener, each
connection's parse, deadlines and keep-alive, the request and its body stream, the answer on the
socket; the clients' port and the admin one), the neutral request/answer protocols the pipeline
serves (``wire``), the body limit and the hop-by-hop headers.

Other rooms import what they use from here (``__all__``); modules of this room import
each other directly.
"""

from __future__ import annotations

from kvgate_agent.sidecar.edge.body import StreamedBody, read_body, too_large
from kvgate_agent.sidecar.edge.client_listener import ClientListener
from kvgate_agent.sidecar.edge.client_request import Request
from kvgate_agent.sidecar.edge.hop_headers import (
    HOP_BY_HOP,
    admitted_request_headers,
    dropped,
    forward_headers,
    identity_headers,
    identity_names,
)
from kvgate_agent.sidecar.edge.wire import (
    ClientRequest,
    Handler,
    Reply,
    ResponseStream,
    answer_now,
    new_stream,
)
from kvgate_agent.sidecar.reading import Answer

__all__ = [
    "HOP_BY_HOP",
    "Answer",
    "ClientListener",
    "ClientRequest",
    "Handler",
    "Reply",
    "Request",
    "ResponseStream",
    "StreamedBody",
    "admitted_request_headers",
    "answer_now",
    "dropped",
    "forward_headers",
    "identity_headers",
    "identity_names",
    "new_stream",
    "read_body",
    "too_large",
]
