"""Prometheus metrics of the gateway (its own registry, served on --metrics-port and at /metrics of
the HTTP port): its own counters, and the vLLM-shaped request metrics (``gateway.request_metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway.request_metrics import RequestMetrics

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        self.registry = registry
        self.request = RequestMetrics(registry, model_name, max_model_len)
        self.requests = Counter("pdserve_gateway_requests", "Generate calls received", registry=registry)
        self.finished = Counter(
            "pdserve_gateway_finished", "Requests finished, by reason", ["reason"], registry=registry
        )
        self.failed = Counter(
            "pdserve_gateway_failed", "Requests failed, by status", ["code"], registry=registry
        )
        self.cancelled = Counter(
            "pdserve_gateway_cancelled", "Requests cancelled by the client", registry=registry
        )
        self.decode_calls = Counter("pdserve_gateway_decode_calls", "Decode calls made", registry=registry)
        self.prefill_routes = Counter(
            "pdserve_gateway_prefill_routes",
            "Prefill choices of the prefix router, by outcome (prefix: the replica holding the longest "
            "prefix; balanced: the least loaded one instead, the match being overloaded; least-load: no "
            "match)",
            ["outcome"],
            registry=registry,
        )
        self.kv_releases = Counter(
            "pdserve_gateway_kv_releases", "KV handles released on the prefill", registry=registry
        )
        self.in_flight = Gauge("pdserve_gateway_in_flight", "Requests in flight", registry=registry)
        self.ttft_seconds = Histogram(
            "pdserve_gateway_ttft_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=registry
        )
        self.retries = Counter(
            "pdserve_gateway_retries",
            "Request attempts run again after a prefill or decode failed, by the stage that failed "
            "(decode: the request moved to another decode)",
            ["stage"],
            registry=registry,
        )
        self.migrated_tokens = Counter(
            "pdserve_gateway_migrated_tokens",
            "Tokens already delivered of requests that moved to another decode (prefilled again)",
            registry=registry,
        )
        self.backends_serving = Gauge(
            "pdserve_gateway_backends_serving",
            "Backends whose health check says SERVING",
            ["role"],
            registry=registry,
        )
        self.backends = Gauge(
            "pdserve_gateway_backends",
            "Backends requests are routed to (serving or not), from fixed addresses and DNS names",
            ["role"],
            registry=registry,
        )
        self.backends_retired = Gauge(
            "pdserve_gateway_backends_retired",
            "Backends gone from DNS whose requests still run there (closed once those end)",
            ["role"],
            registry=registry,
        )
        self.shed = Counter(
            "pdserve_gateway_shed",
            "Requests refused for overload (RESOURCE_EXHAUSTED, HTTP 429), by the stage that was full: "
            "gateway (its in-flight bound), prefill or decode (every replica tried was full)",
            ["stage"],
            registry=registry,
        )
        for stage in ("gateway", "prefill", "decode"):
            self.shed.labels(stage)
        self.admitted = Gauge(
            "pdserve_gateway_admitted",
            "Requests admitted under the gateway's in-flight bound (--max-in-flight) and not ended",
            registry=registry,
        )
        self.generated_tokens = Counter(
            "pdserve_gateway_generated_tokens", "Tokens streamed to clients", registry=registry
        )
