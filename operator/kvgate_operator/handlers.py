"""The kopf handlers, thin: startup makes the :class:`~kvgate_operator.app.Operator` and keeps it
in kopf's memo; cleanup stops it; every watch event is handed to it, which at most triggers a
reconcile pass.

Invariant: no handler uses a finalizer (only ``on.event``, ``on.startup``, ``on.cleanup`` and,
registered at startup when the webhook is enabled, ``on.mutate``), so the operator never adds,
removes or fights over finalizers on anybody's objects
(https://github.com/nolar/kopf/issues/664).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import kopf

from kvgate_operator.app import Operator
from kvgate_operator.settings import OperatorSettings
from kvgate_operator.triggers import WATCHES, Kind

#: The memo key of the :class:`OperatorSettings` to start with (``kopf.run(memo=...)``); without
#: it, startup reads them from the environment.
SETTINGS_KEY = "operator_settings"
#: The memo key of the running :class:`Operator`.
OPERATOR_KEY = "operator"


def running(memo: kopf.Memo) -> Operator | None:
    """The operator kept in ``memo`` (None before startup)."""
    op = memo.get(OPERATOR_KEY)
    return op if isinstance(op, Operator) else None


async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Make the operator from its settings, keep it in the memo, and start it."""
    given = memo.get(SETTINGS_KEY)
    op = Operator(given if isinstance(given, OperatorSettings) else OperatorSettings())
    memo[OPERATOR_KEY] = op
    await op.start(settings)


async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    """Stop the operator."""
    op = running(memo)
    if op is not None:
        await op.stop()


def _on_event(kind: Kind) -> Callable[..., None]:
    def handler(event: Any, memo: kopf.Memo, **_: Any) -> None:
        op = running(memo)
        if op is not None:
            op.on_event(kind, event)

    handler.__name__ = f"trigger_on_{kind.value}"
    return handler


# Registered here rather than with decorators so that the functions keep their own signatures.
kopf.on.startup()(startup)
kopf.on.cleanup()(cleanup)
for _kind, _watch in WATCHES.items():
    kopf.on.event(_watch.group, _watch.version, _watch.plural)(_on_event(_kind))
