"""The model an engine process runs: weights on its device, tokenizer, limits, fingerprint, KV layout."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache

import pdserve.model.deepseek_moe.modeling  # noqa: F401  (registers the DeepSeekMoE models with transformers)
from pdserve.config import EngineConfig
from pdserve.core.limits import ModelLimits
from pdserve.kv.layout import KvLayout
from pdserve.model import decode_attention, packed_linear
from pdserve.model.compile_choice import choose_compile
from pdserve.model.compiled_forward import (
    CompiledForward,
    compile_model,
    stop_compiling,
    use_compile_cache,
    warm_up_or_fall_back,
)
from pdserve.model.eos_tokens import eos_token_ids
from pdserve.model.linear_layout import apply_linear_layout, choose_linear_layout
from pdserve.model.packed_linear import can_pack_linear_weights
from pdserve.model.source import default_cache_dir, resolve_model_dir

logger = logging.getLogger(__name__)


class ForwardUnavailable(RuntimeError):
    """A forward could not run and never will in this process (its expert-parallel group is gone)."""


def run_directly(forward: Callable[[], Any]) -> Any:
    return forward()


@dataclass(frozen=True)
class EngineModel:
    model: Any
    tokenizer: Any
    limits: ModelLimits
    device: torch.device
    fingerprint: str
    kv_layout: KvLayout
    # How a forward runs: at once, or at the next tick of an expert-parallel group (``Lockstep.run``).
    run_forward: Callable[[Callable[[], Any]], Any] = run_directly
    # What the engines' forwards call instead of ``model``: ``model`` compiled (``--compile``).
    forward_module: CompiledForward | None = None

    @property
    def compiled(self) -> bool:
        """Whether the forwards run compiled (``--compile``): the engines warm them up before serving."""
        return self.forward_module is not None and self.forward_module.active

    def warm_up(self, warm_up: Callable[[], float]) -> float:
        """Runs an engine's warm-up of compiled forwards (nothing when eager) and returns its duration;
        a compilation that fails makes the forwards eager (see ``compiled_forward``)."""
        return warm_up_or_fall_back(self.forward_module, warm_up, (ForwardUnavailable,))

    def end_warm_ups(self, recompile_in_serving: bool) -> None:
        """Called once every warm-up of the process is done: compiled forwards compile nothing more
        (``stop_compiling``) unless ``recompile_in_serving``."""
        if self.compiled and not recompile_in_serving:
            stop_compiling()

    def forward(self, **inputs: Any) -> Any:
        """The model's forward on ``inputs``, run the way this engine runs forwards."""
        module = self.model if self.forward_module is None else self.forward_module
        return self.run_forward(lambda: module(**inputs))


def resolve_dtype(name: str, device: torch.device, config: Any) -> torch.dtype:
    if name != "auto":
        dtype: torch.dtype = getattr(torch, name)
        return dtype
    if device.type == "cpu":
        return torch.float32
    configured = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(configured, torch.dtype):
        return configured
    if isinstance(configured, str) and isinstance(getattr(torch, configured, None), torch.dtype):
        resolved: torch.dtype = getattr(torch, configured)
        return resolved
    return torch.bfloat16


def fingerprint(model: Any, dtype: torch.dtype) -> str:
    """Identifies architecture, dtype and weights: two processes agree only on the same model."""
    h = hashlib.sha256()
    h.update(json.dumps(model.config.to_dict(), sort_keys=True, default=str).encode())
    h.update(str(dtype).encode())
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(str(tuple(tensor.shape)).encode())
        sample = tensor.detach().flatten()[:64].to("cpu", torch.float64)
        h.update(sample.numpy().tobytes())
    return h.hexdigest()[:32]


@torch.inference_mode()
def measure_kv_layout(model: Any, device: torch.device) -> KvLayout:
    """One-token forward: the per-layer shapes and dtype of what the cache holds."""
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), cache=cache, use_cache=True)
    return KvLayout.from_cache_layers([(layer.keys, layer.values) for layer in cache.layers])


def load_engine_model(config: EngineConfig, before_move: Callable[[Any], None] | None = None) -> EngineModel:
    """The model of ``config`` on its device. ``before_move`` (an expert-parallel rank keeping its own
    experts) runs on the CPU copy, after the fingerprint and the KV layout are taken from the whole
    model, so that the device never holds what it drops."""
    device = torch.device(config.rank_device)
    if device.type == "cpu":
        torch.set_num_threads(config.threads)
    else:
        torch.cuda.set_device(device)
    model_dir = resolve_model_dir(config.model, config.cache_dir or None)
    hf_config = AutoConfig.from_pretrained(model_dir)
    choice = choose_compile(
        config,
        str(getattr(hf_config, "model_type", "")),
        device.type,
        int(getattr(hf_config, "num_hidden_layers", 0) or 0),
    )
    logger.info("forwards %s: %s", "compiled" if choice.enabled else "eager", choice.reason)
    cache_root = Path(config.cache_dir).expanduser() if config.cache_dir else default_cache_dir()
    if choice.enabled:
        use_compile_cache(cache_root)
    dtype = resolve_dtype(config.dtype, device, hf_config)
    logger.info("loading %s (%s) on %s as %s", config.model, model_dir, device, dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    # Sampled while the weights are contiguous: flattening an input-major weight would copy it whole.
    model_fingerprint = fingerprint(model, dtype)
    if before_move is None:
        model = model.to(device)
        kv_layout = measure_kv_layout(model, device)
    else:
        kv_layout = measure_kv_layout(model, torch.device("cpu"))
        before_move(model)
        model = model.to(device)
    if device.type == "cpu" and dtype == torch.float32:
        decode_attention.load(cache_root)
    if config.linear_layout in ("auto", "packed") and can_pack_linear_weights(device, dtype):
        packed_linear.load(cache_root)  # before timing: the products run the kernel the forwards will
    layout = choose_linear_layout(config.linear_layout, model, device, dtype)
    changed = apply_linear_layout(model, layout.layout)
    logger.info("linear weights %s (%d changed): %s", layout.layout, changed, layout.reason)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    limits = ModelLimits.from_config(hf_config, config.max_model_len, eos_token_ids(model_dir, hf_config))
    return EngineModel(
        model=model,
        tokenizer=tokenizer,
        limits=limits,
        device=device,
        fingerprint=model_fingerprint,
        kv_layout=kv_layout,
        forward_module=compile_model(model, device) if choice.enabled else None,
    )
