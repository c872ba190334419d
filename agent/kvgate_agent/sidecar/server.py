"""Serving one :class:`~kvgate_agent.sidecar.app.Sidecar`: its listeners, and the graceful
shutdown that drains it.

:class:`SidecarServer` starts the proxy's listener (and the admin one), and on shutdown refuses
new work (waiting requests get 503 with Retry-After, the listener closes), lets in-flight
requests finish for up to ``drain_seconds`` (or until told to hurry), ends what is left (streams
with a terminal ``shutting_down`` error event, unanswered requests with 503) and closes
everything; every reservation is released on each of those paths.
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial

from kvgate_agent.admission import Reason
from kvgate_agent.sidecar.app import Sidecar
from kvgate_agent.sidecar.edge import ClientListener

log = logging.getLogger("kvgate")

#: The listeners' limits, as the sidecar has always run the proxy's: a request line and each
#: header field up to 64 KiB (aiohttp's server defaulted to 8,190 bytes), an accept backlog of
#: 1,024.
MAX_FIELD_BYTES = 65536
BACKLOG = 1024


class SidecarServer:
    """The listeners of one sidecar and its drain (see the module docstring): the clients'
    port on kvgate's own server leg
    (:class:`~kvgate_agent.sidecar.edge.client_listener.ClientListener`, the only one: the
    aiohttp leg of kvgate 0.x was retired), and the admin port on the same leg.

    Raises ``ValueError`` when ``settings.server_leg`` names another leg than ``kvgate``."""

    def __init__(self, sidecar: Sidecar) -> None:
        self.sidecar = sidecar
        st = sidecar.settings
        if st.server_leg != "kvgate":
            raise ValueError(
                f"server leg {st.server_leg!r}: kvgate serves clients on its own leg only "
                "('kvgate'; the aiohttp leg was retired)"
            )
        m = sidecar.metrics
        # Both ports' listeners: the same leg, header deadline, field and body bounds.
        listener = partial(
            ClientListener,
            header_timeout=st.header_timeout_seconds,
            max_field=MAX_FIELD_BYTES,
            decoded_limit=st.max_body_bytes + 1,
            on_timeout=m.client_timeouts.labels("headers").inc,
        )
        self._listener = listener(
            sidecar.client_route(),
            on_malformed=sidecar.count_malformed,
            draining=lambda: sidecar.pipeline.draining,
        )
        #: The admin port's listener (``/metrics``, ``/healthz``, ``/readyz``): its answers
        #: without kvgate's refusal headers; it serves on through the drain (``/readyz`` says
        #: ``draining``) and closes with the rest.
        self._admin = listener(
            sidecar.admin_route(), on_malformed=_uncounted, draining=_never, client=False
        )
        self._admin_started = False
        self._opened = False

    @property
    def port(self) -> int:
        """The clients' port (the one the system chose for port 0)."""
        return self._listener.port

    @property
    def admin_port(self) -> int | None:
        """The admin port (the one the system chose for port 0); None without one."""
        if not self._admin_started:
            return None
        return self._admin.port

    async def start(self, listen: tuple[str, int], admin: tuple[str, int] | None) -> None:
        """Listen on ``listen`` (and serve ``/metrics``, ``/healthz``, ``/readyz`` on ``admin``).

        Raises:
            OSError: a port is taken; what had started is closed first.
        """
        try:
            self._opened = True
            await self.sidecar.open()
            await self._listener.start(listen[0], listen[1], BACKLOG)
            if admin is not None:
                await self._admin.start(admin[0], admin[1], BACKLOG)
                self._admin_started = True
        except BaseException:  # a port taken: close what started (the upstream session) first
            await self._close_runners()
            raise

    async def drain(self, drain_seconds: float, hurry: asyncio.Event) -> None:
        """Shut down gracefully: refuse new work, let in-flight requests finish for up to
        ``drain_seconds`` (``hurry`` set cuts that short), end what is left, close
        everything."""
        sc = self.sidecar
        log.info("shutting down: draining up to %.0fs", drain_seconds)
        sc.pipeline.draining = True
        why = "the sidecar is shutting down"
        sc.admission.reject_waiting(Reason.DRAINING, 503, 1.0, why)
        # A request whose body (or engine prompt count) completes from now on reaches
        # admission after the drain began: refused as the waiters were, 503 with Retry-After.
        sc.admission.hold(Reason.DRAINING, retry_after=1.0, message=why, key="draining")
        self._listener.stop_accepting()
        idle = asyncio.ensure_future(self._wait_idle(drain_seconds))
        cut = asyncio.ensure_future(hurry.wait())
        await asyncio.wait({idle, cut}, return_when=asyncio.FIRST_COMPLETED)
        cut.cancel()
        if not idle.done() or not idle.result():
            idle.cancel()
            log.warning(
                "stopping with %d requests in flight (drain deadline or second signal)",
                sc.admission.stats().in_flight,
            )
            await sc.forwarder.end_all(grace=1.0)  # streams end with an error event
        await self._close_runners()  # cancels what is still running: reservations released

    async def _wait_idle(self, seconds: float) -> bool:
        """Until no admitted request is in flight and no request at all is being answered
        (pass-through ones too), at most ``seconds``; whether it came to that."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        if not await self.sidecar.admission.wait_idle(seconds):
            return False
        return await self._listener.wait_idle(max(0.0, deadline - loop.time()))

    async def cleanup(self) -> None:
        """Close every listener and connection at once (no drain)."""
        await self._close_runners()

    async def _close_runners(self) -> None:
        await self._listener.close()
        if self._opened:
            self._opened = False
            await self.sidecar.close()
        if self._admin_started:
            self._admin_started = False
            await self._admin.close()


def _uncounted() -> None:
    """A malformed request on the admin port: not a client's refusal, not counted."""


def _never() -> bool:
    """The admin port never drains: it answers (``/readyz``: ``draining``) until closed."""
    return False
