"""One streaming request to an OpenAI-compatible server, timed chunk by chunk.

1. POST ``/v1/completions`` (or ``/v1/chat/completions``) with ``stream: true`` and
   ``stream_options.include_usage`` so the server reports its own completion token count.
2. Each SSE ``data:`` event that carries a choice is one streamed chunk, even with empty text:
   the first one's arrival is the TTFT, the gaps between later ones are the ITLs, and the last
   one ends the request (vLLM's serving-benchmark definitions).
3. The ``usage`` event gives ``completion_tokens``, ``prompt_tokens`` (which then replaces
   the workload's prompt length) and, where the server reports it,
   ``prompt_tokens_details.cached_tokens`` (prompt tokens served from its prefix cache);
   ``[DONE]`` ends the stream.
A failed request is recorded with its error, never raised.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

DATA_PREFIX = "data:"


@dataclass
class RequestRecord:
    """What one request produced and when (seconds, ``time.perf_counter`` based)."""

    prompt_len: int
    max_tokens: int
    success: bool = False
    error: str = ""
    start_s: float = 0.0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    generated_text: str = ""
    num_chunks: int = 0
    output_tokens: int = 0
    usage_output_tokens: int | None = None
    cached_tokens: int | None = None  # None: the server did not say


def build_payload(
    endpoint: str,
    model: str,
    prompt: list[int] | str,
    max_tokens: int,
    temperature: float,
    ignore_eos: bool,
    extra_body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON body of one streaming request (vLLM's extra fields included), ``extra_body`` last."""
    payload: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        payload["ignore_eos"] = True
    if endpoint == "chat":
        payload["messages"] = [{"role": "user", "content": prompt}]
        payload["max_completion_tokens"] = max_tokens
    else:
        payload["prompt"] = prompt
    payload.update(extra_body or {})
    return payload


def endpoint_path(endpoint: str) -> str:
    return "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"


def _chunk_text(choice: dict[str, Any]) -> str:
    if "delta" in choice:
        delta = choice.get("delta") or {}
        return str(delta.get("content") or delta.get("reasoning_content") or "")
    return str(choice.get("text") or "")


async def stream_request(
    session: aiohttp.ClientSession,
    url: str,
    payload: dict[str, Any],
    record: RequestRecord,
    timeout_s: float,
) -> RequestRecord:
    """Sends ``payload`` to ``url`` and fills ``record`` with timings, text and token count."""
    start = time.perf_counter()
    record.start_s = start
    last = start
    try:
        async with session.post(
            url, json=payload, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as response:
            if response.status != 200:
                body = (await response.text())[:500]
                record.error = f"HTTP {response.status}: {body}"
                return record
            async for raw in response.content:
                line = raw.decode("utf-8", errors="replace").strip()
                if not line.startswith(DATA_PREFIX):
                    continue
                data = line[len(DATA_PREFIX) :].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if not isinstance(event, dict):
                    continue
                if "error" in event:
                    record.error = f"stream error: {json.dumps(event['error'])[:500]}"
                    return record
                choices = event.get("choices") or []
                if choices:
                    now = time.perf_counter()
                    if record.num_chunks == 0:
                        record.ttft_s = now - start
                    else:
                        record.itl_s.append(now - last)
                    last = now
                    record.num_chunks += 1
                    record.generated_text += _chunk_text(choices[0])
                usage = event.get("usage")
                if isinstance(usage, dict):
                    if usage.get("completion_tokens") is not None:
                        record.usage_output_tokens = int(usage["completion_tokens"])
                    if usage.get("prompt_tokens") is not None:
                        record.prompt_len = int(usage["prompt_tokens"])
                    details = usage.get("prompt_tokens_details")
                    if isinstance(details, dict) and details.get("cached_tokens") is not None:
                        record.cached_tokens = int(details["cached_tokens"])
    except (aiohttp.ClientError, TimeoutError, ValueError) as error:
        record.error = f"{type(error).__name__}: {error}"
        return record
    record.latency_s = last - start
    if record.num_chunks == 0:
        record.error = "the stream ended without any chunk"
        return record
    record.success = True
    return record


async def first_model_id(session: aiohttp.ClientSession, base_url: str) -> str:
    """The first model id of ``GET /v1/models``; raises RuntimeError when there is none."""
    async with session.get(f"{base_url}/v1/models", timeout=aiohttp.ClientTimeout(total=30)) as response:
        if response.status != 200:
            raise RuntimeError(f"GET {base_url}/v1/models answered HTTP {response.status}")
        body = await response.json()
    models = body.get("data") or []
    if not models or not isinstance(models[0], dict) or not models[0].get("id"):
        raise RuntimeError(f"GET {base_url}/v1/models lists no model; pass --model")
    return str(models[0]["id"])
