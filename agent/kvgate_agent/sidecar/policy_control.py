"""What changes a running sidecar's admission besides the node agent: its policy file re-read on
SIGHUP (standalone), and an engine that stopped producing tokens
(:mod:`kvgate_agent.sidecar.upstream.engine_stall`)."""

from __future__ import annotations

import asyncio
import logging

from kvgate_agent.admission import AdmissionConfig, AsyncAdmission, Reason
from kvgate_agent.contract.policy import FailureMode, PolicyError, RateLimitPolicy, load_policy
from kvgate_agent.sidecar.engine import EngineProbe
from kvgate_agent.sidecar.identity import Authenticator, KeyFileError
from kvgate_agent.sidecar.node_link import EnforcedPolicy
from kvgate_agent.sidecar.settings import SidecarSettings
from kvgate_agent.sidecar.upstream import EngineStall

log = logging.getLogger("kvgate")

#: Hold key on admission while the engine is stalled under FailClosed.
HOLD_ENGINE_STALL = "engine_stall"


class PolicyControl:
    """Applies a re-read policy file (:meth:`apply_policy`, :meth:`reload`) and a stalled
    engine (:attr:`stall`, :meth:`engine_stalled`) to one sidecar's admission."""

    def __init__(
        self,
        settings: SidecarSettings,
        policy: EnforcedPolicy,
        admission: AsyncAdmission,
        engine: EngineProbe,
        identity: Authenticator,
    ) -> None:
        self.settings = settings
        self.policy = policy
        self.admission = admission
        self.engine = engine
        self.identity = identity
        #: Whether the engine stopped producing tokens with streams in flight.
        self.stall = EngineStall(settings.engine_stall_seconds, self.engine_stalled)

    def apply_policy(self, policy: RateLimitPolicy) -> None:
        """Enforce ``policy`` from now on (standalone; its file re-read on SIGHUP) without
        dropping in-flight work, as new thresholds are in agent mode
        (``AdmissionController.reconfigure``): its limits, tenants, priority, queue and overload
        settings take effect for new requests and waiters are re-examined at once. The KV
        capacity is the engine's reading when the policy asks for it and one was read, else the
        policy's ``capacity.kvCacheTokens`` (FailClosed holds until the engine's is read).

        Raises:
            ValueError: in agent mode (the node agent's thresholds are enforced there).
        """
        self.policy.replace(policy)
        spec = policy.spec
        self.identity.warn(spec.tenants)  # e.g. a keys file's class it no longer declares
        from_engine = spec.capacity.from_engine_metrics
        kv = self.engine.kv_tokens if from_engine else None
        self.admission.reconfigure(AdmissionConfig.from_policy(spec, kv_capacity_tokens=kv))
        self.engine.set_capacity_known(not from_engine or kv is not None)
        if from_engine:
            self.engine.ensure_polling()

    async def reload(self) -> None:
        """SIGHUP: re-read the policy file (standalone, ``settings.policy_file``) and the keys
        and JWKS files that changed. A file that cannot be read or is invalid (a policy whose
        ``tenants.jwt`` has no JWKS file among them) keeps what is enforced, and the log says
        why (errors); what was re-read is logged at info."""
        path = self.settings.policy_file
        if path is not None and self.policy.enforcement is None:
            try:
                policy = await asyncio.to_thread(load_policy, path)
                self.identity.check(policy.spec.tenants)
            except (PolicyError, KeyFileError) as exc:
                log.error("SIGHUP: %s; keeping the policy in force", exc)
            else:
                self.apply_policy(policy)
                log.info("SIGHUP: policy re-read from %s and enforced", path)
        await asyncio.to_thread(self.identity.poll)  # logs each file reloaded or refused

    def engine_stalled(self, stalled: bool) -> None:
        """The engine stalled (or produces tokens again): no new work is sent to it until it
        does. Under FailClosed new requests are refused (503 ``fail_closed``, Retry-After 1);
        under FailOpen they queue behind those in flight, up to their wait budgets
        (:meth:`EngineProbe.pause`). Both are undone when it ends."""
        closed = self.policy.spec.failure_mode is FailureMode.FAIL_CLOSED
        if stalled and closed:
            self.admission.hold(
                Reason.FAIL_CLOSED,
                key=HOLD_ENGINE_STALL,
                retry_after=1.0,
                message="the model server has stopped producing tokens and failureMode is "
                "FailClosed",
            )
        elif stalled:
            self.engine.pause(True)
        else:
            self.admission.lift(HOLD_ENGINE_STALL)
            self.engine.pause(False)
