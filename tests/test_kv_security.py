"""Only the decode link that made a pair's secret can use the pair: forged pulls, forged or bumped
generations, an outsider on the pair store, a receive buffer that cannot be allocated, too many
pairs, malformed handles.

Both sides in this process: the prefill's handoff servicer on a real gRPC server on 127.0.0.1 with
its real sender and registry, and real decode KvPullers, over real gloo pairs.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from datetime import timedelta

import grpc
import psutil
import pytest
import torch
from prometheus_client import CollectorRegistry

from decode_service.known_prefills import KnownPrefills
from decode_service.kv_puller import KvPuller
from decode_service.metrics import DecodeMetrics
from decode_service.pair_link import allocate
from gateway.public_errors import public_error
from pdserve.kv.handle import HandleIssuer
from pdserve.kv.layout import KvLayout, pack
from pdserve.kv.pair_secret import MAX_PAIR_GENERATION
from pdserve.kv.pair_store import MAX_KEYS, MAX_VALUE_BYTES
from pdserve.kv.rendezvous import connect_store, host_store
from pdserve.rpc.errors import RpcError
from pdserve.v1 import kv_pb2, prefill_pb2, prefill_pb2_grpc
from prefill_service.kv_registry import KvRegistry
from prefill_service.kv_sender import KvSender
from prefill_service.metrics import PrefillMetrics
from prefill_service.servicer import KvHandoffServicer

CPU = torch.device("cpu")
TIMEOUT = timedelta(seconds=4)
LAYOUT = KvLayout(keys=((2, 4),) * 2, values=((2, 3),) * 2, dtype=torch.float32)
Layers = list[tuple[torch.Tensor, torch.Tensor]]
INVALID = grpc.StatusCode.INVALID_ARGUMENT


class Prefill:
    """A prefill's handoff side on port 0."""

    async def start(self, max_pairs: int = 256) -> Prefill:
        self.metrics = PrefillMetrics(CollectorRegistry())
        self.registry = KvRegistry(60.0)
        self.sender = KvSender(
            "prefill-s", "gloo", CPU, "127.0.0.1", TIMEOUT, self.metrics, 60.0, max_pairs=max_pairs
        )
        self.server = grpc.aio.server()
        prefill_pb2_grpc.add_PrefillServicer_to_server(
            KvHandoffServicer(self.registry, self.sender, self.metrics), self.server
        )
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        await self.server.start()
        self.channel = grpc.aio.insecure_channel(self.address)
        self.stub = prefill_pb2_grpc.PrefillStub(self.channel)
        self.issuer = HandleIssuer(self.address, "prefill-s", "fp", LAYOUT)
        return self

    def park(self, num_tokens: int) -> tuple[kv_pb2.KvHandle, Layers]:
        layers = [(torch.randn(1, 2, num_tokens, 4), torch.randn(1, 2, num_tokens, 3)) for _ in range(2)]
        entry = self.registry.park(pack(layers, LAYOUT, 0, 0, num_tokens, CPU), num_tokens)
        return self.issuer.issue(entry), layers

    def count(self, name: str) -> float:
        return self.metrics.registry.get_sample_value(name) or 0.0

    async def stop(self) -> None:
        await self.channel.close()
        self.sender.close()
        await self.server.stop(0)


def puller(name: str, allocator: Callable[[int, torch.device], torch.Tensor] = allocate) -> KvPuller:
    metrics = DecodeMetrics(CollectorRegistry())
    return KvPuller(name, "fp", LAYOUT, "gloo", CPU, "127.0.0.1", TIMEOUT, metrics, allocator=allocator)


def assert_exact(received: Layers, layers: Layers) -> None:
    for (k, v), (rk, rv) in zip(layers, received, strict=True):
        assert torch.equal(rk, k[0]) and torch.equal(rv, v[0])


