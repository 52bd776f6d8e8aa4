"""Where two processes meet to form a torch.distributed group: a TCPStore one of them hosts (an
expert-parallel group's ranks, bench-kv's raw pair), and the key prefix of each KV pair generation
(a fresh prefix per generation, so a rebuilt pair never reads a stale key). A KV pair of the
services meets through its own store inside the prefill instead (``pdserve.kv.pair_store``)."""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist

LISTEN_BACKLOG = 128


def pair_prefix(prefill_instance_id: str, decode_instance_id: str, generation: int) -> str:
    return f"pdserve/kv/{prefill_instance_id}/{decode_instance_id}/{generation}/"


def connect_store(address: str, timeout: timedelta) -> dist.Store:
    """A client of a hosted TCPStore."""
    host, _, port = address.rpartition(":")
    return dist.TCPStore(host, int(port), None, False, timeout)


def host_store(host: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """A TCPStore listening on ``host`` only (port 0 picks a free one; see ``.port``).

    torch's store server listens on every interface whatever host it is given, so the listening
    socket is bound here and handed to it."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(LISTEN_BACKLOG)
        bound = listener.getsockname()[1]
        store = dist.TCPStore(
            host, bound, None, True, timeout, wait_for_workers=False, master_listen_fd=listener.fileno()
        )
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store's server owns the socket now
    return store
