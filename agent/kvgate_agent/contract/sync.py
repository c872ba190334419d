"""The sidecar ↔ node agent sync protocol (HTTP on the node, JSON, camelCase).

About once a second each sidecar calls ``POST /v1/sync`` on the agent of its node:

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
"""

from __future__ import annotations

from typing import Annotated

from pydantic import ConfigDict, Field

from kvgate_agent.contract.nodeadmission import PodAdmission
from kvgate_agent.contract.policy import _Model

#: Audience the sidecar's projected service-account token is issued for.
TOKEN_AUDIENCE = "kvgate-agent"
#: Path of the sync endpoint on the node agent.
SYNC_PATH = "/v1/sync"

#: Upper bound of every count and token figure in a report: far above any real value, and below
#: 2^53 (exact in JSON doubles) and the int64 the NodeAdmission schema stores.
MAX_REPORTED = 2**40
NonNegativeInt = Annotated[int, Field(ge=0, le=MAX_REPORTED)]


class SyncReport(_Model):
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


class SafetyNet(_Model):
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


class SyncAnswer(_Model):
    """What the agent answers a sidecar.

    Attributes:
        etag: identifies this exact answer (also in the ``ETag`` header).
        pod: the pod's entry in the NodeAdmission spec (policy reference and thresholds), or
            None when no RateLimitPolicy selects the pod (the sidecar then enforces nothing
            beyond its local defaults).
        safety_net: see :class:`SafetyNet`.
        ttl_seconds: how long the sidecar keeps enforcing these thresholds without a
            successful sync before its policy's ``failureMode`` applies (seconds).
        sync_interval_seconds: how often the agent wants to hear from the sidecar (seconds).
    """

    etag: str
    pod: PodAdmission | None = None
    safety_net: SafetyNet = Field(default_factory=SafetyNet)
    ttl_seconds: Annotated[float, Field(gt=0)] = 30.0
    sync_interval_seconds: Annotated[float, Field(gt=0)] = 1.0


__all__ = [
    "SYNC_PATH",
    "TOKEN_AUDIENCE",
    "SafetyNet",
    "SyncAnswer",
    "SyncReport",
]
