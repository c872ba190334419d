"""kvgate's admission algorithms: pure, clock-injected, no HTTP.

Public API: :class:`AdmissionController` (the decisions), :class:`AsyncAdmission` (awaiting a
place in the queue), :class:`AdmissionConfig` (resolved thresholds), and the decision types.
Inside: :mod:`.bucket` (token buckets), :mod:`.limits` (what is counted and reserved),
:mod:`.holds` (stops on all admission), :mod:`.retry` (Retry-After), :mod:`.controller`
(composes them with the queue and the overload actions), :mod:`.waiting` (the asyncio side).
"""

from kvgate_agent.admission.bucket import BucketMap, TokenBucket
from kvgate_agent.admission.config import AdmissionConfig, LimitThreshold
from kvgate_agent.admission.controller import AdmissionController
from kvgate_agent.admission.decision import (
    AdmissionRequest,
    Decision,
    Outcome,
    Reason,
    Ticket,
    Waiter,
)
from kvgate_agent.admission.holds import Hold
from kvgate_agent.admission.limits import round_up
from kvgate_agent.admission.retry import retry_after_seconds
from kvgate_agent.admission.waiting import AsyncAdmission

__all__ = [
    "AdmissionConfig",
    "AdmissionController",
    "AdmissionRequest",
    "AsyncAdmission",
    "BucketMap",
    "Decision",
    "Hold",
    "LimitThreshold",
    "Outcome",
    "Reason",
    "Ticket",
    "TokenBucket",
    "Waiter",
    "retry_after_seconds",
    "round_up",
]
