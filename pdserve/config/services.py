"""Typed, frozen configuration of the three services; the CLI takes its flags and defaults from here.

Every field is also read from the environment as ``PDSERVE_<FIELD NAME IN UPPER CASE>`` (see
``pdserve.config.flags``), so a flag, an environment variable and a field are one setting.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, TypeVar

from pdserve.config.checks import (
    check_address,
    check_at_least,
    check_backend_address,
    check_chat_template,
    check_choice,
    check_device,
    check_non_negative,
    check_port,
    check_positive,
    device_at,
)
from pdserve.config.compile_setting import compile_setting
from pdserve.config.cpu_list import parse_cpu_list
from pdserve.config.ep_ports import check_ep_port_base, ep_port_range
from pdserve.config.prefill_routing import PrefillRouting
from pdserve.config.request_limits import RequestLimits
from pdserve.config.security import InternalSecurity, PublicSecurity

DEFAULT_MODEL = "smollm2-135m-instruct"
BACKENDS = ("auto", "gloo", "nccl", "shm", "cuda-ipc")
GPU_BACKENDS = ("nccl", "cuda-ipc")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {"float": "float32", "half": "float16"}  # vLLM's names
EP_DISPATCHES = ("auto", "deepep-normal", "all-to-all")
LINEAR_LAYOUTS = ("auto", "packed", "input-major", "plain")


@dataclass(frozen=True)
class EngineConfig:
    """How a prefill or decode process loads and runs its model."""

    model: str = field(default=DEFAULT_MODEL, metadata={"help": "model directory or preset name"})
    device: str = field(default="cpu", metadata={"help": "torch device, e.g. cpu or cuda:0"})
    dtype: str = field(
        default="auto",
        metadata={
            "help": "weights dtype: auto (float32 on CPU, the model's on CUDA), float32, bfloat16 or "
            "float16 (vLLM's float and half name float32 and float16)"
        },
    )
    threads: int = field(default=1, metadata={"help": "intra-op torch threads on CPU"})
    cpus: str = field(
        default="",
        metadata={
            "help": "CPU cores every thread of the process (expert-parallel ranks included) runs on, as "
            "Linux writes them (0, 2-3, 0-1,4); empty: wherever the OS schedules them (pdserve up "
            "gives each engine process cores of its own, see --cpu-bind)"
        },
    )
    max_model_len: int = field(default=0, metadata={"help": "context limit; 0 takes the model's"})
    cache_dir: str = field(
        default="", metadata={"help": "where presets are built (default ~/.cache/pdserve)"}
    )
    compile: str = field(
        default="auto",
        metadata={
            "help": "torch.compile the engine's forwards (inductor, dynamic shapes; warmed up at start-up, "
            "compiled code cached under the cache dir): auto (where it measured faster, see "
            "pdserve/model/compile_choice.py), true (bare --compile) or false",
            "bare": "true",
        },
    )
    enforce_eager: bool = field(
        default=False, metadata={"help": "never compile: run the forwards eagerly (same as --compile false)"}
    )
    recompile_in_serving: bool = field(
        default=False,
        metadata={
            "help": "compiled forwards: compile a shape class the warm-up did not when a request first "
            "needs it (the engine waits for the compilation); by default that forward runs eagerly"
        },
    )
    linear_layout: str = field(
        default="auto",
        metadata={
            "help": "how linear weights are held for float32 on a CPU: auto (the faster of packed and "
            "input-major, timed on the model's products at start-up), packed (by oneDNN), input-major "
            "(MKL's GEMM) or plain (as loaded); see pdserve/model/linear_layout.py"
        },
    )
    no_shared_prefix_attention: bool = field(
        default=False,
        metadata={
            "help": "rows of a forward that share a KV prefix attend to it each on its own (by default "
            "the prefix is read once for all of them, on models whose attention allows it)"
        },
    )
    ep: int = field(
        default=1,
        metadata={
            "help": "expert-parallel ranks: the service runs as this many processes (cuda: one GPU each)"
        },
    )
    ep_timeout_s: float = field(
        default=30.0, metadata={"help": "bound on every wait of the expert-parallel group"}
    )
    ep_dispatch: str = field(
        default="auto",
        metadata={
            "help": "expert-parallel dispatch on CUDA: auto (DeepEP when it passes its start-up checks, "
            "low-latency kernels for decode steps), deepep-normal (DeepEP's normal kernels only), all-to-all"
        },
    )
    ep_rank: int = field(default=0, metadata={"help": "this process's rank (set by rank 0 for the others)"})
    ep_master: str = field(
        default="", metadata={"help": "HOST:PORT of rank 0's group store (set by rank 0 for the others)"}
    )
    ep_devices: tuple[str, ...] = field(
        default=(),
        metadata={"help": "device of each expert-parallel rank (default: consecutive GPUs from --device)"},
    )
    ep_port_base: int = field(
        default=0,
        metadata={
            "help": "first of the group's fixed internal ports, 4 per rank from it (0 picks free ports; "
            "see pdserve/config/ep_ports.py)"
        },
    )

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must not be empty")
        check_device("device", self.device)
        object.__setattr__(self, "dtype", DTYPE_ALIASES.get(self.dtype, self.dtype))
        check_choice("dtype", self.dtype, DTYPES)
        object.__setattr__(self, "compile", compile_setting(self.compile))
        if self.enforce_eager and self.compile == "true":
            raise ValueError("compile=true and enforce_eager contradict each other: choose one")
        check_choice("linear_layout", self.linear_layout, LINEAR_LAYOUTS)
        check_at_least("threads", self.threads, 1)
        parse_cpu_list(self.cpus)
        check_at_least("max_model_len", self.max_model_len, 0)
        check_at_least("ep", self.ep, 1)
        check_positive("ep_timeout_s", self.ep_timeout_s)
        check_choice("ep_dispatch", self.ep_dispatch, EP_DISPATCHES)
        if not 0 <= self.ep_rank < self.ep:
            raise ValueError(f"ep_rank must be in [0, ep) = [0, {self.ep}), got {self.ep_rank}")
        if self.ep_rank > 0 and not self.ep_master:
            raise ValueError("ep_master must be set on ranks other than 0")
        if self.ep_master:
            check_address("ep_master", self.ep_master)
        if self.ep_devices and len(self.ep_devices) != self.ep:
            raise ValueError(
                f"ep_devices must name {self.ep} devices (one per rank), got {len(self.ep_devices)}"
            )
        for device in self.ep_devices:
            check_device("ep_devices", device)
        check_ep_port_base(self.ep_port_base, self.ep)

    @property
    def rank_device(self) -> str:
        """This rank's device, index explicit: its entry of ``ep_devices``, else the r-th GPU from
        ``device`` (``cuda`` is ``cuda:0``)."""
        if self.ep_devices:
            return device_at(self.ep_devices[self.ep_rank])
        return device_at(self.device, self.ep_rank)


@dataclass(frozen=True)
class TransferConfig:
    """The KV handoff between a prefill and a decode process."""

    kv_backend: str = field(
        default="auto",
        metadata={
            "help": "how KV moves: shm or cuda-ipc (same host, read in place), nccl or gloo (pairs), "
            "or auto (the fastest both ends can use)"
        },
    )
    transfer_timeout_s: float = field(default=30.0, metadata={"help": "bound on every KV transfer wait"})
    kv_shm_dir: str = field(
        default="/dev/shm",
        metadata={"help": "shared-memory directory of the same-host KV transport ('' turns it off)"},
    )

    def __post_init__(self) -> None:
        check_choice("kv_backend", self.kv_backend, BACKENDS)
        check_positive("transfer_timeout_s", self.transfer_timeout_s)

    def backend_for(self, device: str) -> str:
        """The torch.distributed backend of pairs on ``device``: the one forced, else by device."""
        if self.kv_backend in ("gloo", "nccl"):
            return self.kv_backend
        return "nccl" if device.startswith("cuda") else "gloo"

    def check_device(self, device: str, side: str) -> None:
        """Raises ValueError when this transport cannot run on ``device`` on the ``side`` named."""
        if self.kv_backend in GPU_BACKENDS and not device.startswith("cuda"):
            raise ValueError(f"kv_backend {self.kv_backend} needs a CUDA device, the {side} is on {device}")
        if self.kv_backend == "shm" and side == "prefill" and device != "cpu":
            raise ValueError(
                f"kv_backend shm parks KV in host memory: the prefill must be on cpu, not {device}"
            )


@dataclass(frozen=True)
class ServerConfig:
    """Where a service listens."""

    host: str = field(default="127.0.0.1", metadata={"help": "address to bind"})
    advertise_host: str = field(
        default="",
        metadata={"help": "name or address peers reach this service by (ready line, KV handles); '' = host"},
    )
    port: int = field(default=0, metadata={"help": "gRPC port (0 picks a free one)"})
    metrics_port: int = field(default=0, metadata={"help": "Prometheus metrics port (0 picks a free one)"})
    grace_s: float = field(default=5.0, metadata={"help": "drain time on SIGTERM"})

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host must not be empty")
        if any(c.isspace() or c == "," for c in self.advertise_host):
            raise ValueError(f"advertise_host must be one host name or address, got {self.advertise_host!r}")
        check_port("port", self.port)
        check_port("metrics_port", self.metrics_port)
        check_non_negative("grace_s", self.grace_s)

    @property
    def public_host(self) -> str:
        """The host other processes use to reach this service."""
        return self.advertise_host or self.host


# The prefill's token budget by device. On CPU a forward takes time in proportion to its tokens, and
# every request of a batch waits for the whole forward: smaller batches give earlier first tokens
# and let the decode start on them while the prefill goes on. A CPU core's GEMMs are near their
# peak from a few hundred rows on (within 5% of 2048 rows at 256). A GPU runs larger batches at
# little extra time.
CPU_BATCH_TOKENS = 512
CUDA_BATCH_TOKENS = 8192
# Least tokens of prompts one CPU prefill forward runs together: the prompts of a step's batch run in
# forwards one after another, each answered when its forward ends, so the first of a burst do not
# wait for the last (a long prompt's chunk of the whole budget still runs alone). A forward's size
# follows the queue, from this many tokens up to the budget (``prefill_service.forward_size``). On
# CUDA a forward of the whole budget takes little longer than a small one: no split.
CPU_FORWARD_TOKENS = 128
MAX_BATCH_TOKENS_HELP = (
    "token budget of one prefill step (per forward: rows x longest chunk); a longer prompt is "
    f"prefilled in chunks of it, other prompts running between them; 0: {CPU_BATCH_TOKENS} on CPU, "
    f"{CUDA_BATCH_TOKENS} on CUDA"
)
MAX_PREFIX_BLOCK_SIZE = 4096


@dataclass(frozen=True)
class EngineService:
    """What every engine service has: where it listens, how it runs its model, how KV moves, who
    may call it."""

    server: ServerConfig = field(default_factory=ServerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    security: InternalSecurity = field(default_factory=InternalSecurity)

    def check_ep_ports(self, *ports: int) -> None:
        """Rank 0's own ports (``ports``: the service's public ones) lie outside the group's block."""
        engine = self.engine
        if engine.ep == 1 or not engine.ep_port_base or engine.ep_rank:
            return
        block = ep_port_range(engine.ep_port_base, engine.ep)
        inside = sorted({p for p in (self.server.port, self.server.metrics_port, *ports) if p in block})
        if inside:
            raise ValueError(
                f"ports {inside} lie in the expert-parallel block [{block.start}, {block.stop}) of "
                f"ep_port_base {engine.ep_port_base}: move the base or the ports"
            )


