"""The sidecar: an OpenAI-compatible reverse proxy that enforces admission in front of one model
server.

``POST /v1/chat/completions`` and ``POST /v1/completions`` go through admission; every other path
is passed through untouched (so the model server's own ``/metrics``, ``/v1/models``, ``/health``
stay reachable). The sidecar's own endpoints are ``/healthz``, ``/readyz`` and
``/kvgate/metrics`` on the same port, and ``/metrics`` on the optional admin port.

Two ways to get thresholds: standalone, from a policy file (``SidecarSettings.policy``); or in a
cluster, from the node agent (``SidecarSettings.agent``): :mod:`kvgate_agent.sidecar.agent_link`
syncs with it, and :meth:`Sidecar.refresh_mode` applies what it says (new thresholds without
dropping in-flight work, the GPU safety net, and ``failureMode`` once the agent has been
unreachable past the TTL).

Every admitted request releases exactly what it reserved on every path (success, upstream error,
timeout, client disconnect before or during the stream, cancellation): the release sits in one
``finally`` and is idempotent (field lesson L01). When the client goes away the handler task is
cancelled (aiohttp ``handler_cancellation``) and the upstream connection is closed at once, so the
model server stops generating into a dead socket (field lesson L05).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from yarl import URL

from kvgate_agent.admission import (
    AdmissionConfig,
    AdmissionController,
    AdmissionRequest,
    AsyncAdmission,
    Decision,
    Outcome,
    Reason,
)
from kvgate_agent.contract.nodeadmission import PodThresholds, PolicyRef
from kvgate_agent.contract.policy import FailureMode, RateLimitPolicy, RateLimitPolicySpec
from kvgate_agent.contract.sync import MAX_REPORTED, SafetyNet, SyncAnswer, SyncReport
from kvgate_agent.sidecar.agent_link import (
    AgentLink,
    AgentSettings,
    Mode,
    SyncResult,
    ThresholdsLink,
)
from kvgate_agent.sidecar.engine_metrics import kv_capacity_from_metrics
from kvgate_agent.sidecar.metrics import SidecarMetrics
from kvgate_agent.sidecar.openai_errors import (
    RATE_LIMIT_ERROR,
    RATE_LIMIT_EXCEEDED,
    SERVER_ERROR,
    SERVICE_UNAVAILABLE,
    RequestError,
    error_body,
)
from kvgate_agent.sidecar.request import ParsedRequest, parse_completion_request
from kvgate_agent.sidecar.sse import StreamAccountant
from kvgate_agent.sidecar.tenants import priority_of, tenant_of
from kvgate_agent.sidecar.tokens import PromptCount, PromptCounter

log = logging.getLogger("kvgate.sidecar")

#: Hop-by-hop headers (RFC 9110 §7.6.1) and those the proxy recomputes; never forwarded.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
ADMITTED_PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
JSON = "application/json"
#: Bound on the sidecar's own reads of the model server (metrics, model list): a hung engine
#: endpoint must not stall the capacity check for the request timeout (minutes).
_PROBE_TIMEOUT = aiohttp.ClientTimeout(total=5.0)
#: Response header naming the thresholds mode (see :class:`Mode`) when a node agent is used.
THRESHOLDS_HEADER = "x-kvgate-thresholds"
#: What an agent-mode sidecar enforces without thresholds (before the first answer, unmanaged
#: pods, FailOpen without any thresholds): no rate limits, no caps; everything is admitted.
NO_LIMITS = RateLimitPolicySpec()
#: Hold keys on the admission controller (see ``AdmissionController.hold``).
HOLD_THRESHOLDS = "thresholds"
HOLD_GPU_MEMORY = "gpu_memory"
HOLD_ENGINE_CAPACITY = "engine_capacity"


@dataclass(slots=True)
class SidecarSettings:
    """Runtime settings of one sidecar.

    Attributes:
        upstream: base URL of the model server, e.g. ``http://127.0.0.1:8000``.
        policy: the RateLimitPolicy enforced (standalone mode).
        agent: the node agent to take thresholds from (cluster mode). Exactly one of
            ``policy`` and ``agent`` must be given.
        tokenizer_file: HF ``tokenizer.json`` for exact prompt counts (else a conservative
            estimate corrected by reported usage).
        max_body_bytes: request bodies above this get 413 (bytes).
        connect_timeout: seconds to open an upstream connection.
        read_timeout: seconds without any upstream byte before the request fails (None: no
            limit).
        drain_seconds: on SIGTERM, how long in-flight requests may take to finish.
        engine_poll_seconds: how often the engine's KV capacity is re-read when
            ``capacity.fromEngineMetrics`` is set.
        tenant_label_limit: distinct tenant label values in metrics before ``other``.
    """

    upstream: str
    policy: RateLimitPolicy | None = None
    tokenizer_file: str | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    connect_timeout: float = 5.0
    read_timeout: float | None = 600.0
    drain_seconds: float = 30.0
    engine_poll_seconds: float = 15.0
    tenant_label_limit: int = 50
    agent: AgentSettings | None = None


def _json_response(status: int, body: bytes, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=body, content_type=JSON, headers=headers)


def _forward_headers(headers: Any) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    for k, v in headers.items():
        if k.lower() not in HOP_BY_HOP:
            out.add(k, v)
    return out


class Sidecar:
    """One sidecar: admission state, the upstream client and the aiohttp handlers.

    Use :meth:`build_app` for the aiohttp application; the handlers only translate HTTP to and
    from the admission core and the byte-level helpers.

    Raises ``ValueError`` unless exactly one of ``settings.policy`` (standalone) and
    ``settings.agent`` (thresholds from the node agent) is given.
    """

    def __init__(self, settings: SidecarSettings, clock: Any = time.monotonic) -> None:
        if (settings.policy is None) == (settings.agent is None):
            raise ValueError(
                "give exactly one of a policy (standalone) or a node agent (cluster mode)"
            )
        self.settings = settings
        spec: RateLimitPolicySpec = NO_LIMITS if settings.policy is None else settings.policy.spec
        self.spec = spec
        self.controller = AdmissionController(AdmissionConfig.from_policy(spec), clock)
        self.admission = AsyncAdmission(self.controller)
        self.metrics = SidecarMetrics(self.controller, settings.tenant_label_limit)
        #: The thresholds' state when a node agent is used (None standalone).
        self.link: ThresholdsLink | None = None
        self.agent_link: AgentLink | None = None
        #: The mode last enforced (None standalone).
        self.mode: Mode | None = None
        self.safety_net = SafetyNet()
        self.policy_ref: PolicyRef | None = None
        self._mismatch_seen: tuple[bool, str | None] = (False, None)
        #: KV capacity the sidecar read from the engine itself (tokens), if it did.
        self.engine_kv_tokens: int | None = None
        self._applied: tuple[PodThresholds | None, bool] | None = None
        if settings.agent is not None:
            a = settings.agent
            self.link = ThresholdsLink(
                clock,
                failure_mode=a.failure_mode,
                ttl_override=a.ttl_override,
                sync_interval=a.sync_interval,
            )
            self.agent_link = AgentLink(a, self.link, self.sync_report, self._on_sync)
            self.metrics.attach_link(self.link, self.current_mode, lambda: self.policy_ref)
        self.counter = PromptCounter(settings.tokenizer_file)
        self.upstream = settings.upstream.rstrip("/")
        self.session: aiohttp.ClientSession | None = None
        self.draining = False
        self.capacity_known = not spec.capacity.from_engine_metrics
        self.engine_max_model_len: int | None = None
        self._health_at = -1e9
        self._health_ok = False
        self._poll_task: asyncio.Task[None] | None = None
        self._engine_wake: asyncio.Event | None = None

    # ------------------------------------------------------------------ lifecycle

    def build_app(self) -> web.Application:
        """The aiohttp application (routes and startup/cleanup hooks)."""
        app = web.Application(client_max_size=self.settings.max_body_bytes + 1)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/kvgate/metrics", self.metrics_endpoint)
        # Standalone, the mode wrapper has nothing to do: route straight to the handler.
        handler = self.completion if self.link is not None else self._completion
        for path in ADMITTED_PATHS:
            app.router.add_post(path, handler)
        app.router.add_route("*", "/{tail:.*}", self.passthrough)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    def build_admin_app(self) -> web.Application:
        """Admin port: ``/metrics``, ``/healthz``, ``/readyz``."""
        app = web.Application()
        app.router.add_get("/metrics", self.metrics_endpoint)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=self.settings.connect_timeout,
            sock_read=self.settings.read_timeout,
        )
        self.session = aiohttp.ClientSession(
            timeout=timeout,
            auto_decompress=False,
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
            skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
        )
        self._engine_wake = asyncio.Event()
        if self.spec.capacity.from_engine_metrics:
            await self.refresh_engine_capacity()
        if (
            self.spec.capacity.from_engine_metrics
            or self.spec.model.max_model_len is None
            or self.link is not None  # thresholds may ask for the engine's capacity later
        ):
            self._poll_task = asyncio.create_task(self._poll_engine())
        if self.agent_link is not None:
            self.refresh_mode(force=True)
            await self.agent_link.start()

    async def _on_cleanup(self, app: web.Application) -> None:
        if self.agent_link is not None:
            await self.agent_link.stop()
        if self._poll_task is not None:
            self._poll_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poll_task
        self.admission.close()
        if self.session is not None:
            await self.session.close()

    async def refresh_engine_capacity(self) -> None:
        """Read the engine's KV capacity from its ``/metrics``. On failure the last known value
        stays; if none was ever read, ``failureMode`` decides: FailOpen enforces the policy's
        explicit ``kvCacheTokens`` (or no KV cap), FailClosed answers 503 until it is read."""
        assert self.session is not None
        tokens: int | None = None
        try:
            async with self.session.get(self.upstream + "/metrics", timeout=_PROBE_TIMEOUT) as resp:
                if resp.status == 200:
                    tokens = kv_capacity_from_metrics(await resp.text())
        except (TimeoutError, aiohttp.ClientError) as exc:
            log.warning("cannot read engine metrics: %s", exc)
        mml = self.spec.model.max_model_len
        if tokens is not None and (tokens > MAX_REPORTED or (mml is not None and tokens < mml)):
            # vLLM refuses to start unless its KV cache holds one max_model_len sequence; a
            # figure below that (or absurdly large) is a broken report: never enforce it.
            log.warning("ignoring the engine's implausible KV capacity of %d tokens", tokens)
            tokens = None
        if tokens is not None:
            if tokens != self.controller.config.kv_capacity_tokens:
                log.info("KV capacity from engine metrics: %d tokens", tokens)
            self.engine_kv_tokens = tokens
            self.controller.set_kv_capacity(tokens)
            self.controller.lift(HOLD_ENGINE_CAPACITY)
            self.capacity_known = True
            self.admission.kick()
        elif not self.capacity_known and self.spec.failure_mode is FailureMode.FAIL_CLOSED:
            # The next attempt is in a second (see _poll_engine): say so, honestly.
            self.controller.hold(
                Reason.FAIL_CLOSED,
                key=HOLD_ENGINE_CAPACITY,
                retry_after=1.0,
                until=self.controller.clock() + 1.0,
                message="the model server's KV capacity is not known yet and failureMode is "
                "FailClosed",
            )

    async def refresh_engine_max_model_len(self) -> None:
        """Learn the engine's context length from ``GET /v1/models`` (vLLM reports
        ``max_model_len`` per model) when the policy gives no ``model.maxModelLen``: a defaulted
        max_tokens is then kept within it, as the engine's own default would be."""
        assert self.session is not None
        try:
            async with self.session.get(
                self.upstream + "/v1/models", timeout=_PROBE_TIMEOUT
            ) as resp:
                data = await resp.json(content_type=None) if resp.status == 200 else None
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            log.debug("cannot read /v1/models: %s", exc)
            return
        lens: list[int] = [
            m["max_model_len"]
            for m in (data or {}).get("data") or []
            if isinstance(m, dict) and type(m.get("max_model_len")) is int
        ]
        if lens and min(lens) > 0:
            self.engine_max_model_len = min(lens)

    async def _poll_engine(self) -> None:
        while True:
            if self.spec.model.max_model_len is None and self.engine_max_model_len is None:
                await self.refresh_engine_max_model_len()
            unknown = not self.capacity_known or (
                self.spec.model.max_model_len is None and self.engine_max_model_len is None
            )
            wake = self._engine_wake
            assert wake is not None
            with contextlib.suppress(TimeoutError):  # new thresholds may wake it early
                await asyncio.wait_for(
                    wake.wait(), 1.0 if unknown else self.settings.engine_poll_seconds
                )
            wake.clear()
            if self.spec.capacity.from_engine_metrics:
                await self.refresh_engine_capacity()

    # ------------------------------------------------------------------ node agent

    def current_mode(self) -> Mode:
        """The thresholds mode now (enforcing it if time moved it on). Agent mode only."""
        mode = self.refresh_mode()
        assert mode is not None, "no node agent configured"
        return mode

    def refresh_mode(self, *, force: bool = False) -> Mode | None:
        """Bring enforcement in line with the link's :class:`Mode` now (time alone moves
        ``stale`` to ``fail_open``/``fail_closed``, so this runs on every admission-controlled
        request, after every sync and at every scrape; it only acts when the mode changed, or
        when ``force`` is set after a new answer). Returns the mode; None standalone.

        Per mode: ``live``/``stale`` enforce the last thresholds in full, with a
        ``gpu_memory_low`` hold while the safety net is closed; ``fail_open`` enforces the last
        thresholds' local caps only (concurrency cap and KV capacity; no rate limits, no
        safety net); ``fail_closed`` holds every new request with ``fail_closed`` (503,
        Retry-After = the sync interval); ``waiting`` enforces no limits, or holds under a
        configured FailClosed; ``unmanaged`` enforces no limits.
        """
        link = self.link
        if link is None:
            return None
        mode = link.mode()
        if mode is self.mode and not force:
            return mode
        if mode is not self.mode:
            age = link.age_seconds()
            (log.info if mode in (Mode.LIVE, Mode.UNMANAGED, Mode.WAITING) else log.warning)(
                "thresholds: %s -> %s (last successful sync: %s, TTL %.1fs)",
                "none" if self.mode is None else self.mode.value,
                mode.value,
                "never" if age is None else f"{age:.1f}s ago",
                link.ttl_seconds,
            )
        self.mode = mode
        thresholds = link.thresholds
        c = self.controller
        if mode in (Mode.WAITING, Mode.UNMANAGED):
            self.apply_thresholds(None)
        else:
            self.apply_thresholds(thresholds, local_caps_only=mode is Mode.FAIL_OPEN)
        if mode is Mode.FAIL_CLOSED or (
            mode is Mode.WAITING and link.failure_mode is FailureMode.FAIL_CLOSED
        ):
            c.hold(
                Reason.FAIL_CLOSED,
                key=HOLD_THRESHOLDS,
                retry_after=link.sync_interval_seconds,
                message="no current admission thresholds from the node agent and failureMode "
                "is FailClosed",
            )
        else:
            c.lift(HOLD_THRESHOLDS)
        net = self.safety_net
        if mode in (Mode.LIVE, Mode.STALE) and not net.open:
            detail = net.reason or "GPU free memory below the safety margin"
            if net.gpu_uuid is not None:
                detail += f" on {net.gpu_uuid}"
            c.hold(
                Reason.GPU_MEMORY_LOW,
                key=HOLD_GPU_MEMORY,
                retry_after=net.retry_after_seconds,
                message=f"admission paused to protect GPU memory: {detail}",
            )
        else:
            c.lift(HOLD_GPU_MEMORY)
        self.admission.kick()
        return mode

    def apply_thresholds(
        self, thresholds: PodThresholds | None, *, local_caps_only: bool = False
    ) -> None:
        """Enforce ``thresholds`` from now on without dropping in-flight work (see
        ``AdmissionController.reconfigure``); None = no limits. ``local_caps_only`` keeps the
        pod's concurrency cap and KV capacity but drops the rate limits (FailOpen).

        The spec's tenants, priority, queue and overload settings take effect for new requests.
        The KV capacity is the sidecar's own reading of the engine when the spec says
        ``capacity.fromEngineMetrics`` and it has one, else the thresholds'
        ``kvCacheTokens`` as resolved by the operator. ``per: Global`` limits arrive already
        split by ``globalShare`` (the operator did it), so they are not split again here.
        Waiters are re-examined at once.
        """
        if self._applied is not None and self._applied == (thresholds, local_caps_only):
            return
        self._applied = (thresholds, local_caps_only)
        spec: RateLimitPolicySpec = NO_LIMITS
        kv: int | None = None
        if thresholds is not None:
            spec = thresholds
            if local_caps_only:
                spec = thresholds.model_copy(update={"rate_limits": []})
            kv = thresholds.kv_capacity_tokens
            if spec.capacity.from_engine_metrics and self.engine_kv_tokens is not None:
                kv = self.engine_kv_tokens
        self.spec = spec
        self.controller.reconfigure(AdmissionConfig.from_policy(spec, kv_capacity_tokens=kv))
        self.capacity_known = not spec.capacity.from_engine_metrics or kv is not None
        if self.capacity_known:
            self.controller.lift(HOLD_ENGINE_CAPACITY)
        elif self._engine_wake is not None:
            self._engine_wake.set()  # read the engine's capacity now, not in a poll interval
        self.admission.kick()

    def _on_sync(self, result: SyncResult, answer: SyncAnswer | None) -> None:
        """After every sync: count it; on a new answer, take its safety net and policy."""
        if self.metrics.agent_sync is not None:
            self.metrics.agent_sync.labels(result.value).inc()
        if answer is not None:
            self.safety_net = answer.safety_net
            self.policy_ref = None if answer.pod is None else answer.pod.policy
            self._check_expected_policy()
        self.refresh_mode(force=answer is not None)

    def _check_expected_policy(self) -> None:
        """Compare the governing policy with the one the pod's ``kvgate.io/policy`` annotation
        names: a mismatch (another policy, or none) is logged once per change and exported as
        ``kvgate_policy_mismatch``; admission follows the agent either way."""
        a = self.settings.agent
        expected = a.expected_policy if a is not None else None
        got = self.policy_ref.name if self.policy_ref is not None else None
        mismatch = expected is not None and got != expected
        if mismatch and (mismatch, got) != self._mismatch_seen:
            log.warning(
                "this pod is annotated kvgate.io/policy=%s but is governed by %s",
                expected,
                "no RateLimitPolicy" if got is None else f"RateLimitPolicy {got}",
            )
        self._mismatch_seen = (mismatch, got)
        self.metrics.policy_mismatch[0] = mismatch

    def sync_report(self) -> SyncReport:
        """What this sidecar tells the node agent now (tokens; decisions cumulative)."""
        a = self.settings.agent
        assert a is not None and self.link is not None, "no node agent configured"
        c = self.controller
        cap = c.kv_capacity_tokens
        answer = self.link.answer
        return SyncReport(
            namespace=a.pod_namespace,
            name=a.pod_name,
            uid=a.pod_uid,
            in_flight=c.in_flight,
            queue_length=c.queue_length,
            kv_reserved_tokens=min(c.kv_reserved_tokens, MAX_REPORTED),
            kv_capacity_tokens=cap if cap is not None and 0 < cap <= MAX_REPORTED else None,
            decisions={k: min(v, MAX_REPORTED) for k, v in self.metrics.decision_counts.items()},
            metrics_url=a.metrics_url,
            gpu_uuids=list(a.gpu_uuids),
            thresholds_etag=None if answer is None else answer.etag,
        )

    # ------------------------------------------------------------------ own endpoints

    async def healthz(self, request: web.Request) -> web.Response:
        """Liveness: the process serves HTTP."""
        return web.Response(text="ok")

    async def readyz(self, request: web.Request) -> web.Response:
        """Readiness: not draining; with a node agent, a first answer arrived or the TTL has
        passed since start; the model server answers its ``/health``; and, under FailClosed,
        the engine's KV capacity is known (FailOpen serves without it)."""
        if self.draining:
            return web.Response(status=503, text="draining")
        if self.link is not None:
            self.refresh_mode()
            if not self.link.ready():
                return web.Response(status=503, text="waiting for thresholds from the node agent")
        if not self.capacity_known and self.spec.failure_mode is FailureMode.FAIL_CLOSED:
            return web.Response(status=503, text="waiting for the engine's KV capacity")
        if not await self._upstream_healthy():
            return web.Response(status=503, text="the model server is not answering")
        return web.Response(text="ok")

    async def _upstream_healthy(self) -> bool:
        """GET the model server's ``/health`` (vLLM, SGLang and TGI serve it), cached for a
        second so probes cannot hammer it. Any answer below 500 counts as up."""
        now = time.monotonic()
        if now - self._health_at < 1.0:
            return self._health_ok
        assert self.session is not None
        try:
            async with self.session.get(
                self.upstream + "/health", timeout=aiohttp.ClientTimeout(total=1.0)
            ) as resp:
                ok = resp.status < 500
        except (TimeoutError, aiohttp.ClientError):
            ok = False
        self._health_at, self._health_ok = now, ok
        self.metrics.upstream_ok[0] = ok
        return ok

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        """Prometheus exposition of the sidecar's registry."""
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    # ------------------------------------------------------------------ admission path

    async def _read_body(self, request: web.Request) -> bytes:
        limit = self.settings.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise RequestError(413, f"request body exceeds {limit} bytes", code="body_too_large")
        chunks = []
        size = 0
        async for chunk in request.content.iter_any():
            size += len(chunk)
            if size > limit:
                raise RequestError(
                    413, f"request body exceeds {limit} bytes", code="body_too_large"
                )
            chunks.append(chunk)
        return b"".join(chunks)

    def _refusal(self, d: Decision, tenant: str, kind: str = "chat") -> web.Response:
        headers = {"x-kvgate-decision": d.outcome.value, "x-kvgate-reason": d.reason.value}
        if d.retry_after is not None:
            headers["Retry-After"] = str(d.retry_after)
        if d.bucket_capacity is not None and d.bucket_window is not None:
            quota = max(1, round(d.bucket_capacity))
            headers["RateLimit-Policy"] = (
                f'"{d.limit}";q={quota};w={max(1, round(d.bucket_window))};qu="{d.unit}"'
            )
            remaining = max(0, int(d.bucket_remaining or 0.0))
            headers["RateLimit"] = f'"{d.limit}";r={remaining};t={d.retry_after or 1}'
        self.metrics.count_decision(
            d.outcome.value, d.reason.value, self.metrics.tenant_label(tenant)
        )
        if d.queue_seconds > 0:
            self.metrics.queue_wait.observe(d.queue_seconds)
        if d.status == 400:
            param = d.param or "max_tokens"
            if param == "prompt" and kind == "chat":
                param = "messages"
            body = error_body(d.message, "invalid_request_error", param, d.reason.value)
        elif d.status == 503:
            body = error_body(d.message, SERVICE_UNAVAILABLE, None, d.reason.value)
        else:
            body = error_body(d.message, RATE_LIMIT_ERROR, None, RATE_LIMIT_EXCEEDED)
        return _json_response(d.status, body, headers)

    def _bad_request(self, exc: RequestError) -> web.Response:
        self.metrics.count_decision("rejected", "invalid_request", "")
        return _json_response(
            exc.status,
            exc.body(),
            {"x-kvgate-decision": "rejected", "x-kvgate-reason": "invalid_request"},
        )

    async def completion(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/chat/completions`` and ``/v1/completions``: validate, admit, forward.
        With a node agent, every answer says the thresholds mode in ``x-kvgate-thresholds``."""
        if self.link is None:
            return await self._completion(request)
        self.refresh_mode()
        resp = await self._completion(request)
        if not resp.prepared and self.mode is not None:  # streams got it in _forward
            resp.headers[THRESHOLDS_HEADER] = self.mode.value
        return resp

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        if self.draining:
            return _json_response(
                503,
                error_body("sidecar is shutting down", SERVICE_UNAVAILABLE),
                {
                    "Retry-After": "1",
                    "x-kvgate-decision": "rejected",
                    "x-kvgate-reason": Reason.DRAINING.value,
                },
            )
        spec = self.spec
        try:
            raw = await self._read_body(request)
            parsed = parse_completion_request(
                raw,
                ADMITTED_PATHS[request.path],  # type: ignore[arg-type]
                default_max_tokens=spec.tenants.default_max_tokens,
                max_tokens_cap=spec.tenants.max_tokens_cap,
                max_model_len=spec.model.max_model_len,
            )
            tenant = tenant_of(request.headers, spec.tenants.header)
            priority = priority_of(request.headers, spec.priority.header)
        except RequestError as exc:
            return self._bad_request(exc)
        prompt = self.counter.count(parsed.body)
        max_tokens = parsed.max_tokens
        mml = spec.model.max_model_len or self.engine_max_model_len
        if parsed.max_tokens_defaulted and mml is not None:
            max_tokens = default_within_context(max_tokens, prompt, mml)
        areq = AdmissionRequest(tenant, prompt.tokens, max_tokens, priority, parsed.n, parsed.model)
        decision = await self.admission.admit(areq)
        if decision.reason is Reason.EXCEEDS_CAPACITY and not prompt.exact:
            # "Never fits" must not rest on a cautious guess: retry with an optimistic count
            # (the server's reported usage corrects the charge afterwards).
            optimistic = optimistic_prompt_tokens(prompt, self.counter.bytes_per_token)
            if optimistic < areq.prompt_tokens:
                areq = AdmissionRequest(
                    tenant, optimistic, max_tokens, priority, parsed.n, parsed.model
                )
                decision = await self.admission.admit(areq)
        if decision.ticket is None:
            return self._refusal(decision, tenant, parsed.path_kind)
        return await self._forward(request, raw, parsed, decision, tenant, prompt, started)

    async def _forward(
        self,
        request: web.Request,
        raw: bytes,
        parsed: ParsedRequest,
        d: Decision,
        tenant: str,
        prompt: PromptCount,
        started: float,
    ) -> web.StreamResponse:
        assert self.session is not None and d.ticket is not None
        ticket = d.ticket
        m = self.metrics
        label = m.tenant_label(tenant)
        headers = {"x-kvgate-decision": d.outcome.value}
        if self.mode is not None:
            headers[THRESHOLDS_HEADER] = self.mode.value
        if d.outcome is Outcome.DEGRADED:
            headers["x-kvgate-reason"] = d.reason.value
            headers["x-kvgate-degraded"] = (
                f"model={d.model}" if d.model is not None else f"max_tokens={d.max_tokens}"
            )
        elif parsed.max_tokens_clamped:
            headers["x-kvgate-reason"] = "max_tokens_cap"
            headers["x-kvgate-degraded"] = f"max_tokens={d.max_tokens}"
        if d.queue_seconds > 0:
            headers["x-kvgate-queue-wait-ms"] = str(round(d.queue_seconds * 1000))
            m.queue_wait.observe(d.queue_seconds)
        m.count_decision(d.outcome.value, d.reason.value, label)
        body = (
            parsed.upstream_body(
                max_tokens=d.max_tokens, model=d.model, include_usage=parsed.stream
            )
            or raw
        )
        fwd = _forward_headers(request.headers)
        fwd["Content-Type"] = JSON
        fwd.popall("Content-Encoding", None)  # the body was decoded on the way in
        fwd.popall("Accept-Encoding", None)  # identity, so the stream can be read for usage
        completion_tokens = 0
        prompt_tokens: int | None = None
        reached = False
        resp: aiohttp.ClientResponse | None = None
        out: web.StreamResponse | None = None
        clean = False
        try:
            try:
                resp = await self.session.post(
                    self.upstream + request.path_qs, data=body, headers=fwd
                )
            except aiohttp.ClientConnectorError as exc:
                m.upstream_errors.labels("connect").inc()
                m.upstream_ok[0] = False
                log.warning("upstream connect failed: %s", exc)
                return _json_response(
                    502,
                    error_body(
                        "model server unreachable", SERVER_ERROR, None, "upstream_unreachable"
                    ),
                    {**headers, "Retry-After": "1", "x-kvgate-reason": "upstream_unreachable"},
                )
            reached = True
            m.upstream_ok[0] = True
            out_headers = _forward_headers(resp.headers)
            out_headers.update(headers)
            if resp.status >= 500:
                m.upstream_errors.labels("status_5xx").inc()
            streaming = (
                parsed.stream and resp.status == 200 and resp.content_type == "text/event-stream"
            )
            if not streaming:
                data = await resp.read()
                clean = True
                if resp.status == 200:
                    prompt_tokens, reported = _usage_of(data)
                    # No usage reported: charge what was reserved rather than nothing.
                    completion_tokens = (
                        ticket.max_tokens * ticket.n if reported is None else reported
                    )
                elif 400 <= resp.status < 500:
                    reached = False  # the engine refused it: no GPU work to charge
                return web.Response(status=resp.status, body=data, headers=out_headers)
            acct = StreamAccountant(strip_usage_chunk=not parsed.client_wants_usage)
            out = web.StreamResponse(status=resp.status, headers=out_headers)
            await _to_client(out.prepare(request))
            first = True
            try:
                async for chunk in resp.content.iter_any():
                    piece = acct.feed(chunk)
                    if piece:
                        await _to_client(out.write(piece))
                        if first:
                            m.ttft.observe(time.perf_counter() - started)
                            first = False
                tail = acct.finish()
                if tail:
                    await _to_client(out.write(tail))
                clean = acct.done
            finally:
                completion_tokens = acct.completion_tokens_estimate
                if acct.usage is not None:
                    prompt_tokens = acct.usage.prompt_tokens
            await _to_client(out.write_eof())
            return out
        except asyncio.CancelledError:
            m.client_disconnects.inc()
            raise
        except _ClientGone:
            m.client_disconnects.inc()
            assert out is not None
            return out  # nobody to answer; the finally below releases everything
        except (TimeoutError, aiohttp.ClientError) as exc:
            timeout = isinstance(exc, TimeoutError)
            m.upstream_errors.labels("timeout" if timeout else "upstream_error").inc()
            m.upstream_ok[0] = False
            log.warning("upstream failed mid-request: %r", exc)
            message = (
                "the model server did not answer in time"
                if timeout
                else "the model server failed while answering"
            )
            code = "upstream_timeout" if timeout else "upstream_error"
            if out is None:  # nothing sent yet: a proper error response
                return _json_response(
                    504 if timeout else 502,
                    error_body(message, SERVER_ERROR, None, code),
                    {**headers, "Retry-After": "1", "x-kvgate-reason": code},
                )
            # Mid-stream: tell the client in-band, as vLLM does, then end the stream.
            with contextlib.suppress(ConnectionResetError, RuntimeError):
                await out.write(b"data: " + error_body(message, SERVER_ERROR, None, code) + b"\n\n")
                await out.write_eof()
            return out
        finally:
            if resp is not None:
                if clean:
                    resp.release()
                else:
                    resp.close()  # drop the connection: the engine sees the peer go away
            self.admission.release(
                ticket,
                completion_tokens=completion_tokens,
                prompt_tokens=prompt_tokens,
                reached_upstream=reached,
            )
            if reached:
                settled_prompt = ticket.prompt_tokens if prompt_tokens is None else prompt_tokens
                m.tokens.labels("prompt", label).inc(settled_prompt)
                m.tokens.labels("completion", label).inc(completion_tokens)
                if prompt_tokens is not None and not prompt.exact:
                    self.counter.observe(prompt.text_bytes, prompt_tokens, prompt.overhead_tokens)

    # ------------------------------------------------------------------ pass-through

    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        """Any other path: forwarded as is (the raw path, not re-normalised), body streamed
        both ways. A path that only differs from an admission-controlled one by dot segments,
        repeated slashes or percent-encoding is refused: an upstream that normalises it would
        otherwise serve a completion that bypassed admission."""
        assert self.session is not None
        raw_path = request.raw_path
        if canonical_path(raw_path) in ADMITTED_PATHS:
            return _json_response(
                400,
                error_body(
                    "use the canonical path for completions (no dot segments, "
                    "repeated slashes or escapes)",
                    "invalid_request_error",
                    None,
                    "non_canonical_path",
                ),
                {"x-kvgate-decision": "rejected", "x-kvgate-reason": "invalid_request"},
            )
        fwd = _forward_headers(request.headers)
        fwd.popall("Content-Encoding", None)  # the body is decoded on the way in
        data = request.content if request.body_exists else None
        url = URL(self.upstream + raw_path, encoded=True)
        try:
            resp = await self.session.request(request.method, url, headers=fwd, data=data)
        except aiohttp.ClientConnectorError:
            self.metrics.upstream_errors.labels("connect").inc()
            return _json_response(
                502,
                error_body("model server unreachable", SERVER_ERROR, None, "upstream_unreachable"),
                {"x-kvgate-decision": "passthrough", "Retry-After": "1"},
            )
        except (TimeoutError, aiohttp.ClientError) as exc:
            self.metrics.upstream_errors.labels("upstream_error").inc()
            return _json_response(
                502,
                error_body(
                    f"model server failed: {type(exc).__name__}",
                    SERVER_ERROR,
                    None,
                    "upstream_error",
                ),
                {"x-kvgate-decision": "passthrough"},
            )
        clean = False
        try:
            out_headers = _forward_headers(resp.headers)
            out_headers["x-kvgate-decision"] = "passthrough"
            out = web.StreamResponse(status=resp.status, headers=out_headers)
            if resp.content_length is not None:
                out.content_length = resp.content_length
            await _to_client(out.prepare(request))
            async for chunk in resp.content.iter_any():
                await _to_client(out.write(chunk))
            await _to_client(out.write_eof())
            clean = True
            return out
        except _ClientGone:
            self.metrics.client_disconnects.inc()
            return out
        except (TimeoutError, aiohttp.ClientError) as exc:
            self.metrics.upstream_errors.labels("upstream_error").inc()
            log.warning("upstream failed during pass-through: %r", exc)
            return out
        finally:
            if clean:
                resp.release()
            else:
                resp.close()


class _ClientGone(Exception):
    """The client closed its connection while the sidecar was writing to it."""


async def _to_client(write: Awaitable[object]) -> None:
    """Await a write to the client; a closed client connection becomes :class:`_ClientGone`
    (so it is never mistaken for an upstream failure)."""
    try:
        await write
    except ConnectionResetError as exc:  # aiohttp's ClientConnectionResetError included
        raise _ClientGone() from exc


def canonical_path(raw_path: str) -> str:
    """``raw_path`` (the request target's path, query dropped) percent-decoded, with empty
    and ``.`` segments removed and ``..`` applied, as a normalising server would see it."""
    path = unquote(raw_path.split("?", 1)[0])
    segments: list[str] = []
    for seg in path.split("/"):
        if seg in ("", "."):
            continue
        if seg == "..":
            if segments:
                segments.pop()
            continue
        segments.append(seg)
    return "/" + "/".join(segments)


#: Bytes per token for an optimistic prompt estimate: English text under Llama-3-class BPE
#: vocabularies averages about 4 bytes per token; 4.5 errs towards fewer tokens.
OPTIMISTIC_BYTES_PER_TOKEN = 4.5


def optimistic_prompt_tokens(prompt: PromptCount, bytes_per_token: float) -> int:
    """A low estimate of an inexact prompt count: the text part re-counted at
    :data:`OPTIMISTIC_BYTES_PER_TOKEN` instead of the cautious ``bytes_per_token``."""
    cautious_text = math.ceil(prompt.text_bytes / bytes_per_token)
    rest = max(0, prompt.tokens - cautious_text)
    return rest + math.ceil(prompt.text_bytes / OPTIMISTIC_BYTES_PER_TOKEN)


def default_within_context(default: int, prompt: PromptCount, max_model_len: int) -> int:
    """The max_tokens to charge and send for a request that gave none: the policy's default,
    lowered so prompt + max_tokens stays within the engine's context (the engine's own default
    is max_model_len − prompt; a request that works direct must not fail through kvgate).

    An estimated prompt may under-count (digits, punctuation, CJK), so the room is taken against
    an upper bound first: a byte-level BPE token covers at least one byte, so tokens ≤ text bytes
    + fixed overhead. Where that leaves no room (a long prompt), the estimate is used instead.
    """
    upper = (
        prompt.tokens
        if prompt.exact
        else max(prompt.tokens, prompt.text_bytes + prompt.overhead_tokens)
    )
    for bound in (upper, prompt.tokens):
        if max_model_len - bound >= 1:
            return min(default, max_model_len - bound)
    return default


def _usage_of(data: bytes) -> tuple[int | None, int | None]:
    """(prompt_tokens, completion_tokens) reported in a non-streaming response body; each None
    when absent or not a non-negative integer."""
    try:
        usage = json.loads(data).get("usage") or {}
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens")
    except (ValueError, AttributeError):
        return None, None
    return (
        prompt if type(prompt) is int and prompt >= 0 else None,
        completion if type(completion) is int and completion >= 0 else None,
    )
