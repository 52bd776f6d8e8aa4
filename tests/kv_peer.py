"""Scripted peers of the KV handoff for failure tests: real PairChannel and gRPC, run step by step.

Run as ``python -m tests.kv_peer decode [BACKEND DEVICE]`` (default ``gloo cpu``; ``nccl cuda:1``
plays a decode on a GPU) or ``python -m tests.kv_peer prefill``. The peer reads
one command per line on stdin and answers one JSON line on stdout per command, so a test can hold
it at an exact point of a transfer and then SIGKILL or SIGSTOP it there.

decode (the decode side of pairs with real prefills; the instance id is per command, so one
process can play a decode and the same decode restarted):
  pull INSTANCE HANDLE_HEX GENERATION -> PullKv; {"ok", "num_bytes"} or {"code", "min_generation"}
  connect INSTANCE HANDLE_HEX GENERATION -> builds this side of that pair (no data moves)
  recv INSTANCE HANDLE_HEX GENERATION PATH -> receives num_bytes into PATH
  borrow INSTANCE HANDLE_HEX PATH -> takes the KV over shm (PullKvMany, reads it in place from the
    prefill's arena into PATH) and keeps it lent: never gives it back (INSTANCE: lowercase hex)
prefill NUM_BYTES (a prefill whose PullKvMany answers NUM_BYTES but never sends, and never answers
a pull over shm; its PairStore serves the pair's store): prints {"grpc", "instance_id"} first, then {"pulled", "decode",
"generation"} once a decode's pull has built the pair (or asked over shm); the decode's receive
then waits on this process.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import uuid
from concurrent import futures
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import torch
import torch.distributed as dist

from pdserve.kv.channel import DECODE_RANK, PREFILL_RANK, PairChannel
from pdserve.kv.handle import MIN_GENERATION_METADATA
from pdserve.kv.relay_store import RelayStore
from pdserve.kv.rendezvous import pair_prefix
from pdserve.kv.shared_memory import DEFAULT_DIR as SHM_DIR
from pdserve.kv.shared_memory import ArenaReader, InstanceLock
from pdserve.v1 import kv_pb2, prefill_pb2, prefill_pb2_grpc
from tests.stack import internal_channel

REPO_ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = timedelta(seconds=30)
HOST = "127.0.0.1"
CPU = torch.device("cpu")


def _say(**message: Any) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _borrow(
    instance: str, handle: kv_pb2.KvHandle, path: str, locks: dict[str, InstanceLock], secret: bytes
) -> None:
    if instance not in locks:
        locks[instance] = InstanceLock(SHM_DIR, instance)
    with internal_channel(handle.prefill_address) as grpc_channel:
        response = prefill_pb2_grpc.PrefillStub(grpc_channel).PullKvMany(
            prefill_pb2.PullKvManyRequest(
                handle_ids=[handle.id], decode_instance_id=instance, transport="shm", pair_secret=secret
            ),
            timeout=30,
        )
    region = ArenaReader(SHM_DIR, handle.prefill_instance_id).region(
        response.lent[0].offset, handle.num_bytes
    )
    with open(path, "wb") as out:
        out.write(region.numpy().tobytes())
    _say(ok=True, num_bytes=response.num_bytes[0])


def _pair_secret(instance: str) -> bytes:
    """The pair secret of a decode instance this peer plays: the same in every peer process, so a
    test can bring "the same decode" back (a real decode keeps its secret for its life)."""
    return hashlib.sha256(instance.encode()).digest()


def run_decode(backend: str = "gloo", device: torch.device = CPU) -> None:
    channels: dict[tuple[str, int], PairChannel] = {}
    stubs: dict[str, prefill_pb2_grpc.PrefillStub] = {}
    locks: dict[str, InstanceLock] = {}
    for line in sys.stdin:
        command, *args = line.split()
        if command == "exit":
            break
        secret = _pair_secret(args[0])
        if command == "borrow":
            _borrow(args[0], kv_pb2.KvHandle.FromString(bytes.fromhex(args[1])), args[2], locks, secret)
            continue
        instance, handle_hex, generation = args[0], args[1], int(args[2])
        handle = kv_pb2.KvHandle.FromString(bytes.fromhex(handle_hex))
        if handle.prefill_address not in stubs:
            stubs[handle.prefill_address] = prefill_pb2_grpc.PrefillStub(
                internal_channel(handle.prefill_address)
            )
        stub = stubs[handle.prefill_address]
        key = (instance, generation)
        if key not in channels:
            prefix = pair_prefix(handle.prefill_instance_id, instance, generation)
            store = RelayStore(stub, instance, secret, generation, TIMEOUT)
            channels[key] = PairChannel(store, prefix, DECODE_RANK, backend, device, HOST, TIMEOUT)
        channel = channels[key]
        if command == "pull":
            request = prefill_pb2.PullKvRequest(
                handle_id=handle.id,
                decode_instance_id=instance,
                pair_generation=generation,
                pair_secret=secret,
            )
            try:
                response = stub.PullKv(request, timeout=30)
            except grpc.RpcError as exc:
                metadata = dict(exc.trailing_metadata() or ())
                minimum = metadata.get(MIN_GENERATION_METADATA)
                _say(ok=False, code=exc.code().name, min_generation=int(minimum) if minimum else None)
                continue
            _say(ok=True, num_bytes=response.num_bytes)
        elif command == "connect":
            channel.connect().result()
            _say(ok=True)
        elif command == "recv":
            buf = torch.empty(handle.num_bytes, dtype=torch.uint8, device=channel.device)
            channel.recv(buf).result()
            with open(args[3], "wb") as out:
                out.write(buf.cpu().numpy().tobytes())
            _say(ok=True)
    for channel in channels.values():
        channel.close()


class _SilentPrefill(prefill_pb2_grpc.PrefillServicer):
    """Answers PullKvMany (the decode's pull call) and builds the pair, but never sends."""

    def __init__(self, instance_id: str, num_bytes: int) -> None:
        self._instance_id = instance_id
        self._num_bytes = num_bytes
        self._channels: list[PairChannel] = []
        self._stores: dict[tuple[str, int], Any] = {}

    def _store(self, decode: str, generation: int) -> Any:
        return self._stores.setdefault((decode, generation), dist.HashStore())

    def PairStore(self, request: prefill_pb2.PairStoreRequest, context: Any) -> prefill_pb2.PairStoreResponse:
        store = self._store(request.decode_instance_id, request.pair_generation)
        keys = list(request.keys)
        if request.op == "set":
            store.set(keys[0], request.value)
        elif request.op in ("get", "wait"):
            store.wait(keys, timedelta(seconds=request.timeout_s))
            if request.op == "get":
                return prefill_pb2.PairStoreResponse(value=store.get(keys[0]))
        elif request.op == "check":
            return prefill_pb2.PairStoreResponse(ready=store.check(keys))
        elif request.op == "add":
            return prefill_pb2.PairStoreResponse(number=store.add(keys[0], request.amount))
        return prefill_pb2.PairStoreResponse()

    def PullKvMany(
        self, request: prefill_pb2.PullKvManyRequest, context: Any
    ) -> prefill_pb2.PullKvManyResponse:
        if request.transport == "shm":
            _say(pulled=True, decode=request.decode_instance_id, generation=0)
            threading.Event().wait()  # never answers: the decode's call waits on this process
        prefix = pair_prefix(self._instance_id, request.decode_instance_id, request.pair_generation)
        store = self._store(request.decode_instance_id, request.pair_generation)
        channel = PairChannel(store, prefix, PREFILL_RANK, "gloo", CPU, HOST, TIMEOUT)
        self._channels.append(channel)

        def built(f: futures.Future[None]) -> None:
            if f.exception() is None:
                _say(pulled=True, decode=request.decode_instance_id, generation=request.pair_generation)

        channel.connect().add_done_callback(built)
        return prefill_pb2.PullKvManyResponse(num_bytes=[self._num_bytes] * len(request.handle_ids))


def run_prefill(num_bytes: int) -> None:
    instance_id = uuid.uuid4().hex
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    prefill_pb2_grpc.add_PrefillServicer_to_server(_SilentPrefill(instance_id, num_bytes), server)
    port = server.add_insecure_port(f"{HOST}:0")
    server.start()
    _say(grpc=f"{HOST}:{port}", instance_id=instance_id)
    threading.Event().wait()


class Peer:
    """A scripted peer process, driven from a test."""

    def __init__(self, role: str, *args: str) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "tests.kv_peer", role, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO_ROOT,
            env=env,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self._lines.put(line)

    def next_message(self, timeout_s: float = 60.0) -> dict[str, Any]:
        try:
            message: dict[str, Any] = json.loads(self._lines.get(timeout=timeout_s))
        except queue.Empty:
            raise TimeoutError(f"the {self.popen.args!r} peer said nothing for {timeout_s} s") from None
        return message

    def ask(self, *words: str, timeout_s: float = 60.0) -> dict[str, Any]:
        assert self.popen.stdin is not None
        self.popen.stdin.write(" ".join(words) + "\n")
        self.popen.stdin.flush()
        return self.next_message(timeout_s)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(30)


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "decode":
        backend = sys.argv[2] if len(sys.argv) > 2 else "gloo"
        run_decode(backend, torch.device(sys.argv[3] if len(sys.argv) > 3 else "cpu"))
    else:
        run_prefill(int(sys.argv[2]))
