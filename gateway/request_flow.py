"""One request through the disaggregated path, as the gateway drives it.

1. tokenize and validate the request; choose a seed when it samples without one;
2. Prefill on the least-loaded prefill: its forward samples the first token and parks the KV;
3. stream that first token to the client at once (detokenized, stop strings applied);
4. if the request is complete at its first token, it ends here: decode is never called;
5. otherwise Decode on the least-loaded decode with the KV handle, relaying its stream;
6. a stop string ends the stream and cancels decode; if the request ends in any way before decode
   has pulled the KV (client cancel, error, stop), the KV is released on the prefill.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from gateway.backends import BackendPool
from gateway.metrics import GatewayMetrics
from gateway.prompt_input import PromptInput
from gateway.text_stream import TextChunk, TextStream
from pdserve.finish import STOP
from pdserve.rpc_errors import RpcError
from pdserve.sampling import SamplingParams
from pdserve.sampling_proto import sampling_to_proto
from pdserve.v1 import decode_pb2, decode_pb2_grpc, gateway_pb2, kv_pb2, prefill_pb2, prefill_pb2_grpc

logger = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 5.0


class RequestFlow:
    def __init__(
        self,
        prompts: PromptInput,
        tokenizer: Any,
        prefills: BackendPool[prefill_pb2_grpc.PrefillStub],
        decodes: BackendPool[decode_pb2_grpc.DecodeStub],
        metrics: GatewayMetrics,
    ) -> None:
        self._prompts = prompts
        self._tokenizer = tokenizer
        self._prefills = prefills
        self._decodes = decodes
        self._metrics = metrics
        self._background: set[asyncio.Task[None]] = set()

    async def generate(
        self, request: gateway_pb2.GenerateRequest, params: SamplingParams
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        request_id = request.request_id or secrets.token_hex(8)
        prompt_ids = self._prompts.token_ids(request, params)
        if not params.is_greedy and params.seed is None:
            params = dataclasses.replace(params, seed=secrets.randbits(63))
        started = time.perf_counter()
        sampling = sampling_to_proto(params)
        text = TextStream(self._tokenizer, params.stop)

        prefill = self._prefills.pick()
        prefill.outstanding += 1
        try:
            first = await prefill.stub.Prefill(
                prefill_pb2.PrefillRequest(
                    request_id=request_id, prompt_token_ids=prompt_ids, sampling=sampling
                )
            )
        except grpc.aio.AioRpcError as exc:
            raise _relay(exc, f"prefill {prefill.address}", delivered=0) from exc
        finally:
            prefill.outstanding -= 1
        self._metrics.ttft_seconds.observe(time.perf_counter() - started)

        handle = first.kv_handle if first.HasField("kv_handle") else None
        pulled_or_released = handle is None
        try:
            chunk = text.add([first.first_token_id])
            reason = STOP if chunk.stopped else (first.finish_reason or None)
            if reason is not None and not chunk.stopped:
                chunk = _join(chunk, text.finish())
            yield _response(chunk, reason, request_id=request_id, num_prompt_tokens=len(prompt_ids))
            if reason is not None:
                self._metrics.finished.labels(reason).inc()
                return
            if handle is None:
                raise RpcError(
                    grpc.StatusCode.INTERNAL, "prefill returned neither a finish reason nor a KV handle"
                )

            async for response in self._decode(request_id, handle, first.first_token_id, sampling, text):
                pulled_or_released = True  # decode answers only after its pull
                yield response
        finally:
            if not pulled_or_released and handle is not None:
                self._release_later(prefill.stub, handle)

    async def _decode(
        self,
        request_id: str,
        handle: kv_pb2.KvHandle,
        first_token_id: int,
        sampling: Any,
        text: TextStream,
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        decode = self._decodes.pick()
        decode.outstanding += 1
        self._metrics.decode_calls.inc()
        call = decode.stub.Decode(
            decode_pb2.DecodeRequest(
                request_id=request_id, kv_handle=handle, first_token_id=first_token_id, sampling=sampling
            )
        )
        try:
            async for message in call:
                chunk = text.add(list(message.token_ids))
                reason = STOP if chunk.stopped else (message.finish_reason or None)
                if reason is not None and not chunk.stopped:
                    chunk = _join(chunk, text.finish())
                yield _response(chunk, reason)
                if reason is not None:
                    self._metrics.finished.labels(reason).inc()
                    return
            raise RpcError(grpc.StatusCode.INTERNAL, "decode stream ended without a finish reason")
        except grpc.aio.AioRpcError as exc:
            raise _relay(exc, f"decode {decode.address}", delivered=text.num_tokens) from exc
        finally:
            decode.outstanding -= 1
            call.cancel()

    def _release_later(self, stub: prefill_pb2_grpc.PrefillStub, handle: kv_pb2.KvHandle) -> None:
        async def release() -> None:
            try:
                response = await stub.ReleaseKv(
                    prefill_pb2.ReleaseKvRequest(handle_id=handle.id), timeout=RELEASE_TIMEOUT_S
                )
                if response.released:
                    self._metrics.kv_releases.inc()
            except grpc.aio.AioRpcError as exc:
                logger.warning("release of KV %s failed: %s", handle.id.hex(), exc.details())

        task = asyncio.get_running_loop().create_task(release())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)


def _join(a: TextChunk, b: TextChunk) -> TextChunk:
    return TextChunk(a.token_ids + b.token_ids, a.text + b.text, a.stopped or b.stopped)


def _response(
    chunk: TextChunk, reason: str | None, request_id: str = "", num_prompt_tokens: int = 0
) -> gateway_pb2.GenerateResponse:
    return gateway_pb2.GenerateResponse(
        token_ids=chunk.token_ids,
        text=chunk.text,
        finish_reason=reason or "",
        request_id=request_id,
        num_prompt_tokens=num_prompt_tokens,
    )


def _relay(exc: grpc.aio.AioRpcError, where: str, delivered: int) -> RpcError:
    code = exc.code()
    if code in (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.NOT_FOUND,
    ):
        return RpcError(code, exc.details() or "")
    if code == grpc.StatusCode.CANCELLED:
        return RpcError(code, f"{where} cancelled the request")
    return RpcError(
        grpc.StatusCode.UNAVAILABLE,
        f"{where} failed ({code.name}: {exc.details()}) after {delivered} tokens were delivered",
    )
