"""What a request may ask of a model: vocabulary, context length, end-of-sequence ids."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.core.logprobs import check_count
from pdserve.core.sampling import SamplingParams


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    max_model_len: int
    eos_token_ids: frozenset[int]

    @classmethod
    def from_config(cls, config: Any, max_model_len: int, eos_token_ids: frozenset[int]) -> ModelLimits:
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        model_len = int(getattr(text_config, "max_position_embeddings", 0) or 0)
        if max_model_len:
            model_len = min(model_len, max_model_len) if model_len else max_model_len
        if model_len <= 0:
            raise ValueError("the model config has no max_position_embeddings; set max_model_len")
        return cls(int(text_config.vocab_size), model_len, eos_token_ids)

    def check_sampling(self, params: SamplingParams) -> None:
        """Raises ValueError naming the field when a token id of ``params`` is outside the vocabulary."""
        for name in ("stop_token_ids", "allowed_token_ids"):
            for token in getattr(params, name):
                if token >= self.vocab_size:
                    raise ValueError(
                        f"sampling.{name} has {token}, outside the vocabulary [0, {self.vocab_size})"
                    )
        for token, _ in params.logit_bias:
            if token >= self.vocab_size:
                raise ValueError(
                    f"sampling.logit_bias has token id {token}, outside the vocabulary [0, {self.vocab_size})"
                )
        for sequence in params.bad_words_token_ids:
            for token in sequence:
                if token >= self.vocab_size:
                    raise ValueError(
                        f"sampling.bad_words_token_ids has {token}, outside the vocabulary [0, {self.vocab_size})"
                    )

    def check_request(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, num_generated: int = 0
    ) -> None:
        """Raises ValueError naming the field when the request does not fit this model.

        ``num_generated``: the last tokens of ``prompt_token_ids`` that the request already
        generated (a resumed request); ``max_tokens`` counts them."""
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        if not 0 <= num_generated < len(prompt_token_ids):
            raise ValueError(
                f"num_generated = {num_generated} must be below the number of prompt_token_ids "
                f"({len(prompt_token_ids)}): at least one token is the prompt"
            )
        if num_generated >= params.max_tokens:
            raise ValueError(
                f"num_generated = {num_generated} must be below sampling.max_tokens = {params.max_tokens} "
                "(a request with max_tokens tokens is complete)"
            )
        for i, token in enumerate(prompt_token_ids):
            if not 0 <= token < self.vocab_size:
                raise ValueError(
                    f"prompt_token_ids[{i}] = {token} is outside the vocabulary [0, {self.vocab_size})"
                )
        self.check_sampling(params)
        check_count("sampling.logprobs", params.logprobs, self.vocab_size)
        check_count("sampling.prompt_logprobs", params.prompt_logprobs, self.vocab_size)
        num_prompt = len(prompt_token_ids) - num_generated
        if num_prompt >= self.max_model_len:
            raise ValueError(
                f"prompt has {num_prompt} tokens; the model's context is {self.max_model_len} "
                "(the prompt must leave room for at least one new token)"
            )
        if num_prompt + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"sampling.max_tokens = {params.max_tokens} is beyond the context: prompt ({num_prompt}) "
                f"+ max_tokens must be <= {self.max_model_len}"
            )
