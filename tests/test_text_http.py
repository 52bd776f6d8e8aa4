"""Text through the whole stack with a SentencePiece-style tokenizer, over the official `openai`
client and gRPC: the leading space of the first generated token, skip_special_tokens, the custom
``--chat-template``, and the endpoints beside generation (/tokenize, /detokenize, /version,
/v1/models/{id}) with ``--api-key`` set.

The stack serves tiny-llama's weights with a Llama-style tokenizer (Metaspace, byte fallback) of
the same vocabulary size, trained offline (``tests.tokenizer_kinds.llama_like``).
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import torch
from transformers import PreTrainedTokenizerFast

import pdserve
from pdserve.model.presets.tiny_tokenizer import CHAT_TEMPLATE, CORPUS, SPECIAL_TOKENS
from pdserve.model.source import resolve_model_dir
from pdserve.v1 import gateway_pb2, gateway_pb2_grpc
from tests.conftest import assert_no_leaks
from tests.grpc_client import Result, make_request
from tests.stack import Stack
from tests.test_http_api import http_get, http_post
from tests.tokenizer_kinds import llama_like

KEY = "sk-text"
MODEL_ID = "tiny-llama-sp"
CUSTOM_TEMPLATE = (
    "{% for message in messages %}[{{ message['role'] }}] {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


def run(address: str, request: gateway_pb2.GenerateRequest) -> Result:
    """One gRPC request with the API key."""

    async def generate() -> Result:
        async with grpc.aio.insecure_channel(address) as channel:
            result = Result()
            calls = gateway_pb2_grpc.GatewayStub(channel).Generate(
                request, timeout=120, metadata=(("authorization", f"Bearer {KEY}"),)
            )
            async for chunk in calls:
                result.chunks.append(chunk)
            return result

    return asyncio.run(generate())


@dataclass
class TextStack:
    stack: Stack
    tokenizer: PreTrainedTokenizerFast
    model: Any
    model_dir: Path

    @property
    def http(self) -> str:
        assert self.stack.gateway is not None
        return str(self.stack.gateway.ready["http"])

    @property
    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://{self.http}/v1", api_key=KEY, max_retries=0)

    def grpc_ids(self, prompt_ids: list[int], max_tokens: int, **sampling: Any) -> Any:
        request = make_request(
            prompt_token_ids=prompt_ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **sampling
        )
        return run(self.stack.address, request)

    def past_prompt(self, prompt_ids: list[int], output: list[int], skip: bool = True) -> str:
        tok = self.tokenizer
        prompt_text = tok.decode(prompt_ids, skip_special_tokens=skip)
        return str(tok.decode(prompt_ids + output, skip_special_tokens=skip))[len(prompt_text) :]


@pytest.fixture(scope="module")
def text_stack(
    cache_dir: Path, reference_models: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TextStack]:
    model, _ = reference_models("tiny-llama")
    model_dir = tmp_path_factory.mktemp("sp-model") / "tiny-llama-sp"
    shutil.copytree(resolve_model_dir("tiny-llama", cache_dir), model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (model_dir / name).unlink(missing_ok=True)
    tokenizer = llama_like(model.config.vocab_size, CORPUS.splitlines(keepends=True), list(SPECIAL_TOKENS))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(model_dir))
    template = tmp_path_factory.mktemp("template") / "custom.jinja"
    template.write_text(CUSTOM_TEMPLATE)
    stack = Stack(
        str(model_dir),
        cache_dir,
        tmp_path_factory.mktemp("sp-logs"),
        gateway_args=[
            *("--http-port", "0", "--served-model-name", MODEL_ID),
            *("--api-key", KEY, "--chat-template", str(template)),
        ],
    ).start()
    try:
        yield TextStack(stack, tokenizer, model, model_dir)
    finally:
        stack.stop()


@pytest.fixture(autouse=True)
def leak_check_text(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "text_stack" in request.fixturenames:
        assert_no_leaks(request.getfixturevalue("text_stack").stack)


def test_the_first_token_keeps_its_leading_space(text_stack: TextStack) -> None:
    """A prompt whose first greedy token is a "▁word" piece: streamed and whole completions start
    with its space, and equal decode(prompt + output) past decode(prompt)."""
    tok = text_stack.tokenizer
    ids = prompt_leading_to(text_stack, lambda piece: piece.startswith("▁") and len(piece) > 1)
    result = text_stack.grpc_ids(ids, max_tokens=8)
    expected = text_stack.past_prompt(ids, result.token_ids)
    assert expected.startswith(" ")
    assert not tok.decode(result.token_ids).startswith(" ")  # decoded alone, the space is lost
    assert result.text == expected
    args: dict[str, Any] = {"model": MODEL_ID, "prompt": ids, "max_tokens": 8, "temperature": 0.0}
    args["extra_body"] = {"ignore_eos": True}
    whole = text_stack.client.completions.create(**args)
    assert whole.choices[0].text == expected
    chunks = [
        c.choices[0].text for c in text_stack.client.completions.create(**args, stream=True) if c.choices
    ]
    assert "".join(chunks) == expected
    assert next(c for c in chunks if c).startswith(" ")


def test_chat_uses_the_custom_template_and_keeps_the_space(text_stack: TextStack) -> None:
    tok = text_stack.tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    custom = tok.apply_chat_template(
        messages, chat_template=CUSTOM_TEMPLATE, add_generation_prompt=True, tokenize=False
    )
    assert custom.startswith("[user] ")
    ids = list(tok(custom, add_special_tokens=False).input_ids)
    status, body = http_post(text_stack.http, "/tokenize", json.dumps({"messages": messages}).encode())
    assert status == 200
    assert body["tokens"] == ids
    own = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert body["tokens"] != list(tok(own, add_special_tokens=False).input_ids)

    expected = text_stack.grpc_ids(ids, max_tokens=6)
    assert expected.text == text_stack.past_prompt(ids, expected.token_ids)
    args: dict[str, Any] = {"model": MODEL_ID, "messages": messages, "max_tokens": 6, "temperature": 0.0}
    args["extra_body"] = {"ignore_eos": True}
    chat = text_stack.client.chat.completions.create(**args)
    assert chat.usage is not None and chat.usage.prompt_tokens == len(ids)
    assert chat.choices[0].message.content == expected.text
    streamed = text_stack.client.chat.completions.create(**args, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected.text
    # the gRPC API's apply_chat_template takes the same template
    grpc_chat = run(
        text_stack.stack.address,
        make_request(
            prompt=messages[0]["content"],
            apply_chat_template=True,
            max_tokens=6,
            temperature=0.0,
            ignore_eos=True,
        ),
    )
    assert grpc_chat.chunks[0].num_prompt_tokens == len(ids)
    assert grpc_chat.token_ids == expected.token_ids


def prompt_leading_to(text_stack: TextStack, wanted: Callable[[str], bool], steps: int = 8) -> list[int]:
    """A prompt whose greedy next token's piece is ``wanted`` and whose greedy ``steps`` tokens
    decode without rewriting earlier text (see gateway.detokenizer), found among seeded random
    prompts of plain text tokens by the one-process model."""
    tok = text_stack.tokenizer
    rng = random.Random(0)
    words = sorted(i for piece, i in tok.get_vocab().items() if piece.startswith("▁") and len(piece) > 2)
    for _ in range(8):
        prompts = torch.tensor([[rng.choice(words) for _ in range(6)] for _ in range(256)])
        with torch.no_grad():
            nexts = text_stack.model(prompts).logits[:, -1].argmax(-1).tolist()
        for prompt, token in zip(prompts.tolist(), nexts, strict=True):
            if wanted(tok.convert_ids_to_tokens(token)) and not rewrites(
                tok, prompt, greedy(text_stack, prompt, steps)
            ):
                return [int(t) for t in prompt]
    pytest.fail("no random prompt leads to the wanted token")


def greedy(text_stack: TextStack, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(text_stack.model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def rewrites(tok: PreTrainedTokenizerFast, prompt: list[int], output: list[int]) -> bool:
    """Whether a token turns text decoded before it into something else (byte fallback's U+FFFDs)."""
    full = str(tok.decode(prompt + output, skip_special_tokens=False))
    return any(
        not full.startswith(str(tok.decode(prompt + output[:k], skip_special_tokens=False)).rstrip("\ufffd"))
        for k in range(len(output) + 1)
    )


def test_skip_special_tokens_over_http_and_grpc(text_stack: TextStack) -> None:
    tok = text_stack.tokenizer
    specials = set(tok.all_special_tokens)
    ids = prompt_leading_to(text_stack, lambda piece: piece in specials)
    kept = text_stack.grpc_ids(ids, max_tokens=4, skip_special_tokens=False)
    skipped = text_stack.grpc_ids(ids, max_tokens=4)
    assert kept.token_ids == skipped.token_ids
    special = tok.convert_ids_to_tokens(kept.token_ids[0])
    assert kept.text.startswith(special)
    assert kept.text == text_stack.past_prompt(ids, kept.token_ids, skip=False)
    assert skipped.text == text_stack.past_prompt(ids, kept.token_ids, skip=True)
    assert special not in skipped.text
    args: dict[str, Any] = {"model": MODEL_ID, "prompt": ids, "max_tokens": 4, "temperature": 0.0}
    http_kept = text_stack.client.completions.create(
        **args,
        extra_body={"ignore_eos": True, "skip_special_tokens": False, "spaces_between_special_tokens": False},
    )
    assert http_kept.choices[0].text == kept.text
    http_skipped = text_stack.client.completions.create(**args, extra_body={"ignore_eos": True})
    assert http_skipped.choices[0].text == skipped.text
    status, body = http_post(
        text_stack.http,
        "/v1/completions",
        json.dumps({**args, "skip_special_tokens": "sometimes"}).encode(),
        KEY,
    )
    assert status == 400 and body["error"]["param"] == "skip_special_tokens"


# --- /tokenize, /detokenize, /version, /v1/models/{id} --------------------------------------------


def post(text_stack: TextStack, path: str, body: Any) -> tuple[int, dict[str, Any]]:
    return http_post(text_stack.http, path, json.dumps(body).encode())


def test_tokenize_a_prompt(text_stack: TextStack) -> None:
    tok = text_stack.tokenizer
    prompt = "The capital of France is €"
    ids = list(tok(prompt).input_ids)
    status, body = post(text_stack, "/tokenize", {"prompt": prompt, "model": MODEL_ID})
    assert (status, body) == (
        200,
        {"count": len(ids), "max_model_len": 2048, "tokens": ids, "token_strs": None},
    )
    status, body = post(text_stack, "/tokenize", {"prompt": prompt, "return_token_strs": True})
    assert body["token_strs"] == tok.convert_ids_to_tokens(ids)
    assert "<0xE2>" in body["token_strs"]
    status, body = post(text_stack, "/tokenize", {"prompt": "<|im_start|>hi", "add_special_tokens": False})
    assert body["tokens"][0] == tok.convert_tokens_to_ids("<|im_start|>")


def test_tokenize_messages_with_and_without_the_generation_prompt(text_stack: TextStack) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    _, with_prompt = post(text_stack, "/tokenize", {"messages": messages})
    _, without = post(text_stack, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    tok = text_stack.tokenizer
    assert tok.decode(with_prompt["tokens"]) == "[system] Be brief.\n[user] Hi\n[assistant]"
    assert tok.decode(without["tokens"]) == "[system] Be brief.\n[user] Hi\n"


def test_detokenize(text_stack: TextStack) -> None:
    tok = text_stack.tokenizer
    ids = [tok.convert_tokens_to_ids("<|im_start|>"), *tok("Paris €", add_special_tokens=False).input_ids]
    status, body = post(text_stack, "/detokenize", {"tokens": ids, "model": MODEL_ID})
    assert (status, body) == (200, {"prompt": tok.decode(ids)})
    assert body["prompt"] == "<|im_start|> Paris €"
    assert post(text_stack, "/detokenize", {"tokens": []}) == (200, {"prompt": ""})


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/detokenize", {"tokens": [5, -1]}, "tokens"),
        ("/detokenize", {"tokens": [512]}, "tokens"),
        ("/detokenize", {"tokens": [2**70]}, "tokens"),
        ("/detokenize", {"tokens": "12"}, "tokens"),
        ("/detokenize", {"tokens": [1] * 2049}, "tokens"),
        ("/detokenize", {}, "tokens"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
        ("/tokenize", {"prompt": "a " * 3000}, "prompt"),
        ("/tokenize", {"prompt": "x" * (1024 * 1024 + 1)}, "prompt"),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "b"}]}, "messages"),
        ("/tokenize", {"messages": [{"role": "user", "content": "y" * (1024 * 1024 + 1)}]}, "messages"),
        ("/tokenize", {"prompt": 5}, "prompt"),
    ],
)
def test_bad_input_is_400_naming_the_field(text_stack: TextStack, path: str, body: Any, param: str) -> None:
    status, answer = post(text_stack, path, body)
    assert status == 400, answer
    assert answer["error"]["type"] == "invalid_request_error"
    assert answer["error"]["param"] == param


