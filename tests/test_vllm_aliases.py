"""vLLM's flag names for the settings pdserve shares with it: each parses to the same config as
pdserve's own flag, on the services and on ``pdserve up`` (which hands it to the children), and
shows in ``--help``; ``--dtype half|float`` name float16 and float32."""

from __future__ import annotations

import argparse
import sys

import pytest

from pdserve.cli import build_parser
from pdserve.config import ColocatedConfig, DecodeConfig, GatewayConfig, PrefillConfig
from pdserve.config.flags import add_arguments, build
from pdserve.launch.spec import LaunchSpec, UpConfig, service_command

GATEWAY = ["--prefill", "h:1", "--decode", "h:2"]
ALIASES = [
    # (config classes, vLLM's flag, pdserve's flag, value)
    ((DecodeConfig, ColocatedConfig, UpConfig), "--max-num-seqs", "--max-running", "7"),
    ((PrefillConfig, ColocatedConfig, UpConfig), "--max-num-batched-tokens", "--max-batch-tokens", "96"),
    ((DecodeConfig, ColocatedConfig, UpConfig), "--block-size", "--kv-block-size", "32"),
    ((PrefillConfig, DecodeConfig, ColocatedConfig, UpConfig), "--dtype", "--dtype", "bfloat16"),
    ((GatewayConfig, UpConfig), "--served-model-name", "--served-model-name", "my-model"),
]
CASES = [(cls, alias, own, value) for classes, alias, own, value in ALIASES for cls in classes]


def parse(cls: type, argv: list[str]) -> object:
    parser = argparse.ArgumentParser()
    add_arguments(parser, cls, {})
    base = GATEWAY if cls is GatewayConfig else []
    return build(cls, parser.parse_args([*base, *argv]))


@pytest.mark.parametrize(
    ("cls", "alias", "own", "value"), CASES, ids=lambda v: getattr(v, "__name__", str(v))
)
def test_an_alias_gives_the_config_of_pdserve_s_flag(cls: type, alias: str, own: str, value: str) -> None:
    by_alias = parse(cls, [alias, value])
    assert by_alias == parse(cls, [own, value])
    assert by_alias != parse(cls, [])


@pytest.mark.parametrize(("name", "expected"), [("half", "float16"), ("float", "float32")])
@pytest.mark.parametrize("cls", [PrefillConfig, DecodeConfig, ColocatedConfig, UpConfig])
def test_vllm_dtype_names(cls: type, name: str, expected: str) -> None:
    assert parse(cls, ["--dtype", name]) == parse(cls, ["--dtype", expected])


def test_an_unknown_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="dtype"):
        parse(DecodeConfig, ["--dtype", "fp8"])
    with pytest.raises(ValueError, match="dtype"):
        UpConfig(dtype="double")


@pytest.mark.parametrize(
    ("command", "aliases"),
    [
        (
            "up",
            ["--max-num-seqs", "--max-num-batched-tokens", "--block-size", "--served-model-name", "--dtype"],
        ),
        ("decode", ["--max-num-seqs", "--block-size", "--dtype"]),
        ("prefill", ["--max-num-batched-tokens", "--dtype"]),
        ("colocated", ["--max-num-seqs", "--max-num-batched-tokens", "--block-size", "--dtype"]),
        ("gateway", ["--served-model-name", "--chat-template"]),
    ],
)
def test_aliases_show_in_help(command: str, aliases: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    shown = capsys.readouterr().out
    for alias in aliases:
        assert alias in shown


def flags_of(argv: list[str]) -> dict[str, str]:
    return dict(zip(argv[4::2], argv[5::2], strict=True))


def test_pdserve_up_hands_the_settings_to_its_children() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, UpConfig, {})
    argv = [
        *("--max-num-seqs", "7", "--max-num-batched-tokens", "96", "--block-size", "32", "--dtype", "half"),
        *("--served-model-name", "my-model", "--chat-template", "{{ messages }}"),
    ]
    config = build(UpConfig, parser.parse_args(argv))
    assert isinstance(config, UpConfig)
    prefill = flags_of(service_command(config, LaunchSpec("prefill")))
    decode = flags_of(service_command(config, LaunchSpec("decode")))
    colocated = flags_of(service_command(config, LaunchSpec("colocated")))
    gateway = flags_of(service_command(config, LaunchSpec("gateway")))
    assert prefill["--max-batch-tokens"] == "96" and prefill["--dtype"] == "float16"
    assert "--max-running" not in prefill and "--kv-block-size" not in prefill
    assert (
        decode["--max-running"] == "7"
        and decode["--kv-block-size"] == "32"
        and decode["--dtype"] == "float16"
    )
    assert "--max-batch-tokens" not in decode
    assert (colocated["--max-running"], colocated["--max-batch-tokens"], colocated["--kv-block-size"]) == (
        "7",
        "96",
        "32",
    )
    assert gateway["--served-model-name"] == "my-model" and gateway["--chat-template"] == "{{ messages }}"
    assert "--dtype" not in gateway and "--max-running" not in gateway
    # what the children parse is what pdserve up was given
    child = build_parser().parse_args(service_command(config, LaunchSpec("decode"))[3:])
    decode_config = build(DecodeConfig, child)
    assert (decode_config.max_running, decode_config.kv_block_size, decode_config.engine.dtype) == (
        7,
        32,
        "float16",
    )
    child = build_parser().parse_args(
        [*service_command(config, LaunchSpec("gateway", prefill=("h:1",), decode=("h:2",)))[3:]]
    )
    gateway_config = build(GatewayConfig, child)
    assert gateway_config.model_id == "my-model" and gateway_config.chat_template == "{{ messages }}"


def test_pdserve_up_leaves_the_children_s_defaults_when_unset() -> None:
    for role in ("prefill", "decode", "colocated", "gateway"):
        argv = service_command(UpConfig(), LaunchSpec(role))
        for flag in ("--dtype", "--max-running", "--max-batch-tokens", "--kv-block-size", "--chat-template"):
            assert flag not in argv
    assert sys.executable == service_command(UpConfig(), LaunchSpec("decode"))[0]


@pytest.mark.parametrize("field", ["max_running", "max_batch_tokens", "kv_block_size"])
def test_up_refuses_negative_sizes(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        UpConfig(**{field: -1})  # type: ignore[arg-type]
