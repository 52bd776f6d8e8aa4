"""Request-level metrics of the gateway, shaped like vLLM's, each with a ``model_name`` label.

What a dashboard or an autoscaler built for vLLM reads, under ``pdserve_`` instead of ``vllm:``
(the README maps each one). One ``RequestTimer`` follows one request through the request flow, so
the gRPC and the HTTP fronts are measured alike:
1. arrival (``RequestTimer`` made): the clock starts;
2. the successful prefill call is sent, and its answer says how long the request waited in the
   prefill's queue: queue time = the gateway's wait for a serving prefill + that wait;
3. each response streamed: the first one is the time to first token; every later one adds the
   time since the previous one, split evenly over its tokens, as inter-token latencies;
4. the end: with a finish reason, end-to-end latency, time per output token (after the first),
   prompt and generation lengths and one finished request of that reason (EOS counts as ``stop``,
   as in vLLM); a request that fails or is cancelled counts as finished with reason ``abort``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram

from pdserve.core.finish import LENGTH, STOP

ABORT = "abort"
FINISHED_REASONS = (STOP, LENGTH, ABORT)
# vLLM's buckets, with finer ones below 10 ms for CPU models.
TTFT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


def length_buckets(max_model_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to the context limit (vLLM's token-count buckets)."""
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max(max_model_len, 1):
                return tuple(buckets)
            buckets.append(float(value))
        scale *= 10


class RequestMetrics:
    """The request-level families of one gateway, bound to the model it serves."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        labels = ["model_name"]

        def histogram(name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
            family = Histogram(name, documentation, labels, buckets=buckets, registry=registry)
            return family.labels(model_name)

        self.e2e_latency = histogram(
            "pdserve_e2e_request_latency_seconds",
            "End-to-end latency of finished requests, arrival to last token",
            REQUEST_LATENCY_BUCKETS,
        )
        self.time_to_first_token = histogram(
            "pdserve_time_to_first_token_seconds", "Arrival to the first token sent", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "pdserve_inter_token_latency_seconds",
            "Time between consecutive output tokens sent",
            TOKEN_LATENCY_BUCKETS,
        )
        self.time_per_output_token = histogram(
            "pdserve_request_time_per_output_token_seconds",
            "Per finished request: first token to last, over the output tokens after the first",
            TOKEN_LATENCY_BUCKETS,
        )
        self.queue_time = histogram(
            "pdserve_request_queue_time_seconds",
            "Arrival to the start of the prefill forward: the wait for a prefill and in its queue",
            REQUEST_LATENCY_BUCKETS,
        )
        lengths = length_buckets(max_model_len)
        self.prompt_tokens = histogram(
            "pdserve_request_prompt_tokens", "Prompt length of finished requests", lengths
        )
        self.generation_tokens = histogram(
            "pdserve_request_generation_tokens", "Output length of finished requests", lengths
        )
        success = Counter(
            "pdserve_request_success",
            "Finished requests by finish reason (stop, length, abort)",
            ["model_name", "finished_reason"],
            registry=registry,
        )
        self.success = {reason: success.labels(model_name, reason) for reason in FINISHED_REASONS}
        self.prompt_tokens_total = Counter(
            "pdserve_prompt_tokens", "Prompt tokens of the requests prefilled", labels, registry=registry
        ).labels(model_name)
        self.generation_tokens_total = Counter(
            "pdserve_generation_tokens", "Output tokens sent", labels, registry=registry
        ).labels(model_name)

    def timer(self, clock: Callable[[], float] = time.perf_counter) -> RequestTimer:
        return RequestTimer(self, clock)


class RequestTimer:
    """One request's clock (see the module docstring for what it observes when)."""

    def __init__(self, metrics: RequestMetrics, clock: Callable[[], float]) -> None:
        self._metrics = metrics
        self._clock = clock
        self.arrived = clock()
        self._first: float | None = None
        self._last = self.arrived
        self._num_prompt_tokens = 0
        self._num_tokens = 0
        self._ended = False

    def prefilled(self, sent_at: float, prefill_queue_seconds: float, num_prompt_tokens: int) -> None:
        """The successful prefill call was sent at ``sent_at`` (this timer's clock)."""
        self._metrics.queue_time.observe(max(0.0, sent_at - self.arrived) + prefill_queue_seconds)
        self._num_prompt_tokens = num_prompt_tokens
        self._metrics.prompt_tokens_total.inc(num_prompt_tokens)

    def now(self) -> float:
        return self._clock()

    def sent(self, num_tokens: int) -> None:
        """A response with ``num_tokens`` tokens is being sent."""
        now = self._clock()
        if self._first is None:
            self._first = now
            self._metrics.time_to_first_token.observe(now - self.arrived)
        elif num_tokens:
            gap = (now - self._last) / num_tokens
            for _ in range(num_tokens):
                self._metrics.inter_token_latency.observe(gap)
        if num_tokens:
            self._last = now
        self._num_tokens += num_tokens
        self._metrics.generation_tokens_total.inc(num_tokens)

    def finished(self, reason: str) -> None:
        if self._ended:
            return
        self._ended = True
        m = self._metrics
        m.e2e_latency.observe(self._last - self.arrived)
        if self._first is not None and self._num_tokens > 1:
            m.time_per_output_token.observe((self._last - self._first) / (self._num_tokens - 1))
        m.prompt_tokens.observe(self._num_prompt_tokens)
        m.generation_tokens.observe(self._num_tokens)
        m.success[LENGTH if reason == LENGTH else STOP].inc()  # eos and stop strings: stop

    def rejected(self) -> None:
        """The request was refused before it started (bad input): not counted."""
        self._ended = True

    def aborted(self) -> None:
        """The request failed or was cancelled (no-op once it finished)."""
        if not self._ended:
            self._ended = True
            self._metrics.success[ABORT].inc()
