"""vLLM's bad words, one part at a time: the words as token sequences (alone and after a space),
the mask of each sequence's last token where the output ends with the rest (output tokens only,
resumed requests included), their bounds, and the proto round trip."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from gateway.bad_words import bad_words_token_ids, resolved
from pdserve.core.limits import ModelLimits
from pdserve.core.logits_processing import LogitsProcessor, request_processor
from pdserve.core.sampling import MAX_BAD_WORDS, SamplingParams
from pdserve.model.source import resolve_model_dir
from pdserve.rpc.sampling_proto import sampling_from_proto, sampling_to_proto

EOS = 0
BAD = ((7,), (3, 5), (1, 2, 9))


def masked(processor: LogitsProcessor) -> set[int]:
    scores = processor.apply(torch.zeros(16))
    return {i for i in range(16) if scores[i] == float("-inf")}


def test_a_sequences_last_token_is_masked_where_the_output_ends_with_the_rest() -> None:
    params = SamplingParams(temperature=0.0, bad_words_token_ids=BAD)
    processor = request_processor(params, {EOS}, [4, 3, 1, 2], 0)  # the prompt ends with 3 and 1, 2
    assert processor is not None
    assert masked(processor) == {7}  # only output tokens count
    processor.append(3)
    assert masked(processor) == {7, 5}
    processor.append(1)
    assert masked(processor) == {7}
    processor.append(2)
    assert masked(processor) == {7, 9}
    processor.append(2)
    assert masked(processor) == {7}


def test_a_resumed_request_counts_the_tokens_it_generated() -> None:
    params = SamplingParams(temperature=0.0, bad_words_token_ids=BAD)
    resumed = request_processor(params, {EOS}, [4, 4, 1, 2], 2)  # 1, 2 were generated
    fresh = request_processor(params, {EOS}, [4, 4, 1, 2], 1)  # only 2 was
    assert resumed is not None and fresh is not None
    assert masked(resumed) == {7, 9} and masked(fresh) == {7}


def test_bad_words_need_the_requests_history() -> None:
    params = SamplingParams(bad_words_token_ids=((3, 5),))
    assert params.needs_history and params.has_processors and not params.has_penalties


def test_words_become_vllms_token_sequences(cache_dir: Path) -> None:
    tokenizer: Any = AutoTokenizer.from_pretrained(resolve_model_dir("tiny-llama", cache_dir))

    def encode(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=False))

    for word in ("hello", "  world", "capital city", "é"):
        plain, spaced = encode(word.lstrip()), encode(" " + word.lstrip())
        expected = [plain]
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            expected.append(spaced)
        assert list(bad_words_token_ids((word,), tokenizer)) == expected, word
    assert bad_words_token_ids(("hello", "hello"), tokenizer) == bad_words_token_ids(("hello",), tokenizer)
    with pytest.raises(ValueError, match="tokenizes to no tokens"):
        bad_words_token_ids(("   ",), tokenizer)
    with pytest.raises(ValueError, match="at most 128"):
        bad_words_token_ids(tuple(f"word{i}" for i in range(MAX_BAD_WORDS + 1)), tokenizer)
    params = resolved(SamplingParams(bad_words=("hello",), bad_words_token_ids=((5,),)), tokenizer)
    assert params.bad_words == () and params.bad_words_token_ids[0] == (5,)
    assert params.bad_words_token_ids[1:] == bad_words_token_ids(("hello",), tokenizer)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"bad_words": ("",)}, "empty strings"),
        ({"bad_words_token_ids": ((),)}, "non-empty"),
        ({"bad_words_token_ids": ((1, -2),)}, ">= 0"),
        ({"bad_words_token_ids": tuple((i,) for i in range(MAX_BAD_WORDS + 1))}, "at most 128"),
        ({"bad_words_token_ids": ((1,) * 4097,)}, "at most 4096"),
    ],
)
def test_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


def test_ids_outside_the_vocabulary_are_refused() -> None:
    limits = ModelLimits(vocab_size=100, max_model_len=64, eos_token_ids=frozenset({EOS}))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        limits.check_sampling(SamplingParams(bad_words_token_ids=((1, 100),)))


def test_the_proto_carries_words_and_sequences() -> None:
    params = SamplingParams(bad_words=("a b",), bad_words_token_ids=((1, 2), (3,)))
    assert sampling_from_proto(sampling_to_proto(params)) == params
