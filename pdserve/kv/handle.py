"""The KV handle: a prefill's lease on one parked KV, and the contract between prefill and decode.

Lifecycle of a handle:
1. a prefill makes one ``HandleIssuer`` for its life: its gRPC address, instance id, where it keeps KV (``pdserve.kv.transports.Place``), model fingerprint, expert-parallel
   rank and KV layout;
2. each KV it parks gets a handle (``HandleIssuer.issue``): a fresh random id of
   ``HANDLE_ID_BYTES``, the token count, the packed size, the lease deadline, the shape and dtype
   of every tensor and the transports it can be moved by, under ``HANDLE_VERSION``;
3. the handle travels prefill -> gateway -> decode inside gRPC messages;
4. before it opens any connection, the decode checks every field (``HandleCheck``): the form of
   the id, the prefill's address and instance id, the transports, the shared-memory domain, device,
   rank and lease (a malformed handle: ``malformed``, INVALID_ARGUMENT), then against its own model
   and place: version, fingerprint, backend, token count, tensors, size and a transport both ends
   can use (``problem``: a decode refuses what it cannot use with FAILED_PRECONDITION);
5. the decode redeems it on the prefill named in it (PullKv/PullKvMany by id); a prefill that
   has torn the pair's generation down answers ABORTED with the lowest generation it takes in the
   trailing metadata ``MIN_GENERATION_METADATA``.
"""

from __future__ import annotations

import functools
import math
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pdserve.kv.layout import KvLayout, spec_from_proto
from pdserve.kv.pair_secret import MAX_DECODE_ID_CHARS, is_owner_id
from pdserve.kv.transports import AUTO, CUDA_IPC, GLOO, NCCL, SHM, Place, choose, network_backend
from pdserve.v1 import kv_pb2

HANDLE_VERSION = 2
HANDLE_ID_BYTES = 16
# Trailing metadata of a pull refused with ABORTED: the lowest pair generation the prefill takes.
MIN_GENERATION_METADATA = "pdserve-min-pair-generation"
MAX_CACHED_LAYOUTS = 4096
CPU_PLACE = Place(host_id="", device="cpu")
MAX_ADDRESS_CHARS = 255
MAX_RANK = 4095
MAX_ID_CHARS = 128
_TRANSPORTS = (SHM, CUDA_IPC, NCCL, GLOO)
_HOST_ID = re.compile(r"[0-9a-f]{0,64}")
_DEVICE = re.compile(r"cpu|cuda(:[0-9]{1,3})?")


def address_problem(address: str) -> str | None:
    """Why ``address`` is not a ``host:port`` a decode can dial, or None."""
    if not address or len(address) > MAX_ADDRESS_CHARS or not address.isprintable() or " " in address:
        return f"must be host:port, 1 to {MAX_ADDRESS_CHARS} characters"
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        return "must be host:port with a port in [1, 65535]"
    if host.startswith("[") != host.endswith("]"):
        return "an IPv6 host must be in brackets"
    return None


def malformed(handle: kv_pb2.KvHandle) -> str | None:
    """Why a handle's fields are malformed whatever the decode (INVALID_ARGUMENT), or None."""
    if not is_handle_id(handle.id):
        return f"kv_handle.id must be {HANDLE_ID_BYTES} bytes"
    problem = address_problem(handle.prefill_address)
    if problem is not None:
        return f"kv_handle.prefill_address {problem}"
    if not is_owner_id(handle.prefill_instance_id):
        return f"kv_handle.prefill_instance_id must be 1 to {MAX_DECODE_ID_CHARS} letters, digits, '.', '_' or '-'"
    if handle.rendezvous_address:
        return "kv_handle.rendezvous_address must be empty"
    if not handle.transports or len(handle.transports) > len(_TRANSPORTS):
        return f"kv_handle.transports must name 1 to {len(_TRANSPORTS)} transports"
    if any(t not in _TRANSPORTS for t in handle.transports):
        return f"kv_handle.transports must be among {list(_TRANSPORTS)}"
    if not _HOST_ID.fullmatch(handle.host_id):
        return "kv_handle.host_id must be lowercase hex (at most 64 digits)"
    if not _DEVICE.fullmatch(handle.device):
        return "kv_handle.device must be 'cpu' or 'cuda:N'"
    if len(handle.device_uuid) > MAX_ID_CHARS or not handle.device_uuid.isprintable():
        return f"kv_handle.device_uuid must be at most {MAX_ID_CHARS} printable characters"
    if handle.rank > MAX_RANK:
        return f"kv_handle.rank must be <= {MAX_RANK}"
    if not math.isfinite(handle.expires_at_unix) or handle.expires_at_unix < 0:
        return "kv_handle.expires_at_unix must be a finite time"
    if len(handle.tensors) > 2 * 4096:
        return "kv_handle has too many tensors"
    if handle.block_ids and handle.block_size < 1:
        return "kv_handle.block_size must be >= 1 when it lists block_ids"
    if len(handle.block_ids) * handle.block_size > handle.num_tokens:
        return "kv_handle.block_ids must cover at most its num_tokens"
    return None


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

    def issue(self, parked: Parked, block_size: int = 0, block_ids: Sequence[int] = ()) -> kv_pb2.KvHandle:
        """The handle of ``parked``; ``block_ids``: the prefix-cache blocks of ``block_size`` tokens
        holding its first positions' KV (``KvHandle.block_ids``)."""
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
        if block_ids:
            handle.block_size = block_size
            handle.block_ids.extend(block_ids)
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
