"""The prefill side of the KV handoff: one transfer pair per decode link, built on demand.

A pair belongs to the decode that made its secret (``pdserve.kv.pair_secret``): pairs are keyed by
(decode instance id, digest of the secret), so a caller presenting another secret, even under the
same decode id and generation, makes a pair of its own and never posts on, rebuilds or retires the
decode's. Each pair generation has its own bounded store in this process (``PairStore``): the
prefill's end builds its group through it directly, the decode's end through ``PairStore`` calls
carrying the secret. At most ``max_pairs`` pairs are open: a new one evicts the least recently used
idle pair (torn down), and is refused (``PairsFull``) when every pair is busy.

Lifecycle of a pull:
1. a decode calls PullKvMany(handles, decode instance, pair secret, pair generation) (PullKv: one
   handle);
2. a generation this prefill already tore down for that pair is refused (``StaleGeneration``)
   before the handle is touched: the decode moves to a newer generation and asks again;
3. the handle is taken out of the registry (a later pull or release finds nothing);
4. if the pair has another generation or is broken, it is closed and a new one is made under the
   decode's generation, with a fresh store (the decode builds its side through that store);
5. the send is posted on the pair, after every earlier send to that decode, and the call returns
   (the KVs of one call go as one send of their buffers concatenated);
6. the send completes, or fails at its bounded timeout (at once when the decode's process died),
   and the buffer is dropped: the KV is freed. A failed send tears the pair down at once (its
   group and thread go) and retires its generation; the decode's next pull builds a new one.

Each pair has its own transfer thread, so a send waiting on one decode never delays another
decode's. A pair left unused for ``idle_s`` (its decode may be gone for good) is torn down at the
next pull from any decode.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch

from pdserve.kv.channel import PREFILL_RANK, PairChannel, transfer_threads
from pdserve.kv.pair_secret import PairKey, pair_key
from pdserve.kv.pair_store import PairStore
from pdserve.kv.rendezvous import pair_prefix
from pdserve.kv.transports import GLOO
from prefill_service.kv_registry import ParkedKv
from prefill_service.metrics import PrefillMetrics

logger = logging.getLogger(__name__)

PAIR_IDLE_S = 600.0
MAX_RETIRED = 4096  # pairs whose last torn-down generation is remembered
MAX_PAIRS = 256


class StaleGeneration(Exception):
    """A pull named a pair generation that is no longer accepted for its decode."""

    def __init__(self, decode_instance_id: str, generation: int, minimum: int) -> None:
        super().__init__(
            f"pair generation {generation} with decode {decode_instance_id} was torn down; "
            f"pull again with generation >= {minimum}"
        )
        self.minimum = minimum


class PairsFull(Exception):
    """Every pair is busy and there is no room for another."""


@dataclass
class _Pair:
    generation: int
    channel: PairChannel
    store: PairStore
    last_used: float


class KvSender:
    def __init__(
        self,
        instance_id: str,
        backend: str,
        device: torch.device,
        local_host: str,
        timeout: timedelta,
        metrics: PrefillMetrics,
        idle_s: float = PAIR_IDLE_S,
        clock: Callable[[], float] = time.monotonic,
        max_pairs: int = MAX_PAIRS,
    ) -> None:
        self._instance_id = instance_id
        self._max_pairs = max_pairs
        self._backend = backend
        self._device = device
        self._local_host = local_host
        self._timeout = timeout
        self._metrics = metrics
        self._idle_s = idle_s
        self._clock = clock
        self._pairs: collections.OrderedDict[PairKey, _Pair] = collections.OrderedDict()
        self._retired: collections.OrderedDict[PairKey, int] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._in_flight = 0
        metrics.kv_pairs.set_function(lambda: len(self._pairs))
        metrics.kv_sends_in_flight.set_function(lambda: self._in_flight)
        metrics.kv_transfer_threads.set_function(transfer_threads)

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    @property
    def default_backend(self) -> str:
        """The backend of a pull that names none."""
        return self._backend

    @property
    def num_pairs(self) -> int:
        return len(self._pairs)

    def check_generation(self, decode_instance_id: str, secret: bytes, generation: int) -> None:
        """Raises StaleGeneration when a pull on that generation would be refused."""
        with self._lock:
            self._check_generation(pair_key(decode_instance_id, secret), generation)

    def pair_store(self, decode_instance_id: str, secret: bytes, generation: int) -> PairStore | None:
        """The store of that pair generation, or None when this prefill has no such pair (another
        secret, another generation, or torn down)."""
        with self._lock:
            pair = self._pairs.get(pair_key(decode_instance_id, secret))
            if pair is None or pair.generation != generation or not pair.channel.is_usable:
                return None
            return pair.store

    def send(
        self,
        entries: Sequence[ParkedKv],
        decode_instance_id: str,
        secret: bytes,
        generation: int,
        backend: str | None = None,
    ) -> concurrent.futures.Future[None]:
        """Posts one send to that decode of the taken handles' buffers, concatenated in order, over
        a pair of ``backend`` (None: this sender's default); they are freed when it ends.

        Raises StaleGeneration, PairsFull, or TransferError when the pair cannot take the send.
        """
        key = pair_key(decode_instance_id, secret)
        if not entries:
            raise ValueError("nothing to send")
        backend = backend or self._backend
        parts = [e.buffer for e in entries]
        buffer = parts[0] if len(parts) == 1 else torch.cat(parts)
        if backend == GLOO and buffer.device.type != "cpu":
            buffer = buffer.to("cpu")  # a GPU-parked KV for a decode that only takes gloo
        with self._lock:
            try:
                pair = self._pair(key, generation, backend)
                future = pair.channel.send(buffer)
            except BaseException:
                for entry in entries:
                    entry.free()
                raise
            self._in_flight += 1
        started = time.perf_counter()
        num_bytes = sum(e.num_bytes for e in entries)

        def done(f: concurrent.futures.Future[None]) -> None:
            exc = f.exception()
            for entry in entries:
                entry.free()
            with self._lock:
                self._in_flight -= 1
                pair.last_used = self._clock()
                if exc is not None:
                    self._tear_down(key, pair)
            if exc is None:
                self._metrics.kv_sent_bytes.inc(num_bytes)
                self._metrics.kv_transfer_seconds.observe(time.perf_counter() - started)
            else:
                self._metrics.kv_pull_failures.inc()
                logger.warning(
                    "KV send of %d bytes to %s (generation %d) failed, KV freed: %s",
                    num_bytes,
                    decode_instance_id,
                    generation,
                    exc,
                )

        future.add_done_callback(done)
        return future

    def close(self) -> None:
        with self._lock:
            for pair in self._pairs.values():
                pair.channel.close()
            self._pairs.clear()

    # --- under self._lock --------------------------------------------------------------------

    def _check_generation(self, key: PairKey, generation: int) -> None:
        minimum = self._retired.get(key, 0) + 1
        current = self._pairs.get(key)
        if current is not None:
            minimum = max(minimum, current.generation)
        if generation < minimum:
            raise StaleGeneration(key[0], generation, minimum)

    def _pair(self, key: PairKey, generation: int, backend: str) -> _Pair:
        now = self._clock()
        self._reap(now, keep=key)
        self._check_generation(key, generation)
        current = self._pairs.get(key)
        if current is not None:
            reusable = current.channel.is_usable and current.channel.backend == backend
            if current.generation == generation and reusable:
                current.last_used = now
                self._pairs.move_to_end(key)
                return current
            logger.info(
                "rebuilding KV pair with %s: generation %d (%s) -> %d",
                key[0],
                current.generation,
                current.channel.state.value,
                generation,
            )
            self._tear_down(key, current)
        self._make_room()
        store = PairStore(self._timeout)
        channel = PairChannel(
            store.store,
            pair_prefix(self._instance_id, key[0], generation),
            PREFILL_RANK,
            backend,
            self._device,
            self._local_host,
            self._timeout,
        )
        pair = _Pair(generation, channel, store, now)
        self._pairs[key] = pair
        return pair

    def _make_room(self) -> None:
        """Evicts the least recently used idle pair when there are ``max_pairs``."""
        if len(self._pairs) < self._max_pairs:
            return
        for key, pair in self._pairs.items():  # least recently used first
            if pair.channel.num_pending == 0:
                logger.info(
                    "evicting KV pair with %s (generation %d): too many pairs", key[0], pair.generation
                )
                self._metrics.kv_pair_evictions.inc()
                self._tear_down(key, pair)
                return
        raise PairsFull(f"all {self._max_pairs} KV pairs are busy")

    def _tear_down(self, key: PairKey, pair: _Pair) -> None:
        """Closes the pair and retires its generation (no-op when it was already replaced)."""
        pair.channel.close()
        if self._pairs.get(key) is not pair:
            return
        del self._pairs[key]
        self._metrics.kv_pair_rebuilds.inc()
        retired = max(self._retired.pop(key, 0), pair.generation)
        self._retired[key] = retired
        while len(self._retired) > MAX_RETIRED:
            self._retired.popitem(last=False)

    def _reap(self, now: float, keep: PairKey) -> None:
        for key, pair in list(self._pairs.items()):
            if key == keep:
                continue
            idle = pair.channel.num_pending == 0 and now - pair.last_used > self._idle_s
            if idle or not pair.channel.is_usable:
                logger.info(
                    "closing KV pair with %s (generation %d): %s",
                    key[0],
                    pair.generation,
                    "idle" if idle else pair.channel.state.value,
                )
                self._tear_down(key, pair)
