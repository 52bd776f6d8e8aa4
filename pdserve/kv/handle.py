"""The KV handle: a prefill's lease on one parked KV, and the contract between prefill and decode.

Lifecycle of a handle:
1. a prefill makes one ``HandleIssuer`` for its life: its gRPC address, instance id, where it keeps KV (``pdserve.kv.transports.Place``), model fingerprint, expert-parallel
   rank and KV layout;
2. each KV it parks gets a handle (``HandleIssuer.issue``): a fresh random id of
   ``HANDLE_ID_BYTES``, the token count, the packed size, the lease deadline, the shape and dtype
   of every tensor and the transports it can be moved by, under ``HANDLE_VERSION``;
3. the handle travels prefill -> gateway -> decode inside gRPC messages;
4. before any byte moves, the decode checks it against its own model and place (``HandleCheck``):
   version, fingerprint, backend, token count, tensors, size and a transport both ends can use;
   a decode refuses what it cannot use with FAILED_PRECONDITION;
5. the decode redeems it on the prefill named in it (PullKv/PullKvMany by id); a prefill that
   has torn the pair's generation down answers ABORTED with the lowest generation it takes in the
   trailing metadata ``MIN_GENERATION_METADATA``.
"""

from __future__ import annotations

import functools
import secrets
from dataclasses import dataclass
from typing import Protocol

from pdserve.kv.layout import KvLayout, spec_from_proto
from pdserve.kv.transports import AUTO, Place, choose, network_backend
from pdserve.v1 import kv_pb2

HANDLE_VERSION = 2
HANDLE_ID_BYTES = 16
# Trailing metadata of a pull refused with ABORTED: the lowest pair generation the prefill takes.
MIN_GENERATION_METADATA = "pdserve-min-pair-generation"
MAX_CACHED_LAYOUTS = 4096
CPU_PLACE = Place(host_id="", device="cpu")


def new_handle_id() -> bytes:
    return secrets.token_bytes(HANDLE_ID_BYTES)


def is_handle_id(value: bytes) -> bool:
    return len(value) == HANDLE_ID_BYTES


def describe(handle: kv_pb2.KvHandle) -> str:
    """A handle in one line, for logs (never for clients)."""
    return (
        f"KV {handle.id.hex()} ({handle.num_tokens} tokens, {handle.num_bytes} bytes) on "
        f"{handle.prefill_address} rank {handle.rank}"
    )


class Parked(Protocol):
    """What a handle is issued for: a KV parked under a lease."""

    @property
    def handle_id(self) -> bytes: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_bytes(self) -> int: ...
    @property
    def expires_at_unix(self) -> float: ...
    @property
    def transports(self) -> tuple[str, ...]: ...


@dataclass(frozen=True)
class HandleIssuer:
    """Issues the handles of one prefill process (or one rank of a prefill group)."""

    prefill_address: str
    prefill_instance_id: str
    model_fingerprint: str
    layout: KvLayout
    place: Place = CPU_PLACE
    rank: int = 0

    def issue(self, parked: Parked) -> kv_pb2.KvHandle:
        handle = kv_pb2.KvHandle(
            version=HANDLE_VERSION,
            id=parked.handle_id,
            prefill_address=self.prefill_address,
            prefill_instance_id=self.prefill_instance_id,
            backend=network_backend(self.place.device),
            model_fingerprint=self.model_fingerprint,
            num_tokens=parked.num_tokens,
            num_bytes=parked.num_bytes,
            expires_at_unix=parked.expires_at_unix,
            rank=self.rank,
            transports=parked.transports,
            host_id=self.place.host_id,
            device=self.place.device,
            device_uuid=self.place.device_uuid,
        )
        handle.MergeFrom(self._tensors(parked.num_tokens))
        return handle

    @functools.lru_cache(maxsize=512)  # noqa: B019 (an issuer lives as long as its prefill)
    def _tensors(self, num_tokens: int) -> kv_pb2.KvHandle:
        """A handle holding only the tensor specs of ``num_tokens`` tokens (merged into each one)."""
        return kv_pb2.KvHandle(tensors=[spec.to_proto() for spec in self.layout.tensor_specs(num_tokens)])


def prefill_place(handle: kv_pb2.KvHandle) -> Place:
    """Where the handle's prefill keeps the KV."""
    return Place(handle.host_id, handle.device, handle.device_uuid)


class HandleCheck:
    """Whether one decode can use a handle's KV, and over which transport; the expected tensors per
    token count are kept for the fast path."""

    def __init__(
        self, fingerprint: str, layout: KvLayout, kv_backend: str = AUTO, place: Place = CPU_PLACE
    ) -> None:
        self._fingerprint = fingerprint
        self._layout = layout
        self._kv_backend = kv_backend
        self._place = place
        self._expected: dict[int, list[kv_pb2.TensorSpec]] = {}

    def transport(self, handle: kv_pb2.KvHandle) -> str | None:
        """The transport this decode takes the handle's KV by, or None when none fits."""
        return choose(self._kv_backend, self._place, handle.transports, prefill_place(handle))

    def problem(self, handle: kv_pb2.KvHandle) -> str | None:
        """Why this decode cannot use the handle's KV, or None when it can."""
        if handle.version != HANDLE_VERSION:
            return (
                f"KV handle version {handle.version} is not the version this decode reads ({HANDLE_VERSION})"
            )
        if handle.model_fingerprint != self._fingerprint:
            return f"model fingerprint {handle.model_fingerprint!r} differs from this decode's {self._fingerprint!r}"
        if handle.backend != network_backend(handle.device):
            return f"KV backend {handle.backend!r} does not fit a KV parked on {handle.device!r}"
        if self.transport(handle) is None:
            return (
                f"none of the KV's transports {list(handle.transports)} reaches this decode "
                f"(--kv-backend {self._kv_backend}, device {self._place.device})"
            )
        if handle.num_tokens < 1:
            return "KV handle holds no tokens"
        if self._matches_exactly(handle):
            return None
        try:
            theirs = [spec_from_proto(t) for t in handle.tensors]
        except ValueError as exc:
            return str(exc)
        if theirs != self._layout.tensor_specs(handle.num_tokens):
            return "KV layout (tensor names, shapes or dtypes) differs from this decode's model"
        expected = self._layout.num_bytes(handle.num_tokens)
        if handle.num_bytes != expected:
            return f"KV size {handle.num_bytes} differs from the {expected} expected"
        return None

    def _matches_exactly(self, handle: kv_pb2.KvHandle) -> bool:
        expected = self._expected.get(handle.num_tokens)
        if expected is None:
            if len(self._expected) >= MAX_CACHED_LAYOUTS:
                self._expected.clear()
            expected = [spec.to_proto() for spec in self._layout.tensor_specs(handle.num_tokens)]
            self._expected[handle.num_tokens] = expected
        return (
            handle.num_bytes == self._layout.num_bytes(handle.num_tokens) and list(handle.tensors) == expected
        )
