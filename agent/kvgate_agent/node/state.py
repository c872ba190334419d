"""What the node agent knows about its node (the NodeAdmission spec, NVML, sidecar reports,
engine metrics), and the sync answers and ``NodeAdmission`` status computed from it.

Invariant: pure (inputs are set by :mod:`kvgate_agent.node.service`, ``node.sync`` and
``node.scrape``), and unknown is never idle nor full: a missing engine figure or an unreadable
GPU neither lowers a capacity nor closes the safety net.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass

from kvgate_agent.contract.nodeadmission import (
    Condition,
    GpuStatus,
    NodeAdmissionSpec,
    NodeAdmissionStatus,
    PodAdmission,
    PodUsage,
)
from kvgate_agent.contract.sync import SyncAnswer, SyncReport
from kvgate_agent.gpu.monitor import GpuSnapshot
from kvgate_agent.gpu.monitor import GpuStatus as GpuReading
from kvgate_agent.node.capacity import KvCapacity, with_capacity
from kvgate_agent.node.capacity import bytes_per_token as _bytes_per_token
from kvgate_agent.node.podgpu import PodGpus, attribute_gpus
from kvgate_agent.node.safety import SafetyNets

PodKey = tuple[str, str]  # (namespace, name)


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What a pod's model server reported in its metrics (tokens); None = unknown."""

    kv_capacity_tokens: int | None = None
    kv_used_tokens: int | None = None


@dataclass(slots=True)
class _PodRecord:
    report: SyncReport
    at: float  # monotonic seconds of the last report


