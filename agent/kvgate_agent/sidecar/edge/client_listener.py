"""kvgate's own server leg, on the clients' port and on the admin one: the listening socket, its
connections (:class:`~kvgate_agent.sidecar.edge.client_conn.ClientConnection`) and their end.

A drain stops accepting, closes the kept-alive connections that are idle and lets the others
answer what they are answering (``Connection: close`` on each answer from then on); closing
ends what is left (each handler cancelled: its reservation released by its own ``finally``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvgate_agent.sidecar.edge.client_conn import ClientConnection, LegConfig
from kvgate_agent.sidecar.edge.client_request import Request
from kvgate_agent.sidecar.edge.wire import Handler

__all__ = ["KEEPALIVE_TIMEOUT_S", "ClientListener"]

#: Seconds an idle kept-alive client connection stays open (aiohttp's server defaults to
#: 3630 s, so a flood of idle connections would be bounded only by file descriptors); nginx's
#: ``keepalive_timeout`` default, https://nginx.org/en/docs/http/ngx_http_core_module.html#keepalive_timeout
KEEPALIVE_TIMEOUT_S = 75.0


class ClientListener:
    """The own leg's listener.

    Args:
        route: the handler of a request (by its method and path).
        header_timeout: seconds a connection may take to send a request's headers (0: none).
        max_field: bytes of a request line or of one header field.
        decoded_limit: bytes of a decoded (gzip, deflate) request body kept at most.
        on_timeout: called for each connection closed by the header deadline.
        on_malformed: called for each request refused as malformed HTTP.
        draining: True once the sidecar drains (answers then close their connection).
        keepalive_timeout: seconds an idle kept-alive connection stays open.
        client: the port serving clients (False: the admin port, whose 408 and malformed-HTTP
            answers carry no ``x-kvgate-*`` refusal headers).
    """

    def __init__(
        self,
        route: Callable[[Request], Handler],
        *,
        header_timeout: float,
        max_field: int,
        decoded_limit: int,
        on_timeout: Callable[[], None],
        on_malformed: Callable[[], None],
        draining: Callable[[], bool],
        keepalive_timeout: float = KEEPALIVE_TIMEOUT_S,
        client: bool = True,
    ) -> None:
        self.connections: set[ClientConnection] = set()
        self.config = LegConfig(
            route=route,
            header_timeout=header_timeout,
            keepalive_timeout=keepalive_timeout,
            max_field=max_field,
            decoded_limit=decoded_limit,
            on_timeout=on_timeout,
            on_malformed=on_malformed,
            draining=draining,
            connections=self.connections,
            client=client,
        )
        self._server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        """The port listened on (the one the system chose for port 0)."""
        assert self._server is not None and self._server.sockets
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def start(self, host: str, port: int, backlog: int) -> None:
        """Listen on ``host:port``. Raises ``OSError`` when the port is taken."""
        config = self.config
        self._server = await asyncio.get_running_loop().create_server(
            lambda: ClientConnection(config), host, port, backlog=backlog, reuse_address=True
        )

    def stop_accepting(self) -> None:
        """Accept no new connection; close the idle kept-alive ones."""
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            if conn.idle:
                conn.close()

    async def wait_idle(self, seconds: float) -> bool:
        """Until no connection has a request being answered (pass-through ones included), at
        most ``seconds``; whether it came to that."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while True:
            tasks = {c.task for c in self.connections if c.task is not None}
            left = deadline - loop.time()
            if not tasks:
                return True
            if left <= 0:
                return False
            await asyncio.wait(tasks, timeout=left)

    async def close(self, grace: float = 1.0) -> None:
        """Close every connection (cancelling what they still run) and wait up to ``grace``
        seconds for their handlers to finish."""
        self.stop_accepting()
        tasks = {c.task for c in self.connections if c.task is not None}
        for conn in list(self.connections):
            conn.abort()
        if tasks:
            await asyncio.wait(tasks, timeout=grace)
