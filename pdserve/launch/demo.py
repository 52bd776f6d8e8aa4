"""The demo request ``pdserve up --demo`` streams to the terminal once the stack is up."""

from __future__ import annotations

import logging
import threading
from typing import Any, TextIO

import grpc

from pdserve import client
from pdserve.rpc.channel_security import PLAIN, ChannelSecurity
from pdserve.v1 import gateway_pb2_grpc

logger = logging.getLogger(__name__)

DEMO_MAX_TOKENS = 64
THREAD_JOIN_S = 2.0


class Demo:
    """Streams one greedy chat request through the gateway to ``out``, on its own thread."""

    def __init__(
        self,
        address: str,
        prompt: str,
        out: TextIO,
        out_lock: threading.Lock,
        security: ChannelSecurity = PLAIN,
    ) -> None:
        """``security``: how to call the gateway (its API key, TLS)."""
        self._address = address
        self._security = security
        self._prompt = prompt
        self._out = out
        self._out_lock = out_lock
        self._channel: Any = None
        self._cancelled = False
        self._thread = threading.Thread(target=self._run, name="pdserve-demo", daemon=True)

    def start(self) -> None:
        self._channel = self._security.channel(self._address)
        self._thread.start()

    def cancel(self) -> None:
        self._cancelled = True
        if self._channel is not None:
            self._channel.close()
        if self._thread.is_alive():
            self._thread.join(THREAD_JOIN_S)

    def _write(self, text: str) -> None:
        with self._out_lock:
            self._out.write(text)
            self._out.flush()

    def _run(self) -> None:
        request = client.build_request(
            prompt=self._prompt, chat=True, temperature=0.0, max_tokens=DEMO_MAX_TOKENS
        )
        stub = gateway_pb2_grpc.GatewayStub(self._channel)
        self._write(f"demo> {self._prompt}\n")
        try:
            for response in stub.Generate(request):
                self._write(response.text)
            self._write("\n")
        except (grpc.RpcError, ValueError) as error:  # ValueError: the channel closed under the call
            if self._cancelled:
                return
            code = error.code().name if isinstance(error, grpc.Call) else type(error).__name__
            details = error.details() if isinstance(error, grpc.Call) else str(error)
            self._write("\n")
            logger.error("demo request failed: %s: %s", code, details)
