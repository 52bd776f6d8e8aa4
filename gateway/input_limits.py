"""The public request checks at the gateway's edge, shared by the gRPC and HTTP APIs.

Each check costs at most one pass over the field it checks and runs before any tokenization,
templating or backend call; a request beyond a bound of ``RequestLimits`` raises ValueError naming
the field and the bound (INVALID_ARGUMENT, HTTP 400). Counts are compared before anything is
iterated, so a hostile list is refused in time proportional to nothing but its length check.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from pdserve.config import RequestLimits
from pdserve.core.sampling import MAX_BAD_WORDS
from pdserve.v1 import gateway_pb2, sampling_pb2

REQUEST_ID = re.compile(r"[\x21-\x7e]*")


class InputLimits:
    def __init__(self, limits: RequestLimits) -> None:
        self.limits = limits

    def check_generate(self, request: gateway_pb2.GenerateRequest) -> None:
        """A gRPC GenerateRequest, before its sampling params are converted."""
        self.check_request_id(request.request_id)
        self.check_prompt_text(request.prompt)
        self.check_prompt_ids(len(request.prompt_token_ids))
        self.check_sampling(request.sampling)

    def check_sampling(self, sampling: sampling_pb2.SamplingParams) -> None:
        self.check_stop(sampling.stop)
        self.check_bad_words(sampling.bad_words)
        self.check_stop_token_ids(len(sampling.stop_token_ids))
        if sampling.HasField("n"):
            self.check_n(sampling.n)
        for name in ("logprobs", "prompt_logprobs"):
            if sampling.HasField(name):
                self.check_logprobs(f"sampling.{name}", getattr(sampling, name))

    def check_n(self, n: int) -> None:
        bound = self.limits.max_n
        if not 1 <= n <= bound:
            raise ValueError(f"n must be in [1, {bound}] (choices of one request), got {n}")

    def check_logprobs(self, field: str, count: int) -> None:
        """A logprobs count against ``max_logprobs`` (-1: only the vocabulary bounds it)."""
        bound = self.limits.max_logprobs
        if bound >= 0 and count > bound:
            raise ValueError(f"{field} = {count} is above the most this gateway serves ({bound})")

    def check_request_id(self, request_id: str) -> None:
        bound = self.limits.max_request_id_bytes
        if len(request_id) > bound:
            raise ValueError(f"request_id has {len(request_id)} characters; at most {bound} are allowed")
        if not REQUEST_ID.fullmatch(request_id):
            raise ValueError(
                "request_id may hold only printable ASCII characters without spaces ('!' to '~')"
            )

    def check_prompt(self, request: gateway_pb2.GenerateRequest) -> None:
        """One prompt of an HTTP completions request, as text or token ids."""
        self.check_prompt_text(request.prompt)
        self.check_prompt_ids(len(request.prompt_token_ids))

    def check_prompt_count(self, count: int) -> None:
        """The prompts of one completions request: each is a request the gateway serves at once."""
        bound = self.limits.max_in_flight
        if count > bound:
            raise ValueError(
                f"prompt is a batch of {count} prompts; at most {bound} are served at once (--max-in-flight)"
            )

    def check_prompt_text(self, text: str) -> None:
        self.check_texts("prompt", (text,))

    def check_texts(self, field: str, texts: Sequence[str]) -> None:
        """Texts that are tokenized together (a prompt, a chat's messages): valid UTF-8, and no
        more than ``max_prompt_bytes`` of it."""
        bound = self.limits.max_prompt_bytes
        total = 0
        for text in texts:
            total += len(text)  # characters: a lower bound of the bytes
            if total > bound:
                raise ValueError(f"{field} is longer than {bound} bytes")
        total = 0
        for text in texts:
            total += utf8_size(field, text)
            if total > bound:
                raise ValueError(f"{field} is longer than {bound} bytes")

    def check_prompt_ids(self, count: int) -> None:
        bound = self.limits.max_prompt_token_ids
        if count > bound:
            raise ValueError(f"prompt_token_ids has {count} ids; at most {bound} are allowed")

    def check_stop(self, stop: Sequence[str]) -> None:
        count, bound = len(stop), self.limits.max_stop_strings
        if count > bound:
            raise ValueError(f"sampling.stop has {count} strings; at most {bound} are allowed")
        self._check_stop_bytes("sampling.stop", "sampling.stop strings", stop)

    def check_bad_words(self, words: Sequence[str]) -> None:
        """As many words as token sequences may be served (``MAX_BAD_WORDS``), and no more bytes
        than stop strings may have."""
        if len(words) > MAX_BAD_WORDS:
            raise ValueError(
                f"sampling.bad_words has {len(words)} words; at most {MAX_BAD_WORDS} are allowed"
            )
        self._check_stop_bytes("sampling.bad_words", "sampling.bad_words", words)

    def _check_stop_bytes(self, field: str, what: str, strings: Sequence[str]) -> None:
        """The UTF-8 bytes of ``strings`` together against ``max_stop_bytes``."""
        total, bound = 0, self.limits.max_stop_bytes
        for text in strings:
            total += utf8_size(field, text)
            if total > bound:
                raise ValueError(f"{what} are longer than {bound} bytes together")

    def check_stop_token_ids(self, count: int) -> None:
        bound = self.limits.max_stop_token_ids
        if count > bound:
            raise ValueError(f"sampling.stop_token_ids has {count} ids; at most {bound} are allowed")


def utf8_size(field: str, text: str) -> int:
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate (JSON may carry one)
        raise ValueError(f"{field} is not valid Unicode text (it holds a lone surrogate)") from None
