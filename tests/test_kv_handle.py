"""The KV handle module alone: what an issued handle carries and what a decode's check refuses."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from pdserve.kv.handle import (
    HANDLE_ID_BYTES,
    HANDLE_VERSION,
    HandleCheck,
    HandleIssuer,
    describe,
    is_handle_id,
    new_handle_id,
)
from pdserve.kv.layout import KvLayout
from pdserve.kv.transports import AUTO, GLOO, NCCL, SHM, Place
from pdserve.v1 import kv_pb2

LAYOUT = KvLayout(keys=((2, 4), (2, 4)), values=((2, 3), (2, 3)), dtype=torch.float32)


PREFILL = Place(host_id="h1", device="cpu")


@dataclass(frozen=True)
class Parked:
    handle_id: bytes
    num_tokens: int
    num_bytes: int
    expires_at_unix: float
    transports: tuple[str, ...] = (SHM, GLOO)


def issuer(rank: int = 0) -> HandleIssuer:
    return HandleIssuer("p:1", "prefill-a", "fp", LAYOUT, PREFILL, rank)


def issued(num_tokens: int = 5) -> kv_pb2.KvHandle:
    parked = Parked(new_handle_id(), num_tokens, LAYOUT.num_bytes(num_tokens), 123.5)
    return issuer(rank=1).issue(parked)


def test_an_issued_handle_carries_the_prefill_the_lease_and_every_tensor() -> None:
    handle = issued(5)
    assert handle.version == HANDLE_VERSION
    assert len(handle.id) == HANDLE_ID_BYTES and is_handle_id(handle.id)
    assert (handle.prefill_address, handle.prefill_instance_id, handle.rendezvous_address) == (
        "p:1",
        "prefill-a",
        "",  # unused: pairs meet through the prefill's PairStore call
    )
    assert (handle.backend, handle.model_fingerprint, handle.rank) == ("gloo", "fp", 1)
    assert (list(handle.transports), handle.host_id, handle.device) == ([SHM, GLOO], "h1", "cpu")
    assert (handle.num_tokens, handle.num_bytes, handle.expires_at_unix) == (5, LAYOUT.num_bytes(5), 123.5)
    assert [t.name for t in handle.tensors] == [s.name for s in LAYOUT.tensor_specs(5)]
    assert [tuple(t.shape) for t in handle.tensors] == [s.shape for s in LAYOUT.tensor_specs(5)]
    assert handle.id.hex() in describe(handle) and "p:1" in describe(handle)


def test_ids_are_random_and_of_one_length() -> None:
    ids = {new_handle_id() for _ in range(100)}
    assert len(ids) == 100
    assert not is_handle_id(b"") and not is_handle_id(b"x" * (HANDLE_ID_BYTES + 1))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("version", HANDLE_VERSION + 1, "version"),
        ("version", 0, "version"),
        ("model_fingerprint", "other", "fingerprint"),
        ("backend", "nccl", "backend"),
        ("num_tokens", 0, "no tokens"),
        ("num_bytes", 1, "size"),
    ],
)
def test_the_check_refuses_what_this_decode_cannot_use(field: str, value: object, message: str) -> None:
    check = HandleCheck("fp", LAYOUT)
    handle = issued(5)
    assert check.problem(handle) is None
    setattr(handle, field, value)
    problem = check.problem(handle)
    assert problem is not None and message in problem


def test_the_check_picks_a_transport_both_ends_can_use() -> None:
    handle = issued(5)
    assert HandleCheck("fp", LAYOUT, AUTO, Place("h1", "cpu")).transport(handle) == SHM
    assert HandleCheck("fp", LAYOUT, AUTO, Place("h2", "cpu")).transport(handle) == GLOO
    assert HandleCheck("fp", LAYOUT, GLOO, Place("h1", "cpu")).transport(handle) == GLOO
    refused = HandleCheck("fp", LAYOUT, NCCL, Place("h1", "cuda:0"))
    assert refused.transport(handle) is None and "transports" in (refused.problem(handle) or "")


def test_the_check_refuses_another_layout() -> None:
    check = HandleCheck("fp", LAYOUT)
    handle = issued(5)
    handle.tensors[3].shape[2] += 1
    assert "layout" in (check.problem(handle) or "")
    handle = issued(5)
    handle.tensors[0].dtype = "no-such-dtype"
    assert "no-such-dtype" in (check.problem(handle) or "")