@dataclass(frozen=True)
class PrefillSettings:
    """The prefill's own settings (a prefill service, and the prefill side of a colocated one)."""

    kv_port: int = field(
        default=0,
        metadata={"help": "unused: KV pairs meet over the prefill's gRPC port (no rendezvous store)"},
    )
    lease_s: float = field(default=30.0, metadata={"help": "seconds a parked KV waits to be pulled"})
    max_batch_tokens: int = field(
        default=0, metadata={"help": MAX_BATCH_TOKENS_HELP, "aliases": ("--max-num-batched-tokens",)}
    )
    max_forward_tokens: int = field(
        default=0,
        metadata={
            "help": "most tokens of prompts one prefill forward runs together (rows x longest "
            "chunk); a step's prompts beyond run in the forwards after it, each answered when its "
            f"forward ends; 0: on CPU from {CPU_FORWARD_TOKENS} up to the token budget, following the "
            "queue (the square root of its tokens times a forward's fixed cost, measured at start), "
            "on CUDA the whole token budget"
        },
    )
    kv_shm_bytes: int = field(
        default=0,
        metadata={
            "help": "size of the shared-memory KV arena a CPU prefill parks KV in for decodes of its "
            "host; 0: a quarter of /dev/shm, at most 4 GiB; -1: none"
        },
    )
    max_prefill_waiting: int = field(
        default=1024,
        metadata={
            "help": "most requests waiting for a prefill forward; more are refused at once "
            "(RESOURCE_EXHAUSTED: the gateway tries another prefill)"
        },
    )
    prefix_cache_tokens: int = field(
        default=-1,
        metadata={
            "help": "most prompt tokens whose KV the prefill's prefix cache keeps (LRU) for prompts "
            "that start the same way, written whole at start; -1: 1/16 of the device's memory (on CPU "
            "a container's memory limit where smaller; at most 4 GiB) over the model's KV bytes per "
            "token; 0: no prefix cache"
        },
    )
    no_prefix_cache: bool = field(
        default=False, metadata={"help": "turn the prefill's prefix cache off (as --prefix-cache-tokens 0)"}
    )
    prefix_block_size: int = field(
        default=16,
        metadata={"help": "tokens per block of the prefix cache: prompts share the KV of whole blocks"},
    )

    def check_prefill(self) -> None:
        check_port("kv_port", self.kv_port)
        check_at_least("kv_shm_bytes", self.kv_shm_bytes, -1)
        check_positive("lease_s", self.lease_s)
        check_at_least("max_prefill_waiting", self.max_prefill_waiting, 1)
        if self.max_batch_tokens < 0:
            raise ValueError(f"max_batch_tokens must be >= 0 (0: by device), got {self.max_batch_tokens}")
        if self.max_forward_tokens < 0:
            raise ValueError(f"max_forward_tokens must be >= 0 (0: by device), got {self.max_forward_tokens}")
        check_at_least("prefix_cache_tokens", self.prefix_cache_tokens, -1)
        if not 1 <= self.prefix_block_size <= MAX_PREFIX_BLOCK_SIZE:
            raise ValueError(
                f"prefix_block_size must be in [1, {MAX_PREFIX_BLOCK_SIZE}], got {self.prefix_block_size}"
            )

    @property
    def prefix_cache_on(self) -> bool:
        """Whether the prefill keeps a prefix cache."""
        return not self.no_prefix_cache and self.prefix_cache_tokens != 0

    def batch_tokens_on(self, device: str) -> int:
        """The token budget on ``device``: ``max_batch_tokens``, or the device's default when 0."""
        if self.max_batch_tokens:
            return self.max_batch_tokens
        return CPU_BATCH_TOKENS if device == "cpu" else CUDA_BATCH_TOKENS

    def forward_tokens_on(self, device: str) -> tuple[int, int]:
        """The least and most tokens of prompts one forward runs together on ``device`` (never more
        than the budget; the size follows the queue between them)."""
        budget = self.batch_tokens_on(device)
        if self.max_forward_tokens:
            fixed = min(self.max_forward_tokens, budget)
            return fixed, fixed
        if device == "cpu":
            return min(CPU_FORWARD_TOKENS, budget), budget
        return budget, budget


