"""What one ``pdserve bench`` run sends, where, and how it reports; every field is a flag."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from pdserve.config.checks import check_file

ENDPOINTS = ("completions", "chat")
PROMPT_FORMATS = ("auto", "ids", "text")
MODES = ("disaggregated", "colocated")
SLO_KEYS = ("ttft_ms", "tpot_ms", "e2el_ms")
WORKLOADS = ("reference", "shared-prefix", "mixed")


def parse_slo(items: tuple[str, ...]) -> dict[str, float]:
    """``("ttft_ms=500", "tpot_ms=50")`` -> ``{"ttft_ms": 500.0, "tpot_ms": 50.0}``.

    Raises ValueError naming the bad item.
    """
    slo: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"slo items are KEY=MS with KEY one of {', '.join(SLO_KEYS)}, got {item!r}")
        try:
            limit = float(value)
        except ValueError:
            raise ValueError(f"slo {key} must be a number of milliseconds, got {value!r}") from None
        if not (limit > 0 and math.isfinite(limit)):
            raise ValueError(f"slo {key} must be > 0 ms, got {value!r}")
        if key in slo:
            raise ValueError(f"slo {key} given twice")
        slo[key] = limit
    return slo


def parse_extra_body(text: str) -> dict[str, Any]:
    """The JSON object of ``--extra-body`` (empty text: none); ValueError on anything else."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError as error:
        raise ValueError(f"extra_body must be a JSON object: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"extra_body must be a JSON object, got {text!r}")
    return value


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run against an OpenAI-compatible server."""

    base_url: str = field(
        default="http://127.0.0.1:8000", metadata={"help": "server root; /v1/... is appended"}
    )
    workload: str = field(
        default="reference",
        metadata={
            "help": "reference (--num-prompts of --input-len/--output-len), shared-prefix (--prefix-* "
            "knobs) or mixed (--mixed-* and --long-* knobs); the last two send token-id prompts"
        },
    )
    prefix_len: int = field(default=1024, metadata={"help": "shared-prefix: tokens of each shared prefix"})
    prefix_groups: int = field(
        default=1,
        metadata={
            "help": "shared-prefix: distinct prefixes; the requests are spread evenly over them and "
            "sent in a seeded random order (SGLang's generated-shared-prefix groups)"
        },
    )
    suffix_len: int = field(default=32, metadata={"help": "shared-prefix: tokens of each request's own"})
    prefix_output_len: int = field(default=32, metadata={"help": "shared-prefix: max_tokens per request"})
    prefix_requests: int = field(default=64, metadata={"help": "shared-prefix: measured requests"})
    prefix_concurrency: int = field(default=16, metadata={"help": "shared-prefix: requests in flight"})
    mixed_duration_s: float = field(
        default=40.0, metadata={"help": "mixed: seconds during which the loops start requests"}
    )
    mixed_streams: int = field(default=16, metadata={"help": "mixed: closed-loop short streams"})
    mixed_input_len: int = field(default=64, metadata={"help": "mixed: prompt tokens of a short stream"})
    mixed_output_len: int = field(default=128, metadata={"help": "mixed: max_tokens of a short stream"})
    long_input_len: int = field(
        default=1024, metadata={"help": "mixed: prompt tokens of the long prompts, sent one after another"}
    )
    long_output_len: int = field(default=8, metadata={"help": "mixed: max_tokens of a long prompt"})
    model: str = field(
        default="", metadata={"help": "model id to request (default: the first of /v1/models)"}
    )
    endpoint: str = field(
        default="completions",
        metadata={"help": "completions (/v1/completions) or chat (/v1/chat/completions)"},
    )
    tokenizer: str = field(
        default="",
        metadata={
            "help": "local tokenizer directory or pdserve preset for prompts and token counts "
            "(default: --launch, else --model when it is a directory)"
        },
    )
    prompt_format: str = field(
        default="auto", metadata={"help": "ids (token-id prompts), text, or auto (ids for completions)"}
    )
    vocab_size: int = field(default=0, metadata={"help": "token ids to draw from without a tokenizer"})
    input_len: int = field(default=64, metadata={"help": "prompt tokens per request"})
    output_len: int = field(default=64, metadata={"help": "max_tokens per request"})
    random_range_ratio: float = field(
        default=0.0, metadata={"help": "lengths uniform in [len*(1-r), len*(1+r)]; 0 = fixed"}
    )
    num_prompts: int = field(default=100, metadata={"help": "measured requests"})
    concurrency: int = field(default=0, metadata={"help": "most requests in flight; 0 = no cap"})
    request_rate: float = field(
        default=math.inf, metadata={"help": "Poisson arrivals per second; inf sends all at once"}
    )
    seed: int = field(default=0, metadata={"help": "seed of prompts, lengths and arrival times"})
    num_warmup: int = field(default=1, metadata={"help": "unmeasured requests sent first, one at a time"})
    ignore_eos: bool = field(
        default=False, metadata={"help": "send ignore_eos so every request runs to max_tokens"}
    )
    temperature: float = field(default=0.0, metadata={"help": "sampling temperature (0 = greedy)"})
    extra_body: str = field(
        default="", metadata={"help": "JSON object merged into every request body (server-specific fields)"}
    )
    slo: tuple[str, ...] = field(
        default=(),
        metadata={"help": "goodput SLOs, e.g. ttft_ms=500,tpot_ms=50 (keys: " + ", ".join(SLO_KEYS) + ")"},
    )
    request_timeout_s: float = field(default=600.0, metadata={"help": "bound on each request"})
    json: bool = field(default=False, metadata={"help": "print the result as JSON instead of a table"})
    output_file: str = field(default="", metadata={"help": "also write the JSON result to this file"})
    progress: bool = field(default=True, metadata={"help": "progress bar on stderr"})
    server_pid: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "server pids whose process trees are measured: CPU seconds and, per process, "
            "the seconds its threads waited for a core (Linux)"
        },
    )
    launch: str = field(
        default="",
        metadata={"help": "start `pdserve up --model MODEL` for the run instead of using --base-url"},
    )
    mode: str = field(default="disaggregated", metadata={"help": "with --launch: disaggregated or colocated"})
    launch_timeout_s: float = field(default=300.0, metadata={"help": "with --launch: bound on start-up"})
    api_key: str = field(
        default="",
        metadata={"help": "API key sent as `Authorization: Bearer KEY` ('' = none)", "secret": True},
    )
    tls_ca: str = field(
        default="",
        metadata={"help": "PEM CA bundle (or self-signed certificate) an https:// server must chain to"},
    )

    def __post_init__(self) -> None:
        if not self.launch and not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")
        check_file("--tls-ca", self.tls_ca)
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {self.workload!r}")
        if self.workload != "reference" and not self.uses_token_ids:
            raise ValueError(
                f"the {self.workload} workload sends token-id prompts: use the completions endpoint"
            )
        for name in (
            "prefix_len",
            "prefix_groups",
            "suffix_len",
            "prefix_output_len",
            "prefix_requests",
            "prefix_concurrency",
            "mixed_streams",
            "mixed_input_len",
            "mixed_output_len",
            "long_input_len",
            "long_output_len",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not (math.isfinite(self.mixed_duration_s) and self.mixed_duration_s > 0):
            raise ValueError(f"mixed_duration_s must be a finite number > 0, got {self.mixed_duration_s}")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(
                f"prompt_format must be one of {', '.join(PROMPT_FORMATS)}, got {self.prompt_format!r}"
            )
        if self.endpoint == "chat" and self.prompt_format == "ids":
            raise ValueError("the chat endpoint takes text prompts, not prompt_format=ids")
        if self.vocab_size < 0:
            raise ValueError(f"vocab_size must be >= 0, got {self.vocab_size}")
        if self.input_len < 1:
            raise ValueError(f"input_len must be >= 1, got {self.input_len}")
        if self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len}")
        if not 0 <= self.random_range_ratio < 1:
            raise ValueError(f"random_range_ratio must be in [0, 1), got {self.random_range_ratio}")
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if self.concurrency < 0:
            raise ValueError(f"concurrency must be >= 0 (0 = no cap), got {self.concurrency}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (inf sends all at once), got {self.request_rate}")
        if self.num_warmup < 0:
            raise ValueError(f"num_warmup must be >= 0, got {self.num_warmup}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        parse_slo(self.slo)
        parse_extra_body(self.extra_body)
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        for pid in self.server_pid:
            if not pid.isdigit():
                raise ValueError(f"server_pid must be process ids, got {pid!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not self.launch_timeout_s > 0:
            raise ValueError(f"launch_timeout_s must be > 0, got {self.launch_timeout_s}")

    @property
    def uses_token_ids(self) -> bool:
        """Whether prompts go out as token-id lists (completions only)."""
        return self.prompt_format == "ids" or (
            self.prompt_format == "auto" and self.endpoint == "completions"
        )

    @property
    def slo_ms(self) -> dict[str, float]:
        return parse_slo(self.slo)
