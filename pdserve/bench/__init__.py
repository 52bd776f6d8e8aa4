"""``pdserve bench``: a serving benchmark client for any OpenAI-compatible endpoint.

1. ``workload`` draws the requests (prompt as token ids or text, prompt and output lengths) and
   their arrival times (all at once, or a seeded Poisson process).
2. ``runner`` sends the warm-up requests one at a time, then the measured ones under a
   concurrency cap, streaming each through ``openai_client`` (SSE), which times every chunk;
   ``cpu_time`` takes the server processes' CPU seconds around the measured part.
3. ``metrics`` turns the per-request records into throughput, TTFT / TPOT / ITL / E2E latency
   statistics and goodput under SLOs, with the same definitions as vLLM's serving benchmark.
4. ``report`` writes the result as JSON or a table; ``benchmark`` runs 1-4 for one config;
   ``command`` wires the CLI, and ``launch`` can start ``pdserve up`` itself for the run.
5. ``compare`` puts several JSON results side by side (``scripts/bench_peers.sh``).
"""
