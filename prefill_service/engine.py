"""The prefill engine: one prompt forward per request, the first token sampled from it.

Lifecycle of a request here:
1. the servicer validates it and submits it to the engine thread (forwards run one at a time,
   off the event loop);
2. the forward runs with a fresh cache and ``logits_to_keep=1``;
3. the first token is sampled from that forward's logits at step 0;
4. if the request is complete at that token (max_tokens=1, EOS, a stop token or stop string)
   nothing is kept; otherwise the prompt's KV is packed into one buffer on the transfer device,
   ready to be parked under a handle.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from pdserve.engine_model import EngineModel
from pdserve.finish import STOP, finish_reason
from pdserve.kv_layout import pack
from pdserve.sampling import SamplingParams, sample


@dataclass(frozen=True)
class PrefillResult:
    first_token_id: int
    finish_reason: str | None
    kv_buffer: torch.Tensor | None
    num_tokens: int
    forward_seconds: float


class PrefillEngine:
    def __init__(self, engine_model: EngineModel, transfer_device: torch.device) -> None:
        self._m = engine_model
        self._transfer_device = transfer_device
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefill")

    async def run(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> PrefillResult:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._prefill, list(prompt_token_ids), params)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    @torch.inference_mode()
    def _prefill(self, prompt_token_ids: list[int], params: SamplingParams) -> PrefillResult:
        m = self._m
        start = time.perf_counter()
        input_ids = torch.tensor([prompt_token_ids], dtype=torch.long, device=m.device)
        cache = DynamicCache(config=m.model.config)
        out = m.model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1)
        token = sample(out.logits[0, -1], params, step=0)
        reason = finish_reason(token, 1, params, m.limits.eos_token_ids)
        if reason is None and params.stop and self._hits_stop_string(token, params.stop):
            reason = STOP
        buffer = None
        if reason is None:
            layers = [(layer.keys, layer.values) for layer in cache.layers]
            buffer = pack(layers, m.kv_layout, 0, 0, len(prompt_token_ids), self._transfer_device)
        if m.device.type == "cuda":
            torch.cuda.synchronize(m.device)
        return PrefillResult(token, reason, buffer, len(prompt_token_ids), time.perf_counter() - start)

    def _hits_stop_string(self, token: int, stop: Sequence[str]) -> bool:
        text: str = self._m.tokenizer.decode([token], skip_special_tokens=True)
        return any(s in text for s in stop)
