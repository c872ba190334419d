"""Both roles end their background tasks with :func:`kvgate_agent.tasks.cancel_and_wait`."""

from __future__ import annotations

import asyncio

from kvgate_agent.tasks import cancel_and_wait


async def test_every_task_is_cancelled_and_awaited_and_none_is_skipped() -> None:
    async def forever() -> None:
        await asyncio.Event().wait()

    tasks = [asyncio.create_task(forever()) for _ in range(3)]
    await asyncio.sleep(0)
    await cancel_and_wait(tasks[0], None, *tasks[1:])
    assert all(t.cancelled() for t in tasks)
    await cancel_and_wait(None)  # nothing to do
    await cancel_and_wait(*tasks)  # already ended: nothing raised


async def test_a_task_that_already_finished_keeps_its_result() -> None:
    async def done() -> int:
        return 7

    task = asyncio.create_task(done())
    await asyncio.sleep(0)
    await cancel_and_wait(task)
    assert task.result() == 7
