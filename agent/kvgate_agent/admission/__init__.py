"""kvgate's admission algorithms: pure, clock-injected, no HTTP.

Public API: :class:`AsyncAdmission` (the one API the sidecar drives: every call that may let a
waiter in wakes the queue itself), :class:`AdmissionController` (the pure decisions, driven
directly on a virtual clock by the benchmark), :class:`AdmissionStats` and
:class:`TenantStats` (read-only snapshots), :class:`AdmissionConfig` (resolved thresholds), and
the decision types.
Inside: :mod:`.bucket` (token buckets), :mod:`.rate_limits` (the rate limits' buckets),
:mod:`.limits` (what is counted and reserved), :mod:`.fairqueue` (the fair queue, a
sub-package by role: ``share``, the tenants' fair-share counters; ``order``, who waits in which
order; ``reserve``, the fair reserve and ``what_blocks``, the one check; ``waitqueue``, the wait
queue; ``pool``, :class:`PoolShare`, the pool's view of the same tenants' service on other
replicas), :mod:`.holds` (stops on all admission), :mod:`.live` (tokens streamed, the engine's
reports), :mod:`.retry` (Retry-After), :mod:`.waiting` (queueing, expiring and pumping the wait
queue), :mod:`.overload` (Degrade, Queue, Reject), :mod:`.controller` (composes them),
:mod:`.async_admission` (the asyncio side).
"""

from kvgate_agent.admission.async_admission import AsyncAdmission
from kvgate_agent.admission.bucket import BucketMap, TokenBucket
from kvgate_agent.admission.config import AdmissionConfig, ResolvedLimit
from kvgate_agent.admission.controller import AdmissionController
from kvgate_agent.admission.decision import (
    AdmissionRequest,
    Decision,
    Outcome,
    Reason,
    Ticket,
    Waiter,
)
from kvgate_agent.admission.fairqueue import STALE_S as POOL_STALE_S
from kvgate_agent.admission.fairqueue import PoolShare
from kvgate_agent.admission.holds import Hold
from kvgate_agent.admission.limits import round_up
from kvgate_agent.admission.retry import retry_after_seconds
from kvgate_agent.admission.stats import AdmissionStats, TenantStats

__all__ = [
    "POOL_STALE_S",
    "AdmissionConfig",
    "AdmissionController",
    "AdmissionRequest",
    "AdmissionStats",
    "AsyncAdmission",
    "BucketMap",
    "Decision",
    "Hold",
    "Outcome",
    "PoolShare",
    "Reason",
    "ResolvedLimit",
    "TenantStats",
    "Ticket",
    "TokenBucket",
    "Waiter",
    "retry_after_seconds",
    "round_up",
]