@dataclass(frozen=True)
class DecodeSettings:
    """The decode's own settings (a decode service, and the decode side of a colocated one)."""

    max_running: int = field(
        default=64, metadata={"help": "most requests decoding at once", "aliases": ("--max-num-seqs",)}
    )
    max_kv_tokens: int = field(default=65536, metadata={"help": "KV pool size of the decode, in tokens"})
    kv_block_size: int = field(
        default=16, metadata={"help": "tokens per KV pool block", "aliases": ("--block-size",)}
    )
    max_decode_waiting: int = field(
        default=256,
        metadata={
            "help": "most requests a decode holds before they run (pulling their KV or waiting to join); "
            "more are refused at once (RESOURCE_EXHAUSTED)"
        },
    )
    max_pulled_waiting: int = field(
        default=0,
        metadata={
            "help": "most requests whose KV is pulled and that wait to join the running set; the others "
            "wait without pulling (0: max_running)"
        },
    )
    max_bypass: int = field(
        default=32,
        metadata={
            "help": "times requests that fit the KV pool may join past the first in line when it does not "
            "(0: strictly first come, first served)"
        },
    )
    context_idle_s: float = field(
        default=10.0,
        metadata={
            "help": "seconds with nothing running after which the decode's batch context is freed, down to "
            "what it reserved at start-up"
        },
    )

    def check_decode(self) -> None:
        check_at_least("max_running", self.max_running, 1)
        check_at_least("max_decode_waiting", self.max_decode_waiting, 1)
        check_at_least("max_pulled_waiting", self.max_pulled_waiting, 0)
        check_at_least("max_bypass", self.max_bypass, 0)
        check_non_negative("context_idle_s", self.context_idle_s)
        check_at_least("kv_block_size", self.kv_block_size, 1)
        if self.max_kv_tokens < self.kv_block_size:
            raise ValueError(
                f"max_kv_tokens must be >= kv_block_size ({self.kv_block_size}), got {self.max_kv_tokens}"
            )


