"""The sidecar: an OpenAI-compatible reverse proxy that enforces admission in front of one model
server (settings, wiring, routes, health and lifecycle).

Every generation API of the supported engines goes through admission (the table in
:mod:`kvgate_agent.sidecar.reading.endpoints`); another method on one of those paths gets 405. Any
other mutating request is refused with 404 unless its path is on the pass-through allowlist; GET,
HEAD and OPTIONS pass through untouched. The sidecar's own endpoints are ``/healthz``, ``/readyz``
and ``/kvgate/metrics`` on the same port, and ``/metrics`` on the optional admin port; the same
port's ``GET /metrics`` is the model server's own with kvgate's router gauges appended
(:mod:`kvgate_agent.sidecar.engine.router_metrics`). Thresholds come from a policy file (standalone)
or from the node agent (:mod:`kvgate_agent.sidecar.node_link.agent_enforcement`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from kvgate_agent.admission import AdmissionConfig, AdmissionController, AsyncAdmission
from kvgate_agent.contract.policy import FailureMode
from kvgate_agent.sidecar.edge import Answer, ClientRequest, Handler, Request
from kvgate_agent.sidecar.engine import EngineProbe, EngineTokenizer, PromptReads, RouterMetrics
from kvgate_agent.sidecar.identity import Authenticator
from kvgate_agent.sidecar.metrics import SidecarMetrics
from kvgate_agent.sidecar.metrics_view import CONTENT_TYPE as METRICS_CONTENT_TYPE
from kvgate_agent.sidecar.metrics_view import MetricsView
from kvgate_agent.sidecar.node_link import NO_LIMITS, AgentEnforcement, AgentLink, EnforcedPolicy
from kvgate_agent.sidecar.pipeline import RequestPipeline
from kvgate_agent.sidecar.policy_control import PolicyControl
from kvgate_agent.sidecar.reading import GENERATION_PATHS, Passthrough, PromptCounter
from kvgate_agent.sidecar.settings import SidecarSettings as SidecarSettings  # re-exported
from kvgate_agent.sidecar.store import StoreLink, register_metrics, share_exchange
from kvgate_agent.sidecar.upstream import Forwarder, ModelServer


class Sidecar:
    """One sidecar: its parts, built here, its applications, its lifecycle and its own
    endpoints.

    :meth:`client_route` routes the clients' port; a request on the model server's paths goes
    through :attr:`pipeline` (:class:`~kvgate_agent.sidecar.pipeline.RequestPipeline`);
    the parts are the admission core (:attr:`admission`), the engine probe (:attr:`engine`),
    the policy enforced now (:attr:`policy`: the policy file's, or the node agent's thresholds
    in agent mode) and the forwarder; with a store, its leases (:attr:`store`) and, with
    ``--share-sync``, the exchange of service counters for pool-wide shares (:attr:`shares`).

    Raises ``ValueError`` unless exactly one of ``settings.policy`` (standalone) and
    ``settings.agent`` (thresholds from the node agent) is given; ``KeyFileError`` when a keys
    or JWKS file cannot be used, or the policy's ``tenants.jwt`` has no JWKS file
    (:meth:`Authenticator.check`).
    """

    def __init__(
        self, settings: SidecarSettings, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if (settings.policy is None) == (settings.agent is None):
            raise ValueError(
                "give exactly one of a policy (standalone) or a node agent (cluster mode)"
            )
        self.settings = settings
        initial = NO_LIMITS if settings.policy is None else settings.policy.spec
        self.admission = AsyncAdmission(
            AdmissionController(AdmissionConfig.from_policy(initial), clock)
        )
        self.metrics = SidecarMetrics(self.admission, settings.tenant_label_limit)
        self._metrics_view = MetricsView(self.metrics.registry)
        #: Whose each request is: the keys and JWKS files (re-read while serving), the header.
        s = settings
        self.identity = Authenticator(s.api_keys_file, s.jwks_file, s.identity_poll_seconds)
        if settings.policy is not None:
            self.identity.check(settings.policy.spec.tenants)  # KeyFileError: exit 2
        #: Every connection to the model server (opened at startup, closed at cleanup).
        self.model_server = ModelServer(
            settings.upstream,
            connect_timeout=settings.connect_timeout,
            upstream_timeout=settings.upstream_timeout,
            on_resend=self.metrics.upstream.resends.inc,
        )
        self.engine = EngineProbe(
            self.model_server,
            self.admission,
            lambda: self.policy.spec,
            self.metrics.upstream.ok,
            settings.engine_poll_seconds,
            settings.engine_usage_seconds,
            self.metrics.engine.capacity_unknown,
            initial=initial,
        )
        enforcement: AgentEnforcement | None = None
        #: Agent mode only: the link syncing with the node agent.
        self.agent_link: AgentLink | None = None
        if settings.agent is not None:
            e = AgentEnforcement(
                settings.agent, clock, self.admission, self.metrics, self.engine, self.identity
            )
            enforcement = e
            self.agent_link = AgentLink(settings.agent, e.state, e.sync_report, e.on_sync)
        self.policy = EnforcedPolicy(settings.policy, enforcement)
        self.counter = PromptCounter(settings.tokenizer_file)
        self.engine_tokens = (
            EngineTokenizer(
                self.model_server.url,
                self.counter,
                timeout=settings.engine_tokenize_timeout,
                session=self.model_server.opened_session,
            )
            if settings.engine_tokenizer
            else None
        )
        if self.engine_tokens is not None:
            self.metrics.engine.attach_prompt_counts(self.engine_tokens.answered)
        #: The policy re-read on SIGHUP, and what a stalled engine changes.
        self.control = PolicyControl(s, self.policy, self.admission, self.engine, self.identity)
        self.stall = self.control.stall  #: whether the engine stopped producing tokens
        #: The model server's side: every forwarded body's bounds, the pass-through allowlist.
        self.forwarder = Forwarder(
            self.model_server, self.metrics, self.admission, self.counter,
            allowlist=Passthrough.of(s.passthrough_paths), body_timeout=s.body_timeout_seconds,
            max_body=s.max_body_bytes, stall=self.stall,
        )  # fmt: skip
        #: The leases of shared limits (None without a store: shared limits are per pod).
        self.store: StoreLink | None = None
        if settings.store is not None:
            store = self.store = StoreLink(settings.store, self.admission, self.policy.name, clock)
            self.policy.attach_store(lambda: store.book.state.value)  # x-kvgate-thresholds
        self.shares = share_exchange(settings.store, self.admission, self.policy.name, clock)
        register_metrics(self.metrics.registry, self.admission, self.store, self.shares)
        #: A request's path: one object per room it passes through, admission, the metrics.
        prompts = PromptReads(self.engine, self.counter, self.engine_tokens)
        self.pipeline = RequestPipeline(
            self.policy, self.identity, prompts, self.admission, self.forwarder, self.metrics
        )

    @property
    def capacity_known(self) -> bool:
        """The KV capacity admission enforces is known."""
        return self.engine.capacity_known

    # ------------------------------------------------------------------ lifecycle

    def client_route(self) -> Callable[[Request], Handler]:
        """The clients' port's routes (:mod:`kvgate_agent.sidecar.edge.client_listener`): a
        request's handler by its raw path (a generation path only as sent, canonical; anything
        else goes to ``pipeline.other``, which refuses what only normalises to one) and, for
        the sidecar's own endpoints, its method (GET or HEAD)."""
        generation = self.pipeline.generation_handler()
        other = self.pipeline.other
        router_metrics = RouterMetrics(self.model_server, self.admission).handle
        own: dict[str, Handler] = {
            "/healthz": self.healthz,
            "/readyz": self.readyz,
            "/kvgate/metrics": self.client_metrics_endpoint,
            "/metrics": router_metrics,
        }
        paths = GENERATION_PATHS

        def route(request: Request) -> Handler:
            path = request.path
            if path in paths:
                return generation
            handler = own.get(path)
            if handler is not None and request.method in ("GET", "HEAD"):
                return handler
            return other

        return route

    async def open(self) -> None:
        """Start what the sidecar runs beside its listeners (the engine probe, the node link,
        the store's leases, the identity files' watch) and open the model server's
        connections."""
        spec = self.policy.spec
        # Agent mode: the policy is the node agent's, checked when its thresholds arrive.
        self.identity.start(spec.tenants if self.policy.enforcement is None else None)
        await self.model_server.open()
        await self.engine.start(
            poll=spec.capacity.from_engine_metrics
            or self.engine.max_model_len is None  # read until known: it bounds the policy's
            or self.policy.enforcement is not None,  # they may ask for the engine's capacity later
        )
        if self.policy.enforcement is not None and self.agent_link is not None:
            self.policy.enforcement.start()  # the mode from now on, pushed as it changes
            await self.agent_link.start()
        if self.store is not None:
            await self.store.start()
        if self.shares is not None:
            await self.shares.start()
        self.stall.start()

    async def close(self) -> None:
        """Stop what :meth:`open` started and close the model server's connections."""
        await self.stall.stop()
        if self.shares is not None:
            await self.shares.stop()
        if self.store is not None:
            await self.store.stop()  # hands the leases back
        if self.agent_link is not None:
            await self.agent_link.stop()
        if self.policy.enforcement is not None:
            self.policy.enforcement.stop()
        await self.engine.stop()
        await self.identity.stop()
        self.admission.close()
        if self.engine_tokens is not None:
            self.engine_tokens.close()
        await self.model_server.close()

    def count_malformed(self) -> None:
        """A request refused by the HTTP parser: a refusal before admission."""
        self.metrics.count_decision("rejected", "invalid_request", "")

    def admin_route(self) -> Callable[[Request], Handler]:
        """The admin port's routes, served by the same leg as the clients' port
        (:mod:`kvgate_agent.sidecar.edge.client_listener`): ``/metrics`` (the whole registry),
        ``/healthz``, ``/readyz`` for GET and HEAD (405 for another method, 404 for another
        path); every answer says ``Server: kvgate``."""
        own: dict[str, Handler] = {
            "/metrics": _server_named(self.metrics_endpoint),
            "/healthz": _server_named(self.healthz),
            "/readyz": _server_named(self.readyz),
        }

        def route(request: Request) -> Handler:
            handler = own.get(request.path)
            if handler is None:
                return _admin_not_found
            if request.method not in ("GET", "HEAD"):
                return _admin_not_allowed
            return handler

        return route

    async def reload(self) -> None:
        """SIGHUP: re-read the policy, keys and JWKS files (:meth:`PolicyControl.reload`)."""
        await self.control.reload()

    # ------------------------------------------------------------------ own endpoints

    async def healthz(self, request: ClientRequest) -> Answer:
        """Liveness: the process serves HTTP."""
        return Answer(text="ok")

    async def readyz(self, request: ClientRequest) -> Answer:
        """Readiness: not draining; with a node agent, a first answer arrived or the TTL has
        passed since start; the model server answers its ``/health`` and has not stalled
        (:mod:`~kvgate_agent.sidecar.upstream.engine_stall`); and, under FailClosed,
        the engine's KV capacity is known (FailOpen serves without it, and says why in the
        body: ``ok, but the engine's KV capacity is not known: ...``)."""
        if self.pipeline.draining:
            return Answer(status=503, text="draining")
        enforcement = self.policy.enforcement
        if enforcement is not None and not enforcement.state.ready():
            return Answer(status=503, text="waiting for thresholds from the node agent")
        if not self.capacity_known and self.policy.spec.failure_mode is FailureMode.FAIL_CLOSED:
            return Answer(status=503, text="waiting for the engine's KV capacity")
        if not await self.engine.healthy():
            return Answer(status=503, text="the model server is not answering")
        if self.stall.stalled:
            return Answer(
                status=503,
                text=f"the model server has produced no token for "
                f"{self.stall.quiet_seconds():.0f}s with streams in flight",
            )
        problem = self.engine.capacity_problem
        return Answer(text="ok" if problem is None else f"ok, but {problem}")

    async def metrics_endpoint(self, request: ClientRequest) -> Answer:
        """Prometheus exposition of the sidecar's registry (the admin port's ``/metrics``)."""
        body = self._metrics_view.admin()
        return Answer(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})

    @property
    def tenants_private(self) -> bool:
        """The policy enforced now names tenants by credentials the sidecar checks
        (``tenants.header: authorization``: API keys, JWTs, each key its own tenant): their
        series are not for whoever can reach the clients' port."""
        return self.policy.spec.tenants.header.lower() == "authorization"

    async def client_metrics_endpoint(self, request: ClientRequest) -> Answer:
        """``/kvgate/metrics`` on the clients' port: the registry's exposition, less every
        series of a named tenant while :attr:`tenants_private`
        (:class:`~kvgate_agent.sidecar.metrics_view.MetricsView`; those stay on the admin
        port)."""
        body = self._metrics_view.clients(self.tenants_private)
        return Answer(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})


#: The header every answer of the admin port carries (not a library's or Python's version).
_SERVER = {"Server": "kvgate"}


def _server_named(handler: Callable[[Any], Awaitable[Answer]]) -> Handler:
    """``handler``, its answers saying ``Server: kvgate`` (:meth:`Sidecar.admin_route`)."""

    async def named(request: Any) -> Answer:
        resp = await handler(request)
        resp.headers.update(_SERVER)
        return resp

    return named


async def _admin_not_found(request: Any) -> Answer:
    """The admin port's answer to a path it does not serve."""
    return Answer(status=404, text="404: Not Found", headers=_SERVER)


async def _admin_not_allowed(request: Any) -> Answer:
    """The admin port's answer to a method other than GET and HEAD on one of its paths."""
    return Answer(
        status=405, text="405: Method Not Allowed", headers={**_SERVER, "Allow": "GET, HEAD"}
    )
