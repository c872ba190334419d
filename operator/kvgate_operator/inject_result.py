"""What the sidecar injection decided (:func:`kvgate_operator.inject.inject`): the
:class:`Injection` every rule returns, and the two ways a rule stops short of injecting."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from kvgate_operator.inject_pod import PodView

__all__ = ["Action", "Injection", "refuse", "skip"]

Action = Literal["injected", "already_injected", "skipped", "refused"]


@dataclass(frozen=True)
class Injection:
    """What :func:`inject` decided.

    Attributes:
        action: ``injected``, ``already_injected``, ``skipped`` or ``refused``.
        reason: stable snake_case reason (named by the rule that decided), for logs and metrics.
        message: human text; for ``refused`` the API server shows it to the user.
        pod: the pod after the mutation (a deep copy; equal to the input unless injected).
        patch: RFC 6902 operations turning the input pod into :attr:`pod`; empty unless
            injected.
    """

    action: Action
    reason: str
    message: str
    pod: dict[str, Any]
    patch: list[dict[str, Any]] = field(default_factory=list)

    @property
    def allowed(self) -> bool:
        """False only for ``refused``: the webhook must then deny the pod."""
        return self.action != "refused"


def skip(pod: PodView, reason: str, message: str) -> Injection:
    """The pod admitted as it is (``skipped``), for ``reason``."""
    return Injection("skipped", reason, message, pod.src)


def refuse(pod: PodView, reason: str, message: str) -> Injection:
    """The pod denied (``refused``), for ``reason``; the API server shows ``message``."""
    return Injection("refused", reason, message, pod.src)
