"""The text options of a request (skip_special_tokens, spaces_between_special_tokens) from the
gRPC and HTTP APIs to SamplingParams, and ``--chat-template``'s reading."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.chat_template import load_chat_template
from gateway.openai_models import ChatCompletionRequest, CompletionRequest
from gateway.openai_requests import sampling_params
from pdserve.config import GatewayConfig
from pdserve.core.sampling import SamplingParams
from pdserve.rpc.sampling_proto import sampling_from_proto, sampling_to_proto
from pdserve.v1 import sampling_pb2
from tests.stack import service_env


def wire(msg: sampling_pb2.SamplingParams) -> sampling_pb2.SamplingParams:
    return sampling_pb2.SamplingParams.FromString(msg.SerializeToString())


def test_unset_text_options_are_true_as_in_vllm() -> None:
    params = sampling_from_proto(wire(sampling_pb2.SamplingParams()))
    assert params.skip_special_tokens is True
    assert params.spaces_between_special_tokens is True


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("spaces", [True, False])
def test_text_options_cross_the_wire(skip: bool, spaces: bool) -> None:
    params = SamplingParams(skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    msg = wire(sampling_to_proto(params))
    assert msg.HasField("skip_special_tokens") and msg.HasField("spaces_between_special_tokens")
    assert sampling_from_proto(msg) == params
    explicit = wire(
        sampling_pb2.SamplingParams(skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    )
    assert sampling_from_proto(explicit) == params


def test_the_proto_fields_take_the_text_range() -> None:
    fields = sampling_pb2.SamplingParams.DESCRIPTOR.fields_by_name
    assert fields["skip_special_tokens"].number == 20
    assert fields["spaces_between_special_tokens"].number == 21


@pytest.mark.parametrize("body_cls", [CompletionRequest, ChatCompletionRequest])
def test_http_bodies_carry_the_text_options(body_cls: type) -> None:
    base = (
        {"prompt": "hi"}
        if body_cls is CompletionRequest
        else {"messages": [{"role": "user", "content": "x"}]}
    )
    default = sampling_params(body_cls.model_validate(base), 4)
    assert (default.skip_special_tokens, default.spaces_between_special_tokens) == (True, True)
    body = body_cls.model_validate(
        {**base, "skip_special_tokens": False, "spaces_between_special_tokens": False}
    )
    assert body.unsupported() == []
    params = sampling_params(body, 4)
    assert (params.skip_special_tokens, params.spaces_between_special_tokens) == (False, False)


def test_chat_template_inline_and_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert load_chat_template("{{ 'a' }}\\n") == "{{ 'a' }}\n"  # escapes read as vLLM reads them
    assert load_chat_template("") is None


@pytest.mark.parametrize(
    ("value", "match"),
    [("/no/such/template.jinja", "looks like a file path"), ("{% for x %}", "not a valid Jinja template")],
)
def test_chat_template_errors(value: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_chat_template(value)


def test_gateway_config_refuses_a_template_path_that_is_no_file(tmp_path: Path) -> None:
    base = {"prefill": ("h:1",), "decode": ("h:2",)}
    with pytest.raises(ValueError, match="chat_template"):
        GatewayConfig(**base, chat_template=str(tmp_path / "missing.jinja"))  # type: ignore[arg-type]
    path = tmp_path / "ok.jinja"
    path.write_text("{{ x }}")
    assert GatewayConfig(**base, chat_template=str(path)).chat_template == str(path)  # type: ignore[arg-type]
    assert GatewayConfig(**base, chat_template="{{ x }}").chat_template == "{{ x }}"  # type: ignore[arg-type]


def test_a_gateway_with_a_broken_template_exits_at_start(cache_dir: Path) -> None:
    """One error line naming the flag, exit 1, before any backend is called."""
    argv = [sys.executable, "-m", "pdserve", "gateway", "--model", "tiny-llama", "--host", "127.0.0.1"]
    argv += ["--port", "0", "--http-port", "-1", "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2"]
    argv += ["--chat-template", "{% for message in %}"]
    done = subprocess.run(argv, env=service_env(cache_dir), capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert "--chat-template" in done.stderr and "not a valid Jinja template" in done.stderr
    assert "Traceback" not in done.stderr
