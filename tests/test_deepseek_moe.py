"""DeepSeekMoE: checkpoint loading against a plain re-derivation of the math, experts implementations,
cached decoding, the presets, and greedy equivalence through a real stack."""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, batched_mm_experts_forward

from pdserve.model.deepseek_moe import DeepseekMoeConfig
from pdserve.model.deepseek_moe.modeling import DeepseekMoeForCausalLM
from pdserve.model.deepseek_moe.random_checkpoint import (
    INDEX_FILE,
    SEED,
    build_shape_preset,
    checkpoint_shapes,
    draw_tensor,
    write_random_checkpoint,
)
from pdserve.model.presets.tiny import tiny_config
from pdserve.model.source import DEEPSEEK_MOE_16B_SHAPE, PRESETS, resolve_model_dir
from tests.grpc_client import generate_many, make_request
from tests.test_equivalence import MAX_TOKENS, PROMPT_LENGTHS, divergence_report, reference_tokens

torch.set_num_threads(1)

TINY = "tiny-deepseek-moe"
TINY_STATE_SHA256 = "954e4da25444585956f421a13cb9f476bf5561226cd941ef3163066292597993"

# Two checkpoints in the published layout: DeepSeekMoE-16B's routing semantics (no renormalization, no
# scaling, MoE from layer 1 on), and the other branches (renormalized and scaled weights, every other
# layer MoE, GQA, a non-default and linearly scaled RoPE, one shared expert).
CHECKPOINTS = {
    "16b-semantics": {
        "hidden_size": 32,
        "intermediate_size": 48,
        "moe_intermediate_size": 12,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_routed_experts": 8,
        "n_shared_experts": 2,
        "num_experts_per_tok": 3,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "norm_topk_prob": False,
        "rope_theta": 10000,
        "rope_scaling": None,
    },
    "renormalized-scaled": {
        "hidden_size": 32,
        "intermediate_size": 40,
        "moe_intermediate_size": 8,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "n_routed_experts": 6,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 2,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "rope_theta": 500.0,
        "rope_scaling": {"type": "linear", "factor": 2.0},
    },
}
VOCAB = 96


def _published_config(shape: dict[str, Any]) -> dict[str, Any]:
    """config.json as DeepSeekMoE checkpoints ship it (remote-code ``auto_map`` included)."""
    return {
        "architectures": ["DeepseekForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_deepseek.DeepseekConfig",
            "AutoModelForCausalLM": "modeling_deepseek.DeepseekForCausalLM",
        },
        "model_type": "deepseek",
        "vocab_size": VOCAB,
        "hidden_act": "silu",
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "scoring_func": "softmax",
        "aux_loss_alpha": 0.001,
        "seq_aux": True,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "float32",
        **shape,
    }


