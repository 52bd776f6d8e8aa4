"""Random-weight DeepSeekMoE checkpoints of any size, written tensor by tensor in the checkpoint layout.

A model of DeepSeekMoE-16B's shapes is never built in memory: the tensor names and shapes come from a
model on the ``meta`` device, each tensor is drawn on the CPU from a generator of its own (seeded from
the preset's seed and the tensor's name), so the weights are the same on every machine whatever its
GPU, thread count or shard size; the tensors of a shard are drawn on ``workers`` threads (torch's CPU
generator is sequential), cast and written as soon as the shard is full, so memory stays near one
shard. The files
are what a published checkpoint looks like (per-expert weights, sharded safetensors with an index), so
loading one goes through the same conversion as a real checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Final

import torch
from safetensors.torch import save_file
from transformers import GenerationConfig

from pdserve.model.deepseek_moe.configuration import DeepseekMoeConfig
from pdserve.model.deepseek_moe.modeling import DeepseekMoeForCausalLM

logger = logging.getLogger(__name__)

SEED: Final = 2
SHARD_BYTES: Final = 4 << 30
INDEX_FILE: Final = "model.safetensors.index.json"


def checkpoint_shapes(config: DeepseekMoeConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of a checkpoint of ``config``, with one entry per routed expert."""
    with torch.device("meta"):
        model = DeepseekMoeForCausalLM(config)
    shapes: dict[str, tuple[int, ...]] = {}
    for name, tensor in model.state_dict().items():
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith("mlp.experts") and leaf == "gate_up_proj":
            experts, double, hidden = tensor.shape
            for e in range(experts):
                shapes[f"{prefix}.{e}.gate_proj.weight"] = (double // 2, hidden)
                shapes[f"{prefix}.{e}.up_proj.weight"] = (double // 2, hidden)
        elif prefix.endswith("mlp.experts") and leaf == "down_proj":
            experts, hidden, inner = tensor.shape
            for e in range(experts):
                shapes[f"{prefix}.{e}.down_proj.weight"] = (hidden, inner)
        else:
            shapes[name] = tuple(tensor.shape)
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def _shard_plan(shapes: dict[str, tuple[int, ...]], itemsize: int, shard_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    used = 0
    for name in sorted(shapes):
        size = itemsize * torch.Size(shapes[name]).numel()
        if shards[-1] and used + size > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def tensor_seed(seed: int, name: str) -> int:
    """The seed of tensor ``name``'s own generator: the same for a name wherever it is drawn."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def draw_tensor(name: str, shape: tuple[int, ...], seed: int, std: float, dtype: torch.dtype) -> torch.Tensor:
    """Ones for a vector (norms), else normal(0, ``std``) drawn in float32 on the CPU, then cast."""
    if len(shape) < 2:
        return torch.ones(shape, dtype=dtype)
    generator = torch.Generator().manual_seed(tensor_seed(seed, name))
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=generator).to(dtype)


def _draw(
    names: list[str],
    shapes: dict[str, tuple[int, ...]],
    seed: int,
    std: float,
    dtype: torch.dtype,
    pool: ThreadPoolExecutor,
) -> Iterator[tuple[str, torch.Tensor]]:
    drawn = pool.map(lambda name: draw_tensor(name, shapes[name], seed, std, dtype), names)
    yield from zip(names, drawn, strict=True)


def write_random_checkpoint(
    config: DeepseekMoeConfig,
    out_dir: Path,
    *,
    seed: int = SEED,
    dtype: torch.dtype = torch.bfloat16,
    shard_bytes: int = SHARD_BYTES,
    workers: int = 0,
) -> int:
    """Write sharded random weights of ``config`` (normal, std ``initializer_range``; norms 1) and the index,
    drawn on ``workers`` threads (0: one per CPU). Returns the number of parameters written."""
    if shard_bytes <= 0:
        raise ValueError(f"shard_bytes must be positive, got {shard_bytes}")
    shapes = checkpoint_shapes(config)
    itemsize = torch.empty((), dtype=dtype).element_size()
    plan = _shard_plan(shapes, itemsize, shard_bytes)
    if workers < 0:
        raise ValueError(f"workers must be >= 0 (0: one per CPU), got {workers}")
    weight_map: dict[str, str] = {}
    total = 0
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        for i, names in enumerate(plan, start=1):
            file_name = f"model-{i:05d}-of-{len(plan):05d}.safetensors"
            shard = dict(_draw(names, shapes, seed, config.initializer_range, dtype, pool))
            save_file(shard, str(out_dir / file_name), metadata={"format": "pt"})
            total += sum(t.numel() for t in shard.values())
            weight_map.update(dict.fromkeys(names, file_name))
            logger.info("wrote %s (%d tensors)", file_name, len(names))
            del shard
    index = {"metadata": {"total_size": total * itemsize}, "weight_map": weight_map}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return total


def build_shape_preset(name: str, out_dir: Path) -> None:
    """Tokenizer, config and generation config of preset ``name``, then its random weights, into ``out_dir``."""
    from pdserve.model.presets.tiny import tiny_config
    from pdserve.model.presets.tiny_tokenizer import EOS_TOKEN, build_tokenizer

    tokenizer = build_tokenizer(model_max_length=1)  # set from the config before saving
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    if not isinstance(eos_id, int):
        raise ValueError(f"tiny tokenizer has no id for {EOS_TOKEN!r}")
    config = tiny_config(name, len(tokenizer), eos_id)
    if not isinstance(config, DeepseekMoeConfig):
        raise ValueError(f"preset {name} is not a DeepSeekMoE model")
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(str(out_dir))
    config.architectures = [DeepseekMoeForCausalLM.__name__]
    config.save_pretrained(str(out_dir))
    GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id).save_pretrained(
        str(out_dir)
    )
    dtype = config.dtype if isinstance(config.dtype, torch.dtype) else torch.bfloat16
    n_params = write_random_checkpoint(config, out_dir, dtype=dtype)
    logger.info("built preset %s (%d parameters, %s) in %s", name, n_params, dtype, out_dir)
