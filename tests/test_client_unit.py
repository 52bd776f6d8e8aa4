"""Unit tests of the `pdserve generate` client against an in-process, scripted Gateway."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TypeVar

import grpc
import pytest

from pdserve import client
from pdserve.v1 import gateway_pb2, gateway_pb2_grpc

pytestmark = pytest.mark.timeout(60)
T = TypeVar("T")

OPTIONAL_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed")
SCRIPT = (
    gateway_pb2.GenerateResponse(token_ids=[1], text="Hello", num_prompt_tokens=3, request_id="r-1"),
    gateway_pb2.GenerateResponse(token_ids=[2, 3], text=", wor"),
    gateway_pb2.GenerateResponse(token_ids=[4], text="ld é", finish_reason="length"),
)


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    client.add_generate_arguments(parser)
    return parser.parse_args(list(argv))


# -- request building ---------------------------------------------------------------------------


def test_flags_not_given_stay_unset() -> None:
    request = client.request_from_args(parse(["Hello there"]))
    assert request.prompt == "Hello there"
    assert list(request.prompt_token_ids) == []
    assert not request.apply_chat_template and request.request_id == ""
    for name in OPTIONAL_SAMPLING_FIELDS:
        assert not request.sampling.HasField(name), name
    assert list(request.sampling.stop) == [] and list(request.sampling.stop_token_ids) == []
    assert not request.sampling.ignore_eos


def test_explicit_zero_values_are_set() -> None:
    request = client.request_from_args(parse(["x", "--temperature", "0", "--top-k", "0", "--seed", "0"]))
    for name in ("temperature", "top_k", "seed"):
        assert request.sampling.HasField(name), name
        assert getattr(request.sampling, name) == 0
    assert not request.sampling.HasField("max_tokens") and not request.sampling.HasField("top_p")


def test_every_flag() -> None:
    argv = ["--prompt", "Hi", "--chat", "--request-id", "req-7", "--max-tokens", "5", "--temperature", "0.7"]
    argv += ["--top-p", "0.5", "--top-k", "40", "--seed", "18446744073709551615", "--stop", "\n\n"]
    argv += ["--stop", "END", "--stop-token-ids", "2, 7", "--ignore-eos"]
    request = client.request_from_args(parse(argv))
    assert (request.prompt, request.apply_chat_template, request.request_id) == ("Hi", True, "req-7")
    sampling = request.sampling
    assert sampling.max_tokens == 5 and sampling.top_k == 40 and sampling.seed == 2**64 - 1
    assert sampling.temperature == pytest.approx(0.7) and sampling.top_p == pytest.approx(0.5)
    assert list(sampling.stop) == ["\n\n", "END"] and list(sampling.stop_token_ids) == [2, 7]
    assert sampling.ignore_eos


def test_prompt_ids() -> None:
    request = client.request_from_args(parse(["--prompt-ids", "1, 2,3", "--max-tokens", "4"]))
    assert list(request.prompt_token_ids) == [1, 2, 3]
    assert request.prompt == ""
    assert request.sampling.max_tokens == 4


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "a prompt is required"),
        (["a", "--prompt", "b"], "either positionally or with --prompt"),
        (["a", "--prompt-ids", "1"], "not both"),
        (["--prompt", "a", "--prompt-ids", "1"], "not both"),
        ([""], "must not be empty"),
        (["--prompt-ids", ","], "at least one token id"),
        (["--prompt-ids", "-1"], "non-negative"),
        (["--prompt-ids", "1", "--chat"], "--chat applies to a text prompt"),
        (["a", "--max-tokens", "0"], "--max-tokens"),
        (["a", "--temperature", "-0.1"], "--temperature"),
        (["a", "--temperature", "nan"], "--temperature"),
        (["a", "--top-p", "0"], "--top-p"),
        (["a", "--top-p", "1.5"], "--top-p"),
        (["a", "--top-k", "-1"], "--top-k"),
        (["a", "--seed", "-1"], "--seed"),
        (["a", "--stop", ""], "--stop"),
        (["a", "--stop-token-ids", "-3"], "--stop-token-ids"),
    ],
)
def test_bad_combinations_are_rejected(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError, match=message):
        client.request_from_args(parse(argv))
    # The command reports it on stderr and exits 2 without calling anyone.
    assert client.run_generate(parse([*argv, "--address", "127.0.0.1:1"])) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and message in captured.err
    assert captured.out == ""


def test_unparsable_token_ids_are_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(["--prompt-ids", "1,x"])
    assert "expected comma-separated integers" in capsys.readouterr().err


# -- streaming against a scripted gateway --------------------------------------------------------


class ScriptedGateway(gateway_pb2_grpc.GatewayServicer):
    """Answers SCRIPT; the prompt picks a failure: "fail", "fail-mid" or "slow"."""

    def __init__(self) -> None:
        self.requests: list[gateway_pb2.GenerateRequest] = []

    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        self.requests.append(request)
        if request.prompt == "fail":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt too long")
        if request.prompt == "slow":
            await asyncio.sleep(5)
        for index, response in enumerate(SCRIPT):
            if request.prompt == "fail-mid" and index == 1:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "decode died")
            yield response


def with_gateway(body: Callable[[str, ScriptedGateway], T]) -> T:
    """Runs ``body(address, servicer)`` on a worker thread while a grpc.aio server on port 0 serves.

    The server runs on this thread's event loop; the client under test makes its own loop on the
    worker thread, as ``pdserve generate`` does in its process.
    """
    servicer = ScriptedGateway()

    async def scenario() -> T:
        server = grpc.aio.server()
        gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server)
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        try:
            return await asyncio.to_thread(body, address, servicer)
        finally:
            await server.stop(0)

    return asyncio.run(scenario())


def test_plain_mode_streams_text_then_a_newline(capsys: pytest.CaptureFixture[str]) -> None:
    def body(address: str, servicer: ScriptedGateway) -> list[gateway_pb2.GenerateRequest]:
        assert client.run_generate(parse(["The capital of France is", "--address", address])) == 0
        return servicer.requests

    requests = with_gateway(body)
    captured = capsys.readouterr()
    assert captured.out == "Hello, world é\n"
    assert captured.err == ""
    # What reached the server: the optional sampling fields the user left out are unset.
    (request,) = requests
    assert request.prompt == "The capital of France is"
    for name in OPTIONAL_SAMPLING_FIELDS:
        assert not request.sampling.HasField(name), name


def test_json_mode_prints_one_object_per_chunk(capsys: pytest.CaptureFixture[str]) -> None:
    def body(address: str, servicer: ScriptedGateway) -> list[gateway_pb2.GenerateRequest]:
        argv = ["--prompt-ids", "5,6", "--json", "--address", address, "--temperature", "0"]
        assert client.run_generate(parse(argv)) == 0
        return servicer.requests

    (request,) = with_gateway(body)
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line) for line in lines] == [
        {"token_ids": [1], "text": "Hello", "finish_reason": ""},
        {"token_ids": [2, 3], "text": ", wor", "finish_reason": ""},
        {"token_ids": [4], "text": "ld é", "finish_reason": "length"},
    ]
    assert list(request.prompt_token_ids) == [5, 6]
    assert request.sampling.HasField("temperature") and request.sampling.temperature == 0


class FlushRecorder(io.StringIO):
    """Records what was written by each flush."""

    def __init__(self) -> None:
        super().__init__()
        self.flushed: list[str] = []

    def flush(self) -> None:
        self.flushed.append(self.getvalue())
        super().flush()


def test_each_chunk_is_flushed_as_it_arrives() -> None:
    out = FlushRecorder()

    def body(address: str, servicer: ScriptedGateway) -> None:
        asyncio.run(client.stream_generate(address, client.build_request(prompt="hi"), out))

    with_gateway(body)
    assert out.flushed[:3] == ["Hello", "Hello, wor", "Hello, world é"]
    assert out.getvalue() == "Hello, world é\n"


@pytest.mark.parametrize(
    ("argv", "out", "err"),
    [
        (["fail"], "", "error: INVALID_ARGUMENT: prompt too long\n"),
        (["fail-mid"], "Hello\n", "error: UNAVAILABLE: decode died\n"),
        (
            ["fail-mid", "--json"],
            '{"token_ids": [1], "text": "Hello", "finish_reason": ""}\n',
            "error: UNAVAILABLE: decode died\n",
        ),
        (["slow", "--timeout-s", "0.3"], "", "error: DEADLINE_EXCEEDED: "),
    ],
)
def test_grpc_errors_exit_1(capsys: pytest.CaptureFixture[str], argv: list[str], out: str, err: str) -> None:
    def body(address: str, servicer: ScriptedGateway) -> int:
        return client.run_generate(parse([*argv, "--address", address]))

    assert with_gateway(body) == 1
    captured = capsys.readouterr()
    assert captured.out == out
    assert captured.err.startswith(err)


def test_an_unreachable_gateway_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    assert client.run_generate(parse(["hi", "--address", address])) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith("error: UNAVAILABLE: ")
    assert captured.out == ""