def _published_state_dict(cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Random weights named as in the checkpoints: one gate/up/down per routed expert."""
    g = torch.Generator().manual_seed(seed)
    hidden, heads, kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = hidden // heads

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g) * 0.3

    def mlp(prefix: str, width: int) -> dict[str, torch.Tensor]:
        return {
            f"{prefix}.gate_proj.weight": rand(width, hidden),
            f"{prefix}.up_proj.weight": rand(width, hidden),
            f"{prefix}.down_proj.weight": rand(hidden, width),
        }

    sd = {"model.embed_tokens.weight": rand(VOCAB, hidden), "lm_head.weight": rand(VOCAB, hidden)}
    sd["model.norm.weight"] = 1 + 0.1 * rand(hidden)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        sd[f"{p}.self_attn.q_proj.weight"] = rand(heads * head_dim, hidden)
        sd[f"{p}.self_attn.k_proj.weight"] = rand(kv_heads * head_dim, hidden)
        sd[f"{p}.self_attn.v_proj.weight"] = rand(kv_heads * head_dim, hidden)
        sd[f"{p}.self_attn.o_proj.weight"] = rand(hidden, heads * head_dim)
        sd[f"{p}.input_layernorm.weight"] = 1 + 0.1 * rand(hidden)
        sd[f"{p}.post_attention_layernorm.weight"] = 1 + 0.1 * rand(hidden)
        if i >= cfg["first_k_dense_replace"] and i % cfg["moe_layer_freq"] == 0:
            sd[f"{p}.mlp.gate.weight"] = rand(cfg["n_routed_experts"], hidden)
            for e in range(cfg["n_routed_experts"]):
                sd.update(mlp(f"{p}.mlp.experts.{e}", cfg["moe_intermediate_size"]))
            sd.update(mlp(f"{p}.mlp.shared_experts", cfg["moe_intermediate_size"] * cfg["n_shared_experts"]))
        else:
            sd.update(mlp(f"{p}.mlp", cfg["intermediate_size"]))
    return {k: v.contiguous() for k, v in sd.items()}


def _reference_logits(sd: dict[str, torch.Tensor], cfg: dict[str, Any], ids: list[int]) -> torch.Tensor:
    """The model written out token by token, expert by expert, in float64."""
    w = {k: v.double() for k, v in sd.items()}
    hidden, heads, kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = hidden // heads
    n = len(ids)

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg["rms_norm_eps"]) * weight

    def silu_mlp(x: torch.Tensor, prefix: str) -> torch.Tensor:
        gate = x @ w[f"{prefix}.gate_proj.weight"].T
        up = x @ w[f"{prefix}.up_proj.weight"].T
        return (gate * torch.sigmoid(gate) * up) @ w[f"{prefix}.down_proj.weight"].T

    positions = torch.arange(n, dtype=torch.float64)
    if cfg["rope_scaling"]:
        positions = positions / cfg["rope_scaling"]["factor"]
    inv_freq = 1.0 / cfg["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = positions[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)

    def rope(x: torch.Tensor) -> torch.Tensor:  # [n, heads, head_dim]
        half = head_dim // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos[:, None] + rotated * sin[:, None]

    x = w["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        h = rms(x, w[f"{p}.input_layernorm.weight"])
        q = rope((h @ w[f"{p}.self_attn.q_proj.weight"].T).view(n, heads, head_dim))
        k = rope((h @ w[f"{p}.self_attn.k_proj.weight"].T).view(n, kv_heads, head_dim))
        v = (h @ w[f"{p}.self_attn.v_proj.weight"].T).view(n, kv_heads, head_dim)
        attn = torch.zeros(n, heads, head_dim, dtype=torch.float64)
        for t in range(n):
            for head in range(heads):
                kv = head // (heads // kv_heads)
                scores = torch.stack([q[t, head] @ k[s, kv] for s in range(t + 1)]) / math.sqrt(head_dim)
                probs = torch.softmax(scores, 0)
                attn[t, head] = sum(probs[s] * v[s, kv] for s in range(t + 1))
        x = x + attn.reshape(n, hidden) @ w[f"{p}.self_attn.o_proj.weight"].T
        h = rms(x, w[f"{p}.post_attention_layernorm.weight"])
        if f"{p}.mlp.gate.weight" not in w:
            x = x + silu_mlp(h, f"{p}.mlp")
            continue
        out = torch.zeros_like(h)
        for t in range(n):
            scores = torch.softmax(w[f"{p}.mlp.gate.weight"] @ h[t], 0)
            chosen = sorted(range(len(scores)), key=lambda e: -float(scores[e]))[: cfg["num_experts_per_tok"]]
            weights = [scores[e] for e in chosen]
            if cfg["norm_topk_prob"]:
                weights = [wt / sum(weights) for wt in weights]
            scale = cfg.get("routed_scaling_factor", 1.0)
            for e, wt in zip(chosen, weights, strict=True):
                out[t] += scale * wt * silu_mlp(h[t], f"{p}.mlp.experts.{e}")
            out[t] += silu_mlp(h[t], f"{p}.mlp.shared_experts")
        x = x + out
    return rms(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_published_layout_loads_and_matches_plain_math(name: str, tmp_path: Path) -> None:
    cfg = _published_config(CHECKPOINTS[name])
    sd = _published_state_dict(cfg, seed=7)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})

    assert isinstance(AutoConfig.from_pretrained(tmp_path), DeepseekMoeConfig)
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert isinstance(model, DeepseekMoeForCausalLM)
    assert not any(info.values()), f"loading was not clean: {info}"
    model.eval().set_experts_implementation("eager")
    ids = [3, 17, 5, 90, 41, 41, 8, 62, 29, 11, 0, 77]
    with torch.no_grad():
        got = model(torch.tensor([ids])).logits[0].double()
    expected = _reference_logits(sd, cfg, ids)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)

    out = tmp_path / "resaved"
    model.save_pretrained(out)
    assert set(load_file(str(out / "model.safetensors"))) == set(sd), (
        "save does not write the published layout"
    )


def test_routing_branches_change_the_output(tmp_path: Path) -> None:
    """The reference's routing options are live: dropping renormalization or scaling changes the logits."""
    cfg = _published_config(CHECKPOINTS["renormalized-scaled"])
    sd = _published_state_dict(cfg, seed=7)
    ids = [3, 17, 5, 90]
    base = _reference_logits(sd, cfg, ids)
    for change in ({"norm_topk_prob": False}, {"routed_scaling_factor": 1.0}):
        assert not torch.allclose(base, _reference_logits(sd, {**cfg, **change}, ids), atol=1e-3)


def test_config_rejects_what_cannot_be_a_model() -> None:
    with pytest.raises(Exception, match="scoring_func"):
        DeepseekMoeConfig(scoring_func="sigmoid")
    with pytest.raises(Exception, match="num_experts_per_tok"):
        DeepseekMoeConfig(n_routed_experts=4, num_experts_per_tok=5)
    with pytest.raises(Exception, match="moe_layer_freq"):
        DeepseekMoeConfig(moe_layer_freq=0)
    dense = DeepseekMoeConfig(n_routed_experts=None, num_experts_per_tok=None)
    assert not any(dense.is_moe_layer(i) for i in range(dense.num_hidden_layers))


@pytest.fixture(scope="module")
def tiny(cache_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(
        resolve_model_dir(TINY, cache_dir), dtype=torch.float32
    ).eval()


def _state_sha256(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()


def test_tiny_preset_shape_and_weights(tiny: Any, cache_dir: Path) -> None:
    config = tiny.config
    assert TINY in PRESETS and config.model_type == "deepseek"
    assert [config.is_moe_layer(i) for i in range(config.num_hidden_layers)] == [False, True, True]
    assert (config.n_routed_experts, config.num_experts_per_tok, config.n_shared_experts) == (8, 3, 2)
    layer = tiny.model.layers[1].mlp
    assert tuple(layer.experts.gate_up_proj.shape) == (8, 64, 64)
    assert tuple(layer.experts.down_proj.shape) == (8, 64, 32)
    on_disk = load_file(str(resolve_model_dir(TINY, cache_dir) / "model.safetensors"))
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in on_disk, (
        "the preset is stored in the published layout"
    )
    assert _state_sha256(tiny) == TINY_STATE_SHA256, (
        "tiny-deepseek-moe weights changed: bump its version in pdserve.model.source"
    )


def test_experts_implementations_agree_and_the_interface_is_used(cache_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(TINY, cache_dir)).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(3))
    model.set_experts_implementation("eager")
    with torch.no_grad():
        eager = model(ids).logits
    for name in ("batched_mm", "grouped_mm"):
        model.set_experts_implementation(name)
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, eager, rtol=1e-4, atol=1e-4)

    calls: list[tuple[int, int]] = []

    def counting(
        module: Any, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        calls.append((hidden.shape[0], index.shape[1]))
        return batched_mm_experts_forward(module, hidden, index, weights)

    ALL_EXPERTS_FUNCTIONS["pdserve-test-counting"] = counting
    try:
        model.set_experts_implementation("pdserve-test-counting")
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, eager, rtol=1e-4, atol=1e-4)
    finally:
        del ALL_EXPERTS_FUNCTIONS["pdserve-test-counting"]
    assert calls == [(80, 3), (80, 3)], "every MoE layer must call the registered experts function once"


def test_dynamic_cache_prefill_then_decode_reproduces_generate(tiny: Any) -> None:
    prompt = torch.randint(0, tiny.config.vocab_size, (1, 23), generator=torch.Generator().manual_seed(5))
    expected = reference_tokens(tiny, prompt[0].tolist(), 24)
    cache = DynamicCache(config=tiny.config)
    tokens: list[int] = []
    with torch.no_grad():
        out = tiny(input_ids=prompt, cache=cache, use_cache=True)
        while len(tokens) < len(expected):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = tiny(input_ids=torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
    assert tokens == expected
    assert cache.get_seq_length() == prompt.shape[1] + len(expected)


def test_16b_shape_preset_has_the_published_shapes() -> None:
    config = tiny_config(DEEPSEEK_MOE_16B_SHAPE, 512, 0)
    assert DEEPSEEK_MOE_16B_SHAPE in PRESETS
    assert isinstance(config, DeepseekMoeConfig) and config.dtype == torch.bfloat16
    published = {
        "hidden_size": 2048,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "moe_intermediate_size": 1408,
        "intermediate_size": 10944,
        "n_routed_experts": 64,
        "n_shared_experts": 2,
        "num_experts_per_tok": 6,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "vocab_size": 102400,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "norm_topk_prob": False,
        "scoring_func": "softmax",
        "routed_scaling_factor": 1.0,
    }
    assert {key: getattr(config, key) for key in published} == published
    assert config.rope_parameters["rope_theta"] == 10000 and config.rope_parameters["rope_type"] == "default"
    shapes = checkpoint_shapes(config)  # from a model on the meta device: nothing is allocated
    n_params = sum(math.prod(shape) for shape in shapes.values())
    assert 16.3e9 < n_params < 16.5e9
    assert shapes["model.layers.27.mlp.experts.63.down_proj.weight"] == (2048, 1408)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (10944, 2048)


def test_random_checkpoint_writer_makes_a_loadable_sharded_checkpoint(tmp_path: Path) -> None:
    shape = {k: v for k, v in CHECKPOINTS["16b-semantics"].items() if not k.startswith("rope")}
    config = DeepseekMoeConfig(vocab_size=VOCAB, **shape)
    written = write_random_checkpoint(config, tmp_path, shard_bytes=40_000, workers=2)
    config.save_pretrained(str(tmp_path))
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert set(index["weight_map"]) == set(checkpoint_shapes(config))
    model, info = AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.bfloat16, output_loading_info=True
    )
    assert not any(info.values()), f"loading was not clean: {info}"
    assert written == sum(p.numel() for p in model.parameters())
    assert torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))
    assert 0.01 < float(model.model.layers[1].mlp.experts.gate_up_proj.detach().float().std()) < 0.03


