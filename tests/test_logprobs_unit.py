"""Logprobs without a stack: the computation (``pdserve.core.logprobs``: top-k order and ties,
ranks, prompt positions across chunks), its bounds (hostile counts), the prefill's batched forward
keeping every position only for the rows that ask, and the HTTP API's vLLM shapes and checks."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from gateway.openai_errors import OpenAIError
from gateway.openai_logprobs import (
    MIN_LOGPROB,
    ChatShape,
    CompletionLogprobsBuilder,
    TokenText,
    chat_counts,
    completion_counts,
    ranked,
)
from gateway.openai_models import ChatCompletionRequest, ChatMessage, CompletionRequest
from gateway.request_flow import _Progress
from gateway.text_stream import TextStream
from pdserve.config import RequestLimits
from pdserve.core.limits import ModelLimits
from pdserve.core.logprobs import PROMPT_CHUNK, position_logprobs, prompt_logprobs, rows_logprobs, top_k
from pdserve.core.sampling import SamplingParams
from pdserve.rpc.logprobs_proto import logprobs_to_proto
from pdserve.rpc.sampling_proto import sampling_from_proto, sampling_to_proto
from pdserve.v1 import sampling_pb2
from prefill_service.engine import PrefillEngine, PrefillResult
from tests.engine_models import eager_engine_model


def test_top_k_orders_by_value_then_lower_id() -> None:
    values = torch.tensor([0.5, 2.0, 1.0, 2.0, 1.0, -3.0, 1.0])
    assert top_k(values, 1) == ([1], [2.0])
    assert top_k(values, 2) == ([1, 3], [2.0, 2.0])
    assert top_k(values, 4) == ([1, 3, 2, 4], [2.0, 2.0, 1.0, 1.0])  # the boundary tie: lower ids first
    assert top_k(values, 0) == ([], [])
    assert top_k(values, 100)[0] == [1, 3, 2, 4, 6, 0, 5]  # k beyond the vocabulary: all of it


def test_position_logprobs_are_raw_log_softmax() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(3)) * 4
    expected = torch.log_softmax(logits, dim=-1)
    token = int(expected.argsort()[10])  # neither the best nor the worst
    entry = position_logprobs(logits, token, 3)
    assert math.isclose(entry.logprob, float(expected[token]), abs_tol=1e-6)
    assert entry.rank == int((expected >= expected[token]).sum()) == 40
    assert list(entry.top_token_ids) == expected.topk(3).indices.tolist()
    tied = position_logprobs(torch.zeros(8), 5, 2)
    assert tied.rank == 8 and tied.top_token_ids == (0, 1)  # all tie: every token counts, lower ids first
    rows = rows_logprobs(torch.stack([logits, logits]), [token, 1], [None, 0])
    assert rows[0] is None and rows[1] is not None and rows[1].top_token_ids == ()


def test_prompt_logprobs_across_chunks() -> None:
    n = PROMPT_CHUNK * 2 + 7
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(n, 40, generator=generator)
    prompt = torch.randint(0, 40, (n,), generator=generator).tolist()
    entries = prompt_logprobs(logits, prompt, 2)
    expected = torch.log_softmax(logits, dim=-1)
    assert [e.token_id for e in entries] == prompt[1:]
    for i, entry in enumerate(entries):
        assert math.isclose(entry.logprob, float(expected[i, prompt[i + 1]]), abs_tol=1e-5)
        assert entry.rank == int((expected[i] >= expected[i, prompt[i + 1]]).sum())
        assert list(entry.top_token_ids) == top_k(expected[i], 2)[0]
    assert prompt_logprobs(logits[:1], prompt[:1], 2) == []


def test_hostile_counts_are_refused() -> None:
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=name):
            SamplingParams(**{name: -1})
    limits = ModelLimits(vocab_size=100, max_model_len=64, eos_token_ids=frozenset({2}))
    limits.check_request([1, 2, 3], SamplingParams(logprobs=100, prompt_logprobs=0))
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"sampling.{name}"):
            limits.check_request([1, 2, 3], SamplingParams(**{name: 101}))
        with pytest.raises(ValueError, match=f"sampling.{name}"):
            limits.check_request([1, 2, 3], SamplingParams(**{name: 2**32 - 1}))
    with pytest.raises(ValueError, match="max_logprobs"):
        RequestLimits(max_logprobs=-2)
    RequestLimits(max_logprobs=-1)


def test_sampling_proto_keeps_unset_and_zero_apart() -> None:
    assert sampling_from_proto(sampling_pb2.SamplingParams()).logprobs is None
    params = SamplingParams(logprobs=0, prompt_logprobs=3)
    back = sampling_from_proto(sampling_to_proto(params))
    assert (back.logprobs, back.prompt_logprobs) == (0, 3)
    assert not sampling_to_proto(SamplingParams()).HasField("logprobs")


def test_prefill_keeps_positions_only_for_requests_that_ask(cache_dir: Path) -> None:
    """Three prompts of different lengths arrive together and share one left-padded forward: the one
    asking for prompt logprobs gets its prompt's (the forward keeps the positions of the longest row
    that asks), each gets the first token's logprobs only when it asks, and all equal a lone
    reference forward."""
    m = eager_engine_model("tiny-llama", cache_dir)
    engine = PrefillEngine(m, m.device, max_batch_tokens=100_000)
    generator = torch.Generator().manual_seed(9)
    long_prompt = torch.randint(3, m.limits.vocab_size, (m.limits.max_model_len - 1,), generator=generator)
    prompts = [torch.randint(3, m.limits.vocab_size, (n,), generator=generator).tolist() for n in (9, 4, 6)]
    params = [
        SamplingParams(max_tokens=1, temperature=0.0, logprobs=2, prompt_logprobs=3),
        SamplingParams(max_tokens=1, temperature=0.0),
        SamplingParams(max_tokens=1, temperature=0.0, logprobs=1),
    ]
    plain = SamplingParams(max_tokens=1, temperature=0.0)

    async def run_all() -> list[PrefillResult]:
        first = asyncio.ensure_future(engine.run(long_prompt.tolist(), plain))
        await asyncio.sleep(0.005)  # the long prompt is in its forward; the three wait together
        results = await asyncio.gather(*(engine.run(p, q) for p, q in zip(prompts, params, strict=True)))
        await first
        return list(results)

    try:
        a, b, c = asyncio.run(run_all())
    finally:
        engine.close()
    assert [r.batch_size for r in (a, b, c)] == [3, 3, 3]
    with torch.no_grad():
        refs = [torch.log_softmax(m.model(torch.tensor([p])).logits[0].float(), dim=-1) for p in prompts]
    assert b.logprobs is None and b.prompt_logprobs == ()
    assert c.prompt_logprobs == ()
    for result, ref, k in ((a, refs[0], 2), (c, refs[2], 1)):
        entry = result.logprobs
        assert entry is not None
        assert entry.token_id == result.first_token_id == int(ref[-1].argmax())
        assert math.isclose(entry.logprob, float(ref[-1].max()), abs_tol=1e-4)
        assert list(entry.top_token_ids) == ref[-1].topk(k).indices.tolist()
    entries = a.prompt_logprobs
    assert [e.token_id for e in entries] == prompts[0][1:]
    for i, entry in enumerate(entries):
        assert math.isclose(entry.logprob, float(refs[0][i, prompts[0][i + 1]]), abs_tol=1e-4)
        assert len(entry.top_token_ids) == 3


class _Tokenizer:
    def decode(self, ids: list[int]) -> str:
        return {1: "a", 2: "b", 3: "a", 4: "\u00e9"}.get(ids[0], f"<{ids[0]}>")


def test_vllm_shapes() -> None:
    """The position's own token first, then the top ones without it; duplicates of a text merge;
    -inf shows as -9999.0; chat lists the first top_logprobs of that order, bytes in UTF-8."""
    entry = logprobs_to_proto(position_logprobs(torch.tensor([0.0, 3.0, 2.0, 1.0, float("-inf")]), 4, 2))
    assert [t for t, _, _ in ranked(entry)] == [4, 1, 2]
    text = TokenText(_Tokenizer())
    builder = CompletionLogprobsBuilder(2, text, offset=5)
    out = builder.add_all([4, 1], [entry, None])
    assert out.tokens == ["\u00e9", "a"] and out.text_offset == [5, 6]
    assert out.token_logprobs[0] == MIN_LOGPROB and out.token_logprobs[1] is None
    assert list(out.top_logprobs[0] or {}) == ["\u00e9", "a", "b"]
    own_top = logprobs_to_proto(position_logprobs(torch.tensor([0.0, 3.0, 2.0, 2.5]), 3, 3))
    assert [t for t, _, _ in ranked(own_top)] == [3, 1, 2]  # its own token moves first, once
    merged = CompletionLogprobsBuilder(3, text).add_all([3], [own_top])
    assert list(merged.top_logprobs[0] or {}) == ["a", "b"]  # 3 and 1 both read "a"
    chat = ChatShape(TokenText(_Tokenizer(), as_token_ids=True), top_logprobs=2).render([4], [entry])
    assert chat is not None and chat.content is not None
    assert chat.content[0].token == "token_id:4" and chat.content[0].bytes == list("\u00e9".encode())
    assert [t.token for t in chat.content[0].top_logprobs] == ["token_id:4", "token_id:1"]


def _error_param(call: object) -> str | None:
    with pytest.raises(OpenAIError) as info:
        call()  # type: ignore[operator]
    return info.value.info.param


def test_request_counts_as_vllm() -> None:
    vocab = 1000
    body = CompletionRequest(prompt="x", echo=True, logprobs=1)
    assert completion_counts(body, vocab, 20) == (1, 1)  # echo: prompt_logprobs defaults to logprobs
    body = CompletionRequest(prompt="x", logprobs=-1)
    assert completion_counts(body, vocab, -1) == (vocab, None)
    assert _error_param(lambda: completion_counts(body, vocab, 20)) == "logprobs"
    body = CompletionRequest(prompt="x", prompt_logprobs=0, stream=True)
    assert completion_counts(body, vocab, 20) == (None, 0)
    chat = ChatCompletionRequest(messages=[ChatMessage(role="user", content="x")], logprobs=True)
    assert chat_counts(chat, vocab, 20) == (0, None)
    chat = ChatCompletionRequest(
        messages=[ChatMessage(role="user", content="x")], prompt_logprobs=2, stream=True
    )
    assert _error_param(lambda: chat_counts(chat, vocab, 20)) == "prompt_logprobs"


def test_gateway_relays_logprobs_with_their_tokens(reference_models: Any) -> None:
    """A response keeps the logprobs of the tokens it carries (a stop string cuts both alike); the
    prompt's go on the first response only, and a resumed prefill does not ask for them again."""
    _, tokenizer = reference_models("tiny-llama")
    ids = tokenizer("the cat sat on the mat", add_special_tokens=False).input_ids[:4]
    stop = tokenizer.decode(ids[2:3]).strip()
    entries = [sampling_pb2.TokenLogprobs(token_id=t, logprob=-float(i)) for i, t in enumerate(ids)]
    sampling = sampling_to_proto(SamplingParams(logprobs=1, prompt_logprobs=2, stop=(stop,)))
    run = _Progress("r", [1, 2, 3], sampling, TextStream(tokenizer, SamplingParams(stop=(stop,))))
    assert run.prefill_request().sampling.prompt_logprobs == 2
    first, reason = run.relay(ids[:1], None, entries[:1], entries[1:3])
    assert (
        reason is None and list(first.logprobs) == entries[:1] and list(first.prompt_logprobs) == entries[1:3]
    )
    resumed = run.prefill_request()
    assert not resumed.sampling.HasField("prompt_logprobs") and resumed.sampling.logprobs == 1
    assert resumed.num_generated == 1 and run.sampling.prompt_logprobs == 2  # the request's own is kept
    later, reason = run.relay(ids[1:], None, entries[1:], entries[1:3])
    assert reason == "stop" and list(later.prompt_logprobs) == []
    assert list(later.token_ids) == ids[1:3] and list(later.logprobs) == entries[1:3]
