"""GPU library calls bounded in time: each runs on a thread pool and is waited on for at most
``call_timeout`` real seconds.

Invariant: a call that did not answer in time is kept, by its key, until it returns, and no new
call with that key starts meanwhile: a wedged driver call never piles up threads, and its late
answer is discarded (never served as fresh data). Any exception a call raises that is not a
:class:`~kvgate_agent.gpu.backend.GpuError` becomes a ``GpuUnknownError`` (a backend bug must
not take the agent down).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from kvgate_agent.gpu.backend import GpuError, GpuTimeout, GpuUnknownError

T = TypeVar("T")


def _uuid(key: str | None) -> str | None:
    """The GPU a key names (``__``-prefixed keys are library-wide calls)."""
    return None if key is None or key.startswith("__") else key


class BoundedCalls:
    """Runs calls on a thread pool, each bounded in time, at most one at a time per key.

    Holds the pool (a private one of 8 threads unless given; only a private one is shut down),
    ``call_timeout`` (real seconds) and, by key (a GPU's uuid, or a library-wide name beginning
    with ``__``), the call that timed out and may still run.

    Args:
        call_timeout: real seconds a call may take, > 0.
        executor: where calls run; a private thread pool by default.
    """

    def __init__(self, call_timeout: float, executor: Executor | None = None) -> None:
        if call_timeout <= 0:
            raise ValueError("call_timeout must be > 0")
        self.call_timeout = call_timeout
        self._owns_executor = executor is None
        self._executor: Executor = executor or ThreadPoolExecutor(
            max_workers=8, thread_name_prefix="kvgate-gpu"
        )
        self._late: dict[str, Future[Any]] = {}

    def late(self, key: str) -> Future[Any] | None:
        """The call for ``key`` that timed out, running or returned since; None when none."""
        return self._late.get(key)

    def discard(self, key: str) -> None:
        """Forget the timed-out call for ``key`` (its answer was read, or is stale)."""
        self._late.pop(key, None)

    def idle(self) -> bool:
        """Whether no timed-out call is still running."""
        return all(f.done() for f in self._late.values())

    def submit(self, key: str, fn: Callable[[], T]) -> Future[T] | None:
        """Start ``fn``, or return None when the previous call for ``key`` is still running."""
        pending = self._late.get(key)
        if pending is not None:
            if not pending.done():
                return None
            del self._late[key]  # its late answer is stale: discard it
        return self._executor.submit(fn)

    def run(self, key: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` and wait for it, within ``call_timeout``.

        Raises:
            GpuError: what ``fn`` raised, ``GpuTimeout`` (no answer in time, or the previous
                call for ``key`` still running) or ``GpuUnknownError`` (another exception).
        """
        fut = self.submit(key, fn)
        if fut is None:
            raise GpuTimeout("previous call still blocked")
        return self.wait(fut, time.monotonic() + self.call_timeout, key=key)

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` once, under no key (nothing is kept if it times out), within
        ``call_timeout``; raises as :meth:`run` does."""
        return self.wait(self._executor.submit(fn), None)

    def wait(self, fut: Future[T], deadline: float | None, key: str | None = None) -> T:
        """``fut``'s answer by ``deadline`` (``time.monotonic()`` seconds; None: within
        ``call_timeout`` from now); on a timeout, the call is kept under ``key`` (when given)
        until it returns. Raises as :meth:`run` does."""
        if deadline is None:
            deadline = time.monotonic() + self.call_timeout
        try:
            return fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            if key is not None:
                self._late[key] = fut
            raise GpuTimeout(f"no answer within {self.call_timeout:g}s", uuid=_uuid(key)) from None
        except GpuError:
            raise
        except Exception as exc:  # a backend bug must not take the agent down
            raise GpuUnknownError(f"{type(exc).__name__}: {exc}", uuid=_uuid(key)) from exc

    def shutdown(self) -> None:
        """Shut the private pool down (running calls are left to finish on their own)."""
        if self._owns_executor:
            self._executor.shutdown(wait=False, cancel_futures=True)
