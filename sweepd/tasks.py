"""The tasks the daemon starts, none of which may end unobserved.

asyncio keeps the exception of a task nobody awaits until the task is
collected, and then at best prints it. A claim call or a close batch that
died that way would leave its flights waiting forever while the replica
looks healthy. Every task the daemon starts for itself goes through
``spawn``, which holds it until it ends and logs how it failed, if it did.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from sweepd.observe import get_logger

T = TypeVar("T")

_running: set[asyncio.Task[Any]] = set()  # held, so a task is not collected mid-flight


def spawn(coroutine: Coroutine[Any, Any, T], *, name: str) -> asyncio.Task[T]:
    task = asyncio.get_running_loop().create_task(coroutine, name=name)
    _running.add(task)
    task.add_done_callback(_ended)
    return task


def _ended(task: asyncio.Task[Any]) -> None:
    _running.discard(task)
    if task.cancelled():
        return
    error = task.exception()
    if error is not None:
        get_logger().error(
            "daemon.task_crashed",
            task=task.get_name(),
            error=f"{type(error).__name__}: {error}",
            exc_info=error,
        )
