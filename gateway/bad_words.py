"""vLLM's ``bad_words`` as token sequences, by the model's tokenizer, before a request leaves the
gateway.

As vLLM: each word (its leading spaces dropped) is tokenized without special tokens, alone and after
one space; the spaced form is kept too when it starts with another token and has as many tokens
(a word in the middle of a text). Repeated words count once. A word that tokenizes to nothing is
refused, and so are more than ``MAX_BAD_WORDS`` sequences in all (ValueError: INVALID_ARGUMENT,
HTTP 400). The engines then mask each sequence's last token wherever the output ends with the rest
(``pdserve.core.logits_processing``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pdserve.core.sampling import MAX_BAD_WORDS, SamplingParams


def bad_words_token_ids(words: tuple[str, ...], tokenizer: Any) -> tuple[tuple[int, ...], ...]:
    sequences: list[tuple[int, ...]] = []
    for word in dict.fromkeys(words):
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            raise ValueError(f"sampling.bad_words entry {word[:32]!r} tokenizes to no tokens")
        sequences.append(plain)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
        if len(sequences) > MAX_BAD_WORDS:
            raise ValueError(
                f"sampling.bad_words give more than {MAX_BAD_WORDS} token sequences; at most "
                f"{MAX_BAD_WORDS} are allowed"
            )
    return tuple(sequences)


def resolved(params: SamplingParams, tokenizer: Any) -> SamplingParams:
    """``params`` with its bad words as token sequences (after any it was given as ids)."""
    if not params.bad_words:
        return params
    sequences = params.bad_words_token_ids + bad_words_token_ids(params.bad_words, tokenizer)
    return dataclasses.replace(params, bad_words=(), bad_words_token_ids=tuple(dict.fromkeys(sequences)))
