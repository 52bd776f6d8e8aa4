"""Unit tests of pdserve.kv.channel: both sides of a PairChannel in one process.

Each channel runs its operations on its own worker thread, so the prefill side (rank 0, hosting
the TCPStore) and the decode side (rank 1, a client of that store) can talk within one test.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from pdserve.kv.channel import (
    DECODE_RANK,
    GLOO_STREAMS,
    MIN_CHUNK_BYTES,
    PREFILL_RANK,
    ChannelState,
    PairChannel,
    TransferError,
    chunks,
    transfer_device,
)
from pdserve.kv.rendezvous import connect_store, host_store, pair_prefix

pytestmark = pytest.mark.timeout(60)

TIMEOUT_S = 2.0
TIMEOUT = timedelta(seconds=TIMEOUT_S)
RESULT_S = 20.0  # bound on waiting for a future; every channel wait is bounded by TIMEOUT
CPU = torch.device("cpu")
HOST = "127.0.0.1"


@pytest.fixture
def stores() -> Iterator[tuple[dist.TCPStore, dist.Store]]:
    server = host_store(HOST, 0, TIMEOUT)
    client = connect_store(f"{HOST}:{server.port}", TIMEOUT)
    yield server, client


@pytest.fixture
def channels() -> Iterator[list[PairChannel]]:
    """Every channel a test creates; all closed at the end."""
    made: list[PairChannel] = []
    yield made
    for channel in made:
        channel.close()


def _pair(
    stores: tuple[dist.TCPStore, dist.Store],
    channels: list[PairChannel],
    generation: int = 0,
    backend: str = "gloo",
    prefill_device: torch.device = CPU,
    decode_device: torch.device = CPU,
) -> tuple[PairChannel, PairChannel]:
    server, client = stores
    prefix = pair_prefix("prefill-a", "decode-b", generation)
    prefill = PairChannel(server, prefix, PREFILL_RANK, backend, prefill_device, HOST, TIMEOUT)
    decode = PairChannel(client, prefix, DECODE_RANK, backend, decode_device, HOST, TIMEOUT)
    channels += [prefill, decode]
    return prefill, decode


def _payload(num_bytes: int, seed: int, device: torch.device = CPU) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=g).to(device)


def _exchange(sender: PairChannel, receiver: PairChannel, sizes: list[int], seed: int = 0) -> None:
    """Posts every receive then every send, and checks each buffer arrived intact."""
    device = receiver.device
    sent = [_payload(n, seed + i, sender.device) for i, n in enumerate(sizes)]
    received = [torch.zeros(n, dtype=torch.uint8, device=device) for n in sizes]
    recv_futures = [receiver.recv(buf) for buf in received]
    send_futures = [sender.send(buf) for buf in sent]
    for future in [*send_futures, *recv_futures]:
        assert future.result(timeout=RESULT_S) is None
    for src, dst in zip(sent, received, strict=True):
        assert torch.equal(src.cpu(), dst.cpu())


# --- helpers of the module -----------------------------------------------------------------------


def test_pair_prefix_names_both_instances_and_the_generation() -> None:
    assert pair_prefix("p1", "d7", 3) == "pdserve/kv/p1/d7/3/"
    assert pair_prefix("p1", "d7", 3) != pair_prefix("p1", "d7", 4)


def test_ranks() -> None:
    assert (PREFILL_RANK, DECODE_RANK) == (0, 1)


def test_transfer_device() -> None:
    assert transfer_device("gloo", CPU) == CPU
    assert transfer_device("gloo", torch.device("cuda:1")) == CPU
    assert transfer_device("gloo", torch.device("meta")) == CPU
    assert transfer_device("nccl", torch.device("cuda:1")) == torch.device("cuda:1")
    with pytest.raises(ValueError, match=r"nccl backend needs a CUDA device, got cpu"):
        transfer_device("nccl", CPU)
    with pytest.raises(ValueError, match=r"unknown KV backend 'mpi'"):
        transfer_device("mpi", CPU)


@pytest.mark.parametrize(
    ("num_bytes", "streams", "count"),
    [
        (0, 4, 1),
        (1, 4, 1),
        (2 * MIN_CHUNK_BYTES - 1, 4, 1),
        (2 * MIN_CHUNK_BYTES, 4, 2),
        (3 * MIN_CHUNK_BYTES + 5, 4, 3),
        (64 * MIN_CHUNK_BYTES + 3, 4, 4),
        (64 * MIN_CHUNK_BYTES + 3, 1, 1),
    ],
)
def test_chunks_cover_the_buffer_once_in_order(num_bytes: int, streams: int, count: int) -> None:
    buf = torch.empty(num_bytes, dtype=torch.uint8)
    parts = chunks(buf, streams)
    assert len(parts) == count
    assert sum(p.numel() for p in parts) == num_bytes
    offset = 0
    for part in parts:
        assert part.is_contiguous()
        assert part.data_ptr() == buf.data_ptr() + offset  # views, back to back, no copy
        offset += part.numel()
    assert max(p.numel() for p in parts) - min(p.numel() for p in parts) <= 1
    assert chunks(buf, streams)[0].numel() == parts[0].numel()  # both sides cut the same way


def test_a_channel_moves_host_tensors_under_gloo(stores: tuple[dist.TCPStore, dist.Store]) -> None:
    server, _ = stores
    channel = PairChannel(
        server, pair_prefix("p", "d", 0), PREFILL_RANK, "gloo", torch.device("meta"), HOST, TIMEOUT
    )
    try:
        assert channel.device == CPU
        assert channel.peer == DECODE_RANK
        assert channel.state is ChannelState.CREATED
        assert channel.is_usable
    finally:
        channel.close()


# --- transfers -----------------------------------------------------------------------------------


def test_sends_arrive_intact_and_in_order(
    stores: tuple[dist.TCPStore, dist.Store], channels: list[PairChannel]
) -> None:
    prefill, decode = _pair(stores, channels)
    assert prefill.state is ChannelState.CREATED
    assert decode.state is ChannelState.CREATED
    _exchange(prefill, decode, [1, 4096, 64, 100_003, 7])
    assert prefill.state is ChannelState.READY
    assert decode.state is ChannelState.READY
    # The group stays up: a second batch reuses it, in order again.
    _exchange(prefill, decode, [333, 5, 70_000], seed=100)
    assert prefill.state is ChannelState.READY
    assert decode.state is ChannelState.READY


def test_large_buffers_split_over_every_connection_arrive_intact_and_in_order(
    stores: tuple[dist.TCPStore, dist.Store], channels: list[PairChannel]
) -> None:
    prefill, decode = _pair(stores, channels)
    large = GLOO_STREAMS * MIN_CHUNK_BYTES + 12_345  # one chunk per connection
    assert len(chunks(torch.empty(large, dtype=torch.uint8), GLOO_STREAMS)) == GLOO_STREAMS
    # Chunked and whole buffers interleaved: each lands in its own buffer, in posting order.
    _exchange(prefill, decode, [large, 3, 2 * MIN_CHUNK_BYTES + 1, large + 1, 70_000])
    _exchange(decode, prefill, [large], seed=50)
    assert prefill.state is ChannelState.READY
    assert decode.state is ChannelState.READY


def test_a_large_receive_without_a_send_times_out_within_the_bound(
    stores: tuple[dist.TCPStore, dist.Store], channels: list[PairChannel]
) -> None:
    prefill, decode = _pair(stores, channels)
    _exchange(prefill, decode, [64])
    start = time.monotonic()
    future = decode.recv(torch.zeros(GLOO_STREAMS * MIN_CHUNK_BYTES, dtype=torch.uint8))
    with pytest.raises(TransferError, match=r"recv"):
        future.result(timeout=RESULT_S)
    assert time.monotonic() - start < TIMEOUT_S + 1.5  # every chunk waits within one bound
    assert decode.state is ChannelState.BROKEN


def test_transfers_run_in_both_directions(
    stores: tuple[dist.TCPStore, dist.Store], channels: list[PairChannel]
) -> None:
    prefill, decode = _pair(stores, channels)
    _exchange(prefill, decode, [128], seed=1)
    _exchange(decode, prefill, [256, 3], seed=2)
    _exchange(prefill, decode, [9], seed=3)


def test_sends_posted_before_receives_wait_for_them(
    stores: tuple[dist.TCPStore, dist.Store], channels: list[PairChannel]
) -> None:
    prefill, decode = _pair(stores, channels)
    sent = [_payload(n, i) for i, n in enumerate((10, 20_000, 30))]
    send_futures = [prefill.send(buf) for buf in sent]
    time.sleep(0.2)
    received = [torch.zeros_like(buf) for buf in sent]
    recv_futures = [decode.recv(buf) for buf in received]
    for future in [*send_futures, *recv_futures]:
        future.result(timeout=RESULT_S)
    for src, dst in zip(sent, received, strict=True):
        assert torch.equal(src, dst)


def test_a_send_without_a_receive_times_out_and_breaks_the_channel(
    stores: tuple[dist.TCPStore, dist.Store], channels: list[PairChannel]
) -> None:
    prefill, decode = _pair(stores, channels)
    _exchange(prefill, decode, [64])  # the group is up

    start = time.monotonic()
    first = prefill.send(_payload(512, 1))
    queued = prefill.send(_payload(512, 2))  # posted behind the one that will fail
    with pytest.raises(TransferError, match=r"send"):
        first.result(timeout=RESULT_S)
    assert time.monotonic() - start < TIMEOUT_S + 3
    assert prefill.state is ChannelState.BROKEN
    assert not prefill.is_usable
    # The operation queued behind the failure fails at once, without a second timeout.
    with pytest.raises(TransferError, match=r"broken"):
        queued.result(timeout=RESULT_S)
    assert time.monotonic() - start < TIMEOUT_S + 3

    # A broken channel refuses new operations up front.
    with pytest.raises(TransferError, match=r"is broken"):
        prefill.send(_payload(8, 3))
    with pytest.raises(TransferError, match=r"is broken"):
        prefill.recv(torch.zeros(8, dtype=torch.uint8))
    # close() keeps it broken rather than closed.
    prefill.close()
    assert prefill.state is ChannelState.BROKEN


def test_a_recv_without_a_send_times_out_and_breaks_the_channel(
    stores: tuple[dist.TCPStore, dist.Store], channels: list[PairChannel]
) -> None:
    prefill, decode = _pair(stores, channels)
    _exchange(prefill, decode, [64])
    start = time.monotonic()
    future = decode.recv(torch.zeros(32, dtype=torch.uint8))
    with pytest.raises(TransferError, match=r"recv"):
        future.result(timeout=RESULT_S)
    assert time.monotonic() - start < TIMEOUT_S + 3
    assert decode.state is ChannelState.BROKEN
    assert prefill.state is ChannelState.READY


def test_a_peer_that_never_connects_fails_within_the_timeout(
    stores: tuple[dist.TCPStore, dist.Store], channels: list[PairChannel]
) -> None:
    prefill, _ = _pair(stores, channels)  # the decode side never runs an operation
    start = time.monotonic()
    future = prefill.send(_payload(16, 0))
    with pytest.raises(TransferError):
        future.result(timeout=RESULT_S)
    assert time.monotonic() - start < TIMEOUT_S + 3
    assert prefill.state is ChannelState.BROKEN


def test_a_new_generation_works_after_a_failure_on_the_same_store(
    stores: tuple[dist.TCPStore, dist.Store], channels: list[PairChannel]
) -> None:
    prefill, decode = _pair(stores, channels, generation=4)
    _exchange(prefill, decode, [64])
    with pytest.raises(TransferError):
        prefill.send(_payload(128, 0)).result(timeout=RESULT_S)
    assert prefill.state is ChannelState.BROKEN
    prefill.close()
    decode.close()

    prefill2, decode2 = _pair(stores, channels, generation=5)
    assert prefill2.prefix == pair_prefix("prefill-a", "decode-b", 5)
    _exchange(prefill2, decode2, [128, 1, 50_000], seed=7)
    assert prefill2.state is ChannelState.READY
    assert decode2.state is ChannelState.READY


def test_close_makes_every_later_operation_fail(
    stores: tuple[dist.TCPStore, dist.Store], channels: list[PairChannel]
) -> None:
    prefill, decode = _pair(stores, channels)
    _exchange(prefill, decode, [16])
    prefill.close()
    assert prefill.state is ChannelState.CLOSED
    assert not prefill.is_usable
    with pytest.raises(TransferError, match=r"is closed"):
        prefill.send(_payload(16, 0))
    with pytest.raises(TransferError, match=r"is closed"):
        prefill.recv(torch.zeros(16, dtype=torch.uint8))
    prefill.close()  # idempotent
    assert prefill.state is ChannelState.CLOSED


def test_close_during_a_wait_ends_it_by_the_timeout_and_stays_closed(
    stores: tuple[dist.TCPStore, dist.Store], channels: list[PairChannel]
) -> None:
    prefill, _ = _pair(stores, channels)  # the decode side never connects
    start = time.monotonic()
    future = prefill.send(_payload(16, 0))
    time.sleep(0.2)
    prefill.close()
    assert prefill.state is ChannelState.CLOSED
    with pytest.raises(TransferError):
        future.result(timeout=RESULT_S)
    assert time.monotonic() - start < TIMEOUT_S + 3
    assert prefill.state is ChannelState.CLOSED  # a failure after close() does not turn it broken


def test_close_before_any_operation(stores: tuple[dist.TCPStore, dist.Store]) -> None:
    server, _ = stores
    channel = PairChannel(server, pair_prefix("p", "d", 0), PREFILL_RANK, "gloo", CPU, HOST, TIMEOUT)
    channel.close()
    assert channel.state is ChannelState.CLOSED
    with pytest.raises(TransferError, match=r"^channel pdserve/kv/p/d/0/ is closed$"):
        channel.send(torch.zeros(4, dtype=torch.uint8))


# --- buffer checks -------------------------------------------------------------------------------


def test_buffers_on_the_wrong_device_are_refused(stores: tuple[dist.TCPStore, dist.Store]) -> None:
    server, _ = stores
    channel = PairChannel(server, pair_prefix("p", "d", 0), PREFILL_RANK, "gloo", CPU, HOST, TIMEOUT)
    try:
        wrong = torch.empty(16, dtype=torch.uint8, device="meta")
        with pytest.raises(ValueError, match=r"^send buffer is on meta, the channel moves cpu tensors$"):
            channel.send(wrong)
        with pytest.raises(ValueError, match=r"^recv buffer is on meta"):
            channel.recv(wrong)
        assert channel.state is ChannelState.CREATED  # a refused buffer does not break the channel
    finally:
        channel.close()


def test_non_contiguous_buffers_are_refused(stores: tuple[dist.TCPStore, dist.Store]) -> None:
    server, _ = stores
    channel = PairChannel(server, pair_prefix("p", "d", 0), PREFILL_RANK, "gloo", CPU, HOST, TIMEOUT)
    try:
        strided = torch.zeros(16, 2, dtype=torch.uint8)[:, 0]
        assert not strided.is_contiguous()
        with pytest.raises(ValueError, match=r"^send buffer must be contiguous$"):
            channel.send(strided)
        with pytest.raises(ValueError, match=r"^recv buffer must be contiguous$"):
            channel.recv(strided)
        assert channel.state is ChannelState.CREATED
    finally:
        channel.close()


def test_an_nccl_channel_needs_a_cuda_device(stores: tuple[dist.TCPStore, dist.Store]) -> None:
    server, _ = stores
    with pytest.raises(ValueError, match=r"nccl backend needs a CUDA device"):
        PairChannel(server, pair_prefix("p", "d", 0), PREFILL_RANK, "nccl", CPU, HOST, TIMEOUT)


# --- NCCL ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs 2 CUDA devices: NCCL refuses two ranks of one communicator on one GPU "
    "('Duplicate GPU detected')",
)
def test_nccl_pair_moves_cuda_buffers(
    stores: tuple[dist.TCPStore, dist.Store], channels: list[PairChannel]
) -> None:
    prefill, decode = _pair(
        stores,
        channels,
        backend="nccl",
        prefill_device=torch.device("cuda:0"),
        decode_device=torch.device("cuda:1"),
    )
    assert prefill.device == torch.device("cuda:0")
    assert decode.device == torch.device("cuda:1")
    _exchange(prefill, decode, [1, 4096, 1 << 20, 7])
    assert prefill.state is ChannelState.READY
    assert decode.state is ChannelState.READY
    with pytest.raises(ValueError, match=r"send buffer is on cpu"):
        prefill.send(torch.zeros(4, dtype=torch.uint8))
