"""Text through the stack: tokenized prompts, incremental detokenization, stop strings, chat template."""

from __future__ import annotations

from typing import Any

from tests.conftest import StackPool
from tests.grpc_client import make_request, run

MODEL = "tiny-llama"


def test_streamed_text_equals_the_decode_past_the_prompt(
    stack_pool: StackPool, reference_models: Any
) -> None:
    stack = stack_pool.get(MODEL)
    _, tokenizer = reference_models(MODEL)
    for prompt in ("The capital of France is", "héllo wörld, 世界 🙂", "a"):
        result = run(
            stack.address, make_request(prompt=prompt, max_tokens=40, temperature=0.0, ignore_eos=True)
        )
        assert result.chunks[0].num_prompt_tokens == len(tokenizer(prompt).input_ids)
        assert len(result.token_ids) == 40
        prompt_ids = tokenizer(prompt).input_ids
        past_prompt = tokenizer.decode(prompt_ids + result.token_ids, skip_special_tokens=True)
        assert result.text == past_prompt[len(tokenizer.decode(prompt_ids, skip_special_tokens=True)) :]


def test_stop_string_mid_stream_truncates_and_stops(stack_pool: StackPool) -> None:
    stack = stack_pool.get(MODEL)
    prompt = "Once upon a time"
    full = run(stack.address, make_request(prompt=prompt, max_tokens=48, temperature=0.0, ignore_eos=True))
    text = full.text
    stop = next(
        text[i : i + 3]
        for i in range(8, len(text) - 3)
        if text[i : i + 3].strip() == text[i : i + 3] and text.index(text[i : i + 3]) == i
    )
    result = run(
        stack.address,
        make_request(
            prompt=prompt, max_tokens=48, temperature=0.0, ignore_eos=True, stop=[stop, "\x00never"]
        ),
    )
    assert result.finish_reason == "stop"
    assert result.text == text[: text.index(stop)]
    assert stop not in result.text
    assert len(result.token_ids) < 48
    assert result.token_ids == full.token_ids[: len(result.token_ids)]


def test_chat_template_is_applied_on_request(stack_pool: StackPool, reference_models: Any) -> None:
    stack = stack_pool.get(MODEL)
    _, tokenizer = reference_models(MODEL)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi there"}], add_generation_prompt=True, tokenize=False
    )
    expected_ids = tokenizer(text, add_special_tokens=False).input_ids
    chat = run(
        stack.address,
        make_request(
            prompt="hi there", apply_chat_template=True, max_tokens=5, temperature=0.0, ignore_eos=True
        ),
    )
    plain = run(
        stack.address,
        make_request(prompt_token_ids=expected_ids, max_tokens=5, temperature=0.0, ignore_eos=True),
    )
    assert chat.chunks[0].num_prompt_tokens == len(expected_ids)
    assert chat.token_ids == plain.token_ids
