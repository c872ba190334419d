"""TCP keep-alive for every connection to the Kubernetes API server, the node agent's and the
operator's alike (here, the one module both may import)."""

from __future__ import annotations

from typing import Final

#: TCP keep-alive: first probe after 10 s idle, then every 5 s; dead after 3 unanswered (about
#: 25 s), as ``(idle, interval, count)`` for
#: ``kubernetes.utils.keepalive.tcp_keepalive_socket_options``. client-go uses 30 s idle with
#: the kernel's 15 s x 9 probes (2.75 min), too slow for noticing a dead network within a minute
#: (https://github.com/kubernetes/client-go/blob/master/transport/cache.go).
KEEPALIVE: Final = (10, 5, 3)

__all__ = ["KEEPALIVE"]
