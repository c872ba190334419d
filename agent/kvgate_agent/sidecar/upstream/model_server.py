"""Every connection from the sidecar to its model server, owned in one place.

:class:`ModelServer` holds the three clients the sidecar talks to its engine with, opened
together when the sidecar starts serving and closed together when it stops:

- :attr:`~ModelServer.pool`: kvgate's own kept-alive connections for admitted requests
  (:class:`~kvgate_agent.sidecar.upstream.upstream.UpstreamPool`, the hot path);
- :meth:`~ModelServer.session`: an aiohttp client for pass-through requests, the engine's
  ``/tokenize`` and ``/apply-template``, and the fallback pool's sidecar;
- :meth:`~ModelServer.probe`: an aiohttp client whose connections close after each read, for
  the engine probe (``/metrics``, ``/props``, ``/slots``, ``/v1/models``, ``/health``) and the
  engine load poll: the connections to the model server are then those of the requests in
  flight and the idle kept-alive ones of the two pools, nothing a probe left behind.

The parts that use them (the forwarder, the engine probe, the engine tokenizer) are given this
object when they are built; none holds a client of its own or has one set later.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp

from kvgate_agent.sidecar.upstream.upstream import UpstreamPool

_SKIP_HEADERS = ("User-Agent", "Accept-Encoding", "Content-Type")


def base_url_problem(url: str) -> str | None:
    """Why ``url`` cannot be a model server's base URL, or None when it can: the server's root
    (``http://host:8000``, a trailing ``/`` allowed), no path, query or fragment. Clients' paths
    (``/v1/chat/completions``) go upstream as sent and the probes read ``/metrics``, ``/props``
    and ``/v1/models`` from the root, so a base with a path (OpenAI clients' ``.../v1``) would be
    used one way by requests and another by the probes."""
    try:
        u = urlsplit(url)
        u.port  # noqa: B018  # raises ValueError for a port that is not a number in 0..65535
    except ValueError as exc:
        return f"not a URL ({exc})"
    if u.scheme not in ("http", "https") or not u.hostname:
        return "expected an http:// or https:// URL with a host"
    if u.path not in ("", "/") or u.query or u.fragment:
        root = f"{u.scheme}://{u.netloc}"
        return (
            f"give the model server's root, {root}, not a path: clients' paths "
            f"(/v1/chat/completions) are forwarded as sent and the KV capacity is read from "
            f"{root}/metrics"
        )
    return None


@dataclass(slots=True)
class Flag:
    """A yes/no the sidecar sets on its paths and a 0/1 gauge reads at scrape time."""

    value: bool


class ModelServer:
    """The sidecar's connections to the model server at ``url``.

    Args:
        url: the model server's base URL, e.g. ``http://127.0.0.1:8000`` (a trailing ``/`` is
            dropped).
        connect_timeout: seconds to open a connection.
        upstream_timeout: seconds without a byte of an answer (None: no limit).
        on_resend: called for each admitted request sent a second time (see
            :mod:`~kvgate_agent.sidecar.upstream.upstream`).

    Raises:
        ValueError: ``url`` is not an ``http://`` or ``https://`` URL with a host, or has a
            path, query or fragment (:func:`base_url_problem`).
    """

    def __init__(
        self,
        url: str,
        *,
        connect_timeout: float,
        upstream_timeout: float | None,
        on_resend: Callable[[], object] | None = None,
    ) -> None:
        problem = base_url_problem(url)
        if problem is not None:
            raise ValueError(f"model server URL {url!r}: {problem}")
        self.url = url.rstrip("/")
        #: Admitted requests' kept-alive connections (usable at once; closed by :meth:`close`).
        self.pool = UpstreamPool(
            self.url,
            connect_timeout=connect_timeout,
            read_timeout=upstream_timeout,
            on_resend=on_resend,
        )
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=connect_timeout, sock_read=upstream_timeout
        )
        self._session: aiohttp.ClientSession | None = None
        self._probe: aiohttp.ClientSession | None = None
        self._closed = False

    async def open(self) -> None:
        """Open the two aiohttp clients (on the running event loop; again: nothing).

        Raises:
            RuntimeError: after :meth:`close` (one open and one close per sidecar's life).
        """
        if self._closed:
            raise RuntimeError("the model server's connections were closed for good")
        if self._session is not None:
            return
        self._session = aiohttp.ClientSession(
            timeout=self._timeout,
            auto_decompress=False,
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
            skip_auto_headers=_SKIP_HEADERS,
        )
        self._probe = aiohttp.ClientSession(
            timeout=self._timeout,
            auto_decompress=False,
            connector=aiohttp.TCPConnector(force_close=True),
            skip_auto_headers=_SKIP_HEADERS,
        )

    async def close(self) -> None:
        """Close every connection: the pool's (idle or busy) and both clients'."""
        self._closed = True
        self.pool.close()
        sessions, self._session, self._probe = (self._session, self._probe), None, None
        for s in sessions:
            if s is not None:
                await s.close()

    def opened_session(self) -> aiohttp.ClientSession | None:
        """The kept-alive client once :meth:`open` ran, else None."""
        return self._session

    def session(self) -> aiohttp.ClientSession:
        """The kept-alive client (pass-through, ``/tokenize``, the fallback pool).

        Raises:
            RuntimeError: before :meth:`open` (the sidecar opens it when it starts serving).
        """
        if self._session is None:
            raise RuntimeError("the model server's connections are not open yet")
        return self._session

    def probe(self) -> aiohttp.ClientSession:
        """The client whose connections close after each read (the probe, the load poll).

        Raises:
            RuntimeError: before :meth:`open`.
        """
        if self._probe is None:
            raise RuntimeError("the model server's connections are not open yet")
        return self._probe
