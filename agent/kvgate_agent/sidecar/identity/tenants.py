"""Who a request belongs to (tenant, its class) and how important it is (priority), from its
headers under the policy enforced now.

Pure header logic: the proxy passes a case-insensitive header mapping.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from kvgate_agent.admission import AdmissionRequest
from kvgate_agent.contract.policy import (
    MAX_PRIORITY,
    MIN_PRIORITY,
    PriorityTarget,
    RateLimitPolicySpec,
    TenantsSpec,
)
from kvgate_agent.sidecar.identity.classes import ClassResolver, TenantClass
from kvgate_agent.sidecar.reading import RequestError

ANONYMOUS = "anonymous"
#: The one tenant of every unknown or missing API key under ``tenants.unknownKeys: Pool``.
UNKNOWN = "unknown"
#: Tenant header values longer than this are hashed, so a huge header cannot bloat state.
MAX_TENANT_LEN = 128


def _digest(value: str) -> str:
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def bearer_token(value: str | None) -> str | None:
    """The credential of an ``Authorization`` header value: the token of ``Bearer <token>``
    (RFC 6750 §2.1; the scheme in any case), else the whole value; None when missing or
    blank."""
    if value is None or not value.strip():
        return None
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else value


def tenant_name(value: str) -> str:
    """``value`` as a tenant name: as is, or ``h-<first 16 hex digits of its SHA-256>`` when
    longer than :data:`MAX_TENANT_LEN` or not printable."""
    if len(value) > MAX_TENANT_LEN or not value.isprintable():
        return "h-" + _digest(value)
    return value


def tenant_of(headers: Mapping[str, str], header: str) -> str:
    """Tenant key for a request, from its header as sent (a gateway's; see
    :mod:`kvgate_agent.sidecar.identity.identity` for keys and tokens the sidecar checks).

    Args:
        headers: request headers (case-insensitive mapping).
        header: the policy's ``tenants.header``. ``authorization`` keys tenants by
            ``key-<first 16 hex digits of SHA-256 of the bearer token>``: the raw credential is
            never stored, logged or exported.

    Returns ``anonymous`` when the header is missing or empty.
    """
    value = headers.get(header)
    if not value:
        return ANONYMOUS
    if header.lower() == "authorization":
        token = bearer_token(value)
        return "key-" + _digest(value if token is None else token)
    value = value.strip()
    if not value:
        return ANONYMOUS
    return tenant_name(value)


def priority_of(headers: Mapping[str, str], header: str) -> int | None:
    """Priority from the policy's priority header: an integer, higher = more important, negative
    = sheddable; None when absent or empty.

    Raises:
        RequestError: 400 when the header is not an integer in [MIN_PRIORITY, MAX_PRIORITY]
            ([-1000, 1000]).
    """
    value = headers.get(header)
    if value is None or value.strip() == "":
        return None
    try:
        p = int(value.strip())
    except ValueError:
        raise RequestError(
            400, f"header {header} must be an integer, got {value[:32]!r}", param=header
        ) from None
    if not MIN_PRIORITY <= p <= MAX_PRIORITY:
        raise RequestError(
            400, f"header {header} must be between {MIN_PRIORITY} and {MAX_PRIORITY}", param=header
        )
    return p


def request_priority(header: int | None, class_priority: int, trusted: bool) -> int:
    """A request's priority from its priority header's value (None: no header) and its tenant
    class's priority (``tenants.classes[].priority``; 0 for the implicit default class).

    ``trusted`` (``priority.trusted``: a gateway sets the header): the header's value as is.
    Untrusted (the default): the header may only lower the class's priority (a client marking
    itself sheddable with -1), never raise it above the class's.
    """
    if header is None:
        return class_priority
    return header if trusted else min(header, class_priority)


@dataclass(frozen=True, slots=True)
class Identity:
    """Who sent a request and how it is served: ``tenant`` (its key, :func:`tenant_of`),
    ``tenant_class`` (:class:`~kvgate_agent.sidecar.identity.classes.TenantClass`) and ``priority``
    (:func:`request_priority`)."""

    tenant: str
    tenant_class: TenantClass
    priority: int

    def admission_request(
        self,
        prompt_tokens: int,
        max_tokens: int,
        n: int = 1,
        model: str | None = None,
        *,
        model_rewritable: bool = True,
        degraded: bool = False,
        prompt_tokens_min: int | None = None,
    ) -> AdmissionRequest:
        """The :class:`AdmissionRequest` for this request (its fields' meaning and units are
        there), with this identity's tenant and priority and its class's fair-share weight and
        TTFT SLO."""
        c = self.tenant_class
        return AdmissionRequest(
            self.tenant,
            prompt_tokens,
            max_tokens,
            self.priority,
            n,
            model,
            model_rewritable=model_rewritable,
            degraded=degraded,
            prompt_tokens_min=prompt_tokens_min,
            weight=c.weight,
            ttft_slo_seconds=c.ttft_slo_seconds,
        )


class Identifier:
    """Names each request's :class:`Identity` under the policy enforced now. The class table
    (:class:`~kvgate_agent.sidecar.identity.classes.ClassResolver`) is built once per policy: again
    only when the enforced ``spec.tenants`` is another object (new thresholds)."""

    def __init__(self) -> None:
        self._tenants: TenantsSpec | None = None
        self._resolve = ClassResolver(TenantsSpec())

    def __call__(
        self,
        headers: Mapping[str, str],
        spec: RateLimitPolicySpec,
        tenant: str,
        key_class: str | None = None,
    ) -> Identity:
        """The identity of a request of ``tenant`` (named by :mod:`.identity`). ``key_class``:
        the ``class`` of the request's API key in the keys file, None for none; a class the
        policy declares decides the request's class over the match rules, another name is
        ignored (the match rules and the default class decide; :mod:`.identity` warns).

        Raises:
            RequestError: 400, the priority header is not an integer in [-1000, 1000].
        """
        if spec.tenants is not self._tenants:
            self._tenants, self._resolve = spec.tenants, ClassResolver(spec.tenants)
        cls = None if key_class is None else self._resolve.named(key_class)
        if cls is None:
            cls = self._resolve(tenant)
        header = priority_of(headers, spec.priority.header)
        return Identity(tenant, cls, request_priority(header, cls.priority, spec.priority.trusted))


def engine_priority(priority: int, target: PriorityTarget) -> int | None:
    """The ``priority`` body field to send an engine for kvgate's ``priority`` (higher = more
    important), or None when the policy forwards none (``priority.forwardTo: None``).

    vLLM serves lower values first (``--scheduling-policy priority``: "lower value means
    earlier handling",
    https://docs.vllm.ai/en/latest/serving/openai_compatible_server.html#extra-parameters), so
    the value is negated; SGLang (``--enable-priority-scheduling``) serves higher values first
    unless ``--schedule-low-priority-values-first``
    (https://docs.sglang.ai/advanced_features/server_arguments.html), so it is sent as is. Both
    keep kvgate's order: a request kvgate ranks above another is served first by the engine too.
    """
    if target is PriorityTarget.VLLM:
        return -priority
    if target is PriorityTarget.SGLANG:
        return priority
    return None
