"""The ``pdserve generate`` client: builds a ``GenerateRequest`` and streams the answer.

Sampling options the user does not pass stay unset in the request (proto3 ``optional``), so the
server applies its own defaults; an option passed explicitly, even ``--temperature 0``, is set.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from collections.abc import Sequence
from typing import TextIO

import grpc

from pdserve.rpc.channel_security import PLAIN, ChannelSecurity
from pdserve.rpc.client_flags import add_tls_client_arguments, tls_from_args
from pdserve.v1 import gateway_pb2, gateway_pb2_grpc, sampling_pb2

DEFAULT_ADDRESS = "127.0.0.1:50051"
API_KEY_ENV = "PDSERVE_API_KEY"
MAX_UINT32 = 2**32 - 1
MAX_UINT64 = 2**64 - 1
MAX_INT32 = 2**31 - 1


def parse_int_list(text: str) -> list[int]:
    """``"1, 2,3"`` -> ``[1, 2, 3]``; raises ValueError on anything else."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    try:
        return [int(part) for part in parts]
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None


def _argparse_int_list(text: str) -> list[int]:
    try:
        return parse_int_list(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def build_request(
    *,
    prompt: str | None = None,
    prompt_ids: Sequence[int] | None = None,
    chat: bool = False,
    request_id: str = "",
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
) -> gateway_pb2.GenerateRequest:
    """A request from exactly one of ``prompt`` / ``prompt_ids``; ``None`` options stay unset.

    Raises ValueError with a message meant for the user on a bad combination or value.
    """
    if prompt is not None and prompt_ids is not None:
        raise ValueError("give either a prompt or --prompt-ids, not both")
    if prompt is None and prompt_ids is None:
        raise ValueError("a prompt is required (positional, --prompt, or --prompt-ids)")
    if prompt is not None and not prompt:
        raise ValueError("the prompt must not be empty")
    if prompt_ids is not None:
        if not prompt_ids:
            raise ValueError("--prompt-ids must list at least one token id")
        if any(not 0 <= token <= MAX_INT32 for token in prompt_ids):
            raise ValueError("--prompt-ids must be non-negative token ids")
        if chat:
            raise ValueError("--chat applies to a text prompt, not to --prompt-ids")
    if max_tokens is not None and not 1 <= max_tokens <= MAX_UINT32:
        raise ValueError(f"--max-tokens must be >= 1, got {max_tokens}")
    if temperature is not None and not temperature >= 0:
        raise ValueError(f"--temperature must be >= 0, got {temperature}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {top_p}")
    if top_k is not None and not 0 <= top_k <= MAX_INT32:
        raise ValueError(f"--top-k must be >= 0, got {top_k}")
    if seed is not None and not 0 <= seed <= MAX_UINT64:
        raise ValueError(f"--seed must be in [0, 2**64), got {seed}")
    if any(not text for text in stop):
        raise ValueError("--stop strings must not be empty")
    if any(not 0 <= token <= MAX_INT32 for token in stop_token_ids):
        raise ValueError("--stop-token-ids must be non-negative token ids")

    sampling = sampling_pb2.SamplingParams(stop=list(stop), stop_token_ids=list(stop_token_ids))
    sampling.ignore_eos = ignore_eos
    if max_tokens is not None:
        sampling.max_tokens = max_tokens
    if temperature is not None:
        sampling.temperature = temperature
    if top_p is not None:
        sampling.top_p = top_p
    if top_k is not None:
        sampling.top_k = top_k
    if seed is not None:
        sampling.seed = seed
    request = gateway_pb2.GenerateRequest(request_id=request_id, sampling=sampling, apply_chat_template=chat)
    if prompt is not None:
        request.prompt = prompt
    else:
        request.prompt_token_ids.extend(prompt_ids or ())
    return request


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``pdserve generate``."""
    parser.add_argument(
        "prompt", nargs="?", default=None, help="text prompt (or use --prompt / --prompt-ids)"
    )
    parser.add_argument("--prompt", dest="prompt_flag", default=None, help="text prompt, as a flag")
    parser.add_argument(
        "--prompt-ids", type=_argparse_int_list, default=None, help="prompt as token ids, e.g. 1,2,3"
    )
    parser.add_argument(
        "--address", default=DEFAULT_ADDRESS, help=f"gateway HOST:PORT (default {DEFAULT_ADDRESS})"
    )
    parser.add_argument("--request-id", default="", help="request id (the gateway makes one up if empty)")
    parser.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user message (chat template)"
    )
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens to generate (server default 16)")
    parser.add_argument("--temperature", type=float, default=None, help="0 is greedy (server default 1.0)")
    parser.add_argument(
        "--top-p", type=float, default=None, help="nucleus mass in (0, 1] (server default 1.0)"
    )
    parser.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens; 0 keeps all")
    parser.add_argument("--seed", type=int, default=None, help="seed of the request's random stream")
    parser.add_argument(
        "--stop", action="append", default=None, help="stop string (repeat the flag for several)"
    )
    parser.add_argument(
        "--stop-token-ids", type=_argparse_int_list, default=None, help="stop token ids, e.g. 2,7"
    )
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    parser.add_argument("--json", action="store_true", help="print one JSON object per streamed chunk")
    parser.add_argument(
        "--timeout-s", type=float, default=0.0, help="deadline of the whole call in seconds (0: none)"
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV, ""),
        help=f"the gateway's API key, sent as `authorization: Bearer KEY` (env {API_KEY_ENV})",
    )
    add_tls_client_arguments(parser)


def request_from_args(args: argparse.Namespace) -> gateway_pb2.GenerateRequest:
    """The request described by parsed ``pdserve generate`` flags; raises ValueError."""
    prompt: str | None = args.prompt
    prompt_flag: str | None = args.prompt_flag
    if prompt is not None and prompt_flag is not None:
        raise ValueError("give the prompt either positionally or with --prompt, not both")
    return build_request(
        prompt=prompt if prompt is not None else prompt_flag,
        prompt_ids=args.prompt_ids,
        chat=args.chat,
        request_id=args.request_id,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop or (),
        stop_token_ids=args.stop_token_ids or (),
        ignore_eos=args.ignore_eos,
    )


def chunk_json(response: gateway_pb2.GenerateResponse) -> str:
    """One streamed chunk as the JSON line of ``--json`` mode."""
    return json.dumps(
        {
            "token_ids": list(response.token_ids),
            "text": response.text,
            "finish_reason": response.finish_reason,
        },
        ensure_ascii=False,
    )


async def stream_generate(
    address: str,
    request: gateway_pb2.GenerateRequest,
    out: TextIO,
    *,
    json_mode: bool = False,
    timeout_s: float | None = None,
    security: ChannelSecurity = PLAIN,
) -> None:
    """Streams one request to ``out``: text as it arrives then a newline, or one JSON line per chunk.

    ``security``: the API key and TLS of the call. A failed call raises ``grpc.aio.AioRpcError``;
    in text mode what arrived before is already written, followed by a newline.
    """
    async with security.aio_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        call = stub.Generate(request, timeout=timeout_s)
        wrote_text = False
        try:
            async for response in call:
                if json_mode:
                    out.write(chunk_json(response) + "\n")
                elif response.text:
                    out.write(response.text)
                    wrote_text = True
                out.flush()
        except BaseException:
            if wrote_text:
                out.write("\n")
                out.flush()
            raise
        if not json_mode:
            out.write("\n")
            out.flush()


def run_generate(args: argparse.Namespace) -> int:
    """``pdserve generate``: 0 on success, 1 on a gRPC error, 2 on bad arguments."""
    try:
        request = request_from_args(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    timeout_s: float = args.timeout_s
    if timeout_s < 0:
        print(f"error: --timeout-s must be >= 0, got {timeout_s}", file=sys.stderr)
        return 2
    try:
        security = tls_from_args(args, ChannelSecurity.public(args.api_key).metadata)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        asyncio.run(
            stream_generate(
                args.address,
                request,
                sys.stdout,
                json_mode=args.json,
                timeout_s=timeout_s or None,
                security=security,
            )
        )
    except grpc.aio.AioRpcError as error:
        print(f"error: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. piped into `head`: stop quietly
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return 0
