"""Missed injections: pods that asked for the sidecar but were admitted without it.

That happens when the webhook was down or unreachable while the pod was created (the chart's
``failurePolicy: Ignore`` lets pods through rather than block them), or when the namespace was
labelled after the pod was created. The reconcile pass finds them with :func:`find_missed` (pure:
the same rules as the webhook, by calling :func:`~kvgate_operator.inject.inject` as a dry run:
a pod is missed exactly when the webhook would inject it now) and posts one ``InjectionMissed``
Warning Event per pod (:class:`ReportedPods` remembers which, bounded).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvgate_operator.inject import ANNOTATION_INJECTED, LABEL_INJECT, inject
from kvgate_operator.template import InjectionConfig

EVENT_REASON = "InjectionMissed"


@dataclass(frozen=True)
class MissedPod:
    """An opted-in pod running without the sidecar."""

    namespace: str
    name: str
    uid: str
    #: ``pod label`` or ``namespace label``: how the pod opted in.
    opted_in_by: str

    @property
    def message(self) -> str:
        return (
            f"the pod asked for the kvgate sidecar ({self.opted_in_by} {LABEL_INJECT}=true) but "
            "was admitted without it: the injection webhook was unavailable when it was created, "
            "or the namespace was labelled afterwards. Its requests bypass kvgate's admission "
            "control; recreate the pod (e.g. kubectl rollout restart) to get the sidecar."
        )


def _dict(x: Any) -> Mapping[str, Any]:
    return x if isinstance(x, Mapping) else {}


def find_missed(
    pods: Iterable[Mapping[str, Any]],
    namespace_labels: Mapping[str, Mapping[str, str]] | None,
    config: InjectionConfig,
) -> list[MissedPod]:
    """The pods (as the API returns them) that the webhook would inject if they were created
    now, i.e. opted in, not opted out, not excluded, not already injected, not terminating or
    finished.

    Args:
        pods: Pod objects.
        namespace_labels: namespace name → labels; None when the namespaces could not be read
            (then only the pod label counts as opting in).
        config: the webhook's injection config (excluded namespaces, own namespace, ports).
    """
    out: list[MissedPod] = []
    for pod in pods:
        meta = _dict(pod.get("metadata"))
        status = _dict(pod.get("status"))
        if meta.get("deletionTimestamp") is not None:
            continue
        if status.get("phase") in ("Succeeded", "Failed"):
            continue
        if ANNOTATION_INJECTED in _dict(meta.get("annotations")):
            continue  # cheap pre-filter: inject() would say already_injected
        namespace = str(meta.get("namespace") or "")
        by_pod = _dict(meta.get("labels")).get(LABEL_INJECT) == "true"
        by_ns = _dict((namespace_labels or {}).get(namespace)).get(LABEL_INJECT) == "true"
        if not (by_pod or by_ns):
            continue
        result = inject(pod, namespace=namespace, namespace_opt_in=by_ns, config=config)
        if result.action == "injected":
            out.append(
                MissedPod(
                    namespace,
                    str(meta.get("name") or ""),
                    str(meta.get("uid") or ""),
                    "pod label" if by_pod else "namespace label",
                )
            )
    return out


class ReportedPods:
    """Which pods (by uid) already got their ``InjectionMissed`` Event; the oldest are
    forgotten beyond ``limit`` (a forgotten pod that is still missed gets no second Event
    anyway: the Event's name is derived from its uid, see :func:`event_name`)."""

    def __init__(self, limit: int = 10000) -> None:
        self.limit = limit
        self._uids: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, uid: object) -> bool:
        return uid in self._uids

    def __len__(self) -> int:
        return len(self._uids)

    def add(self, uid: str) -> None:
        self._uids[uid] = None
        self._uids.move_to_end(uid)
        while len(self._uids) > self.limit:
            self._uids.popitem(last=False)

    def new(self, missed: Iterable[MissedPod]) -> list[MissedPod]:
        """Those of ``missed`` not reported yet."""
        return [m for m in missed if m.uid not in self._uids]


def event_name(pod: MissedPod) -> str:
    """The Event's name: fixed per pod uid, so the API server refuses a second one (409), even
    from a restarted operator."""
    return f"{pod.name[:200]}.kvgate-injection-missed.{pod.uid[:8] or 'nouid'}"
