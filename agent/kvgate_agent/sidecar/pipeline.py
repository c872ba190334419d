"""One request's path through the sidecar: a generation request is checked (method, media
type, draining), its tenant named, its body read and parsed by its API, its prompt counted,
then admitted (or queued, degraded or refused) and forwarded; any other path passes through or
is refused.

Invariant: every generation request reaches admission once, and the model server only when
admitted (or degraded to the fallback pool); a refusal never reaches the model server.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from kvgate_agent.admission import AsyncAdmission, Decision, Reason
from kvgate_agent.sidecar.edge import Answer, ClientRequest, Reply, identity_headers
from kvgate_agent.sidecar.engine import PromptReads
from kvgate_agent.sidecar.identity import INVALID_API_KEY, Authenticator, Identity, engine_priority
from kvgate_agent.sidecar.metrics import SidecarMetrics
from kvgate_agent.sidecar.node_link import EnforcedPolicy
from kvgate_agent.sidecar.reading import (
    GENERATION_PATHS,
    SAFE_METHODS,
    ParsedRequest,
    PromptCount,
    RequestError,
    canonical_path,
    default_within_context,
    is_json,
    optimistic_prompt_tokens,
    output_within_context,
    prompt_over_context,
    responses,
    waited_seconds,
)
from kvgate_agent.sidecar.reading import HEADER as REQUEST_START
from kvgate_agent.sidecar.upstream import Forwarder, already_degraded


class RequestPipeline:
    """The handlers of the model server's paths: :meth:`completion` for the generation paths
    (:data:`~kvgate_agent.sidecar.reading.endpoints.GENERATION_PATHS`), :meth:`other` for the
    rest (an absolute-form target without a path too: the own leg reads it as the root).

    Holds :attr:`draining` (set on shutdown: new generation requests get 503) and one object
    per room a request passes through, built by :class:`~kvgate_agent.sidecar.app.Sidecar`.

    Args:
        policy: the policy enforced now and where it stands (the node link's
            :class:`~kvgate_agent.sidecar.node_link.enforced.EnforcedPolicy`: its spec, the
            ``x-kvgate-thresholds`` header).
        identity: who each request is, in one call (the identity room's
            :meth:`~kvgate_agent.sidecar.identity.identity.Authenticator.who`).
        engine: what a request reads of the engine: the context per request, the prompt's
            count (the engine room's :class:`~kvgate_agent.sidecar.engine.probe.PromptReads`).
        admission: the one admission object.
        upstream: the model server's side: the body bounds, the pass-through allowlist, the
            admitted, degraded and passed-through trips (the upstream room's
            :class:`~kvgate_agent.sidecar.upstream.forward.Forwarder`).
        metrics: the sidecar's metrics (decisions, queue wait, the expected cached prefix).
    """

    def __init__(
        self,
        policy: EnforcedPolicy,
        identity: Authenticator,
        engine: PromptReads,
        admission: AsyncAdmission,
        upstream: Forwarder,
        metrics: SidecarMetrics,
    ) -> None:
        self.policy = policy
        self.identity = identity
        self.engine = engine
        self.admission = admission
        self.upstream = upstream
        self.metrics = metrics
        self.draining = False

    def generation_handler(self) -> Callable[[ClientRequest], Awaitable[Reply]]:
        """The handler of the generation paths: :meth:`completion`, or standalone without a
        store (no mode header to add) the request's path itself."""
        return self.completion if self.policy.headed else self._completion

    async def other(self, request: ClientRequest) -> Reply:
        """Every path but the generation ones and the sidecar's own: GET, HEAD and OPTIONS pass
        through; another method only to a path on the allowlist (404 otherwise). A path that
        only normalises (dot segments, repeated slashes, escapes) to a generation or allowlisted
        one is refused with 400: an upstream that normalises it would otherwise serve it
        unchecked. A body over ``--max-body-bytes`` gets 413 (:meth:`Forwarder.passthrough`)."""
        raw = request.rel_url.raw_path  # an absolute-form target's raw_path is the whole URL
        if not raw.startswith("/"):  # ``OPTIONS *``, CONNECT's authority: nothing to pass on
            return self._refused_early(responses.not_a_path(raw))
        path = canonical_path(raw)
        if path in GENERATION_PATHS:
            return self._refused_early(responses.non_canonical_path())
        if request.method in SAFE_METHODS:
            return await self.upstream.passthrough(request)
        if not self.upstream.allows(path):
            return self._refused_early(responses.not_allowed_path(request.method, path))
        if raw != path:
            return self._refused_early(responses.non_canonical_path())
        return await self.upstream.passthrough(request)

    def _refused_early(self, resp: Answer) -> Answer:
        """``resp`` (a 4xx refusal before admission), counted in
        ``kvgate_admission_decisions_total{outcome="rejected",reason="invalid_request"}`` with
        an empty tenant."""
        self.metrics.count_decision("rejected", "invalid_request", "")
        return resp

    async def completion(self, request: ClientRequest) -> Reply:
        """A generation path (:data:`GENERATION_PATHS`): validate, admit, forward. With a node
        agent, every answer says the thresholds mode in ``x-kvgate-thresholds``."""
        if not self.policy.headed:
            return await self._completion(request)
        resp = await self._completion(request)
        value = self.policy.header()
        prepared = not isinstance(resp, Answer) and resp.prepared
        if not prepared and value is not None:  # streams got it with the admission headers
            resp.headers[responses.THRESHOLDS_HEADER] = value
        return resp

    async def _not_a_generation(self, request: ClientRequest) -> Reply | None:
        """The answer to a request on a generation path that is not a JSON POST (OPTIONS, a CORS
        preflight, passes through; another method gets 405; a body declared as anything but
        JSON 415), or None for a JSON POST."""
        if request.method != "POST":
            if request.method == "OPTIONS":
                return await self.upstream.passthrough(request)
            self.metrics.count_decision("rejected", "invalid_request", "")
            return responses.method_not_allowed(request.method, request.path)
        content_type = request.headers.get("Content-Type")
        if content_type is not None and not is_json(content_type):
            self.metrics.count_decision("rejected", "invalid_request", "")
            return responses.unsupported_media_type(content_type)
        return None

    async def _completion(self, request: ClientRequest) -> Reply:
        started = time.perf_counter()
        if (early := await self._not_a_generation(request)) is not None:
            return early
        if self.draining:
            return responses.draining()
        spec = self.policy.spec
        try:
            who = self.identity.who(request.headers, spec)  # tenant, class, priority
        except RequestError as exc:  # nothing read, admitted or forwarded
            if exc.status == 401:
                self.metrics.count_decision("rejected", INVALID_API_KEY, "")
                return responses.unauthorized(exc)
            self.metrics.count_decision("rejected", "invalid_request", "")
            return responses.bad_request(exc)
        try:
            raw = await self.upstream.read_body(request)
            parsed = GENERATION_PATHS[request.path].parse(
                raw,
                default_max_tokens=spec.tenants.default_max_tokens,
                max_tokens_cap=spec.tenants.max_tokens_cap,
                max_model_len=spec.model.max_model_len,
            )
        except RequestError as exc:
            self.metrics.count_decision("rejected", "invalid_request", "")
            return responses.bad_request(exc)
        prompt = await self._prompt(parsed, who)
        context = self.engine.context_tokens(spec)  # tokens per request; None: not known
        try:
            max_tokens, reserved = self._output_tokens(parsed, prompt, context)
        except RequestError as exc:
            self.metrics.count_decision("rejected", "invalid_request", "")
            return responses.bad_request(exc)
        d = await self._admit(request, parsed, who, prompt, reserved, context)
        if d.max_tokens >= reserved:  # admitted as asked: the engine is sent what it would be
            d.max_tokens = max_tokens
        m = self.metrics
        label = m.tenant_label(who.tenant)
        if d.queue_seconds > 0:
            m.queue_wait.observe(d.queue_seconds)
        if d.reason is Reason.FALLBACK_POOL:
            return await self.upstream.degrade(
                request, self.policy.spec, parsed, raw, d, self.policy.header(),
                lambda x: m.count_decision(x.outcome.value, x.reason.value, label),
            )  # fmt: skip
        m.count_decision(d.outcome.value, d.reason.value, label)
        if d.ticket is None:
            return responses.refusal(d, parsed.api)
        headers = responses.admitted_headers(d, self.policy.header(), parsed.max_tokens_clamped)
        body = (
            parsed.upstream_body(
                max_tokens=d.max_tokens,
                model=d.model,
                include_usage=parsed.stream,
                priority=engine_priority(who.priority, spec.priority.forward_to),
            )
            or raw
        )
        return await self.upstream.admitted(
            request,
            body,
            d.ticket,
            parsed,
            headers,
            prompt=prompt,
            tenant_label=label,
            started=started,
            decided=identity_headers(
                spec.tenants.header, spec.priority.header, who.tenant, who.priority
            ),
        )

    async def _admit(
        self,
        request: ClientRequest,
        parsed: ParsedRequest,
        who: Identity,
        prompt: PromptCount,
        reserved: int,
        context: int | None,
    ) -> Decision:
        """Admission's decision on a request whose prompt counts ``prompt`` and whose choices
        may each produce ``reserved`` output tokens, within ``context`` tokens per request.
        Once the engine has reported cached prompt tokens
        (:class:`~kvgate_agent.sidecar.reading.prefix_blocks.PrefixNaming`), the prompt's
        leading full KV blocks are named (``prefix_blocks``), so that its expected cached prefix is
        neither reserved nor charged (``kvgate_prefix_cached_tokens_total{source="expected"}``
        counts it). The proxy's ``X-Request-Start`` says how long a retry already waited
        (:mod:`~kvgate_agent.sidecar.reading.request_start`): that comes off its TTFT wait
        budget."""
        areq = who.admission_request(
            prompt.tokens,
            reserved,
            parsed.n,
            parsed.model,
            model_rewritable=parsed.model_field,
            degraded=already_degraded(request.headers),
            prompt_tokens_min=optimistic_prompt_tokens(prompt, self.engine.bytes_per_token),
        )
        areq.prefix_blocks = self.upstream.prefixes.blocks(
            parsed.body if parsed.count_body is None else parsed.count_body,
            parsed.model,
            self.admission.config.block_size,
            context,
        )
        areq.waited_seconds = waited_seconds(request.headers.get(REQUEST_START), time.time())
        d = await self.admission.admit(areq)
        if d.ticket is not None and d.ticket.cached_tokens:
            self.metrics.prefix_cached_tokens.labels("expected").inc(d.ticket.cached_tokens)
        return d

    def _output_tokens(
        self, parsed: ParsedRequest, prompt: PromptCount, context: int | None
    ) -> tuple[int, int]:
        """(max_tokens to send, output tokens per choice to reserve KV for) within ``context``
        tokens per request (the smaller of ``model.maxModelLen`` and the engine's:
        :meth:`PromptReads.context_tokens`; None: unbounded): a defaulted max_tokens is lowered
        to fit it (:func:`default_within_context`) and the reservation never holds more than
        the context leaves after the prompt (:func:`output_within_context`); a client's own
        max_tokens goes to the engine as sent, which cuts it (llama.cpp) or refuses it (vLLM)
        as it would without kvgate.

        Raises:
            RequestError: 400 ``context_length_exceeded``, the prompt leaves no room for output.
        """
        max_tokens = parsed.max_tokens
        if context is None:
            return max_tokens, max_tokens
        if over := prompt_over_context(prompt, self.engine.bytes_per_token, context):
            raise RequestError(400, over, code="context_length_exceeded")
        if parsed.max_tokens_defaulted:
            max_tokens = default_within_context(max_tokens, prompt, context)
        return max_tokens, output_within_context(max_tokens, prompt.tokens, context)

    async def _prompt(self, parsed: ParsedRequest, who: Identity) -> PromptCount:
        """The prompt's count (tokens): the estimate, or with ``--tokenizer engine`` the
        engine's own, asked only when admission could take the request (not draining, no hold,
        not over its request-count rate limit with no way around)."""
        count_body = parsed.body if parsed.count_body is None else parsed.count_body
        prompt = self.engine.estimate(count_body)
        if self.engine.asks_engine:
            est = who.admission_request(prompt.tokens, parsed.max_tokens, parsed.n)
            if not (self.draining or self.admission.refused_whatever_the_prompt(est)):
                prompt = await self.engine.exact(count_body, prompt)
        return prompt
