"""The backend addresses a supervisor hands to a gateway started beside its backends.

Replicas choose their ports when they bind, seconds into their start; a gateway given
``--backends-from-stdin`` loads its tokenizer and model limits meanwhile, then reads one line from its
stdin, a JSON object ``{"prefill": [ADDRESS, ...], "decode": [ADDRESS, ...]}``, and only then builds
its backend pools and serves. The addresses are checked as ``--prefill`` and ``--decode`` are.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Sequence
from dataclasses import replace
from typing import TextIO

from pdserve.config.services import GatewayConfig

KEYS = ("prefill", "decode")


def backend_line(prefill: Sequence[str], decode: Sequence[str]) -> str:
    """The line that hands ``prefill`` and ``decode`` to the gateway (ends with a newline)."""
    return json.dumps({"prefill": list(prefill), "decode": list(decode)}) + "\n"


def with_backend_line(config: GatewayConfig, line: str) -> GatewayConfig:
    """``config`` with the addresses of ``line``; ``ValueError`` says what is wrong with it."""
    if not line:
        raise ValueError("stdin ended before the line of backend addresses")
    try:
        message = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"the line of backend addresses is not JSON ({error}): {line[:200]!r}") from None
    if (
        not isinstance(message, dict)
        or set(message) != set(KEYS)
        or not all(isinstance(v, list) and all(isinstance(a, str) for a in v) for v in message.values())
    ):
        raise ValueError(
            'the line of backend addresses must be {"prefill": [ADDRESS, ...], "decode": [ADDRESS, ...]}, '
            f"got {line[:200]!r}"
        )
    return replace(
        config, prefill=tuple(message["prefill"]), decode=tuple(message["decode"]), backends_from_stdin=False
    )


async def read_backend_line(config: GatewayConfig, stream: TextIO) -> GatewayConfig:
    """``config`` with the addresses of the next line of ``stream``, read on a daemon thread (a process
    stopped while it waits for the line does not wait for the thread)."""
    loop = asyncio.get_running_loop()
    line: asyncio.Future[str] = loop.create_future()

    def settle(text: str, error: BaseException | None) -> None:
        if line.done():
            return
        if error is not None:
            line.set_exception(error)
        else:
            line.set_result(text)

    def read() -> None:
        text, error = "", None
        try:
            text = stream.readline()
        except Exception as exc:  # handed to the waiting coroutine
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, text, error)

    threading.Thread(target=read, name="backend-line", daemon=True).start()
    return with_backend_line(config, await line)