class NodeState:
    """The node agent's state. Pure: every method takes the time it needs as an argument.

    Args:
        node_name: the node (and its NodeAdmission object's name).
        ttl_seconds: how long a sidecar keeps enforcing thresholds without a successful sync
            before its ``failureMode`` applies (sent in every answer).
        sync_interval_seconds: how often sidecars should sync (sent in every answer).
        report_expiry_seconds: a sidecar not heard from for this long counts as disconnected
            (its usage leaves the status).
    """

    def __init__(
        self,
        node_name: str,
        *,
        ttl_seconds: float = 30.0,
        sync_interval_seconds: float = 1.0,
        report_expiry_seconds: float = 10.0,
    ) -> None:
        self.node_name = node_name
        self.ttl_seconds = ttl_seconds
        self.sync_interval_seconds = sync_interval_seconds
        self.report_expiry_seconds = report_expiry_seconds
        self.spec: NodeAdmissionSpec | None = None
        self.spec_known = False  # True once the NodeAdmission was read (present or absent)
        self.spec_read_at: float | None = None
        self.gpus: GpuSnapshot | None = None
        self.gpus_by_pod: dict[str, set[str]] = {}
        self._pods: dict[PodKey, PodAdmission] = {}
        self._reports: dict[PodKey, _PodRecord] = {}
        self._engine: dict[PodKey, EngineFacts] = {}
        #: Each governed pod's GPU safety net.
        self.safety = SafetyNets()
        #: Each governed pod's KV capacity from its sources (and the engine figures ignored).
        self.capacity = KvCapacity()
        self._answers: dict[PodKey, SyncAnswer] = {}
        self.stopped = False  # set on shutdown: the last status says so
        #: Bumped whenever a cached answer is dropped (an answer may have changed).
        self.version = 0
        self._held: dict[PodKey, int] = {}  # pods whose sync the agent holds now (long poll)

    # ------------------------------------------------------------------ inputs

    def set_spec(self, spec: NodeAdmissionSpec | None, now: float) -> None:
        """The NodeAdmission spec as read from the API server (None: no object for this node,
        so no pod on it is governed)."""
        self.spec = spec
        self.spec_known = True
        self.spec_read_at = now
        self._pods = {(p.namespace, p.name): p for p in (spec.pods if spec else [])}
        self.capacity.keep(self._pods)
        self._refresh()

    def set_gpus(self, snapshot: GpuSnapshot, gpus_by_pod: Mapping[str, set[str]]) -> None:
        """A new NVML snapshot and the pod UID → GPU UUIDs map from NVML processes. The cached
        answers (and :attr:`version`) stay when nothing they depend on moved (each GPU's
        uuid, health, total and free bytes, and the map): an idle node's polls wake no held
        sync."""
        by_pod = {k: set(v) for k, v in gpus_by_pod.items()}
        same = (
            self.gpus is not None
            and _answer_inputs(self.gpus) == _answer_inputs(snapshot)
            and by_pod == self.gpus_by_pod
        )
        self.gpus = snapshot
        self.gpus_by_pod = by_pod
        if not same:
            self._refresh()

    def record(self, report: SyncReport, now: float) -> None:
        """A sidecar's sync report (already authenticated)."""
        key = (report.namespace, report.name)
        prev = self._reports.get(key)
        self._reports[key] = _PodRecord(report, now)
        if prev is None or prev.report.gpu_uuids != report.gpu_uuids:
            self._refresh(only=key)

    def set_engine(self, key: PodKey, facts: EngineFacts | None) -> None:
        """The pod's current engine facts (None: unknown or stale)."""
        if facts is None:
            if self._engine.pop(key, None) is not None:
                self._answers.pop(key, None)
                self.version += 1
        elif self._engine.get(key) != facts:
            self._engine[key] = facts
            self._answers.pop(key, None)
            self.version += 1

    def hold(self, key: PodKey) -> None:
        """The agent holds a sync of this pod (long poll): its sidecar counts as heard from
        until :meth:`release`."""
        self._held[key] = self._held.get(key, 0) + 1

    def release(self, key: PodKey, now: float) -> None:
        """A held sync of this pod ended at ``now``: the sidecar was heard from until then."""
        left = self._held.get(key, 0) - 1
        if left > 0:
            self._held[key] = left
        else:
            self._held.pop(key, None)
        rec = self._reports.get(key)
        if rec is not None:
            rec.at = max(rec.at, now)

    def is_held(self, key: PodKey) -> bool:
        """Whether a sync of this pod is held now (its sidecar is connected)."""
        return key in self._held

    def expire(self, now: float) -> list[PodKey]:
        """Forget sidecars not heard from for ``report_expiry_seconds``; returns their keys."""
        gone = [
            k
            for k, r in self._reports.items()
            if now - r.at > self.report_expiry_seconds and k not in self._held
        ]
        for k in gone:
            del self._reports[k]
            self._engine.pop(k, None)
            self._answers.pop(k, None)
            self.capacity.forget(k)
        if gone:
            self.version += 1
        return gone

    # ------------------------------------------------------------------ queries

    def connected(self, now: float) -> int:
        """Sidecars heard from within ``report_expiry_seconds``, or whose sync is held now."""
        return sum(
            1
            for k, r in self._reports.items()
            if now - r.at <= self.report_expiry_seconds or k in self._held
        )

    def reports(self) -> dict[PodKey, tuple[SyncReport, float]]:
        """Every known sidecar's last report and when it came (monotonic seconds)."""
        return {k: (r.report, r.at) for k, r in self._reports.items()}

    def pod_gpus(self, key: PodKey) -> PodGpus:
        """The GPUs attributed to a pod (see :func:`~kvgate_agent.node.podgpu.attribute_gpus`)."""
        pod = self._pods.get(key)
        rec = self._reports.get(key)
        uid = pod.uid if pod is not None else (rec.report.uid if rec else None)
        node = [g.uuid for g in self.gpus.gpus] if self.gpus else []
        return attribute_gpus(uid, rec.report.gpu_uuids if rec else (), self.gpus_by_pod, node)

    def safety_open(self, key: PodKey) -> bool:
        """Whether the GPU safety net lets the pod admit new requests (see
        :class:`~kvgate_agent.node.safety.SafetyNets`)."""
        return self.safety.is_open(key)

    def answer(self, key: PodKey) -> SyncAnswer:
        """The answer for a pod's sidecar (cached until an input changes)."""
        cached = self._answers.get(key)
        if cached is not None:
            return cached
        pod = self._pods.get(key)
        if pod is not None:
            pod = self._with_capacity(key, pod)
        net = self.safety.answer(key, max(1.0, self.sync_interval_seconds))
        body = {
            "pod": None if pod is None else pod.model_dump(mode="json", by_alias=True),
            "safetyNet": net.model_dump(mode="json", by_alias=True),
            "ttlSeconds": self.ttl_seconds,
            "syncIntervalSeconds": self.sync_interval_seconds,
        }
        digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:20]
        ans = SyncAnswer(
            etag=f'"{digest}"',
            pod=pod,
            safety_net=net,
            ttl_seconds=self.ttl_seconds,
            sync_interval_seconds=self.sync_interval_seconds,
        )
        self._answers[key] = ans
        return ans

    def kv_capacity(self, key: PodKey) -> int | None:
        """The pod's KV capacity, tokens, from the best source (see
        :func:`~kvgate_agent.node.capacity.with_capacity`); None for a pod not governed."""
        pod = self._pods.get(key)
        if pod is None:
            return None
        return self._with_capacity(key, pod).thresholds.kv_capacity_tokens

    def status(self) -> NodeAdmissionStatus:
        """The ``NodeAdmission`` status without heartbeat time and condition transition times
        (the writer adds them). Pods: the governed pods of this node (the spec's), with what
        their sidecars and engines report; a sidecar of a pod not in the spec (ungoverned, or
        on another node) is answered but never reported here."""
        gpus = [_gpu_status(g) for g in self.gpus.gpus] if self.gpus else []
        keys = sorted(self._pods)
        pods = []
        for key in keys:
            rec = self._reports.get(key)
            eng = self._engine.get(key)
            pod = self._pods.get(key)
            attributed = self.pod_gpus(key)
            pods.append(
                PodUsage(
                    namespace=key[0],
                    name=key[1],
                    uid=pod.uid if pod else (rec.report.uid if rec else None),
                    in_flight=rec.report.in_flight if rec else 0,
                    queue_length=rec.report.queue_length if rec else 0,
                    kv_reserved_tokens=rec.report.kv_reserved_tokens if rec else 0,
                    kv_used_tokens=eng.kv_used_tokens
                    if eng and eng.kv_used_tokens is not None and eng.kv_used_tokens <= 1 << 40
                    else None,
                    engine_kv_capacity_tokens=self._plausible_engine_kv(key),
                    gpu_uuids=sorted(attributed.uuids),
                    gpu_source=attributed.source if attributed.uuids else None,
                    safety_net_open=self.safety_open(key),
                )
            )
        return NodeAdmissionStatus(gpus=gpus, pods=pods, conditions=self.conditions())

    def conditions(self) -> list[Condition]:
        """``Ready`` (the agent reads at least one GPU and its NodeAdmission) and
        ``GpuMemoryLow`` (the safety net is closed for some pod)."""
        snap = self.gpus
        if self.stopped:
            ready = Condition(
                type="Ready",
                status="False",
                reason="AgentStopped",
                message="the node agent shut down; GPU and KV figures are its last reading",
            )
        elif snap is None:
            ready = Condition(
                type="Ready", status="Unknown", reason="Starting", message="no GPU read yet"
            )
        elif not snap.ready:
            ready = Condition(
                type="Ready", status="False", reason="NoUsableGpu", message=snap.reason or ""
            )
        elif any(not g.healthy for g in snap.gpus):
            bad = ", ".join(f"{g.uuid}: {g.reason}" for g in snap.gpus if not g.healthy)
            ready = Condition(type="Ready", status="True", reason="SomeGpusUnhealthy", message=bad)
        else:
            ready = Condition(type="Ready", status="True", reason="Reporting")
        closed = sorted(f"{k[0]}/{k[1]}" for k in self.safety.closed())
        low = Condition(
            type="GpuMemoryLow",
            status="True" if closed else "False",
            reason="BelowSafetyMargin" if closed else "AboveSafetyMargin",
            message=("admission stopped for " + ", ".join(closed)) if closed else "",
        )
        return [ready, low]

    # ------------------------------------------------------------------ internals

    def _with_capacity(self, key: PodKey, pod: PodAdmission) -> PodAdmission:
        engine_kv = self._plausible_engine_kv(key) if self._engine.get(key) else None
        return with_capacity(pod, engine_kv, self.gpus, self.pod_gpus(key))

    def _plausible_engine_kv(self, key: PodKey) -> int | None:
        """The pod's engine-reported KV capacity if plausible (see
        :meth:`~kvgate_agent.node.capacity.KvCapacity.engine_kv`), else None."""
        eng = self._engine.get(key)
        reported = eng.kv_capacity_tokens if eng else None
        pod = self._pods.get(key)
        return self.capacity.engine_kv(key, pod, reported, self.gpus, self.pod_gpus(key))

    def bytes_per_token(self, key: PodKey) -> int | None:
        """KV bytes per token of a governed pod's model, from its thresholds."""
        pod = self._pods.get(key)
        return None if pod is None else _bytes_per_token(pod)

    def _refresh(self, only: PodKey | None = None) -> None:
        """Re-evaluate the safety net (all pods, or one) and drop cached answers."""
        self.version += 1
        keys = [only] if only is not None else list(set(self._pods) | self.safety.pods())
        for key in keys:
            self._answers.pop(key, None)
            pod = self._pods.get(key)
            margin = pod.thresholds.capacity.safety_margin_bytes if pod else None
            if pod is None or margin is None or self.gpus is None:
                self.safety.drop(key)
            else:
                self.safety.update(key, margin, self.gpus, self.pod_gpus(key).uuids)
        if only is None:
            self._answers.clear()


