"""Property-based: random public inputs over gRPC and HTTP get only OK or a clear client error
(never INTERNAL / 500, never a crash), and the stack serves exactly (greedy == model.generate)
afterwards. Small example counts: one shared stack, a 2-core CI."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.v1 import gateway_pb2, sampling_pb2
from tests.conftest import assert_no_leaks
from tests.grpc_client import make_request, run
from tests.stack import Stack
from tests.test_equivalence import reference_tokens

VOCAB = 512  # tiny-llama's vocabulary; ids around it are tried
CLIENT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE}
SETTINGS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

texts = st.text(st.characters(codec="utf-8"), max_size=40)
int32 = st.integers(-(2**31), 2**31 - 1)
token_ids = st.one_of(st.integers(-3, VOCAB + 3), int32)
floats32 = st.floats(width=32, allow_nan=True, allow_infinity=True)

sampling = st.builds(
    sampling_pb2.SamplingParams,
    max_tokens=st.one_of(st.integers(0, 12), st.integers(0, 2**32 - 1)),
    temperature=st.one_of(st.just(0.0), floats32),
    top_p=floats32,
    top_k=int32,
    seed=st.integers(0, 2**64 - 1),
    stop=st.lists(texts, max_size=70),
    stop_token_ids=st.lists(token_ids, max_size=1100),
    ignore_eos=st.booleans(),
)
grpc_requests = st.builds(
    gateway_pb2.GenerateRequest,
    request_id=st.one_of(st.text(max_size=300), st.text(st.characters(min_codepoint=33, max_codepoint=126))),
    prompt=st.one_of(st.just(""), texts),
    prompt_token_ids=st.lists(token_ids, max_size=40),
    sampling=sampling,
    apply_chat_template=st.booleans(),
)


def greedy_is_exact(stack: Stack, reference_models: Any) -> None:
    model, _ = reference_models("tiny-llama")
    prompt = [5, 17, 99, 230, 41]
    result = run(
        stack.address, make_request(prompt_token_ids=prompt, max_tokens=12, temperature=0.0, ignore_eos=True)
    )
    assert result.token_ids == reference_tokens(model, prompt, 12)


@SETTINGS
@given(request=grpc_requests)
def test_random_grpc_requests_get_ok_or_a_client_error(
    limits_stack: Stack, request: gateway_pb2.GenerateRequest
) -> None:
    if request.sampling.max_tokens > 12:  # keep runs short: a long one is beyond the context, or slow
        request.sampling.max_tokens = (
            12 if request.sampling.max_tokens < 4096 else request.sampling.max_tokens
        )
    try:
        run(limits_stack.address, request)
    except grpc.aio.AioRpcError as exc:
        assert exc.code() in CLIENT_ERRORS, (exc.code(), exc.details())
        assert "Traceback" not in (exc.details() or "")


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | texts,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=8,
)
FIELDS = (
    "prompt",
    "messages",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "stream",
    "n",
    "timeout",
    "model",
    "stream_options",
    "logit_bias",
)
bodies = st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=6).map(
    lambda d: {"prompt": "hi", "max_tokens": 4, **d}
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool"]), "content": JSON_VALUES}
    ),
    max_size=3,
)


def post(stack: Stack, path: str, body: bytes) -> tuple[int, bytes]:
    assert stack.gateway is not None
    request = urllib.request.Request(
        f"http://{stack.gateway.ready['http']}{path}", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def bounded(body: dict[str, Any]) -> dict[str, Any]:
    """Short runs: a number of tokens the model can reach in a blink, when it is one."""
    tokens = body.get("max_tokens")
    if isinstance(tokens, int) and not isinstance(tokens, bool) and 8 < tokens < 4096:
        body["max_tokens"] = 8
    if isinstance(body.get("timeout"), float) and math.isfinite(body["timeout"]) and body["timeout"] > 0:
        body["timeout"] = max(body["timeout"], 0.001)
    return body


@SETTINGS
@given(body=bodies, chat=st.booleans(), conversation=messages)
def test_random_http_bodies_get_ok_or_a_client_error(
    limits_stack: Stack, body: dict[str, Any], chat: bool, conversation: list[Any]
) -> None:
    body = bounded(body)
    if chat:
        body.pop("prompt", None)
        body.setdefault("messages", conversation)
    status, answer = post(
        limits_stack, "/v1/chat/completions" if chat else "/v1/completions", json.dumps(body).encode()
    )
    assert status in (200, 400, 404, 504), (status, answer[:500])
    if status != 200:
        error = json.loads(answer)["error"]
        assert (
            error["type"] in ("invalid_request_error", "server_error") and "Traceback" not in error["message"]
        )
        if status == 504:
            assert error["code"] == "timeout"


def test_the_stack_still_serves_exactly_after_the_random_inputs(
    limits_stack: Stack, reference_models: Any
) -> None:
    greedy_is_exact(limits_stack, reference_models)
    assert_no_leaks(limits_stack)


@pytest.mark.parametrize("raw", [b"{", b"[]", b'"x"', b"\xff\xfe", b'{"prompt": "\\ud800", "max_tokens": 2}'])
def test_malformed_http_bodies_are_400(limits_stack: Stack, raw: bytes) -> None:
    status, answer = post(limits_stack, "/v1/completions", raw)
    assert status == 400, answer[:300]