@dataclass(frozen=True)
class PrefillConfig(PrefillSettings, EngineService):
    def __post_init__(self) -> None:
        self.check_prefill()
        self.transfer.check_device(self.engine.device, "prefill")
        self.check_ep_ports(self.kv_port)

    @property
    def batch_tokens(self) -> int:
        """The prefill's token budget: ``max_batch_tokens``, or the device's default when 0."""
        return self.batch_tokens_on(self.engine.device)

    @property
    def forward_tokens(self) -> tuple[int, int]:
        """The least and most tokens of prompts one prefill forward runs together."""
        return self.forward_tokens_on(self.engine.device)


DECODE_PREFILL_HELP = (
    "prefills this decode pulls KV from (HOST:PORT, or dns:///NAME:PORT; any port of their hosts); "
    "empty: only prefills of this host"
)


@dataclass(frozen=True)
class DecodeConfig(DecodeSettings, EngineService):
    prefill: tuple[str, ...] = field(default=(), metadata={"help": DECODE_PREFILL_HELP})
    resolve_interval_s: float = field(
        default=5.0, metadata={"help": "seconds between resolutions of the dns:/// prefill names"}
    )

    def __post_init__(self) -> None:
        for address in self.prefill:
            check_backend_address("prefill", address)
        check_positive("resolve_interval_s", self.resolve_interval_s)
        self.check_decode()
        self.transfer.check_device(self.engine.device, "decode")
        self.check_ep_ports()


