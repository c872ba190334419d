"""The sidecar: an OpenAI-compatible reverse proxy that enforces admission in front of one model
server (settings, wiring, routes, health and lifecycle).

Every generation API of the supported engines goes through admission (the table in
:mod:`kvgate_agent.sidecar.endpoints`); another method on one of those paths gets 405. Any other
mutating request is refused with 404 unless its path is on the pass-through allowlist; GET, HEAD
and OPTIONS pass through untouched. The sidecar's own endpoints are ``/healthz``, ``/readyz`` and
``/kvgate/metrics`` on the same port, and ``/metrics`` on the optional admin port. Thresholds come
from a policy file (standalone) or from the node agent (:mod:`kvgate_agent.sidecar.thresholds`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from yarl import URL

from kvgate_agent.admission import (
    AdmissionConfig,
    AdmissionController,
    AsyncAdmission,
    Reason,
)
from kvgate_agent.contract.policy import FailureMode, RateLimitPolicySpec
from kvgate_agent.sidecar import responses
from kvgate_agent.sidecar.agent_link import (
    AgentLink,
    Mode,
    ThresholdsLink,
)
from kvgate_agent.sidecar.body import read_body
from kvgate_agent.sidecar.endpoints import (
    GENERATION_PATHS,
    SAFE_METHODS,
    Passthrough,
)
from kvgate_agent.sidecar.engine_tokens import EngineTokenizer
from kvgate_agent.sidecar.fallback_pool import already_degraded, degrade_to_pool
from kvgate_agent.sidecar.forward import Forwarder
from kvgate_agent.sidecar.identity import INVALID_API_KEY, Authenticator
from kvgate_agent.sidecar.metrics import SidecarMetrics
from kvgate_agent.sidecar.model_server import ModelServer
from kvgate_agent.sidecar.openai_errors import RequestError
from kvgate_agent.sidecar.probe import EngineProbe
from kvgate_agent.sidecar.request import ParsedRequest, canonical_path, is_json
from kvgate_agent.sidecar.settings import SidecarSettings as SidecarSettings  # re-exported
from kvgate_agent.sidecar.slowclients import GuardedAppRunner, track_requests
from kvgate_agent.sidecar.store import SharedStore, register_metrics
from kvgate_agent.sidecar.tenants import Identifier, Identity, engine_priority
from kvgate_agent.sidecar.thresholds import NO_LIMITS, AgentThresholds
from kvgate_agent.sidecar.tokens import (
    PromptCount,
    PromptCounter,
    default_within_context,
    optimistic_prompt_tokens,
    prompt_over_context,
)


class Sidecar:
    """One sidecar: admission state, the upstream client and the aiohttp handlers.

    Use :meth:`build_app` for the aiohttp application; the handlers only translate HTTP to and
    from the admission core (:attr:`admission`), the engine probe (:attr:`engine`), the node
    agent's thresholds (:attr:`thresholds`, agent mode) and the forwarder.

    Raises ``ValueError`` unless exactly one of ``settings.policy`` (standalone) and
    ``settings.agent`` (thresholds from the node agent) is given.
    """

    def __init__(
        self, settings: SidecarSettings, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if (settings.policy is None) == (settings.agent is None):
            raise ValueError(
                "give exactly one of a policy (standalone) or a node agent (cluster mode)"
            )
        self.settings = settings
        self._policy_spec = NO_LIMITS if settings.policy is None else settings.policy.spec
        self.admission = AsyncAdmission(
            AdmissionController(AdmissionConfig.from_policy(self._policy_spec), clock)
        )
        self.metrics = SidecarMetrics(self.admission, settings.tenant_label_limit)
        #: Whose each request is: the keys and JWKS files (re-read while serving), the header.
        s = settings
        self.identity = Authenticator(s.api_keys_file, s.jwks_file, s.identity_poll_seconds)
        #: Every connection to the model server (opened at startup, closed at cleanup).
        self.model_server = ModelServer(
            settings.upstream,
            connect_timeout=settings.connect_timeout,
            upstream_timeout=settings.upstream_timeout,
            on_resend=self.metrics.upstream_resends.inc,
        )
        #: Agent mode only: the node agent's thresholds and the link syncing with it.
        self.thresholds: AgentThresholds | None = None
        self.agent_link: AgentLink | None = None
        self.engine = EngineProbe(
            self.model_server,
            self.admission,
            lambda: self.spec,
            self.metrics.upstream_ok,
            settings.engine_poll_seconds,
            settings.engine_usage_seconds,
            self.metrics.engine_unknown,
        )
        if settings.agent is not None:
            t = AgentThresholds(settings.agent, clock, self.admission, self.metrics, self.engine)
            self.thresholds = t
            self.agent_link = AgentLink(settings.agent, t.link, t.sync_report, t.on_sync)
            self.metrics.attach_link(t.link, self.current_mode, lambda: t.policy_ref)
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
            self.metrics.attach_prompt_counts(self.engine_tokens.answered)
        self.forwarder = Forwarder(
            self.model_server,
            self.metrics,
            self.admission,
            self.counter,
            body_timeout=settings.body_timeout_seconds,
        )
        self.draining = False
        self.passthrough = Passthrough.of(settings.passthrough_paths)
        self.identify = Identifier()  # each request's tenant, class and priority
        #: The leases of shared limits (None without a store: shared limits are per pod).
        self.store: SharedStore | None = None
        if settings.store is not None:
            self.store = SharedStore(settings.store, self.admission, self._policy_name, clock)
        register_metrics(self.metrics.registry, self.admission, self.store)

    # ------------------------------------------------------------------ state

    @property
    def spec(self) -> RateLimitPolicySpec:
        """The policy spec enforced now (the node agent's thresholds in agent mode)."""
        return self._policy_spec if self.thresholds is None else self.thresholds.spec

    @property
    def link(self) -> ThresholdsLink | None:
        """The thresholds' state when a node agent is used (None standalone)."""
        return None if self.thresholds is None else self.thresholds.link

    @property
    def mode(self) -> Mode | None:
        """The thresholds mode last enforced (None standalone)."""
        return None if self.thresholds is None else self.thresholds.mode

    @property
    def capacity_known(self) -> bool:
        """The KV capacity admission enforces is known."""
        return self.engine.capacity_known

    def _policy_name(self) -> str:
        """``namespace/name`` of the governing policy (the store keys' hash tag)."""
        ref = None if self.thresholds is None else self.thresholds.policy_ref
        if ref is not None:
            return f"{ref.namespace}/{ref.name}"
        meta = None if self.settings.policy is None else self.settings.policy.metadata
        return "standalone" if meta is None else f"{meta.namespace or 'default'}/{meta.name}"

    def mode_header(self) -> str | None:
        """``x-kvgate-thresholds``: the thresholds mode (agent mode) and, with a store, where
        shared limits stand (``store=shared|local|closed``); None when neither applies."""
        mode = self.mode
        parts = [] if mode is None else [mode.value]
        if self.store is not None:
            parts.append(f"store={self.store.book.state.value}")
        return ", ".join(parts) or None

    def refresh_mode(self, *, force: bool = False) -> Mode | None:
        """Enforce the thresholds mode now (see :meth:`AgentThresholds.refresh`); None
        standalone."""
        return None if self.thresholds is None else self.thresholds.refresh(force=force)

    def current_mode(self) -> Mode:
        """The thresholds mode now (enforcing it if time moved it on). Agent mode only."""
        mode = self.refresh_mode()
        assert mode is not None, "no node agent configured"
        return mode

    # ------------------------------------------------------------------ lifecycle

    def build_app(self) -> web.Application:
        """The aiohttp application (routes and startup/cleanup hooks)."""
        app = web.Application(
            client_max_size=self.settings.max_body_bytes + 1,
            middlewares=[track_requests, self._pathless],
        )
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/kvgate/metrics", self.metrics_endpoint)
        # Standalone, the mode wrapper has nothing to do: route straight to the handler.
        wrap = self.thresholds is not None or self.store is not None
        handler = self.completion if wrap else self._completion
        for path in GENERATION_PATHS:
            app.router.add_route("*", path, handler)
        app.router.add_route("*", "/{tail:.*}", self.other)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    def runner(self, *, admin: bool = False, **kwargs: Any) -> GuardedAppRunner:
        """The runner serving :meth:`build_app` (:meth:`build_admin_app` with ``admin``) with
        the header deadline (``settings.header_timeout_seconds``); ``kwargs`` go to
        ``web.AppRunner``."""
        timeouts = self.metrics.client_timeouts.labels("headers")
        return GuardedAppRunner(
            self.build_admin_app() if admin else self.build_app(),
            header_timeout=self.settings.header_timeout_seconds,
            on_timeout=timeouts.inc,
            **kwargs,
        )

    def build_admin_app(self) -> web.Application:
        """Admin port: ``/metrics``, ``/healthz``, ``/readyz``."""
        app = web.Application(middlewares=[track_requests])
        app.router.add_get("/metrics", self.metrics_endpoint)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        self.identity.start(self.spec.tenants)
        await self.model_server.open()
        spec = self.spec
        await self.engine.start(
            poll=spec.capacity.from_engine_metrics
            or spec.model.max_model_len is None
            or self.thresholds is not None,  # thresholds may ask for the engine's capacity later
        )
        if self.agent_link is not None:
            self.refresh_mode(force=True)
            await self.agent_link.start()
        if self.store is not None:
            await self.store.start()

    async def _on_cleanup(self, app: web.Application) -> None:
        if self.store is not None:
            await self.store.stop()  # hands the leases back
        if self.agent_link is not None:
            await self.agent_link.stop()
        await self.engine.stop()
        await self.identity.stop()
        self.admission.close()
        if self.engine_tokens is not None:
            self.engine_tokens.close()
        await self.model_server.close()

    # ------------------------------------------------------------------ own endpoints

    async def healthz(self, request: web.Request) -> web.Response:
        """Liveness: the process serves HTTP."""
        return web.Response(text="ok")

    async def readyz(self, request: web.Request) -> web.Response:
        """Readiness: not draining; with a node agent, a first answer arrived or the TTL has
        passed since start; the model server answers its ``/health``; and, under FailClosed,
        the engine's KV capacity is known (FailOpen serves without it, and says why in the
        body: ``ok, but the engine's KV capacity is not known: ...``)."""
        if self.draining:
            return web.Response(status=503, text="draining")
        if self.thresholds is not None:
            self.refresh_mode()
            if not self.thresholds.link.ready():
                return web.Response(status=503, text="waiting for thresholds from the node agent")
        if not self.capacity_known and self.spec.failure_mode is FailureMode.FAIL_CLOSED:
            return web.Response(status=503, text="waiting for the engine's KV capacity")
        if not await self.engine.healthy():
            return web.Response(status=503, text="the model server is not answering")
        problem = self.engine.capacity_problem
        return web.Response(text="ok" if problem is None else f"ok, but {problem}")

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        """Prometheus exposition of the sidecar's registry."""
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    # ------------------------------------------------------------------ admission path

    @web.middleware
    async def _pathless(
        self, request: web.Request, handler: Callable[[web.Request], Any]
    ) -> web.StreamResponse:
        """An absolute-form target without a path (``GET http://host HTTP/1.1``) is the root
        (RFC 9112 §3.2.2): served by :meth:`other` as ``/`` (aiohttp's router matches no route
        for an empty path, and would answer a plain-text 404)."""
        rel = request.rel_url
        if rel.raw_path == "":
            root = URL.build(path="/", query_string=rel.raw_query_string, encoded=True)
            return await self.other(request.clone(rel_url=root))
        resp: web.StreamResponse = await handler(request)
        return resp

    async def other(self, request: web.Request) -> web.StreamResponse:
        """Every path but the generation ones and the sidecar's own: GET, HEAD and OPTIONS pass
        through; another method only to a path on the allowlist (404 otherwise). A path that
        only normalises (dot segments, repeated slashes, escapes) to a generation or allowlisted
        one is refused with 400: an upstream that normalises it would otherwise serve it
        unchecked."""
        raw = request.rel_url.raw_path  # an absolute-form target's raw_path is the whole URL
        path = canonical_path(raw)
        if path in GENERATION_PATHS:
            return responses.non_canonical_path()
        if request.method in SAFE_METHODS:
            return await self.forwarder.passthrough(request)
        if not self.passthrough.allows(path):
            self.metrics.count_decision("rejected", "invalid_request", "")
            return responses.not_allowed_path(request.method, path)
        if raw != path:
            return responses.non_canonical_path()
        return await self.forwarder.passthrough(request)

    async def completion(self, request: web.Request) -> web.StreamResponse:
        """A generation path (:data:`GENERATION_PATHS`): validate, admit, forward. With a node
        agent, every answer says the thresholds mode in ``x-kvgate-thresholds``."""
        if self.thresholds is None and self.store is None:
            return await self._completion(request)
        self.refresh_mode()
        resp = await self._completion(request)
        value = self.mode_header()
        if not resp.prepared and value is not None:  # streams got it with the admission headers
            resp.headers[responses.THRESHOLDS_HEADER] = value
        return resp

    async def _not_a_generation(self, request: web.Request) -> web.StreamResponse | None:
        """The answer to a request on a generation path that is not a JSON POST (OPTIONS, a CORS
        preflight, passes through; another method gets 405; a body declared as anything but
        JSON 415), or None for a JSON POST."""
        if request.method != "POST":
            if request.method == "OPTIONS":
                return await self.forwarder.passthrough(request)
            self.metrics.count_decision("rejected", "invalid_request", "")
            return responses.method_not_allowed(request.method, request.path)
        content_type = request.headers.get("Content-Type")
        if content_type is not None and not is_json(content_type):
            self.metrics.count_decision("rejected", "invalid_request", "")
            return responses.unsupported_media_type(content_type)
        return None

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        if (early := await self._not_a_generation(request)) is not None:
            return early
        if self.draining:
            return responses.draining()
        spec, st = self.spec, self.settings
        try:
            tenant = self.identity.tenant(request.headers, spec.tenants)
        except RequestError as exc:  # 401: nothing read, admitted or forwarded
            self.metrics.count_decision("rejected", INVALID_API_KEY, "")
            return responses.unauthorized(exc)
        try:
            slow = self.metrics.client_timeouts.labels("body").inc
            raw = await read_body(request, st.max_body_bytes, st.body_timeout_seconds, slow)
            parsed = GENERATION_PATHS[request.path].parse(
                raw,
                default_max_tokens=spec.tenants.default_max_tokens,
                max_tokens_cap=spec.tenants.max_tokens_cap,
                max_model_len=spec.model.max_model_len,
            )
            who = self.identify(request.headers, spec, tenant)  # class, priority
        except RequestError as exc:
            self.metrics.count_decision("rejected", "invalid_request", "")
            return responses.bad_request(exc)
        prompt = await self._prompt(parsed, who)
        max_tokens = parsed.max_tokens
        mml = spec.model.max_model_len or self.engine.max_model_len
        if mml is not None and (
            over := prompt_over_context(prompt, self.counter.bytes_per_token, mml)
        ):
            self.metrics.count_decision("rejected", "invalid_request", "")
            return responses.bad_request(RequestError(400, over, code="context_length_exceeded"))
        if parsed.max_tokens_defaulted and mml is not None:
            max_tokens = default_within_context(max_tokens, prompt, mml)
        areq = who.admission_request(
            prompt.tokens,
            max_tokens,
            parsed.n,
            parsed.model,
            model_rewritable=parsed.model_field,
            degraded=already_degraded(request.headers),
            prompt_tokens_min=optimistic_prompt_tokens(prompt, self.counter.bytes_per_token),
        )
        d = await self.admission.admit(areq)
        m = self.metrics
        label = m.tenant_label(who.tenant)
        if d.queue_seconds > 0:
            m.queue_wait.observe(d.queue_seconds)
        if d.reason is Reason.FALLBACK_POOL:
            return await degrade_to_pool(
                self.model_server.session(), request, self.spec, parsed, raw, d, self.mode_header(),
                lambda x: m.count_decision(x.outcome.value, x.reason.value, label),
            )  # fmt: skip
        m.count_decision(d.outcome.value, d.reason.value, label)
        if d.ticket is None:
            return responses.refusal(d, parsed.api)
        headers = responses.admitted_headers(d, self.mode_header(), parsed.max_tokens_clamped)
        body = (
            parsed.upstream_body(
                max_tokens=d.max_tokens,
                model=d.model,
                include_usage=parsed.stream,
                priority=engine_priority(who.priority, spec.priority.forward_to),
            )
            or raw
        )
        return await self.forwarder.admitted(
            request,
            body,
            d.ticket,
            parsed,
            headers,
            prompt=prompt,
            tenant_label=label,
            started=started,
        )

    async def _prompt(self, parsed: ParsedRequest, who: Identity) -> PromptCount:
        """The prompt's count (tokens): the estimate, or with ``--tokenizer engine`` the
        engine's own, asked only when admission could take the request (not draining, no hold,
        not over its request-count rate limit with no way around)."""
        count_body = parsed.body if parsed.count_body is None else parsed.count_body
        prompt = self.counter.count(count_body)
        if self.engine_tokens is not None:
            est = who.admission_request(prompt.tokens, parsed.max_tokens, parsed.n)
            if not (self.draining or self.admission.refused_whatever_the_prompt(est)):
                prompt = await self.engine_tokens.count(count_body, prompt)
        return prompt
