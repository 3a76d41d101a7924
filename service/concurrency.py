"""Small asyncio helpers shared by the jobs."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


async def gather_or_cancel(*aws: Awaitable[T]) -> list[T]:
    """``asyncio.gather`` that, when one awaitable fails, cancels the others
    and waits for them before raising that first error (unwrapped, unlike a
    TaskGroup). Plain gather leaves the siblings running: orphaned uploads
    that outlive their job (a retry then races them) and, at shutdown, the
    store they use."""
    tasks = [asyncio.ensure_future(aw) for aw in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def for_each_bounded(
    items: Iterable[T], width: int, work: Callable[[T], Awaitable[None]]
) -> None:
    """Run ``work`` over ``items`` with at most ``width`` at a time, without
    creating a task per item (a manifest may list 100 000 files). The first
    error cancels the rest and is raised, as by ``gather_or_cancel``."""
    iterator: Iterator[T] = iter(items)

    async def worker() -> None:
        for item in iterator:
            await work(item)

    await gather_or_cancel(*(worker() for _ in range(max(1, width))))
