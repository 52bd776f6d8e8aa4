"""Tiny random-weight presets: small models of several attention/MLP families, bit-identical on every host.

The weights are large enough (``INITIALIZER_RANGE``) that greedy decoding has clear top-1/top-2 logit
margins, so argmax seldom flips on the last-bit differences between batch shapes or kernels.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    GenerationConfig,
    LlamaConfig,
    PretrainedConfig,
    Qwen2MoeConfig,
)

import pdserve.model.deepseek_moe.modeling  # noqa: F401  (AutoModelForCausalLM builds the DeepSeekMoE presets)
from pdserve.model.deepseek_moe import DeepseekMoeConfig
from pdserve.model.presets.tiny_tokenizer import EOS_TOKEN, save_tokenizer

logger = logging.getLogger(__name__)

SEED: Final = 2
INITIALIZER_RANGE: Final = 0.25
MAX_POSITIONS: Final = 2048
HIDDEN_SIZE: Final = 64


def _llama(common: dict[str, Any]) -> PretrainedConfig:
    return LlamaConfig(
        **common,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


def _qwen2_moe(common: dict[str, Any]) -> PretrainedConfig:
    return Qwen2MoeConfig(
        **common,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        decoder_sparse_step=1,
        norm_topk_prob=False,
        use_sliding_window=False,
    )


def _deepseek_v2_mla(common: dict[str, Any]) -> PretrainedConfig:
    return DeepseekV2Config(
        **common,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        first_k_dense_replace=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=32,
        topk_method="greedy",
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
    )


def _deepseek_moe(common: dict[str, Any]) -> PretrainedConfig:
    return DeepseekMoeConfig(
        **common,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_shared_experts=2,
        moe_intermediate_size=32,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
    )


def _deepseek_moe_16b_shape(common: dict[str, Any]) -> PretrainedConfig:
    """DeepSeekMoE-16B's shapes (the config's defaults, vocabulary included) in bfloat16; only the special
    token ids come from the tiny tokenizer. Built by ``deepseek_moe.random_checkpoint``, never in memory."""
    ids = {key: common[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return DeepseekMoeConfig(**ids, dtype="bfloat16")


CONFIG_FACTORIES: Final[Mapping[str, Callable[[dict[str, Any]], PretrainedConfig]]] = MappingProxyType(
    {
        "tiny-llama": _llama,
        "tiny-moe": _qwen2_moe,
        "tiny-mla-moe": _deepseek_v2_mla,
        "tiny-deepseek-moe": _deepseek_moe,
        "deepseek-moe-16b-shape": _deepseek_moe_16b_shape,
    }
)


def tiny_config(name: str, vocab_size: int, eos_id: int) -> PretrainedConfig:
    """The model config of tiny preset ``name`` for a tokenizer of ``vocab_size`` tokens."""
    factory = CONFIG_FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"unknown tiny preset {name!r}; expected one of {sorted(CONFIG_FACTORIES)}")
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN_SIZE,
        "max_position_embeddings": MAX_POSITIONS,
        "initializer_range": INITIALIZER_RANGE,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
    }
    return factory(common)


@torch.no_grad()
def fill_portable(model: torch.nn.Module, seed: int, std: float) -> None:
    """Refill every matrix of ``model`` with uniform noise of standard deviation ``std``, bit-exactly.

    The values come from integer draws and correctly rounded arithmetic only, so they are the same on
    every CPU architecture and do not depend on the module construction order. One-dimensional
    parameters (norm weights, biases) keep their constant initial values; embedding padding rows stay 0.
    """
    generator = torch.Generator(device="cpu").manual_seed(seed)
    half = 1 << 23
    scale = std * math.sqrt(3.0) / half
    for _, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        if param.ndim < 2:
            continue
        ints = torch.randint(0, 2 * half, tuple(param.shape), generator=generator, dtype=torch.int64)
        param.copy_(((ints - half).to(torch.float64) * scale).to(param.dtype))
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding) and module.padding_idx is not None:
            module.weight[module.padding_idx].zero_()


def build_tiny_preset(name: str, out_dir: Path) -> None:
    """Write tokenizer, config, generation config and seeded float32 weights of ``name`` into ``out_dir``."""
    tokenizer = save_tokenizer(out_dir, MAX_POSITIONS)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    if not isinstance(eos_id, int):
        raise ValueError(f"tiny tokenizer has no id for {EOS_TOKEN!r}")
    config = tiny_config(name, len(tokenizer), eos_id)
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.manual_seed(SEED)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fill_portable(model, SEED, INITIALIZER_RANGE)
    model.generation_config = GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "built tiny preset %s (%s, %d parameters) in %s", name, type(model).__name__, n_params, out_dir
    )
