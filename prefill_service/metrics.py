"""Prometheus metrics of a prefill process (its own registry, served on --metrics-port)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.model.compile import CompileCacheLookups, CompiledFrames

QUEUE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

if TYPE_CHECKING:
    from prefill_service.kv_lender import KvLender
    from prefill_service.kv_space import KvSpace
    from prefill_service.prefix_cache import PrefixCache

CACHED_TOKENS_BUCKETS = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class PrefillMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter("pdserve_prefill_requests", "Prefill requests served", registry=registry)
        self.finished_at_first_token = Counter(
            "pdserve_prefill_finished_at_first_token",
            "Requests complete at their first token (never sent to decode)",
            ["reason"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "pdserve_prefill_prompt_tokens", "Prompt tokens run through prefill", registry=registry
        )
        self.forward_seconds = Histogram(
            "pdserve_prefill_forward_seconds", "Duration of prefill forwards", registry=registry
        )
        self.waiting = Gauge(
            "pdserve_prefill_waiting",
            "Requests in the prefill queue: submitted, not yet in a forward",
            registry=registry,
        )
        self.shed = Counter(
            "pdserve_prefill_shed",
            "Prefill requests refused because the queue was full (--max-prefill-waiting)",
            registry=registry,
        )
        self.deadline_expired = Counter(
            "pdserve_prefill_deadline_expired",
            "Prefill requests dropped from the queue because their deadline passed",
            registry=registry,
        )
        self.running = Gauge(
            "pdserve_prefill_running", "Requests in the prefill forward running now", registry=registry
        )
        self.queue_seconds = Histogram(
            "pdserve_prefill_queue_seconds",
            "Time requests waited in the prefill queue before their forward",
            buckets=QUEUE_BUCKETS,
            registry=registry,
        )
        self.batch_size = Histogram(
            "pdserve_prefill_batch_size",
            "Size of the batched forward each request ran in",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=registry,
        )
        self.parked_handles = Gauge("pdserve_kv_parked_handles", "KV handles parked", registry=registry)
        self.parked_bytes = Gauge("pdserve_kv_parked_bytes", "Bytes of parked KV", registry=registry)
        self.kv_parks = Counter("pdserve_kv_parks", "KV handles parked", registry=registry)
        self.kv_pulls = Counter("pdserve_kv_pulls", "KV pulls started by decodes", registry=registry)
        self.kv_pull_calls = Counter(
            "pdserve_kv_pull_calls",
            "PullKv and PullKvMany calls past their checks (one PullKvMany serves several pulls)",
            registry=registry,
        )
        self.kv_pull_failures = Counter(
            "pdserve_kv_pull_failures", "KV sends that failed or timed out", registry=registry
        )
        self.kv_pulls_not_found = Counter(
            "pdserve_kv_pulls_not_found", "Pulls of unknown or expired handles", registry=registry
        )
        self.kv_releases = Counter("pdserve_kv_releases", "KV handles released unpulled", registry=registry)
        self.kv_expiries = Counter("pdserve_kv_expiries", "KV handles whose lease expired", registry=registry)
        self.kv_sent_bytes = Counter("pdserve_kv_sent_bytes", "KV bytes sent to decodes", registry=registry)
        self.kv_transfer_seconds = Histogram(
            "pdserve_kv_send_seconds",
            "Duration of KV sends (posted to completed)",
            buckets=TRANSFER_BUCKETS,
            registry=registry,
        )
        self.kv_pairs = Gauge("pdserve_kv_pairs", "Open (prefill, decode) transfer pairs", registry=registry)
        self.kv_sends_in_flight = Gauge(
            "pdserve_kv_sends_in_flight", "KV sends posted and not yet ended", registry=registry
        )
        self.kv_transfer_threads = Gauge(
            "pdserve_kv_transfer_threads",
            "Transfer threads alive (one per open pair when no transfer is ending)",
            registry=registry,
        )
        self.kv_pair_rebuilds = Counter(
            "pdserve_kv_pair_rebuilds",
            "Pairs replaced by a new generation or torn down after a failure",
            registry=registry,
        )
        self.kv_pair_evictions = Counter(
            "pdserve_kv_pair_evictions",
            "Idle pairs torn down to make room for a new one",
            registry=registry,
        )
        self.kv_pulls_refused = Counter(
            "pdserve_kv_pulls_refused",
            "Pulls and pair-store calls refused: bad owner fields or generation, unknown pair, no room",
            registry=registry,
        )
        self.kv_pulls_stale = Counter(
            "pdserve_kv_pulls_stale_generation",
            "Pulls refused because they named a pair generation already torn down",
            registry=registry,
        )
        self.kv_transport_pulls = Counter(
            "pdserve_kv_transport_pulls",
            "KV pulls started by decodes, by transport (shm, cuda-ipc, nccl, gloo)",
            ["transport"],
            registry=registry,
        )
        self.kv_lent_handles = Gauge(
            "pdserve_kv_lent_handles",
            "KVs lent to decodes of this host (read in place), not yet given back",
            registry=registry,
        )
        self.kv_lent_bytes = Gauge("pdserve_kv_lent_bytes", "Bytes of KV lent to decodes", registry=registry)
        self.kv_given_back = Counter(
            "pdserve_kv_given_back", "Lent KVs given back by their decode", registry=registry
        )
        self.kv_reclaimed = Counter(
            "pdserve_kv_reclaimed", "Lent KVs freed because their decode died", registry=registry
        )
        self.kv_arena_bytes = Gauge(
            "pdserve_kv_arena_bytes", "Size of the shared-memory KV arena (0: none)", registry=registry
        )
        self.kv_arena_used_bytes = Gauge(
            "pdserve_kv_arena_used_bytes", "Bytes of the shared-memory KV arena in use", registry=registry
        )
        self.kv_arena_misses = Counter(
            "pdserve_kv_arena_misses",
            "KVs parked in private memory because the shared-memory arena was full",
            registry=registry,
        )
        self.prefix_cache_queries = Counter(
            "pdserve_prefill_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            registry=registry,
        )
        self.prefix_cache_hits = Counter(
            "pdserve_prefill_prefix_cache_hits",
            "Prompt tokens whose KV came from the prefix cache",
            registry=registry,
        )
        self.cached_tokens = Histogram(
            "pdserve_prefill_cached_tokens",
            "Prompt tokens of each request taken from the prefix cache",
            buckets=CACHED_TOKENS_BUCKETS,
            registry=registry,
        )
        self.prefix_cache_tokens = Gauge(
            "pdserve_prefill_prefix_cache_tokens", "Tokens held in the prefix cache", registry=registry
        )
        self.prefix_cache_capacity_tokens = Gauge(
            "pdserve_prefill_prefix_cache_capacity_tokens",
            "Most tokens the prefix cache holds (0: no prefix cache)",
            registry=registry,
        )
        self.prefix_cache_evicted_tokens = Counter(
            "pdserve_prefill_prefix_cache_evicted_tokens",
            "Tokens evicted from the prefix cache to make room",
            registry=registry,
        )
        self.compiles = CompiledFrames("pdserve_prefill_compiles", registry)
        self.compile_cache = CompileCacheLookups("pdserve_prefill_compile_cache_lookups", registry)
        self.warmup_seconds = Gauge(
            "pdserve_prefill_warmup_seconds",
            "Duration of the start-up warm-up of the compiled forwards (0: none ran)",
            registry=registry,
        )
        self.forward_fixed_tokens = Gauge(
            "pdserve_prefill_forward_fixed_tokens",
            "A prefill forward's fixed cost in tokens of its per-token cost, measured at start; forwards "
            "follow the queue at the square root of its tokens times this (0: a fixed size)",
            registry=registry,
        )

    def track_queue(self, num_waiting: Callable[[], int], num_running: Callable[[], int]) -> None:
        self.waiting.set_function(num_waiting)
        self.running.set_function(num_running)

    def track_prefix_cache(self, cache: PrefixCache) -> None:
        self.prefix_cache_tokens.set_function(lambda: cache.num_tokens)
        self.prefix_cache_capacity_tokens.set(cache.capacity_tokens)

    def track_parked(self, num_handles: Callable[[], int], num_bytes: Callable[[], int]) -> None:
        self.parked_handles.set_function(num_handles)
        self.parked_bytes.set_function(num_bytes)

    def track_lent(self, lender: KvLender, space: KvSpace) -> None:
        self.kv_lent_handles.set_function(lambda: lender.num_lent)
        self.kv_lent_bytes.set_function(lambda: lender.num_bytes_lent)
        arena = space.arena
        self.kv_arena_bytes.set(arena.capacity if arena is not None else 0)
        self.kv_arena_used_bytes.set_function(lambda: space.arena_bytes_used)
