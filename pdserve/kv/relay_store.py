"""The decode's end of a pair store (``pdserve.kv.pair_store``): a ``torch.distributed.Store`` whose
every operation is a ``PairStore`` call on the prefill, carrying the pair's owner (decode id and
secret) and generation. Gloo and NCCL build the decode's side of a pair through it exactly as
through any store; it runs on the pair's transfer thread, so its calls are blocking gRPC calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import grpc
import torch.distributed as dist

from pdserve.v1 import prefill_pb2, prefill_pb2_grpc

# How long past a wait's own timeout a call may take before the decode gives up on the prefill: the
# prefill answers a timed-out wait itself; a prefill that is stopped or gone never answers, and the
# pair's bound (the transfer timeout) must hold for it too.
ANSWER_MARGIN_S = 0.5
WAITING_OPS = frozenset({"wait", "get"})


class RelayStore(dist.Store):
    def __init__(
        self,
        stub: prefill_pb2_grpc.PrefillStub,
        decode_instance_id: str,
        secret: bytes,
        generation: int,
        timeout: timedelta,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self._prefix = prefix
        self._stub = stub
        self._decode = decode_instance_id
        self._secret = secret
        self._generation = generation
        self._timeout = timeout

    def _call(self, op: str, keys: Sequence[str], **fields: object) -> prefill_pb2.PairStoreResponse:
        wait_s = self._timeout.total_seconds()
        request = prefill_pb2.PairStoreRequest(
            decode_instance_id=self._decode,
            pair_secret=self._secret,
            pair_generation=self._generation,
            op=op,
            keys=[f"{self._prefix}/{key}" if self._prefix else key for key in keys],  # as PrefixStore
            timeout_s=wait_s,
            **fields,  # type: ignore[arg-type]
        )
        try:
            response: prefill_pb2.PairStoreResponse = self._stub.PairStore(
                request, timeout=wait_s + ANSWER_MARGIN_S if op in WAITING_OPS else wait_s
            )
        except grpc.RpcError as exc:
            raise RuntimeError(f"pair store {op} failed: {exc.code().name}: {exc.details()}") from None
        return response

    @staticmethod
    def _bytes(value: str | bytes) -> bytes:
        return value.encode() if isinstance(value, str) else bytes(value)

    def set(self, key: str, value: str | bytes) -> None:
        self._call("set", [key], value=self._bytes(value))

    def get(self, key: str) -> bytes:
        return self._call("get", [key]).value

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._call("wait", keys)

    def check(self, keys: list[str]) -> bool:
        return self._call("check", keys).ready

    def add(self, key: str, value: int) -> int:
        return self._call("add", [key], amount=value).number

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        return self._call(
            "compare_set", [key], expected=self._bytes(expected_value), value=self._bytes(desired_value)
        ).value

    def prefixed(self, prefix: str) -> RelayStore:
        """This store with every key under ``prefix`` (what ``PrefixStore`` does for C++ stores)."""
        return RelayStore(self._stub, self._decode, self._secret, self._generation, self._timeout, prefix)

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout
