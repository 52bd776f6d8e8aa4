"""Unit tests of pdserve.config (validation) and pdserve.config.flags (flags, environment, defaults)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import pytest

from pdserve.config import (
    CPU_BATCH_TOKENS,
    CUDA_BATCH_TOKENS,
    DEFAULT_MODEL,
    ColocatedConfig,
    DecodeConfig,
    EngineConfig,
    GatewayConfig,
    PrefillConfig,
    ServerConfig,
    TransferConfig,
)
from pdserve.config import flags as cli_options
from pdserve.config.flags import add_arguments, build, env_names, options

ADDRS = {"prefill": ("127.0.0.1:1",), "decode": ("127.0.0.1:2",)}


# --- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "kwargs", "pattern"),
    [
        (EngineConfig, {"model": ""}, r"^model must not be empty$"),
        (EngineConfig, {"device": "gpu"}, r"^device must be cpu or cuda\[:N\], got 'gpu'$"),
        (EngineConfig, {"device": ""}, r"^device "),
        (EngineConfig, {"dtype": "int8"}, r"^dtype must be one of .*got 'int8'$"),
        (EngineConfig, {"threads": 0}, r"^threads must be >= 1, got 0$"),
        (EngineConfig, {"max_model_len": -1}, r"^max_model_len must be >= 0, got -1$"),
        (TransferConfig, {"kv_backend": "mpi"}, r"^kv_backend must be one of .*got 'mpi'$"),
        (
            TransferConfig,
            {"transfer_timeout_s": 0.0},
            r"^transfer_timeout_s must be a finite number > 0, got 0\.0$",
        ),
        (TransferConfig, {"transfer_timeout_s": -1.0}, r"^transfer_timeout_s "),
        (ServerConfig, {"host": ""}, r"^host must not be empty$"),
        (ServerConfig, {"port": -1}, r"^port must be in \[0, 65535\]"),
        (ServerConfig, {"port": 65536}, r"^port must be in \[0, 65535\].*got 65536$"),
        (ServerConfig, {"metrics_port": 70000}, r"^metrics_port must be in \[0, 65535\]"),
        (ServerConfig, {"metrics_port": -5}, r"^metrics_port "),
        (ServerConfig, {"grace_s": -0.5}, r"^grace_s must be a finite number >= 0, got -0\.5$"),
        (ServerConfig, {"advertise_host": "a b"}, r"^advertise_host must be one host name or address"),
        (PrefillConfig, {"kv_port": 65536}, r"^kv_port must be in \[0, 65535\]"),
        (PrefillConfig, {"kv_port": -1}, r"^kv_port "),
        (DecodeConfig, {"kv_block_size": 0}, r"^kv_block_size must be >= 1, got 0$"),
        (DecodeConfig, {"max_kv_tokens": 8}, r"^max_kv_tokens must be >= kv_block_size \(16\), got 8$"),
        (
            PrefillConfig,
            {"max_batch_tokens": -1},
            r"^max_batch_tokens must be >= 0 \(0: by device\), got -1$",
        ),
        (PrefillConfig, {"lease_s": float("nan")}, r"^lease_s must be a finite number > 0, got nan$"),
        (PrefillConfig, {"prefix_cache_tokens": -2}, r"^prefix_cache_tokens must be >= -1, got -2$"),
        (PrefillConfig, {"prefix_block_size": 0}, r"^prefix_block_size must be in \[1, 4096\], got 0$"),
        (PrefillConfig, {"prefix_block_size": 4097}, r"^prefix_block_size must be in \[1, 4096\]"),
        (
            TransferConfig,
            {"transfer_timeout_s": float("nan")},
            r"^transfer_timeout_s must be a finite number > 0",
        ),
        (ServerConfig, {"grace_s": float("inf")}, r"^grace_s must be a finite number >= 0"),
        (EngineConfig, {"device": "cudafoo"}, r"^device must be cpu or cuda\[:N\]"),
        (EngineConfig, {"linear_layout": "blocked"}, r"^linear_layout must be one of"),
        (GatewayConfig, {**ADDRS, "decode": ("h:99999",)}, r"^decode addresses must look like HOST:PORT"),
        (PrefillConfig, {"lease_s": 0.0}, r"^lease_s must be a finite number > 0, got 0\.0$"),
        (DecodeConfig, {"max_running": 0}, r"^max_running must be >= 1, got 0$"),
        (
            GatewayConfig,
            {"decode": ADDRS["decode"]},
            r"prefill address is required \(--prefill / PDSERVE_PREFILL\)",
        ),
        (
            GatewayConfig,
            {"prefill": ADDRS["prefill"]},
            r"decode address is required \(--decode / PDSERVE_DECODE\)",
        ),
        (GatewayConfig, {**ADDRS, "max_model_len": -1}, r"^max_model_len must be >= 0, got -1$"),
        (
            GatewayConfig,
            {**ADDRS, "prefill": ("nohost",)},
            r"^prefill addresses must look like HOST:PORT with a port in \[1, 65535\], got 'nohost'$",
        ),
        (
            GatewayConfig,
            {**ADDRS, "prefill": (":80",)},
            r"^prefill addresses must look like HOST:PORT with a port in \[1, 65535\], got ':80'$",
        ),
        (
            GatewayConfig,
            {**ADDRS, "decode": ("h:",)},
            r"^decode addresses must look like HOST:PORT with a port in \[1, 65535\], got 'h:'$",
        ),
        (
            GatewayConfig,
            {**ADDRS, "decode": ("h:1", "h:x")},
            r"^decode addresses must look like HOST:PORT with a port in \[1, 65535\], got 'h:x'$",
        ),
    ],
)
def test_invalid_values_name_the_field(cls: type, kwargs: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        cls(**kwargs)


def test_boundary_values_are_valid() -> None:
    assert ServerConfig(port=65535, metrics_port=0, grace_s=0.0).port == 65535
    assert EngineConfig(device="cuda", dtype="bfloat16", max_model_len=0).device == "cuda"
    assert EngineConfig(device="cuda:3").device == "cuda:3"
    assert PrefillConfig(kv_port=65535, lease_s=0.001).kv_port == 65535
    assert DecodeConfig(max_running=1).max_running == 1
    gateway = GatewayConfig(prefill=("a:1", "b:2"), decode=("[::1]:3",))
    assert gateway.prefill == ("a:1", "b:2")
    assert gateway.server.port == 50051


def test_defaults() -> None:
    engine = EngineConfig()
    assert (engine.model, engine.device, engine.dtype, engine.threads) == (DEFAULT_MODEL, "cpu", "auto", 1)
    assert TransferConfig() == TransferConfig(kv_backend="auto", transfer_timeout_s=30.0)
    assert ServerConfig() == ServerConfig(host="127.0.0.1", port=0, metrics_port=0, grace_s=5.0)
    assert ServerConfig(host="0.0.0.0").public_host == "0.0.0.0"
    assert ServerConfig(host="0.0.0.0", advertise_host="prefill").public_host == "prefill"
    assert PrefillConfig().lease_s == 30.0
    assert DecodeConfig().max_running == 64


def test_the_prefill_token_budget_follows_the_device_unless_set() -> None:
    assert PrefillConfig().batch_tokens == CPU_BATCH_TOKENS
    assert PrefillConfig(engine=EngineConfig(device="cuda:1")).batch_tokens == CUDA_BATCH_TOKENS
    assert PrefillConfig(max_batch_tokens=300).batch_tokens == 300
    assert PrefillConfig(engine=EngineConfig(device="cuda"), max_batch_tokens=5).batch_tokens == 5
    colocated = ColocatedConfig(engine=EngineConfig(device="cuda"))
    assert colocated.prefill_config().batch_tokens == CUDA_BATCH_TOKENS


def test_a_cpu_prefill_sizes_forwards_by_the_queue_from_128_tokens_to_the_budget_unless_set() -> None:
    assert PrefillConfig().forward_tokens == (128, CPU_BATCH_TOKENS)
    assert PrefillConfig(max_batch_tokens=64).forward_tokens == (64, 64)  # never more than the budget
    assert PrefillConfig(max_batch_tokens=1000).forward_tokens == (128, 1000)
    assert PrefillConfig(max_forward_tokens=300).forward_tokens == (300, 300)  # set: a fixed size
    assert PrefillConfig(max_forward_tokens=4096).forward_tokens == (CPU_BATCH_TOKENS, CPU_BATCH_TOKENS)
    assert PrefillConfig(engine=EngineConfig(device="cuda")).forward_tokens == (8192, 8192)  # no split
    with pytest.raises(ValueError, match=r"^max_forward_tokens must be >= 0 \(0: by device\), got -2$"):
        PrefillConfig(max_forward_tokens=-2)


def test_backend_for() -> None:
    auto = TransferConfig()
    assert auto.backend_for("cpu") == "gloo"
    assert auto.backend_for("cuda") == "nccl"
    assert auto.backend_for("cuda:1") == "nccl"
    assert TransferConfig(kv_backend="gloo").backend_for("cuda:0") == "gloo"
    assert TransferConfig(kv_backend="nccl").backend_for("cpu") == "nccl"


# --- flags, environment, defaults ----------------------------------------------------------------


def _parse(cls: type, argv: list[str], env: dict[str, str]) -> Any:
    parser = argparse.ArgumentParser()
    add_arguments(parser, cls, env)
    return build(cls, parser.parse_args(argv))


def test_no_flags_and_no_env_give_the_dataclass_defaults() -> None:
    assert _parse(PrefillConfig, [], {}) == PrefillConfig()
    assert _parse(DecodeConfig, [], {}) == DecodeConfig()


def test_flags_override_env_which_overrides_defaults() -> None:
    env = {"PDSERVE_PORT": "7000", "PDSERVE_LEASE_S": "12.5", "PDSERVE_DEVICE": "cuda:1"}
    config = _parse(PrefillConfig, ["--port", "7001", "--kv-backend", "gloo"], env)
    assert config == PrefillConfig(
        server=ServerConfig(port=7001),  # flag over env
        engine=EngineConfig(device="cuda:1"),  # env over default
        transfer=TransferConfig(kv_backend="gloo"),  # flag over default
        lease_s=12.5,  # env over default
    )
    assert isinstance(config.server.port, int)
    assert isinstance(config.lease_s, float)


def test_every_leaf_field_has_a_flag() -> None:
    argv = [
        "--host", "0.0.0.0", "--port", "1", "--metrics-port", "2", "--grace-s", "0.5",
        "--model", "m", "--device", "cuda:0", "--dtype", "float16", "--threads", "3",
        "--max-model-len", "128", "--cache-dir", "/c",
        "--kv-backend", "nccl", "--transfer-timeout-s", "4",
        "--kv-port", "5", "--lease-s", "6",
    ]  # fmt: skip
    assert _parse(PrefillConfig, argv, {}) == PrefillConfig(
        server=ServerConfig(host="0.0.0.0", port=1, metrics_port=2, grace_s=0.5),
        engine=EngineConfig(
            model="m", device="cuda:0", dtype="float16", threads=3, max_model_len=128, cache_dir="/c"
        ),
        transfer=TransferConfig(kv_backend="nccl", transfer_timeout_s=4.0),
        kv_port=5,
        lease_s=6.0,
    )


def test_env_names_every_leaf_field() -> None:
    env = {
        "PDSERVE_HOST": "h",
        "PDSERVE_PORT": "1",
        "PDSERVE_METRICS_PORT": "2",
        "PDSERVE_GRACE_S": "3",
        "PDSERVE_MODEL": "m",
        "PDSERVE_DEVICE": "cuda",
        "PDSERVE_DTYPE": "float32",
        "PDSERVE_THREADS": "4",
        "PDSERVE_MAX_MODEL_LEN": "5",
        "PDSERVE_CACHE_DIR": "/d",
        "PDSERVE_KV_BACKEND": "gloo",
        "PDSERVE_TRANSFER_TIMEOUT_S": "6",
        "PDSERVE_MAX_RUNNING": "7",
        "OTHER_PORT": "9",
    }
    assert _parse(DecodeConfig, [], env) == DecodeConfig(
        server=ServerConfig(host="h", port=1, metrics_port=2, grace_s=3.0),
        engine=EngineConfig(
            model="m", device="cuda", dtype="float32", threads=4, max_model_len=5, cache_dir="/d"
        ),
        transfer=TransferConfig(kv_backend="gloo", transfer_timeout_s=6.0),
        max_running=7,
    )


def test_add_arguments_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_MAX_RUNNING", "9")
    parser = argparse.ArgumentParser()
    add_arguments(parser, DecodeConfig)
    assert build(DecodeConfig, parser.parse_args([])).max_running == 9


def test_an_explicit_env_mapping_replaces_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_MAX_RUNNING", "9")
    assert _parse(DecodeConfig, [], {}).max_running == 64


def test_tuples_are_comma_separated_in_flags_and_env() -> None:
    env = {"PDSERVE_PREFILL": " a:1 , b:2,, ", "PDSERVE_DECODE": "c:3"}
    config = _parse(GatewayConfig, [], env)
    assert config.prefill == ("a:1", "b:2")
    assert config.decode == ("c:3",)
    config = _parse(GatewayConfig, ["--decode", "d:4,e:5"], env)
    assert config.prefill == ("a:1", "b:2")
    assert config.decode == ("d:4", "e:5")
    assert config.server.port == 50051  # the gateway's own default


def test_a_gateway_without_addresses_is_refused() -> None:
    with pytest.raises(ValueError, match=r"prefill address is required"):
        _parse(GatewayConfig, [], {})
    with pytest.raises(ValueError, match=r"decode address is required"):
        _parse(GatewayConfig, ["--prefill", "a:1"], {"PDSERVE_DECODE": " , "})


@pytest.mark.parametrize(
    ("env", "pattern"),
    [
        ({"PDSERVE_PORT": "abc"}, r"^port must be int, got 'abc'$"),
        ({"PDSERVE_LEASE_S": "soon"}, r"^lease_s must be float, got 'soon'$"),
        ({"PDSERVE_THREADS": "1.5"}, r"^threads must be int, got '1\.5'$"),
    ],
)
def test_unparsable_env_values_name_the_field(env: dict[str, str], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        add_arguments(argparse.ArgumentParser(), PrefillConfig, env)


def test_invalid_env_values_fail_validation_with_the_field_name() -> None:
    with pytest.raises(ValueError, match=r"^port must be in \[0, 65535\]"):
        _parse(PrefillConfig, [], {"PDSERVE_PORT": "70000"})
    with pytest.raises(ValueError, match=r"^kv_backend must be one of"):
        _parse(PrefillConfig, [], {"PDSERVE_KV_BACKEND": "mpi"})


def test_invalid_flag_values_name_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _parse(PrefillConfig, ["--port", "abc"], {})
    assert exc.value.code == 2
    assert "--port" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"^lease_s must be a finite number > 0, got -1\.0$"):
        _parse(PrefillConfig, ["--lease-s", "-1"], {})


def test_help_shows_the_env_var_and_the_effective_default() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, GatewayConfig, {"PDSERVE_PREFILL": "a:1,b:2"})
    text = parser.format_help()
    assert "PDSERVE_PREFILL" in text
    assert "'a:1,b:2'" in text
    assert "--metrics-port" in text


# --- a custom dataclass: bools and tuples --------------------------------------------------------


@dataclass(frozen=True)
class _Inner:
    flag_on: bool = False
    names: tuple[str, ...] = ("x",)


@dataclass(frozen=True)
class _Outer:
    inner: _Inner = field(default_factory=_Inner)
    count: int = field(default=2, metadata={"help": "how many"})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1", True),
        ("true", True),
        ("YES", True),
        ("on", True),
        ("0", False),
        ("False", False),
        ("off", False),
        ("", False),
    ],
)
def test_booleans(text: str, expected: bool) -> None:
    assert _parse(_Outer, [], {"PDSERVE_FLAG_ON": text}).inner.flag_on is expected
    assert _parse(_Outer, ["--flag-on", text], {}).inner.flag_on is expected


def test_an_invalid_boolean_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"^flag_on must be a boolean, got 'maybe'$"):
        add_arguments(argparse.ArgumentParser(), _Outer, {"PDSERVE_FLAG_ON": "maybe"})


def test_options_walk_nested_fields_depth_first() -> None:
    opts = list(options(_Outer))
    assert [o.path for o in opts] == [("inner", "flag_on"), ("inner", "names"), ("count",)]
    assert [o.flag for o in opts] == ["--flag-on", "--names", "--count"]
    assert [o.env_var for o in opts] == ["PDSERVE_FLAG_ON", "PDSERVE_NAMES", "PDSERVE_COUNT"]
    assert [o.default for o in opts] == [False, ("x",), 2]
    assert opts[2].help == "how many"
    assert _parse(_Outer, [], {"PDSERVE_NAMES": "a,b"}) == _Outer(inner=_Inner(names=("a", "b")))
    assert _parse(_Outer, ["--names", ""], {}) == _Outer(inner=_Inner(names=()))


# --- env_names -----------------------------------------------------------------------------------

SERVER_ENV = [
    "PDSERVE_HOST",
    "PDSERVE_ADVERTISE_HOST",
    "PDSERVE_PORT",
    "PDSERVE_METRICS_PORT",
    "PDSERVE_GRACE_S",
]
ENGINE_ENV = [
    "PDSERVE_MODEL",
    "PDSERVE_DEVICE",
    "PDSERVE_DTYPE",
    "PDSERVE_THREADS",
    "PDSERVE_CPUS",
    "PDSERVE_MAX_MODEL_LEN",
    "PDSERVE_CACHE_DIR",
    "PDSERVE_COMPILE",
    "PDSERVE_ENFORCE_EAGER",
    "PDSERVE_RECOMPILE_IN_SERVING",
    "PDSERVE_LINEAR_LAYOUT",
    "PDSERVE_NO_SHARED_PREFIX_ATTENTION",
    "PDSERVE_EP",
    "PDSERVE_EP_TIMEOUT_S",
    "PDSERVE_EP_DISPATCH",
    "PDSERVE_EP_RANK",
    "PDSERVE_EP_MASTER",
    "PDSERVE_EP_DEVICES",
    "PDSERVE_EP_PORT_BASE",
]
TRANSFER_ENV = ["PDSERVE_KV_BACKEND", "PDSERVE_TRANSFER_TIMEOUT_S", "PDSERVE_KV_SHM_DIR"]
INTERNAL_ENV = [
    "PDSERVE_INTERNAL_TOKEN",
    "PDSERVE_INTERNAL_TOKEN_FILE",
    "PDSERVE_INTERNAL_TLS_CERT",
    "PDSERVE_INTERNAL_TLS_KEY",
    "PDSERVE_INTERNAL_TLS_CA",
]


@pytest.mark.parametrize(
    ("cls", "expected"),
    [
        (ServerConfig, SERVER_ENV),
        (EngineConfig, ENGINE_ENV),
        (TransferConfig, TRANSFER_ENV),
        (
            PrefillConfig,
            [
                *SERVER_ENV,
                *ENGINE_ENV,
                *TRANSFER_ENV,
                *INTERNAL_ENV,
                "PDSERVE_KV_PORT",
                "PDSERVE_LEASE_S",
                "PDSERVE_MAX_BATCH_TOKENS",
                "PDSERVE_MAX_FORWARD_TOKENS",
                "PDSERVE_KV_SHM_BYTES",
                "PDSERVE_MAX_PREFILL_WAITING",
                "PDSERVE_PREFIX_CACHE_TOKENS",
                "PDSERVE_NO_PREFIX_CACHE",
                "PDSERVE_PREFIX_BLOCK_SIZE",
            ],
        ),
        (
            DecodeConfig,
            [
                *SERVER_ENV,
                *ENGINE_ENV,
                *TRANSFER_ENV,
                *INTERNAL_ENV,
                "PDSERVE_MAX_RUNNING",
                "PDSERVE_MAX_KV_TOKENS",
                "PDSERVE_KV_BLOCK_SIZE",
                "PDSERVE_MAX_DECODE_WAITING",
                "PDSERVE_MAX_PULLED_WAITING",
                "PDSERVE_MAX_BYPASS",
                "PDSERVE_CONTEXT_IDLE_S",
                "PDSERVE_PREFILL",
                "PDSERVE_RESOLVE_INTERVAL_S",
            ],
        ),
        (
            GatewayConfig,
            [
                *SERVER_ENV,
                "PDSERVE_MODEL",
                "PDSERVE_CACHE_DIR",
                "PDSERVE_MAX_MODEL_LEN",
                "PDSERVE_PREFILL",
                "PDSERVE_DECODE",
                "PDSERVE_RESOLVE_INTERVAL_S",
                "PDSERVE_BACKENDS_FROM_STDIN",
                "PDSERVE_HTTP_PORT",
                "PDSERVE_SERVED_MODEL_NAME",
                "PDSERVE_GENERATION_CONFIG",
                "PDSERVE_CHAT_TEMPLATE",
                "PDSERVE_MAX_STOP_STRINGS",
                "PDSERVE_MAX_STOP_BYTES",
                "PDSERVE_MAX_STOP_TOKEN_IDS",
                "PDSERVE_MAX_REQUEST_ID_BYTES",
                "PDSERVE_MAX_PROMPT_BYTES",
                "PDSERVE_MAX_PROMPT_TOKEN_IDS",
                "PDSERVE_MAX_BODY_BYTES",
                "PDSERVE_MAX_IN_FLIGHT",
                "PDSERVE_RETRY_AFTER_S",
                "PDSERVE_MAX_LOGPROBS",
                "PDSERVE_TOKENIZER_THREADS",
                "PDSERVE_MAX_N",
                "PDSERVE_PREFILL_ROUTING",
                "PDSERVE_PREFIX_BLOCK_SIZE",
                "PDSERVE_PREFIX_INDEX_BLOCKS",
                "PDSERVE_PREFIX_BALANCE_THRESHOLD",
                "PDSERVE_API_KEY",
                "PDSERVE_TLS_CERT",
                "PDSERVE_TLS_KEY",
                "PDSERVE_REFLECTION",
                *INTERNAL_ENV,
            ],
        ),
    ],
)
def test_env_names(cls: type, expected: list[str]) -> None:
    names = env_names(cls)
    assert names == expected
    assert len(set(names)) == len(names)
    assert all(n.startswith(cli_options.ENV_PREFIX) and n == n.upper() for n in names)


@pytest.mark.parametrize("cls", [PrefillConfig, DecodeConfig, GatewayConfig])
def test_leaf_field_names_are_unique_so_flags_map_back_to_fields(cls: type) -> None:
    def leaves(kind: type) -> list[str]:
        out: list[str] = []
        for f in dataclasses.fields(kind):
            sub = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            out += leaves(type(sub)) if dataclasses.is_dataclass(sub) else [f.name]
        return out

    names = leaves(cls)
    assert len(set(names)) == len(names)
    assert env_names(cls) == ["PDSERVE_" + n.upper() for n in names]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ep": 0}, "ep must be >= 1"),
        ({"ep": 2, "ep_rank": 2, "ep_master": "h:1"}, "ep_rank must be in"),
        ({"ep": 2, "ep_rank": -1}, "ep_rank must be in"),
        ({"ep": 2, "ep_rank": 1}, "ep_master must be set"),
        ({"ep": 2, "ep_rank": 1, "ep_master": "nohost"}, "ep_master"),
        ({"ep": 2, "ep_timeout_s": 0.0}, "ep_timeout_s"),
        ({"ep_dispatch": "deepep-fast"}, "ep_dispatch"),
        ({"ep": 2, "ep_port_base": -1}, "ep_port_base"),
        ({"ep": 4, "ep_port_base": 65530}, "ep_port_base"),
    ],
)
def test_expert_parallel_fields_are_validated(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_expert_parallel_ports_are_fixed_blocks_outside_the_service_ports() -> None:
    from pdserve.config.ep_ports import ep_port_range, ep_rank_ports
    from pdserve.expert_parallel.group import internal_port, rank_port_overrides

    assert ep_port_range(29600, 2) == range(29600, 29608)
    assert ep_rank_ports(29600, 0).group_store == 29601
    assert rank_port_overrides(29600, 1) == {
        "port": 0,
        "metrics_port": 29606,
        "kv_port": 29605,
        "prefill_metrics_port": 29607,
    }
    assert set(rank_port_overrides(0, 1).values()) == {0}, "no base: free ports, as before"
    engine = EngineConfig(ep=2, ep_rank=1, ep_master="h:1", ep_port_base=29600)
    assert internal_port(engine) == 29604 and internal_port(EngineConfig(ep=2)) == 0
    with pytest.raises(ValueError, match=r"ports \[29601\] lie in the expert-parallel block"):
        PrefillConfig(engine=EngineConfig(ep=2, ep_port_base=29600), kv_port=29601)
    assert PrefillConfig(engine=EngineConfig(ep=2, ep_port_base=29600), kv_port=29500).kv_port == 29500


def test_secret_settings_are_not_shown_in_help() -> None:
    parser = argparse.ArgumentParser()
    cli_options.add_arguments(parser, GatewayConfig, env={"PDSERVE_API_KEY": "sk-secret"})
    assert "sk-secret" not in parser.format_help() and "(set)" in parser.format_help()
    assert parser.parse_args([]).api_key == "sk-secret"


@pytest.mark.parametrize(
    ("device", "ep", "rank", "expected"),
    [
        ("cpu", 4, 3, "cpu"),
        ("cuda", 2, 1, "cuda:1"),
        ("cuda:2", 4, 3, "cuda:5"),
        ("cuda:1", 1, 0, "cuda:1"),
        ("cuda", 1, 0, "cuda:0"),
    ],
)
def test_each_rank_takes_its_own_gpu(device: str, ep: int, rank: int, expected: str) -> None:
    master = "127.0.0.1:1" if rank else ""
    assert EngineConfig(device=device, ep=ep, ep_rank=rank, ep_master=master).rank_device == expected


def test_ranks_take_the_gpus_listed() -> None:
    listed = EngineConfig(device="cuda", ep=2, ep_rank=1, ep_master="h:1", ep_devices=("cuda:3", "cuda"))
    assert listed.rank_device == "cuda:0"
    with pytest.raises(ValueError, match="ep_devices must name 2 devices"):
        EngineConfig(device="cuda", ep=2, ep_devices=("cuda:1",))
    with pytest.raises(ValueError, match="ep_devices must be cpu or cuda"):
        EngineConfig(device="cuda", ep=1, ep_devices=("gpu",))


@pytest.mark.parametrize("cls", [PrefillConfig, DecodeConfig, ColocatedConfig, GatewayConfig])
def test_to_args_builds_the_same_config_again(cls: type) -> None:
    base = cls(prefill=("h:1", "h:2"), decode=("h:3",)) if cls is GatewayConfig else cls()
    parser = argparse.ArgumentParser()
    cli_options.add_arguments(parser, cls, env={})
    assert cli_options.build(cls, parser.parse_args(cli_options.to_args(cls, base))) == base
    args = cli_options.to_args(cls, base, port=7, not_a_field=1)
    assert cli_options.build(cls, parser.parse_args(args)).server.port == 7
