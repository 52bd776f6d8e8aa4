"""The decode engine: a step loop on its own thread over the running set of requests.

Lifecycle of a request here:
1. the servicer submits it with the KV pulled from the prefill; it waits while the running set is
   full (``max_running``);
2. it joins the running set at the next step: its cache is rebuilt from the received tensors;
3. at every step it advances by one token: forward of its last token with its cache, sample at
   its step index, check whether it is complete;
4. each token is handed to the servicer's stream at once; the request leaves the running set the
   step it finishes, or the step after it is cancelled.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from decode_service.metrics import DecodeMetrics
from pdserve.engine_model import EngineModel
from pdserve.finish import finish_reason
from pdserve.sampling import SamplingParams, sample

logger = logging.getLogger(__name__)

# Called on the engine thread with (new token ids, finish reason or None, error or None).
EmitFn = Callable[[list[int], str | None, BaseException | None], None]


@dataclass
class DecodeSequence:
    request_id: str
    kv: Sequence[tuple[torch.Tensor, torch.Tensor]]
    first_token_id: int
    params: SamplingParams
    emit: EmitFn
    cancelled: threading.Event = field(default_factory=threading.Event)
    num_generated: int = 1
    last_token_id: int = -1
    cache: DynamicCache | None = None

    def cancel(self) -> None:
        self.cancelled.set()


class DecodeEngine:
    def __init__(self, engine_model: EngineModel, metrics: DecodeMetrics, max_running: int) -> None:
        self._m = engine_model
        self._metrics = metrics
        self._max_running = max_running
        self._waiting: queue.Queue[DecodeSequence | None] = queue.Queue()
        self._running: list[DecodeSequence] = []
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="decode-engine", daemon=True)
        metrics.running.set_function(lambda: len(self._running))
        metrics.waiting.set_function(self._waiting.qsize)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._waiting.put(None)
        self._thread.join(timeout=30)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return self._waiting.qsize()

    def submit(self, seq: DecodeSequence) -> None:
        seq.last_token_id = seq.first_token_id
        self._waiting.put(seq)

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        if self._m.device.type == "cuda":
            torch.cuda.set_device(self._m.device)
        while not self._stopped.is_set():
            self._admit(block=not self._running)
            for seq in list(self._running):
                if seq.cancelled.is_set():
                    self._running.remove(seq)
                    continue
                try:
                    done = self._step(seq)
                except Exception as exc:
                    logger.exception("decode step failed for %s", seq.request_id)
                    seq.emit([], None, exc)
                    done = True
                if done:
                    self._running.remove(seq)
            if self._running:
                self._metrics.steps.inc()
        for seq in self._running:
            seq.emit([], None, RuntimeError("decode engine stopped"))
        self._running.clear()

    def _admit(self, block: bool) -> None:
        while len(self._running) < self._max_running:
            try:
                seq = self._waiting.get(block=block)
            except queue.Empty:
                return
            if seq is None:
                return
            block = False
            if seq.cancelled.is_set():
                continue
            reason = finish_reason(seq.first_token_id, 1, seq.params, self._m.limits.eos_token_ids)
            if reason is not None:
                seq.emit([], reason, None)
                continue
            device = self._m.device
            seq.cache = DynamicCache(
                [(k.unsqueeze(0).to(device), v.unsqueeze(0).to(device)) for k, v in seq.kv],
                config=self._m.model.config,
            )
            seq.kv = ()
            self._running.append(seq)

    def _step(self, seq: DecodeSequence) -> bool:
        input_ids = torch.tensor([[seq.last_token_id]], dtype=torch.long, device=self._m.device)
        out = self._m.model(input_ids=input_ids, cache=seq.cache, use_cache=True)
        token = sample(out.logits[0, -1], seq.params, step=seq.num_generated)
        seq.num_generated += 1
        seq.last_token_id = token
        reason = finish_reason(token, seq.num_generated, seq.params, self._m.limits.eos_token_ids)
        self._metrics.generated_tokens.inc()
        seq.emit([token], reason, None)
        return reason is not None
