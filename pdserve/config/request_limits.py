"""Bounds on what one public request may bring, and on how many the gateway holds at once.

The gateway checks every public request against them at its edge (``gateway.input_limits``) before
any tokenization or backend call: a request beyond a bound is INVALID_ARGUMENT (HTTP 400; a body
beyond ``max_body_bytes`` is HTTP 413, and a gRPC message beyond it is refused by gRPC itself with
RESOURCE_EXHAUSTED). ``max_in_flight`` bounds the requests the gateway serves at once: one more is
RESOURCE_EXHAUSTED (HTTP 429 with ``Retry-After``) at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.config.checks import check_at_least

MIB = 1024 * 1024


@dataclass(frozen=True)
class RequestLimits:
    max_stop_strings: int = field(default=64, metadata={"help": "most stop strings of one request"})
    max_stop_bytes: int = field(
        default=16384, metadata={"help": "most UTF-8 bytes of one request's stop strings together"}
    )
    max_stop_token_ids: int = field(default=1024, metadata={"help": "most stop token ids of one request"})
    max_request_id_bytes: int = field(
        default=256,
        metadata={"help": "longest request id (printable ASCII without spaces: '!' to '~')"},
    )
    max_prompt_bytes: int = field(
        default=MIB, metadata={"help": "most UTF-8 bytes of a prompt (or chat messages) before tokenization"}
    )
    max_prompt_token_ids: int = field(
        default=131072, metadata={"help": "most prompt token ids of one request (the context bounds it too)"}
    )
    max_body_bytes: int = field(
        default=4 * MIB,
        metadata={"help": "largest HTTP request body (413 beyond) and gRPC request message"},
    )
    max_in_flight: int = field(
        default=256,
        metadata={"help": "most requests the gateway serves at once; more are refused at once (429)"},
    )
    retry_after_s: int = field(
        default=1, metadata={"help": "the Retry-After (seconds) of a request refused for overload"}
    )
    max_logprobs: int = field(
        default=20,
        metadata={
            "help": "most logprobs, top_logprobs or prompt_logprobs one request may ask for, as vLLM's "
            "--max-logprobs (-1: up to the whole vocabulary)"
        },
    )
    tokenizer_threads: int = field(
        default=2,
        metadata={"help": "threads that tokenize prompts and apply chat templates off the event loop"},
    )

    def __post_init__(self) -> None:
        for name in (
            "max_stop_strings",
            "max_stop_bytes",
            "max_stop_token_ids",
            "max_request_id_bytes",
            "max_prompt_bytes",
            "max_prompt_token_ids",
            "max_in_flight",
            "retry_after_s",
            "tokenizer_threads",
        ):
            check_at_least(name, getattr(self, name), 1)
        check_at_least("max_body_bytes", self.max_body_bytes, 1024)
        check_at_least("max_logprobs", self.max_logprobs, -1)