def _answer_inputs(snap: GpuSnapshot) -> list[tuple[object, ...]]:
    """What the answers read from a GPU snapshot (safety net, NVML estimate, attribution)."""
    return [(g.uuid, g.healthy, g.total_bytes, g.free_bytes) for g in snap.gpus]


def _gpu_status(g: GpuReading) -> GpuStatus:
    return GpuStatus(
        uuid=g.uuid,
        index=None if g.mig else g.index,
        name=g.name,
        mig=g.mig,
        parent_uuid=g.parent_uuid,
        total_bytes=g.total_bytes,
        used_bytes=g.used_bytes,
        free_bytes=g.free_bytes,
        reserved_bytes=g.reserved_bytes,
        utilization_percent=g.utilization,
        healthy=g.healthy,
        reason=g.reason,
    )


@dataclass(slots=True)
class StatusGate:
    """Decides when to write the NodeAdmission status: only on a meaningful change (see
    :func:`meaningful_change`), never more often than ``min_interval`` seconds, and at least
    every ``heartbeat_interval`` seconds (so the operator and users can tell a live agent from a
    dead one). Small load changes ride on the next heartbeat."""

    min_interval: float = 5.0
    heartbeat_interval: float = 60.0
    last_written: NodeAdmissionStatus | None = None
    last_write: float | None = None

    def due(
        self, status: NodeAdmissionStatus, capacities: Mapping[PodKey, int | None], now: float
    ) -> bool:
        """Whether to write ``status`` now (monotonic seconds)."""
        if self.last_write is None or self.last_written is None:
            return True
        since = now - self.last_write
        if since >= self.heartbeat_interval:
            return True
        if since < self.min_interval:
            return False
        return meaningful_change(self.last_written, status, capacities)

    def wrote(self, status: NodeAdmissionStatus, now: float) -> None:
        """Record a successful write of ``status``."""
        self.last_written = status
        self.last_write = now


