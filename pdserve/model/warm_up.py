"""A warm-up asked of an engine thread: its forwards run once on dummy inputs before serving.

With ``--compile`` the first forward of each shape class (batch 1 or more, prefill with or without
an attention mask) compiles the model. An engine runs a warm-up on its own thread, through its real
forward path, so that the service compiles before it announces ready and serving traffic does not.
The caller waits for it; the engine thread runs it between its batches or steps.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable


class WarmUp:
    def __init__(self) -> None:
        self._done: concurrent.futures.Future[float] = concurrent.futures.Future()

    def run(self, warm_up: Callable[[], None]) -> None:
        """On the engine thread: runs ``warm_up`` and hands its duration or its error to the caller."""
        started = time.perf_counter()
        try:
            warm_up()
        except Exception as exc:
            self._done.set_exception(exc)
            return
        self._done.set_result(time.perf_counter() - started)

    def abandon(self, why: str) -> None:
        """The engine stopped before running it."""
        if not self._done.done():
            self._done.set_exception(RuntimeError(why))

    def wait(self) -> float:
        """Blocks until the engine ran it; its duration in seconds (or its error, raised)."""
        return self._done.result()
