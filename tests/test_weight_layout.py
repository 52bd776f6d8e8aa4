"""Linear weights stored input-major: same values and outputs, only the strides change, shared weights kept."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdserve.config import EngineConfig
from pdserve.model import cpu_kernel, packed_linear
from pdserve.model.engine_model import load_engine_model
from pdserve.model.packed_linear import PackedLinear
from pdserve.model.presets.tiny import INITIALIZER_RANGE, SEED, fill_portable, tiny_config
from pdserve.model.weight_layout import prefers_input_major, store_linear_weights_input_major


def _llama(tied: bool) -> torch.nn.Module:
    config = tiny_config("tiny-llama", vocab_size=96, eos_id=1)  # 4 layers
    config.tie_word_embeddings = tied
    model = AutoModelForCausalLM.from_config(config)
    fill_portable(model, SEED, INITIALIZER_RANGE)
    return model.eval()


def test_only_cpu_float32_prefers_input_major() -> None:
    assert prefers_input_major(torch.device("cpu"), torch.float32)
    assert not prefers_input_major(torch.device("cpu"), torch.bfloat16)
    assert not prefers_input_major(torch.device("cpu"), torch.float16)
    assert not prefers_input_major(torch.device("cuda", 0), torch.float32)


def test_weights_keep_values_and_outputs() -> None:
    model = _llama(tied=False)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    prompt = torch.randint(0, 96, (3, 7), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        logits = model(input_ids=prompt).logits
        reference = model.generate(prompt, max_new_tokens=12, do_sample=False)

    # 4 layers x (q, k, v, o, gate, up, down) + lm_head
    assert store_linear_weights_input_major(model) == 29
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            assert module.weight.stride() == (1, module.out_features), name
    after = model.state_dict()
    assert after.keys() == before.keys()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
    with torch.inference_mode():
        torch.testing.assert_close(model(input_ids=prompt).logits, logits, rtol=1e-5, atol=1e-5)
        assert torch.equal(model.generate(prompt, max_new_tokens=12, do_sample=False), reference)
    assert store_linear_weights_input_major(model) == 0  # already input-major


def test_tied_output_projection_keeps_its_layout() -> None:
    model = _llama(tied=True)
    embeddings = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight is embeddings
    assert store_linear_weights_input_major(model) == 28
    assert model.get_output_embeddings().weight is embeddings
    assert embeddings.is_contiguous()


def test_a_cpu_engine_model_asked_to_pack_packs_its_weights_or_else_loads_them_input_major(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = EngineConfig(
        model="tiny-llama", cache_dir=str(cache_dir), compile="true", linear_layout="packed"
    )
    if torch.backends.mkldnn.is_available():  # compiled code calls the packed product (packed_linear)
        assert isinstance(load_engine_model(config).model.model.layers[0].self_attn.q_proj, PackedLinear)
        # ... through its C++ kernel, built with the model where a compiler is.
        assert packed_linear.has_cpp_kernel() or shutil.which(cpu_kernel.compiler()) is None
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    projection = load_engine_model(config).model.model.layers[0].self_attn.q_proj
    assert projection.weight.stride() == (1, projection.out_features)