async def until(predicate: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def code_of(call: object) -> grpc.StatusCode:
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def forged_pull(
    handle: kv_pb2.KvHandle, decode: str, generation: int, secret: bytes
) -> prefill_pb2.PullKvRequest:
    return prefill_pb2.PullKvRequest(
        handle_id=handle.id, decode_instance_id=decode, pair_generation=generation, pair_secret=secret
    )


def test_a_forged_pull_naming_a_live_pair_never_reaches_it() -> None:
    """The reproduction: a caller parks its own KV and pulls it naming the victim decode's id and
    pair generation (with any secret but the victim's). The victim's pair is untouched, its next
    pulls get exactly their own KV, and forged or bumped generations change nothing."""

    async def scenario() -> None:
        prefill = await Prefill().start()
        victim = puller("decode-v")
        try:
            first, first_layers = prefill.park(5)
            assert_exact(await victim.pull(first), first_layers)
            assert prefill.sender.num_pairs == 1
            rebuilds = prefill.count("pdserve_kv_pair_rebuilds_total")
            for generation in (1, 2, 1000):  # the live one, a bump, a jump
                own, _ = prefill.park(7)
                request = forged_pull(own, "decode-v", generation, secrets.token_bytes(32))
                assert await code_of(prefill.stub.PullKv(request, timeout=10)) == grpc.StatusCode.OK
            # Each forged pull made a pair of its own (its send waits there in vain).
            assert prefill.sender.num_pairs == 4
            for n in (3, 9, 4):
                handle, layers = prefill.park(n)
                assert_exact(await victim.pull(handle), layers)
            assert prefill.count("pdserve_kv_pulls_stale_generation_total") == 0
            # The forged pair is torn down at its send's timeout; the victim's never was.
            await until(lambda: prefill.sender.num_in_flight == 0)
            assert prefill.count("pdserve_kv_pair_rebuilds_total") - rebuilds == 3
            handle, layers = prefill.park(6)
            assert_exact(await victim.pull(handle), layers)
            assert victim.num_pairs == 1 and prefill.registry.num_parked == 0
        finally:
            await victim.close()
            await prefill.stop()

    asyncio.run(scenario())


def test_bad_generations_and_owner_fields_are_invalid_argument_and_break_nothing() -> None:
    async def scenario() -> None:
        prefill = await Prefill().start()
        victim = puller("decode-v")
        try:
            handle, layers = prefill.park(4)
            assert_exact(await victim.pull(handle), layers)
            own, _ = prefill.park(4)
            secret = secrets.token_bytes(32)
            bad = [
                forged_pull(own, "decode-v", 0, secret),
                forged_pull(own, "decode-v", MAX_PAIR_GENERATION + 1, secret),
                forged_pull(own, "decode-v", (1 << 64) - 1, secret),
                forged_pull(own, "decode-v", 1, b""),
                forged_pull(own, "decode-v", 1, secrets.token_bytes(31)),
                forged_pull(own, "", 1, secret),
                forged_pull(own, "x" * 129, 1, secret),
                forged_pull(own, "decode v/../", 1, secret),
            ]
            for request in bad:
                assert await code_of(prefill.stub.PullKv(request, timeout=10)) == INVALID
            assert prefill.registry.num_parked == 1  # refused before the take
            assert prefill.sender.num_pairs == 1
            assert prefill.count("pdserve_kv_pulls_refused_total") == len(bad)
            handle, layers = prefill.park(8)
            assert_exact(await victim.pull(handle), layers)
        finally:
            await victim.close()
            await prefill.stop()

    asyncio.run(scenario())


def test_an_outsider_on_the_pair_store_cannot_read_write_or_grow_it() -> None:
    async def scenario() -> None:
        prefill = await Prefill().start()
        victim = puller("decode-v")
        try:
            handle, layers = prefill.park(4)
            assert_exact(await victim.pull(handle), layers)

            def store_call(secret: bytes, op: str, key: str, value: bytes = b"", generation: int = 1):  # type: ignore[no-untyped-def]
                return prefill.stub.PairStore(
                    prefill_pb2.PairStoreRequest(
                        decode_instance_id="decode-v",
                        pair_secret=secret,
                        pair_generation=generation,
                        op=op,
                        keys=[key],
                        value=value,
                        timeout_s=0.1,
                    ),
                    timeout=10,
                )

            # The victim's pair store is out of reach without its secret: no read, no write.
            stranger = secrets.token_bytes(32)
            for op in ("get", "set", "check", "add"):
                assert await code_of(store_call(stranger, op, "pdserve/kv/prefill-s/decode-v/1//0/0")) == (
                    grpc.StatusCode.NOT_FOUND
                )
            assert await code_of(store_call(b"", "check", "k")) == INVALID
            assert await code_of(store_call(stranger, "list_keys", "k")) == INVALID
            # An outsider's own pair (made by a pull of its own KV) has a store bounded in keys and size.
            own, _ = prefill.park(3)
            assert await code_of(
                prefill.stub.PullKv(forged_pull(own, "decode-v", 1, stranger), timeout=10)
            ) == (grpc.StatusCode.OK)
            assert await code_of(store_call(stranger, "set", "k", b"x" * (MAX_VALUE_BYTES + 1))) == INVALID
            assert await code_of(store_call(stranger, "set", "k" * 300)) == INVALID
            codes = [await code_of(store_call(stranger, "set", f"k{i}", b"v")) for i in range(MAX_KEYS + 5)]
            assert codes == [grpc.StatusCode.OK] * MAX_KEYS + [grpc.StatusCode.RESOURCE_EXHAUSTED] * 5
            handle, layers = prefill.park(5)
            assert_exact(await victim.pull(handle), layers)
        finally:
            await victim.close()
            await prefill.stop()

    asyncio.run(scenario())


def test_a_receive_buffer_that_cannot_be_allocated_tears_the_pair_down() -> None:
    """The allocation fails after PullKvMany went out (the prefill posts its send all the same):
    the pair is torn down, so the next pull's receive takes its own bytes, not the failed one's."""
    failing = [LAYOUT.num_bytes(11)]  # the next buffer of this size cannot be allocated, once

    def allocator(num_bytes: int, device: torch.device) -> torch.Tensor:
        if num_bytes in failing:
            failing.remove(num_bytes)
            raise RuntimeError(f"cannot allocate {num_bytes} bytes")
        return allocate(num_bytes, device)

    async def scenario() -> None:
        prefill = await Prefill().start()
        decode = puller("decode-a", allocator)
        try:
            handle, layers = prefill.park(4)
            assert_exact(await decode.pull(handle), layers)
            lost, _ = prefill.park(11)
            with pytest.raises(RpcError) as failure:
                await decode.pull(lost)
            assert failure.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert decode.num_pairs == 0  # torn down
            for n in (11, 12, 5):
                handle, layers = prefill.park(n)
                assert_exact(await decode.pull(handle), layers)
            await until(lambda: prefill.sender.num_in_flight == 0)
            # The failed pull's KV was sent into the torn-down pair and freed, or (its call cancelled
            # before it arrived) is still parked: nothing else is.
            prefill.registry.release(lost.id)
            assert prefill.registry.num_parked == 0 and prefill.sender.num_pairs == 1
        finally:
            await decode.close()
            await prefill.stop()

    asyncio.run(scenario())


def test_pairs_are_bounded_and_the_least_recently_used_idle_one_is_evicted() -> None:
    async def scenario() -> None:
        prefill = await Prefill().start(max_pairs=2)
        decodes = [puller(f"decode-{i}") for i in range(3)]
        try:
            for decode in decodes:
                handle, layers = prefill.park(3)
                assert_exact(await decode.pull(handle), layers)
            assert prefill.sender.num_pairs == 2
            assert prefill.count("pdserve_kv_pair_evictions_total") == 1
            handle, layers = prefill.park(6)  # the evicted decode comes back on a new generation
            assert_exact(await decodes[0].pull(handle), layers)
            assert prefill.sender.num_pairs == 2 and prefill.registry.num_parked == 0
        finally:
            for decode in decodes:
                await decode.close()
            await prefill.stop()

    asyncio.run(scenario())


def test_a_malformed_handle_is_invalid_argument_before_any_connection() -> None:
    async def scenario() -> None:
        prefill = await Prefill().start()
        decode = puller("decode-a")
        try:
            good, _ = prefill.park(3)
            edits: list[Callable[[kv_pb2.KvHandle], None]] = [
                lambda h: setattr(h, "id", b"short"),
                lambda h: setattr(h, "prefill_address", "no-port"),
                lambda h: setattr(h, "prefill_address", "127.0.0.1:70000"),
                lambda h: setattr(h, "prefill_instance_id", "a/b"),
                lambda h: setattr(h, "rendezvous_address", "10.0.0.1:29500"),
                lambda h: h.transports.append("carrier-pigeon"),
                lambda h: setattr(h, "host_id", "not hex"),
                lambda h: setattr(h, "device", "tpu"),
                lambda h: setattr(h, "rank", 1 << 20),
                lambda h: setattr(h, "expires_at_unix", float("nan")),
            ]
            for edit in edits:
                handle = kv_pb2.KvHandle()
                handle.CopyFrom(good)
                edit(handle)
                with pytest.raises(RpcError) as failure:
                    await decode.pull(handle)
                assert failure.value.code == INVALID, failure.value.message
            assert prefill.count("pdserve_kv_pull_calls_total") == 0
            assert decode.num_pairs == 0 and prefill.registry.num_parked == 1
        finally:
            await decode.close()
            await prefill.stop()

    asyncio.run(scenario())


def test_public_errors_carry_no_address_or_backend_text() -> None:
    internal = RpcError(
        grpc.StatusCode.UNAVAILABLE,
        "decode 10.1.2.3:50062 failed (ABORTED: KV transfer from prefill [::1]:50061 failed: "
        "recv on pdserve/kv/abc/def/1/ failed: Connection reset by peer) after 3 tokens were delivered",
    )
    public = public_error(internal, "req-1")
    assert public.code == grpc.StatusCode.UNAVAILABLE
    assert (
        public.message
        == "the service could not complete the request after 3 tokens were delivered (request id req-1)"
    )
    failed = public_error(RpcError(grpc.StatusCode.INTERNAL, "decode failed: CUDA error at host-7:1234"), "r")
    assert failed.message == "internal error (request id r)"
    client = public_error(
        RpcError(grpc.StatusCode.INVALID_ARGUMENT, "PullKvMany on prefill-0.pdserve:50061: bad handle"), "r"
    )
    assert client.message == "PullKvMany on <internal>: bad handle (request id r)"


def test_known_prefills_are_the_hosts_of_the_list_its_names_resolved_again() -> None:
    answers = {"prefill.svc": ["10.0.0.5:50061"]}

    def resolver(host: str, port: int) -> list[str]:
        return answers[host]

    async def scenario() -> None:
        local = KnownPrefills(())
        assert local.knows("127.0.0.1:1") and local.knows("[::1]:2") and local.knows("localhost:3")
        assert not local.knows("10.0.0.5:50061")
        known = KnownPrefills(["10.0.0.9:50061", "dns:///prefill.svc:50061"], resolver=resolver, keep_s=2.5)
        assert known.knows("10.0.0.9:7") and not known.knows("127.0.0.1:50061")
        assert await known.check("10.0.0.5:29600")  # resolved on first sight, any port
        answers["prefill.svc"] = ["10.0.0.6:50061"]
        assert not known.knows("10.0.0.6:50061")
        await asyncio.sleep(1.0)  # past the minimum interval between resolutions
        assert await known.check("10.0.0.6:50061")
        assert known.knows("10.0.0.5:1")  # gone from the name, kept for keep_s
        await asyncio.sleep(2.0)
        await known.refresh()
        assert not known.knows("10.0.0.5:1")
        with pytest.raises(RpcError) as failure:
            await puller_with(KnownPrefills(["10.0.0.9:50061"])).pull(handle_named("127.0.0.1:50061"))
        assert failure.value.code == grpc.StatusCode.PERMISSION_DENIED

    asyncio.run(scenario())


def puller_with(known: KnownPrefills) -> KvPuller:
    metrics = DecodeMetrics(CollectorRegistry())
    return KvPuller(
        "decode-k", "fp", LAYOUT, "gloo", CPU, "127.0.0.1", TIMEOUT, metrics, known_prefills=known
    )


def handle_named(address: str) -> kv_pb2.KvHandle:
    issuer = HandleIssuer(address, "prefill-k", "fp", LAYOUT)
    entry = KvRegistry(60.0).park(
        pack([(torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 3))] * 2, LAYOUT, 0, 0, 2, CPU), 2
    )
    return issuer.issue(entry)


def test_a_hosted_store_listens_on_its_host_only() -> None:
    """An expert-parallel group's store (and bench-kv's) binds the host it is given, not every
    interface as torch's store server would on its own; it still serves its clients."""
    timeout = timedelta(seconds=10)
    store = host_store("127.0.0.1", 0, timeout)
    listening = [
        c.laddr
        for c in psutil.Process().net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == store.port
    ]
    assert [address.ip for address in listening] == ["127.0.0.1"], listening
    client = connect_store(f"127.0.0.1:{store.port}", timeout)
    client.set("key", "value")
    assert store.get("key") == b"value"