def test_random_weights_do_not_depend_on_shards_threads_or_device(tmp_path: Path) -> None:
    """Each tensor is drawn on the CPU from its own generator: the same weights however they are written."""
    shape = {k: v for k, v in CHECKPOINTS["16b-semantics"].items() if not k.startswith("rope")}
    config = DeepseekMoeConfig(vocab_size=VOCAB, **shape)
    written = []
    for name, shard_bytes, workers in (("a", 40_000, 1), ("b", 1 << 30, 3)):
        (tmp_path / name).mkdir()
        write_random_checkpoint(config, tmp_path / name, shard_bytes=shard_bytes, workers=workers)
        tensors: dict[str, torch.Tensor] = {}
        for file in sorted((tmp_path / name).glob("*.safetensors")):
            tensors.update(load_file(str(file)))
        written.append(tensors)
    assert written[0].keys() == written[1].keys()
    assert all(torch.equal(written[0][k], written[1][k]) for k in written[0])
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    again = draw_tensor(name, tuple(written[0][name].shape), SEED, config.initializer_range, torch.bfloat16)
    assert torch.equal(again, written[0][name])


def test_shape_preset_builder_writes_a_servable_directory(tmp_path: Path) -> None:
    """The builder of the 16B-shape preset, run on the tiny preset's config so that it stays small."""
    build_shape_preset(TINY, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), f"loading was not clean: {info}"
    assert model.dtype == torch.bfloat16
    assert model.config.eos_token_id == tokenizer.eos_token_id == model.generation_config.eos_token_id
    assert tokenizer.model_max_length == model.config.max_position_embeddings


def test_greedy_matches_generate_through_the_stack(stack_pool: Any, reference_models: Any) -> None:
    stack = stack_pool.get(TINY)
    model, _ = reference_models(TINY)
    generator = torch.Generator().manual_seed(20261129)
    prompts = [
        torch.randint(0, model.config.vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS
    ]
    requests = [
        make_request(prompt_token_ids=p, max_tokens=m, temperature=0.0)
        for p, m in zip(prompts, MAX_TOKENS, strict=True)
    ]
    results = asyncio.run(generate_many(stack.address, requests))
    for prompt, max_tokens, result in zip(prompts, MAX_TOKENS, results, strict=True):
        ref = reference_tokens(model, prompt, max_tokens)
        assert result.token_ids == ref, divergence_report(model, prompt, ref, result.token_ids)
        assert len(result.chunks[0].token_ids) == 1, "the first chunk carries exactly the prefill's token"
