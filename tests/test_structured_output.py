"""Structured output in process: specs are bounded and validated, the mask allows exactly what the
grammar allows (EOS only where it may end), and the prefill's first token and the decode's steps
are constrained, token for token what one process gives with the same grammar."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry
from transformers import DynamicCache

from decode_service.engine import DecodeEngine
from decode_service.kv_pool import KvPool
from decode_service.metrics import DecodeMetrics
from decode_service.sequence import DecodeSequence, Emission
from pdserve.core.finish import LENGTH, STOP
from pdserve.core.grammar import Grammars, apply_masks, grammar_of
from pdserve.core.sampling import SamplingParams
from pdserve.core.structured_output import MAX_CHOICES, MAX_SPEC_BYTES, StructuredOutput
from pdserve.model.engine_model import EngineModel
from pdserve.rpc.sampling_proto import sampling_from_proto, sampling_to_proto
from prefill_service.engine import PrefillEngine
from tests.engine_models import eager_engine_model
from tests.test_equivalence import reference_tokens

CHOICES = ("The capital of France is Paris.", "A small town sat at the edge of a wide river")
REGEX = r"[a-z]{3,6} [0-9]{2}"


@pytest.fixture(scope="module")
def m(cache_dir: Path) -> EngineModel:
    return eager_engine_model("tiny-llama", cache_dir)


@pytest.fixture(scope="module")
def grammars(m: EngineModel) -> Grammars:
    return Grammars(m.tokenizer, m.limits.vocab_size, m.limits.eos_token_ids)


def allowed(
    grammars: Grammars, output: StructuredOutput, generated: list[int], ignore_eos: bool = False
) -> set[int]:
    logits = torch.zeros((1, grammars.vocab_size))
    apply_masks(logits, [grammars.start(output, generated, ignore_eos)])
    return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())


def one_process(
    m: EngineModel, grammars: Grammars, output: StructuredOutput, prompt: list[int], n: int
) -> list[int]:
    """Greedy tokens of a whole forward per step, masked by a grammar state of this process."""
    state = grammars.start(output, [], ignore_eos=False)
    tokens: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = m.model(torch.tensor([prompt + tokens])).logits[:, -1].clone()
        apply_masks(logits, [state])
        tokens.append(int(logits[0].argmax()))
        state.advance(tokens[-1])
        if state.done:
            break
    return tokens


@pytest.mark.parametrize(
    ("output", "message"),
    [
        (StructuredOutput("json", '{"type": "nope"}'), "structured_output.json is not valid"),
        (StructuredOutput("json", "{not json"), "structured_output.json is not valid"),
        (StructuredOutput("json", '{"$ref": "#/missing"}'), "structured_output.json is not valid"),
        (StructuredOutput("regex", "([a-z"), "structured_output.regex is not valid"),
        # hostile: nesting far past what the schema compiler recurses into
        (
            StructuredOutput("json", '{"items": ' * 2000 + "{}" + "}" * 2000),
            "structured_output.json is not valid",
        ),
    ],
)
def test_invalid_specs_are_refused_naming_the_field(output: StructuredOutput, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        grammar_of(output)
    assert len(str(info.value)) < 400


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kind": "grammar", "spec": "start: x"}, "must be one of"),
        ({"kind": "regex"}, "must not be empty"),
        ({"kind": "regex", "spec": "a" * (MAX_SPEC_BYTES + 1)}, f"longer than {MAX_SPEC_BYTES} bytes"),
        ({"kind": "json", "spec": "\ud800"}, "lone surrogate"),
        ({"kind": "choice"}, "at least one string"),
        ({"kind": "choice", "choices": ("x",) * (MAX_CHOICES + 1)}, f"at most {MAX_CHOICES}"),
        ({"kind": "choice", "choices": ("é" * (MAX_SPEC_BYTES // 2 + 1),)}, "longer than"),
        ({"kind": "json_object", "spec": "{}"}, "takes no spec"),
    ],
)
def test_spec_shape_and_size_are_bounded(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StructuredOutput(**fields)


def test_proto_round_trip_keeps_the_spec() -> None:
    for output in (
        StructuredOutput("json", '{"type": "integer"}', any_whitespace=False),
        StructuredOutput("json_object"),
        StructuredOutput("regex", REGEX),
        StructuredOutput("choice", choices=CHOICES),
    ):
        params = SamplingParams(structured_output=output)
        assert sampling_from_proto(sampling_to_proto(params)) == params


def test_mask_allows_the_grammar_and_eos_only_where_it_may_end(m: EngineModel, grammars: Grammars) -> None:
    eos = min(m.limits.eos_token_ids)
    digits = StructuredOutput("regex", "[0-9]{1,2}")
    first = allowed(grammars, digits, [])
    assert first and all(re.fullmatch(r"[0-9]{1,2}", m.tokenizer.decode([t])) for t in first)
    assert eos not in first  # nothing generated yet: the grammar cannot end
    one = m.tokenizer.encode("7", add_special_tokens=False)
    after = allowed(grammars, digits, one)
    assert eos in after  # "7" may end, or take one more digit
    assert eos not in allowed(grammars, digits, one, ignore_eos=True)
    state = grammars.start(digits, one, ignore_eos=False)
    assert state.finish_reason(None) is None and not state.done
    state.advance(m.tokenizer.encode("3", add_special_tokens=False)[0])
    assert state.done and state.finish_reason(None) == STOP and state.finish_reason(LENGTH) == STOP
    with pytest.raises(ValueError, match=r"does not match structured_output\.regex"):
        grammars.start(digits, m.tokenizer.encode("x", add_special_tokens=False), ignore_eos=False)


def test_rows_without_a_grammar_keep_their_logits(grammars: Grammars) -> None:
    logits = torch.randn(3, grammars.vocab_size)
    before = logits.clone()
    apply_masks(logits, [None, grammars.start(StructuredOutput("json_object"), [], False), None])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert 0 < int(torch.isfinite(logits[1]).sum()) < grammars.vocab_size


def test_prefill_first_token_is_masked(m: EngineModel, grammars: Grammars) -> None:
    engine = PrefillEngine(m, m.device)
    prompt = m.tokenizer.encode("The quick brown fox", add_special_tokens=False)
    output = StructuredOutput("choice", choices=CHOICES)
    params = SamplingParams(max_tokens=1, temperature=0.0, structured_output=output)
    try:
        result = asyncio.run(engine.run(prompt, params, grammar=grammars.start(output, [], False)))
    finally:
        engine.close()
    assert result.first_token_id == one_process(m, grammars, output, prompt, 1)[0]
    assert result.first_token_id != reference_tokens(m.model, prompt, 1)[0]  # the mask changed it
    assert result.finish_reason == LENGTH


def test_decode_steps_follow_the_grammar_next_to_a_free_row(m: EngineModel, grammars: Grammars) -> None:
    pool = KvPool(m.kv_layout, 64, 16, m.device)
    engine = DecodeEngine(m, DecodeMetrics(CollectorRegistry()), 8, pool)
    engine.start()
    output = StructuredOutput("choice", choices=CHOICES)
    prompt = m.tokenizer.encode("Water boils at", add_special_tokens=False)
    expected = one_process(m, grammars, output, prompt, 40)
    results: dict[str, list[Any]] = {}
    ended = {name: threading.Event() for name in ("constrained", "free")}

    def prefilled() -> list[tuple[torch.Tensor, torch.Tensor]]:
        cache = DynamicCache(config=m.model.config)
        with torch.no_grad():
            m.model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True)
        return [(layer.keys[0], layer.values[0]) for layer in cache.layers]

    def submit(name: str, first: int, grammar: Any, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        results[name] = [[first], None]

        def emit(emission: Emission) -> None:
            results[name][0].extend(emission.token_ids)
            if emission.is_last:
                results[name][1] = emission.finish_reason or emission.error
                ended[name].set()

        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        engine.submit(DecodeSequence(name, kv, first, params, emit, grammar=grammar))

    # Every eager forward of the model runs before the engine's thread compiles its first step:
    # dynamo builds a step's guards from the model's state, which a forward on another thread changes.
    free = reference_tokens(m.model, prompt, 12)
    kv = [prefilled(), prefilled()]
    try:
        submit("constrained", expected[0], grammars.start(output, expected[:1], ignore_eos=False), kv[0])
        submit("free", free[0], None, kv[1])
        assert all(event.wait(60) for event in ended.values())
    finally:
        engine.stop()
    tokens, reason = results["constrained"]
    assert tokens == expected and reason == STOP
    assert m.tokenizer.decode(tokens) in CHOICES
    assert results["free"][0][:12] == free
    assert pool.num_used_blocks == 0


def test_json_schema_output_of_the_split_validates(m: EngineModel, grammars: Grammars) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "blue"]}},
        "required": ["ok", "tag"],
        "additionalProperties": False,
    }
    output = StructuredOutput("json", json.dumps(schema), any_whitespace=False)
    prompt = m.tokenizer.encode("result =", add_special_tokens=False)
    tokens = one_process(m, grammars, output, prompt, 40)
    jsonschema.validate(json.loads(m.tokenizer.decode(tokens)), schema)