#: A GPU's free memory moving by more than this fraction of its total is a meaningful change.
GPU_FREE_STEP = 0.05
#: A pod's reserved KV moving by more than this fraction of its capacity is a meaningful change.
KV_RESERVED_STEP = 0.10


def meaningful_change(
    prev: NodeAdmissionStatus,
    new: NodeAdmissionStatus,
    capacities: Mapping[PodKey, int | None],
) -> bool:
    """Whether ``new`` differs from ``prev`` in a way readers act on: GPUs appearing, going or
    changing health; a GPU's free memory moving by more than :data:`GPU_FREE_STEP` of its total;
    pods appearing or going; a pod's uid, engine capacity, GPUs or safety net changing; its
    reserved KV moving by more than :data:`KV_RESERVED_STEP` of its capacity (``capacities``,
    tokens); a condition's status or reason changing."""
    if [(c.type, c.status, c.reason) for c in prev.conditions] != [
        (c.type, c.status, c.reason) for c in new.conditions
    ]:
        return True
    old_gpus = {g.uuid: g for g in prev.gpus}
    if set(old_gpus) != {g.uuid for g in new.gpus}:
        return True
    for g in new.gpus:
        o = old_gpus[g.uuid]
        if (o.healthy, o.reason, o.total_bytes) != (g.healthy, g.reason, g.total_bytes):
            return True
        if (o.free_bytes is None) != (g.free_bytes is None):
            return True
        moved = abs((g.free_bytes or 0) - (o.free_bytes or 0))
        if moved > GPU_FREE_STEP * (g.total_bytes or 0):
            return True
    old_pods = {(p.namespace, p.name): p for p in prev.pods}
    if set(old_pods) != {(p.namespace, p.name) for p in new.pods}:
        return True
    for p in new.pods:
        key = (p.namespace, p.name)
        op = old_pods[key]
        fields = ("uid", "engine_kv_capacity_tokens", "safety_net_open", "gpu_uuids")
        if any(getattr(op, f) != getattr(p, f) for f in fields):
            return True
        cap = capacities.get(key)
        step = KV_RESERVED_STEP * cap if cap else 0
        if abs(p.kv_reserved_tokens - op.kv_reserved_tokens) > step:
            return True
    return False