def test_another_model_is_404(text_stack: TextStack) -> None:
    for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [5]})):
        status, answer = post(text_stack, path, {**body, "model": "gpt-9"})
        assert status == 404 and answer["error"]["code"] == "model_not_found"


def test_version_and_the_model_object(text_stack: TextStack) -> None:
    status, version = http_get(text_stack.http, "/version")
    assert (status, json.loads(version)) == (200, {"version": pdserve.__version__})
    card = text_stack.client.models.retrieve(MODEL_ID)
    assert (card.id, card.object, card.owned_by) == (MODEL_ID, "model", "pdserve")
    extra = card.model_dump()
    assert extra["root"] == str(text_stack.model_dir) and extra["parent"] is None
    assert extra["max_model_len"] == 2048
    assert extra["permission"][0]["object"] == "model_permission"
    assert text_stack.client.models.list().data[0].model_dump() == extra
    with pytest.raises(openai.NotFoundError) as error:
        text_stack.client.models.retrieve("gpt-9")
    assert error.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_the_api_key_guards_v1_only(text_stack: TextStack) -> None:
    """As in vLLM: /v1 needs the key; /tokenize, /detokenize and /version do not."""
    assert http_get(text_stack.http, f"/v1/models/{MODEL_ID}")[0] == 401
    assert post(text_stack, "/tokenize", {"prompt": "a"})[0] == 200
    assert post(text_stack, "/detokenize", {"tokens": [5]})[0] == 200
    assert http_get(text_stack.http, "/version")[0] == 200
