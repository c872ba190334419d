"""The operator's ``kubernetes`` client, sized so a silently dead network is noticed.

The reconciler's calls (LIST, PATCH, CREATE) pass no timeout of their own; without one, a call
on a connection that a partition or a lost NAT entry left open and silent would wait forever
and stall every later pass. :class:`BoundedApiClient` gives each such call ``(connect, read)``
timeouts (the read timeout bounds each silence between bytes, not the whole answer, so a large
LIST still completes), and the sockets send TCP keep-alive probes, which catch a dead peer on
an idle pooled connection too.

urllib3 keeps idle connections in its pool for ever; one that went dead while idle would cost
the next call its whole read timeout. So, as aiohttp does by default (``keepalive_timeout``
15 s), connections idle longer than :data:`POOL_IDLE_SECONDS` are not reused, and the pool is
emptied after any failed call (a dead network takes the pooled connections with it).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from kubernetes import client, config
from kubernetes.utils.keepalive import tcp_keepalive_socket_options
from urllib3 import Retry
from urllib3.exceptions import HTTPError

from kvgate_agent.contract.keepalive import KEEPALIVE

#: Seconds a pooled connection may sit idle and still be reused (aiohttp's default
#: ``keepalive_timeout``,
#: https://docs.aiohttp.org/en/stable/client_reference.html#aiohttp.TCPConnector).
POOL_IDLE_SECONDS = 15.0


class BoundedApiClient(client.ApiClient):
    """An ``ApiClient`` whose calls without a ``_request_timeout`` get ``timeout`` (seconds:
    a number for the whole call, or ``(connect, read)``), and whose idle or failed pooled
    connections are not reused (see the module docstring). Thread-safe, as ``ApiClient`` is.

    Args:
        clock: monotonic seconds (for the idle time).
    """

    def __init__(
        self,
        configuration: client.Configuration,
        timeout: float | tuple[float, float],
        clock: Any = time.monotonic,
    ) -> None:
        super().__init__(configuration)
        self.default_timeout = timeout
        self.clock = clock
        self._lock = threading.Lock()
        self._last_used = clock()
        self._busy = 0

    def _drop_pool(self) -> None:
        """Close the idle pooled connections (calls in flight finish on theirs)."""
        self.rest_client.pool_manager.clear()

    def call_api(
        self,
        method: Any,
        url: Any,
        header_params: Any = None,
        body: Any = None,
        post_params: Any = None,
        _request_timeout: Any = None,
    ) -> Any:
        with self._lock:
            if self._busy == 0 and self.clock() - self._last_used > POOL_IDLE_SECONDS:
                self._drop_pool()
            self._busy += 1
        try:
            return super().call_api(
                method,
                url,
                header_params,
                body,
                post_params,
                _request_timeout if _request_timeout is not None else self.default_timeout,
            )
        except HTTPError:  # timeouts, refused or reset connections (urllib3's, after retries)
            self._drop_pool()
            raise
        finally:
            with self._lock:
                self._busy -= 1
                self._last_used = self.clock()


#: urllib3's retries of one call: one retry of a failed connect or send (a pooled connection
#: the server closed), none after a read timed out. urllib3's default retries a read timeout
#: three times, so a call on a silent connection took 4 x its read timeout: a Lease renewal
#: (read timeout ``renew_deadline / 2``) would outlast the renew deadline.
#: https://urllib3.readthedocs.io/en/stable/reference/urllib3.util.html#urllib3.util.Retry
RETRIES = Retry(total=1, read=0, redirect=0)


def default_api_client(
    connect_timeout: float = 10.0, read_timeout: float = 30.0
) -> client.ApiClient:
    """A kubernetes client: in-cluster credentials, else the kubeconfig (``$KUBECONFIG``); TCP
    keep-alive on its sockets, :data:`RETRIES`, and ``(connect_timeout, read_timeout)`` on every
    call that sets no timeout of its own.

    Raises:
        kubernetes.config.ConfigException: no usable configuration.
    """
    cfg = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
    except config.ConfigException:
        config.load_kube_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
    cfg.socket_options = tcp_keepalive_socket_options(*KEEPALIVE)
    cfg.retries = RETRIES
    return BoundedApiClient(cfg, (connect_timeout, read_timeout))
