"""Background tasks' end, shared by both roles: :func:`cancel_and_wait`."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

__all__ = ["cancel_and_wait"]


async def cancel_and_wait(*tasks: asyncio.Task[Any] | None) -> None:
    """Cancel every task given (None: none), then wait for each to end, its
    :class:`asyncio.CancelledError` suppressed (a task that ended otherwise is left as it is)."""
    for task in tasks:
        if task is not None:
            task.cancel()
    for task in tasks:
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await task
