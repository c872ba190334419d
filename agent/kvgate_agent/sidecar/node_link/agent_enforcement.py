"""Agent mode: enforce what the node agent answers (thresholds, the GPU safety net,
``failureMode`` past the TTL) and build the report the sidecar syncs with.

The mode is pushed, not pulled: :class:`AgentEnforcement` applies it after each sync outcome
(:meth:`AgentEnforcement.on_sync`) and, while started, when time alone changes it (a timer on
the event loop at :meth:`SyncState.next_change_at`, re-armed after each application). A request
reads what is enforced; nothing on the request path or at a scrape changes the mode.

Invariant: new thresholds take effect without dropping in-flight work
(``AdmissionController.reconfigure``), and are only re-applied when they or the mode changed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from prometheus_client import CollectorRegistry

from kvgate_agent.admission import AdmissionConfig, AsyncAdmission, Reason
from kvgate_agent.contract.nodeadmission import PodThresholds, PolicyRef
from kvgate_agent.contract.policy import FailureMode, RateLimitPolicySpec
from kvgate_agent.contract.sync import MAX_REPORTED, SafetyNet, SyncAnswer, SyncReport
from kvgate_agent.sidecar.engine import EngineProbe
from kvgate_agent.sidecar.identity import Authenticator
from kvgate_agent.sidecar.node_link.settings import AgentSettings
from kvgate_agent.sidecar.node_link.sync_metrics import SyncMetrics
from kvgate_agent.sidecar.node_link.sync_state import Mode, SyncResult, SyncState
from kvgate_agent.sidecar.upstream import Flag

log = logging.getLogger("kvgate.sidecar")

#: What an agent-mode sidecar enforces without thresholds (before the first answer, unmanaged
#: pods, FailOpen without any thresholds): no rate limits, no caps; everything is admitted.
NO_LIMITS = RateLimitPolicySpec()
#: Hold keys on admission (see ``AsyncAdmission.hold``).
HOLD_THRESHOLDS = "thresholds"
HOLD_GPU_MEMORY = "gpu_memory"
#: Least delay of the mode timer (seconds): a timer that fires a hair before the TTL's end (the
#: mode not yet changed) waits this long again rather than spin.
MIN_TIMER_SECONDS = 0.001


class LinkMetrics(Protocol):
    """What the node link sets and reports, and the registry its own metrics
    (:class:`~kvgate_agent.sidecar.node_link.sync_metrics.SyncMetrics`) join (the sidecar's
    :class:`~kvgate_agent.sidecar.metrics.SidecarMetrics` is one)."""

    @property
    def registry(self) -> CollectorRegistry: ...
    @property
    def policy_mismatch(self) -> Flag: ...
    @property
    def decision_counts(self) -> dict[str, int]: ...


class AgentEnforcement:
    """What one agent-mode sidecar enforces: the node agent's answer in the mode the sync's
    state implies, applied to the admission.

    :meth:`start` (on the sidecar's loop, at startup) applies the mode and keeps it current
    until :meth:`stop`; :meth:`on_sync` takes each sync outcome. ``clock`` (monotonic seconds)
    must advance with the loop's ``time()``: a deadline of the clock becomes a delay on the loop.

    Attributes:
        state: the sync's state (last answer, its age, the mode it implies).
        mode: the mode last enforced (None before the first :meth:`refresh`).
        spec: the policy spec enforced now (:data:`NO_LIMITS` until thresholds arrive).
        safety_net: the GPU safety net of the last answer.
        policy_ref: the policy governing this pod in the last answer, if any.
        listeners: called with each new mode once it is enforced (diagnostics, tests).
    """

    def __init__(
        self,
        settings: AgentSettings,
        clock: Callable[[], float],
        admission: AsyncAdmission,
        metrics: LinkMetrics,
        probe: EngineProbe,
        identity: Authenticator,
    ) -> None:
        self.settings = settings
        self.admission = admission
        self.metrics = metrics
        self.probe = probe
        self.identity = identity
        self.state = SyncState(
            clock,
            failure_mode=settings.failure_mode,
            ttl_override=settings.ttl_override,
            sync_interval=settings.sync_interval,
        )
        self.mode: Mode | None = None
        self.spec: RateLimitPolicySpec = NO_LIMITS
        self.safety_net = SafetyNet()
        self.policy_ref: PolicyRef | None = None
        self._mismatch_seen: tuple[bool, str | None] = (False, None)
        self._applied: tuple[PodThresholds | None, bool] | None = None
        self.listeners: list[Callable[[Mode], object]] = []
        #: The sync's metrics, on the sidecar's registry.
        self.sync_metrics = SyncMetrics(
            metrics.registry, self.state, self.enforced_mode, lambda: self.policy_ref
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None  # the clock's deadline the timer is armed for

    # ------------------------------------------------------------------ pushing the mode

    def start(self) -> None:
        """Enforce the mode now and keep it current from now on (a timer on the running loop
        for each deadline of :meth:`SyncState.next_change_at`). Call on the sidecar's loop."""
        self._loop = asyncio.get_running_loop()
        self.refresh(force=True)

    def stop(self) -> None:
        """Cancel the timer: the mode changes no more by time alone."""
        self._loop = None
        self._disarm()

    def _arm(self) -> None:
        """Set the timer for the next change time alone brings (none: no timer); a timer
        already set for that deadline stays."""
        loop = self._loop
        at = None if loop is None else self.state.next_change_at()
        if at is None or loop is None:
            self._disarm()
            return
        if self._timer is not None and at == self._timer_at:
            return
        self._disarm()
        delay = max(at - self.state.clock(), MIN_TIMER_SECONDS)  # the clock's seconds to the loop's
        self._timer = loop.call_later(delay, self._on_timer)
        self._timer_at = at

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._timer_at = None

    def _on_timer(self) -> None:
        self._timer = self._timer_at = None
        try:
            self.refresh()
        except Exception:  # a bug must not pass silently on the loop; the next sync re-arms
            log.exception("applying the mode at the end of the TTL failed")

    def enforced_mode(self) -> Mode:
        """The mode enforced now; before :meth:`start`, the one the sync's state implies (what
        will be enforced). Reads only: the scrape reports the mode, it never changes it."""
        return self.state.mode() if self.mode is None else self.mode

    # ------------------------------------------------------------------ applying

    def refresh(self, *, force: bool = False) -> Mode:
        """Bring enforcement in line with the state's :class:`Mode` now, and re-arm the timer
        for the next change time alone brings. Runs after every sync outcome, at that timer
        and at :meth:`start`; it only acts when the mode changed, or when ``force`` is set
        after a new answer. Returns the mode.

        Per mode: ``live``/``stale`` enforce the last thresholds in full, with a
        ``gpu_memory_low`` hold while the safety net is closed; ``fail_open`` enforces the last
        thresholds' local caps only (concurrency cap and KV capacity; no rate limits, no
        safety net); ``fail_closed`` holds every new request with ``fail_closed`` (503,
        Retry-After = the sync interval); ``waiting`` enforces no limits, or holds under a
        configured FailClosed; ``unmanaged`` enforces no limits.
        """
        mode = self.state.mode()
        changed = mode is not self.mode
        if changed or force:
            self._enforce(mode, changed=changed)
        self._arm()
        if changed:
            for listener in self.listeners:
                listener(mode)
        return mode

    def _enforce(self, mode: Mode, *, changed: bool) -> None:
        """Apply ``mode``: the thresholds (or none), the fail-closed hold, the safety net."""
        state = self.state
        if changed:
            self._log_change(mode)
        self.mode = mode
        if mode in (Mode.WAITING, Mode.UNMANAGED):
            self.apply(None)
        else:
            self.apply(state.thresholds, local_caps_only=mode is Mode.FAIL_OPEN)
        a = self.admission
        if mode is Mode.FAIL_CLOSED or (
            mode is Mode.WAITING and state.failure_mode is FailureMode.FAIL_CLOSED
        ):
            a.hold(
                Reason.FAIL_CLOSED,
                key=HOLD_THRESHOLDS,
                retry_after=state.sync_interval_seconds,
                message="no current admission thresholds from the node agent and failureMode "
                "is FailClosed",
            )
        else:
            a.lift(HOLD_THRESHOLDS)
        self._apply_safety_net(mode)

    def _log_change(self, mode: Mode) -> None:
        age = self.state.age_seconds()
        (log.info if mode in (Mode.LIVE, Mode.UNMANAGED, Mode.WAITING) else log.warning)(
            "thresholds: %s -> %s (last successful sync: %s, TTL %.1fs)",
            "none" if self.mode is None else self.mode.value,
            mode.value,
            "never" if age is None else f"{age:.1f}s ago",
            self.state.ttl_seconds,
        )

    def _apply_safety_net(self, mode: Mode) -> None:
        """Hold new requests with ``gpu_memory_low`` while the last answer's safety net is
        closed (live and stale modes only)."""
        net = self.safety_net
        if mode in (Mode.LIVE, Mode.STALE) and not net.open:
            detail = net.reason or "GPU free memory below the safety margin"
            if net.gpu_uuid is not None:
                detail += f" on {net.gpu_uuid}"
            self.admission.hold(
                Reason.GPU_MEMORY_LOW,
                key=HOLD_GPU_MEMORY,
                retry_after=net.retry_after_seconds,
                message=f"admission paused to protect GPU memory: {detail}",
            )
        else:
            self.admission.lift(HOLD_GPU_MEMORY)

    def apply(self, thresholds: PodThresholds | None, *, local_caps_only: bool = False) -> None:
        """Enforce ``thresholds`` from now on without dropping in-flight work (see
        ``AdmissionController.reconfigure``); None = no limits. ``local_caps_only`` keeps the
        pod's concurrency cap and KV capacity but drops the rate limits (FailOpen).

        The spec's tenants, priority, queue and overload settings take effect for new requests.
        The KV capacity is the sidecar's own reading of the engine when the spec says
        ``capacity.fromEngineMetrics`` and it has one, else the thresholds'
        ``kvCacheTokens`` as resolved by the operator. ``per: Global`` limits arrive already
        split by ``globalShare`` (the operator did it), so they are not split again here.
        Waiters are re-examined at once. A policy's tenants are checked against the keys and
        JWKS files now (:meth:`Authenticator.warn`: e.g. a keys file's ``class`` the policy
        does not declare is logged when the thresholds arrive, not at that key's first
        request).
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
            if spec.capacity.from_engine_metrics and self.probe.kv_tokens is not None:
                kv = self.probe.kv_tokens
        self.spec = spec
        if thresholds is not None:
            self.identity.warn(spec.tenants)
        self.admission.reconfigure(AdmissionConfig.from_policy(spec, kv_capacity_tokens=kv))
        self.probe.set_capacity_known(not spec.capacity.from_engine_metrics or kv is not None)

    def on_sync(self, result: SyncResult, answer: SyncAnswer | None) -> None:
        """After every sync: count it; on a new answer, take its safety net and policy."""
        self.sync_metrics.agent_sync.labels(result.value).inc()
        if answer is not None:
            self.safety_net = answer.safety_net
            self.policy_ref = None if answer.pod is None else answer.pod.policy
            self._check_expected_policy()
        self.refresh(force=answer is not None)

    def _check_expected_policy(self) -> None:
        """Compare the governing policy with the one the pod's ``kvgate.io/policy`` annotation
        names: a mismatch (another policy, or none) is logged once per change and exported as
        ``kvgate_policy_mismatch``; admission follows the agent either way."""
        expected = self.settings.expected_policy
        got = self.policy_ref.name if self.policy_ref is not None else None
        mismatch = expected is not None and got != expected
        if mismatch and (mismatch, got) != self._mismatch_seen:
            log.warning(
                "this pod is annotated kvgate.io/policy=%s but is governed by %s",
                expected,
                "no RateLimitPolicy" if got is None else f"RateLimitPolicy {got}",
            )
        self._mismatch_seen = (mismatch, got)
        self.metrics.policy_mismatch.value = mismatch

    def sync_report(self) -> SyncReport:
        """What this sidecar tells the node agent now (tokens; decisions cumulative)."""
        a = self.settings
        c = self.admission.stats()
        cap = c.kv_capacity_tokens
        answer = self.state.answer
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
