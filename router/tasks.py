"""Long-lived background tasks that cannot die silently."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Coroutine, TypeVar

log = logging.getLogger("hotswap")
T = TypeVar("T")


def spawn(coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
    """create_task, plus an ERROR with the traceback if the task ever ends on an exception:
    a scheduler loop or a watch that stopped would otherwise leave nothing but silence."""
    task = asyncio.create_task(coro, name=name)
    task.add_done_callback(_report_crash)
    return task


def _report_crash(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("task %s stopped on an unexpected error", task.get_name(), exc_info=task.exception())
