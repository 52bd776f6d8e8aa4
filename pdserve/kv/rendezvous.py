"""Where the two processes of a KV pair meet: the TCPStore a prefill hosts, and the key prefix of
each pair generation in it (a fresh prefix per generation, so a rebuilt pair never reads a stale
key)."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist


def pair_prefix(prefill_instance_id: str, decode_instance_id: str, generation: int) -> str:
    return f"pdserve/kv/{prefill_instance_id}/{decode_instance_id}/{generation}/"


def connect_store(address: str, timeout: timedelta) -> dist.Store:
    """A client of a prefill's rendezvous TCPStore."""
    host, _, port = address.rpartition(":")
    return dist.TCPStore(host, int(port), None, False, timeout)


def host_store(host: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """The rendezvous TCPStore a prefill hosts (port 0 picks a free one; see ``.port``)."""
    return dist.TCPStore(host, port, None, True, timeout, wait_for_workers=False)
