"""What ``pdserve up`` runs: its configuration, each child's launch spec and command line, and the
ready line a child prints when it serves."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.config import BACKENDS, DEFAULT_MODEL, HTTP_PORT, InternalSecurity, PublicSecurity
from pdserve.config.checks import (
    check_at_least,
    check_chat_template,
    check_choice,
    check_device,
    check_file,
    check_non_negative,
    check_port,
    check_positive,
)
from pdserve.config.compile_setting import compile_setting
from pdserve.config.services import DTYPE_ALIASES, DTYPES, LINEAR_LAYOUTS

PREFILL = "prefill"
DECODE = "decode"
GATEWAY = "gateway"
COLOCATED = "colocated"
ROLES = (PREFILL, DECODE, GATEWAY, COLOCATED)
MODES = ("disaggregated", "colocated")
CPU_BIND_AUTO = "auto"  # see cpu_plan
CPU_BIND_NONE = "none"
CPU_BINDS = (CPU_BIND_AUTO, CPU_BIND_NONE)


@dataclass(frozen=True)
class UpConfig:
    """What ``pdserve up`` runs and how it supervises it."""

    model: str = field(default=DEFAULT_MODEL, metadata={"help": "model directory or preset name"})
    host: str = field(default="127.0.0.1", metadata={"help": "address every service binds and advertises"})
    port: int = field(default=50051, metadata={"help": "gateway gRPC port (0 picks a free one)"})
    http_port: int = field(
        default=HTTP_PORT,
        metadata={
            "help": "gateway OpenAI-compatible HTTP port, also serving /metrics "
            "(-1 turns it off, 0 picks a free one)"
        },
    )
    device: str = field(default="cpu", metadata={"help": "torch device of the replicas, e.g. cpu or cuda:0"})
    threads: int = field(default=1, metadata={"help": "intra-op torch threads of each replica on CPU"})
    cpu_bind: str = field(
        default="auto",
        metadata={
            "help": "auto: on CPU, each engine process runs on cores of its own when there are enough "
            "(see pdserve/launch/cpu_plan.py); none: wherever the OS schedules it"
        },
    )
    cache_dir: str = field(
        default="", metadata={"help": "where presets are built (default ~/.cache/pdserve)"}
    )
    mode: str = field(
        default="disaggregated",
        metadata={
            "help": "disaggregated (prefill and decode processes) or colocated (one process, no transfer)"
        },
    )
    prefill_replicas: int = field(
        default=1, metadata={"help": "number of prefill processes (colocated: of prefill+decode processes)"}
    )
    decode_replicas: int = field(default=1, metadata={"help": "number of decode processes"})
    prefill_ep: int = field(
        default=1,
        metadata={"help": "expert-parallel ranks (processes) of each prefill (colocated: of each service)"},
    )
    decode_ep: int = field(default=1, metadata={"help": "expert-parallel ranks (processes) of each decode"})
    compile: str = field(
        default="auto",
        metadata={
            "help": "engines run their forwards through torch.compile (compiled at start-up, cached under "
            "the cache dir): auto (where it measured faster), true (bare --compile) or false",
            "bare": "true",
        },
    )
    enforce_eager: bool = field(
        default=False, metadata={"help": "engines never compile (same as --compile false)"}
    )
    recompile_in_serving: bool = field(
        default=False,
        metadata={"help": "engines compile a shape class their warm-up did not when serving needs it"},
    )
    no_shared_prefix_attention: bool = field(
        default=False,
        metadata={"help": "engines attend to a KV prefix their rows share row by row, not once for all"},
    )
    linear_layout: str = field(
        default="auto",
        metadata={
            "help": "engines' linear weights for float32 on a CPU: auto (the faster of packed and "
            "input-major, timed at start-up), packed, input-major or plain"
        },
    )
    max_restarts: int = field(
        default=5, metadata={"help": "give up when one child dies more often than this within the window"}
    )
    restart_window_s: float = field(default=60.0, metadata={"help": "window of max_restarts, in seconds"})
    restart_backoff_s: float = field(
        default=1.0, metadata={"help": "delay before the first restart; doubles with each recent death"}
    )
    restart_backoff_max_s: float = field(default=30.0, metadata={"help": "cap of the restart delay"})
    startup_timeout_s: float = field(
        default=600.0,
        metadata={
            "help": "bound on startup until every service is SERVING (first model conversion ~1 min; "
            "a first compilation, cached after, some minutes on a small CPU)"
        },
    )
    shutdown_timeout_s: float = field(
        default=15.0, metadata={"help": "on SIGINT/SIGTERM, time the children get before SIGKILL"}
    )
    prefill_devices: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "GPUs of the prefill ranks, N or cuda:N, one per replica and rank (default: in order)"
        },
    )
    decode_devices: tuple[str, ...] = field(
        default=(),
        metadata={"help": "GPUs of the decode ranks, one per replica and rank (default: in order)"},
    )
    kv_backend: str = field(
        default="auto",
        metadata={"help": "how KV moves: auto, shm, cuda-ipc, nccl or gloo (see pdserve prefill)"},
    )
    dtype: str = field(
        default="auto",
        metadata={"help": "weights dtype of the replicas: auto, float32 (float), bfloat16 or float16 (half)"},
    )
    max_batch_tokens: int = field(
        default=0,
        metadata={
            "help": "token budget of one prefill forward (0: the prefill's default, by device)",
            "aliases": ("--max-num-batched-tokens",),
        },
    )
    max_running: int = field(
        default=0,
        metadata={
            "help": "most requests each decode runs at once (0: the decode's default)",
            "aliases": ("--max-num-seqs",),
        },
    )
    kv_block_size: int = field(
        default=0,
        metadata={
            "help": "tokens per decode KV block (0: the decode's default)",
            "aliases": ("--block-size",),
        },
    )
    served_model_name: str = field(
        default="", metadata={"help": "model id of the HTTP API (default: the --model value)"}
    )
    chat_template: str = field(
        default="",
        metadata={"help": "chat template in place of the model's: a file, or the Jinja template itself"},
    )
    demo: bool = field(default=False, metadata={"help": "once up, stream one demo request to stderr"})
    demo_prompt: str = field(
        default="What is the capital of France?", metadata={"help": "user message of the demo request"}
    )
    # The gateway's (handed to it through the environment); the internal token is made per run
    # when none is set, and reaches the children through the environment too.
    public: PublicSecurity = field(default_factory=PublicSecurity)
    tls_ca: str = field(
        default="",
        metadata={
            "help": "PEM CA bundle that pdserve up's own health checks and demo trust for the gateway's "
            "--tls-cert (default: the certificate itself, e.g. a self-signed one)"
        },
    )
    internal: InternalSecurity = field(default_factory=InternalSecurity)

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must not be empty")
        if not self.host:
            raise ValueError("host must not be empty")
        check_port("port", self.port)
        check_port("http_port", self.http_port, off=-1)
        object.__setattr__(self, "compile", compile_setting(self.compile))
        if self.enforce_eager and self.compile == "true":
            raise ValueError("compile=true and enforce_eager contradict each other: choose one")
        check_device("device", self.device)
        object.__setattr__(self, "dtype", DTYPE_ALIASES.get(self.dtype, self.dtype))
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("linear_layout", self.linear_layout, LINEAR_LAYOUTS)
        for name in ("max_batch_tokens", "max_running", "kv_block_size"):
            check_at_least(name, getattr(self, name), 0)
        check_chat_template(self.chat_template)
        check_choice("kv_backend", self.kv_backend, BACKENDS)
        if (self.prefill_devices or self.decode_devices) and self.device == "cpu":
            raise ValueError("prefill_devices and decode_devices name GPUs: set device to cuda")
        check_at_least("threads", self.threads, 1)
        check_choice("cpu_bind", self.cpu_bind, CPU_BINDS)
        check_choice("mode", self.mode, MODES)
        check_at_least("prefill_replicas", self.prefill_replicas, 1)
        check_at_least("decode_replicas", self.decode_replicas, 1)
        if self.prefill_ep < 1 or self.decode_ep < 1:
            raise ValueError(
                f"prefill_ep and decode_ep must be >= 1, got {self.prefill_ep} and {self.decode_ep}"
            )
        if self.mode == "colocated" and self.decode_ep not in (1, self.prefill_ep):
            raise ValueError(
                "in colocated mode --prefill-ep sizes each service's group; --decode-ep must be 1 or equal to it"
            )
        check_at_least("max_restarts", self.max_restarts, 0)
        check_positive("restart_window_s", self.restart_window_s)
        check_positive("restart_backoff_s", self.restart_backoff_s)
        if not self.restart_backoff_max_s >= self.restart_backoff_s:
            raise ValueError(
                f"restart_backoff_max_s must be >= restart_backoff_s ({self.restart_backoff_s}), "
                f"got {self.restart_backoff_max_s}"
            )
        check_positive("startup_timeout_s", self.startup_timeout_s)
        check_non_negative("shutdown_timeout_s", self.shutdown_timeout_s)
        if self.demo and not self.demo_prompt:
            raise ValueError("demo_prompt must not be empty when demo is on")
        check_file("--tls-ca", self.tls_ca)

    @property
    def uses_gpus(self) -> bool:
        return self.device.startswith("cuda")

    def restart_delay_s(self, recent_deaths: int) -> float:
        """Backoff before restarting a child that died ``recent_deaths`` times in the window."""
        exponent = min(max(recent_deaths - 1, 0), 62)
        return float(min(self.restart_backoff_s * 2**exponent, self.restart_backoff_max_s))


@dataclass(frozen=True)
class LaunchSpec:
    """How one child is started. Ports are 0 (free-chosen) until its first ready line pins them."""

    role: str
    index: int = 0
    port: int = 0
    metrics_port: int = 0
    kv_port: int = 0
    prefill_metrics_port: int = 0
    http_port: int = -1
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()  # of each rank (engine processes; empty: the configured device)
    cpus: str = ""  # the CPU list of an engine process (empty: not bound)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")

    @property
    def name(self) -> str:
        return GATEWAY if self.role == GATEWAY else f"{self.role}-{self.index}"


def awaits_backends(spec: LaunchSpec) -> bool:
    """Whether ``spec`` starts a gateway before its backends: it reads their addresses on stdin."""
    return spec.role == GATEWAY and not spec.prefill


CommandBuilder = Callable[[LaunchSpec], Sequence[str]]
HealthCheck = Callable[[str, float], None]


def service_command(config: UpConfig, spec: LaunchSpec) -> list[str]:
    """The real command line of a child: ``python -m pdserve ROLE ...``."""
    command = [sys.executable, "-m", "pdserve", spec.role, "--model", config.model, "--host", config.host]
    command += ["--port", str(spec.port), "--metrics-port", str(spec.metrics_port)]
    if spec.role == GATEWAY:
        if awaits_backends(spec):
            command += ["--backends-from-stdin", "true"]
        else:
            command += ["--prefill", ",".join(spec.prefill), "--decode", ",".join(spec.decode)]
        command += ["--http-port", str(spec.http_port)]
        command += _set_only(served_model_name=config.served_model_name, chat_template=config.chat_template)
    else:
        devices = spec.devices or (config.device,)
        command += ["--device", devices[0], "--threads", str(config.threads)]
        command += _set_only(cpus=spec.cpus)
        command += ["--ep", str(config.decode_ep if spec.role == DECODE else config.prefill_ep)]
        if len(devices) > 1:
            command += ["--ep-devices", ",".join(devices)]
        command += ["--kv-backend", config.kv_backend]
        if config.compile != "auto":
            command += ["--compile", config.compile]
        if config.enforce_eager:
            command += ["--enforce-eager", "true"]
        if config.recompile_in_serving:
            command += ["--recompile-in-serving", "true"]
        if config.no_shared_prefix_attention:
            command += ["--no-shared-prefix-attention", "true"]
        if config.linear_layout != "auto":
            command += ["--linear-layout", config.linear_layout]
        command += _set_only(dtype="" if config.dtype == "auto" else config.dtype)
    if spec.role in (PREFILL, COLOCATED):
        command += ["--kv-port", str(spec.kv_port)]
        command += _set_only(max_batch_tokens=config.max_batch_tokens)
    if spec.role in (DECODE, COLOCATED):
        command += _set_only(max_running=config.max_running, kv_block_size=config.kv_block_size)
    if spec.role == COLOCATED:
        command += ["--prefill-metrics-port", str(spec.prefill_metrics_port)]
    if config.cache_dir:
        command += ["--cache-dir", config.cache_dir]
    return command


def _set_only(**settings: str | int) -> list[str]:
    """The flags of the settings given a value ('' and 0 leave the child's own default)."""
    return [
        arg
        for name, value in settings.items()
        if value
        for arg in (f"--{name.replace('_', '-')}", str(value))
    ]


def parse_ready_line(line: str) -> dict[str, Any] | None:
    """The addresses of a child's ready line (``ready``/``service`` keys dropped), or None.

    A ready line is a JSON object with ``"ready": true`` and a string ``"grpc"`` address.
    """
    text = line.strip()
    if not text.startswith("{"):
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if (
        not isinstance(value, dict)
        or value.get("ready") is not True
        or not isinstance(value.get("grpc"), str)
    ):
        return None
    return {key: item for key, item in value.items() if key not in ("ready", "service")}


def port_of(address: object) -> int:
    """The port of ``HOST:PORT``; 0 when there is none."""
    if not isinstance(address, str):
        return 0
    port = address.rpartition(":")[2]
    return int(port) if port.isdigit() else 0


def pin_ports(spec: LaunchSpec, info: Mapping[str, Any]) -> LaunchSpec:
    """``spec`` with the ports a child announced, so that a restart comes back on the same ones."""
    return dataclasses.replace(
        spec,
        port=port_of(info.get("grpc")),
        metrics_port=port_of(info.get("metrics")),
        kv_port=port_of(info.get("kv_rendezvous")),
        prefill_metrics_port=port_of(info.get("prefill_metrics")),
        http_port=port_of(info["http"]) if "http" in info else spec.http_port,
    )


def bind_error(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound now (as the servers bind it), or None when it can."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        socket.create_server((host, port), family=family).close()
    except OSError as error:
        return error.strerror or str(error)
    return None


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


def pdserve_executable() -> str:
    """How to call the ``pdserve`` script of this interpreter, as a user would type it."""
    candidate = Path(sys.executable).parent / "pdserve"
    if not candidate.exists():
        return "pdserve"
    relative = os.path.relpath(candidate)
    return relative if not relative.startswith("..") else str(candidate)


def curl_example(http_address: str, model: str, with_api_key: bool = False, tls_ca: str = "") -> str:
    """The ``curl`` line of the hint ``pdserve up`` prints: one chat request over the HTTP API
    (``with_api_key``: sending the key of ``$PDSERVE_API_KEY``; ``tls_ca``: over HTTPS, trusting it)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 32,
    }
    return (
        "or over the OpenAI-compatible HTTP API:\n"
        + (
            f"  curl --cacert {shlex.quote(tls_ca)} https://{http_address}/v1/chat/completions"
            if tls_ca
            else f"  curl http://{http_address}/v1/chat/completions"
        )
        + " -H 'Content-Type: application/json' \\\n"
        + ('    -H "Authorization: Bearer $PDSERVE_API_KEY" \\\n' if with_api_key else "")
        + f"    -d {shlex.quote(json.dumps(body))}\n"
    )
