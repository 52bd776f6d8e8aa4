"""Bad input gets INVALID_ARGUMENT with a message that names the field; never a traceback."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from tests.conftest import StackPool
from tests.grpc_client import expect_error, make_request

MODEL = "tiny-llama"
CONTEXT = 2048

CASES: list[tuple[str, dict[str, Any], str]] = [
    ("neither input", {}, "prompt"),
    ("empty prompt", {"prompt": ""}, "prompt"),
    ("both inputs", {"prompt": "hi", "prompt_token_ids": [1, 2]}, "prompt_token_ids"),
    ("prompt over context", {"prompt_token_ids": [5] * (CONTEXT + 10)}, "context"),
    ("prompt at context", {"prompt_token_ids": [5] * CONTEXT}, "context"),
    ("max_tokens 0", {"prompt_token_ids": [5], "max_tokens": 0}, "max_tokens"),
    ("max_tokens beyond context", {"prompt_token_ids": [5] * 100, "max_tokens": CONTEXT}, "max_tokens"),
    ("negative temperature", {"prompt_token_ids": [5], "temperature": -0.5}, "temperature"),
    ("top_p zero", {"prompt_token_ids": [5], "top_p": 0.0}, "top_p"),
    ("top_p above one", {"prompt_token_ids": [5], "top_p": 1.5}, "top_p"),
    ("negative top_k", {"prompt_token_ids": [5], "top_k": -1}, "top_k"),
    ("token id negative", {"prompt_token_ids": [5, -1]}, "prompt_token_ids[1]"),
    ("token id beyond vocabulary", {"prompt_token_ids": [5, 6, 10**6]}, "prompt_token_ids[2]"),
    ("stop token outside vocabulary", {"prompt_token_ids": [5], "stop_token_ids": [10**6]}, "stop_token_ids"),
    ("empty stop string", {"prompt_token_ids": [5], "stop": [""]}, "stop"),
    ("chat template with ids", {"prompt_token_ids": [5], "apply_chat_template": True}, "apply_chat_template"),
]


@pytest.mark.parametrize(("case", "fields", "named"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_invalid_argument(
    stack_pool: StackPool, case: str, fields: dict[str, Any], named: str
) -> None:
    stack = stack_pool.get(MODEL)
    error = expect_error(stack.address, make_request(**fields))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{case}: {error.code()} {error.details()}"
    details = error.details() or ""
    assert named in details, f"{case}: the message does not name {named!r}: {details!r}"
    assert "Traceback" not in details


def test_good_request_after_bad_ones(stack_pool: StackPool) -> None:
    stack = stack_pool.get(MODEL)
    from tests.grpc_client import run

    result = run(stack.address, make_request(prompt="Hello there", max_tokens=3, temperature=0.0))
    assert len(result.token_ids) >= 1
