"""Several response streams read at once, their items in the order they come.

``interleaved`` runs each stream in a task of its own and yields ``(position, item)`` as items
arrive, ``position`` being the stream's place in the list. It ends when every stream has ended; the
first error of any stream ends it with that error. Closing it (or its consumer going away) cancels
every stream still running, and each stream is closed, so that the work behind it is released.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Sequence
from typing import TypeVar

T = TypeVar("T")


async def interleaved(streams: Sequence[AsyncGenerator[T, None]]) -> AsyncGenerator[tuple[int, T], None]:
    queue: asyncio.Queue[tuple[int, T | Exception | None]] = asyncio.Queue()

    async def pump(position: int, stream: AsyncGenerator[T, None]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for item in stream:
                    await queue.put((position, item))
            await queue.put((position, None))
        except Exception as exc:  # handed to the consumer, which raises it
            await queue.put((position, exc))

    tasks = [asyncio.create_task(pump(position, stream)) for position, stream in enumerate(streams)]
    running = len(tasks)
    try:
        while running:
            position, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield position, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
