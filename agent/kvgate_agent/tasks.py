"""Background tasks, shared by both roles: :func:`every` (a step repeated on a tick, a bug in
one step logged, not fatal) and :func:`cancel_and_wait` (their end)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["cancel_and_wait", "every"]


async def every(
    step: Callable[[], Awaitable[object]], tick_s: float, log: logging.Logger, what: str
) -> None:
    """Run ``step`` then sleep ``tick_s`` seconds, until cancelled. An exception out of a step
    (a bug: each step handles its own I/O errors) is logged with ``what`` and the loop goes
    on, so that one bad step does not silently stop the background job."""
    while True:
        try:
            await step()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s step failed", what)
        await asyncio.sleep(tick_s)


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