C = TypeVar("C")


def _part(cls: type[C], config: Any, **overrides: Any) -> C:
    """The ``cls`` config made of ``config``'s fields of the same names."""
    values = {f.name: getattr(config, f.name) for f in fields(cls) if hasattr(config, f.name)}  # type: ignore[arg-type]
    return cls(**{**values, **overrides})


@dataclass(frozen=True)
class ColocatedConfig(DecodeSettings, PrefillSettings, EngineService):
    """Prefill and decode in one process sharing one model: the KV is handed over in memory."""

    prefill_metrics_port: int = field(default=0, metadata={"help": "metrics port of the prefill side"})

    def __post_init__(self) -> None:
        check_port("prefill_metrics_port", self.prefill_metrics_port)
        self.check_prefill()
        self.check_decode()
        self.check_ep_ports(self.kv_port, self.prefill_metrics_port)

    def prefill_config(self) -> PrefillConfig:
        # The decode takes the KV in memory: no shared-memory arena to park it in.
        return _part(
            PrefillConfig,
            self,
            server=replace(self.server, metrics_port=self.prefill_metrics_port),
            kv_shm_bytes=-1,
        )

    def decode_config(self) -> DecodeConfig:
        return _part(DecodeConfig, self)


HTTP_PORT = 8000


@dataclass(frozen=True)
class GatewayConfig:
    server: ServerConfig = field(default_factory=lambda: ServerConfig(port=50051))
    model: str = field(default=DEFAULT_MODEL, metadata={"help": "model directory or preset (tokenizer)"})
    cache_dir: str = field(
        default="", metadata={"help": "where presets are built (default ~/.cache/pdserve)"}
    )
    max_model_len: int = field(default=0, metadata={"help": "context limit; 0 takes the model's"})
    prefill: tuple[str, ...] = field(
        default=(),
        metadata={"help": "prefill gRPC addresses: HOST:PORT, or dns:///NAME:PORT for every address of NAME"},
    )
    decode: tuple[str, ...] = field(
        default=(),
        metadata={"help": "decode gRPC addresses: HOST:PORT, or dns:///NAME:PORT for every address of NAME"},
    )
    resolve_interval_s: float = field(
        default=5.0, metadata={"help": "seconds between resolutions of the dns:/// backend names"}
    )
    backends_from_stdin: bool = field(
        default=False,
        metadata={
            "help": "take --prefill and --decode from the first line of stdin, a JSON object "
            '{"prefill": [...], "decode": [...]}, read once the model is loaded (a supervisor starts '
            "the gateway beside its backends so)"
        },
    )
    http_port: int = field(
        default=HTTP_PORT,
        metadata={
            "help": "OpenAI-compatible HTTP port, also serving /metrics (-1 turns it off, 0 picks a free one)"
        },
    )
    served_model_name: str = field(
        default="", metadata={"help": "model id of the HTTP API (default: the --model value)"}
    )
    generation_config: str = field(
        default="auto",
        metadata={
            "help": "sampling defaults for the fields a request omits (temperature, top_p, top_k, "
            "repetition_penalty, min_p), as vLLM's flag: 'auto' the model's generation_config.json, "
            "'vllm' none (pdserve's own defaults), or a directory holding a generation_config.json"
        },
    )
    chat_template: str = field(
        default="",
        metadata={
            "help": "chat template in place of the model's: a file, or the Jinja template itself "
            "(as vLLM's --chat-template)"
        },
    )
    limits: RequestLimits = field(default_factory=RequestLimits)
    routing: PrefillRouting = field(default_factory=PrefillRouting)
    public: PublicSecurity = field(default_factory=PublicSecurity)
    internal: InternalSecurity = field(default_factory=InternalSecurity)

    def __post_init__(self) -> None:
        if not self.generation_config:
            raise ValueError("generation_config must be 'auto', 'vllm' or a directory, got ''")
        if self.backends_from_stdin:
            if self.prefill or self.decode:
                raise ValueError("backends_from_stdin reads the prefill and decode addresses: set neither")
        elif not self.prefill:
            raise ValueError("at least one prefill address is required (--prefill / PDSERVE_PREFILL)")
        elif not self.decode:
            raise ValueError("at least one decode address is required (--decode / PDSERVE_DECODE)")
        for address in self.prefill:
            check_backend_address("prefill", address)
        for address in self.decode:
            check_backend_address("decode", address)
        check_at_least("max_model_len", self.max_model_len, 0)
        check_positive("resolve_interval_s", self.resolve_interval_s)
        check_port("http_port", self.http_port, off=-1)
        check_chat_template(self.chat_template)

    @property
    def model_id(self) -> str:
        """The model id the HTTP API serves and accepts."""
        return self.served_model_name or self.model
