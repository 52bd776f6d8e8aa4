"""The prefill side of the KV handoff: one transfer channel per decode process, built on demand.

Lifecycle of a pull:
1. a decode calls PullKv(handle, decode instance, pair generation);
2. the handle is taken out of the registry (a later pull or release finds nothing);
3. if this decode's channel has another generation or is broken, it is closed and a new one is
   made under the decode's generation (the decode makes its side under the same store prefix);
4. the send is posted on the channel, after every earlier send to that decode, and PullKv returns;
5. the send completes (or fails at its bounded timeout, breaking the channel) and the buffer is
   dropped: the KV is freed.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from pdserve.kv_transport import PREFILL_RANK, PairChannel, pair_prefix
from prefill_service.kv_registry import ParkedKv
from prefill_service.metrics import PrefillMetrics

logger = logging.getLogger(__name__)


class KvSender:
    def __init__(
        self,
        instance_id: str,
        store: dist.Store,
        backend: str,
        device: torch.device,
        local_host: str,
        timeout: timedelta,
        metrics: PrefillMetrics,
    ) -> None:
        self._instance_id = instance_id
        self._store = store
        self._backend = backend
        self._device = device
        self._local_host = local_host
        self._timeout = timeout
        self._metrics = metrics
        self._channels: dict[str, tuple[int, PairChannel]] = {}
        self._lock = threading.Lock()
        self._in_flight = 0
        metrics.kv_pairs.set_function(lambda: len(self._channels))

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    def send(self, entry: ParkedKv, decode_instance_id: str, generation: int) -> None:
        """Posts the send of a taken handle to that decode; the buffer is freed when it ends."""
        channel = self._channel(decode_instance_id, generation)
        started = time.perf_counter()
        with self._lock:
            self._in_flight += 1
        future = channel.send(entry.buffer)
        num_bytes = entry.num_bytes

        def done(f: object) -> None:
            with self._lock:
                self._in_flight -= 1
            exc = future.exception()
            if exc is None:
                self._metrics.kv_sent_bytes.inc(num_bytes)
                self._metrics.kv_transfer_seconds.observe(time.perf_counter() - started)
            else:
                self._metrics.kv_pull_failures.inc()
                logger.warning("KV send of %d bytes to %s failed: %s", num_bytes, decode_instance_id, exc)

        future.add_done_callback(done)

    def _channel(self, decode_instance_id: str, generation: int) -> PairChannel:
        with self._lock:
            self._prune_broken(keep=decode_instance_id)
            current = self._channels.get(decode_instance_id)
            if current is not None:
                current_generation, channel = current
                if current_generation == generation and channel.is_usable:
                    return channel
                logger.info(
                    "rebuilding KV pair with %s: generation %d (%s) -> %d",
                    decode_instance_id,
                    current_generation,
                    channel.state.value,
                    generation,
                )
                channel.close()
            channel = PairChannel(
                self._store,
                pair_prefix(self._instance_id, decode_instance_id, generation),
                PREFILL_RANK,
                self._backend,
                self._device,
                self._local_host,
                self._timeout,
            )
            self._channels[decode_instance_id] = (generation, channel)
            return channel

    def _prune_broken(self, keep: str) -> None:
        for peer in [p for p, (_, c) in self._channels.items() if p != keep and not c.is_usable]:
            self._channels.pop(peer)[1].close()

    def close(self) -> None:
        with self._lock:
            for _, channel in self._channels.values():
                channel.close()
            self._channels.clear()
