"""The sidecar ↔ node agent sync protocol (HTTP on the node, JSON, camelCase).

Each sidecar calls ``POST /v1/sync`` on the agent of its node (held until its answer changes,
see "Long poll" below; once a second against an agent that does not hold calls):

- Request headers: ``Authorization: Bearer <projected service-account token>`` (audience
  ``kvgate-agent``; the agent checks it with a TokenReview and matches the pod it is bound to
  against ``namespace``/``name``/``uid`` in the body); optionally ``If-None-Match: <etag>`` with
  the ETag of the thresholds it already applies.
- Request body: a :class:`SyncReport` (the sidecar's usage now).
- Answer ``200`` with a :class:`SyncAnswer` and an ``ETag`` header, or ``304 Not Modified``
  (empty body, same ``ETag``) when the answer would be identical to ``If-None-Match``: an
  unchanged answer costs one small request and no body.
- Errors: ``401`` (no or invalid token), ``403`` (the token belongs to another pod),
  ``413`` (a report over 64 KiB), ``422`` (malformed report), ``503`` with ``Retry-After``
  (the agent has not read its NodeAdmission yet, or cannot check the token now), each with a
  JSON body ``{"error": {"message", "type", "code"}}``.

Units: tokens, seconds. The ETag covers everything in the answer, so any change (new policy
generation, new KV capacity, the GPU safety net closing or opening) changes it.

Long poll: a sync that sends ``If-None-Match`` and ``Prefer: wait=<seconds>`` (RFC 7240,
https://www.rfc-editor.org/rfc/rfc7240#section-4.3) is held by the agent until the pod's answer
differs from that ETag (``200`` with the new answer at once) or until the wait is over (``304``);
the agent caps the wait (:data:`MAX_WAIT_SECONDS` unless configured) and says it held the call
with ``Preference-Applied: wait=<seconds>``. A sidecar that sees no ``Preference-Applied``
(an agent that answers at once) keeps syncing every ``syncIntervalSeconds``. While a call is
held, the agent counts the sidecar as connected; a sidecar whose report changed materially
abandons its held call and sends the new report (at most once per ``syncIntervalSeconds``).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import ConfigDict, Field

from kvgate_agent.contract.base import ContractModel
from kvgate_agent.contract.nodeadmission import PodAdmission

#: Audience the sidecar's projected service-account token is issued for.
TOKEN_AUDIENCE = "kvgate-agent"
#: Path of the sync endpoint on the node agent.
SYNC_PATH = "/v1/sync"
#: How often a sidecar syncs until an answer gives its own interval, seconds; also an answer's
#: default ``syncIntervalSeconds``.
DEFAULT_SYNC_INTERVAL_SECONDS = 1.0

#: Request header asking the agent to hold the sync (RFC 7240 ``Prefer: wait=N``)...
PREFER_HEADER = "Prefer"
#: ...and the answer header saying it did (``Preference-Applied: wait=N``).
APPLIED_HEADER = "Preference-Applied"
#: Longest hold of one sync, seconds: well below common proxy idle timeouts (60 s for nginx's
#: ``proxy_read_timeout``, https://nginx.org/en/docs/http/ngx_http_proxy_module.html) and below
#: the default 30 s thresholds TTL, so a held call never outlives the sidecar's patience.
MAX_WAIT_SECONDS = 25.0


def parse_wait(prefer: str | None) -> float | None:
    """The ``wait`` preference of a ``Prefer`` header value in seconds (``"wait=20"`` → 20.0;
    other preferences are ignored), or None when absent or not a non-negative number."""
    if not prefer:
        return None
    for item in prefer.split(","):
        name, _, value = item.strip().partition("=")
        if name.strip().lower() != "wait":
            continue
        value = value.strip().strip('"')
        try:
            wait = float(value)
        except ValueError:
            return None
        return wait if wait >= 0 and wait == wait and wait != float("inf") else None
    return None


#: Upper bound of every count and token figure in a report: far above any real value, and below
#: 2^53 (exact in JSON doubles) and the int64 the NodeAdmission schema stores.
MAX_REPORTED = 2**40
NonNegativeInt = Annotated[int, Field(ge=0, le=MAX_REPORTED)]


class SyncReport(ContractModel):
    """What a sidecar reports about its pod (tokens; counters are cumulative since it started).

    Attributes:
        namespace, name, uid: the pod (uid from the downward API; optional for standalone runs
            but checked against the token when given).
        in_flight: requests admitted and not finished.
        queue_length: requests waiting for admission.
        kv_reserved_tokens: KV cache reserved by admitted requests (tokens).
        kv_capacity_tokens: the KV capacity the sidecar enforces now (tokens), if any.
        decisions: admission decisions so far by outcome (``admitted``, ``queued``,
            ``degraded``, ``rejected``).
        metrics_url: where the agent can scrape the model server's Prometheus metrics (the
            sidecar passes ``/metrics`` through to the engine), e.g.
            ``http://10.0.3.7:8081/metrics``; None = do not scrape.
        gpu_uuids: the GPUs (or MIG slices) the model server uses, when the sidecar knows
            (``NVIDIA_VISIBLE_DEVICES`` of the pod); else the agent maps it from NVML processes,
            or treats every GPU of the node as the pod's.
        thresholds_etag: the ETag of the thresholds the sidecar applies (diagnostics).
    """

    model_config = ConfigDict(strict=True)  # no "3" or true for a number

    namespace: Annotated[str, Field(min_length=1, max_length=63)]
    name: Annotated[str, Field(min_length=1, max_length=253)]
    uid: Annotated[str, Field(max_length=128)] | None = None
    in_flight: NonNegativeInt = 0
    queue_length: NonNegativeInt = 0
    kv_reserved_tokens: NonNegativeInt = 0
    kv_capacity_tokens: Annotated[int, Field(gt=0, le=MAX_REPORTED)] | None = None
    decisions: Annotated[dict[str, NonNegativeInt], Field(max_length=16)] = Field(
        default_factory=dict
    )
    metrics_url: Annotated[str, Field(pattern=r"^https?://", max_length=2048)] | None = None
    gpu_uuids: list[Annotated[str, Field(max_length=128)]] = Field(
        default_factory=list, max_length=64
    )
    thresholds_etag: Annotated[str, Field(max_length=128)] | None = None


class SafetyNet(ContractModel):
    """The node's GPU memory safety net for this pod.

    ``open`` False: NVML free memory on one of the pod's GPUs is below the policy's
    ``capacity.safetyMarginBytes``; the sidecar admits nothing new (503 with Retry-After
    ``retryAfterSeconds``) until an answer says ``open`` again.
    """

    open: bool = True
    reason: str | None = None
    gpu_uuid: str | None = None
    free_bytes: NonNegativeInt | None = None
    margin_bytes: NonNegativeInt | None = None
    retry_after_seconds: Annotated[float, Field(gt=0)] = 1.0


class SyncAnswer(ContractModel):
    """What the agent answers a sidecar.

    Attributes:
        etag: identifies this exact answer (also in the ``ETag`` header).
        pod: the pod's entry in the NodeAdmission spec (policy reference and thresholds), or
            None when no RateLimitPolicy selects the pod (the sidecar then enforces nothing
            beyond its local defaults).
        safety_net: see :class:`SafetyNet`.
        ttl_seconds: how long the sidecar keeps enforcing these thresholds without a
            successful sync before its policy's ``failureMode`` applies (seconds).
        sync_interval_seconds: how often the agent wants to hear from the sidecar when it does
            not hold syncs, and the least time between two reports when it does (seconds).
    """

    etag: str
    pod: PodAdmission | None = None
    safety_net: SafetyNet = Field(default_factory=SafetyNet)
    ttl_seconds: Annotated[float, Field(gt=0)] = 30.0
    sync_interval_seconds: Annotated[float, Field(gt=0)] = DEFAULT_SYNC_INTERVAL_SECONDS


__all__ = [
    "APPLIED_HEADER",
    "DEFAULT_SYNC_INTERVAL_SECONDS",
    "MAX_WAIT_SECONDS",
    "PREFER_HEADER",
    "SYNC_PATH",
    "TOKEN_AUDIENCE",
    "SafetyNet",
    "SyncAnswer",
    "SyncReport",
    "parse_wait",
]
