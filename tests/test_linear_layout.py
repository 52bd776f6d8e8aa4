"""How an engine's linear weights are held on a CPU: ``auto`` times both layouts on the model's own
products and keeps the faster, the other settings choose without timing, CPU float32 alone changes
anything, and every layout keeps the model's greedy tokens."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from pdserve.config import EngineConfig
from pdserve.model import engine_model, linear_layout
from pdserve.model.engine_model import load_engine_model
from pdserve.model.linear_layout import apply_linear_layout, choose_linear_layout, time_layouts
from pdserve.model.packed_linear import PackedLinear
from pdserve.model.presets.tiny import INITIALIZER_RANGE, SEED, fill_portable, tiny_config
from tests.cpu_kernels import require_packed_linear_kernel
from tests.test_equivalence import reference_tokens

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")


def _llama(tied: bool = False) -> nn.Module:
    config = tiny_config("tiny-llama", vocab_size=96, eos_id=1)  # 4 layers
    config.tie_word_embeddings = tied
    model = AutoModelForCausalLM.from_config(config)
    fill_portable(model, SEED, INITIALIZER_RANGE)
    return model.eval()


def _layout_of(model: nn.Module) -> str:
    projection = model.model.layers[0].self_attn.q_proj
    if isinstance(projection, PackedLinear):
        return "packed"
    return "input-major" if projection.weight.stride(0) == 1 else "plain"


@needs_onednn
@pytest.mark.parametrize("setting", ["packed", "input-major", "plain"])
def test_a_setting_other_than_auto_is_taken_without_timing(
    setting: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_timing(model: nn.Module) -> tuple[float, float]:
        raise AssertionError("timed")

    monkeypatch.setattr(linear_layout, "time_layouts", no_timing)
    model = _llama()
    choice = choose_linear_layout(setting, model, CPU, torch.float32)
    assert choice.layout == setting and choice.reason == f"--linear-layout {setting}"
    apply_linear_layout(model, choice.layout)
    assert _layout_of(model) == setting


@needs_onednn
def test_auto_times_the_models_products_and_keeps_the_faster(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_packed_linear_kernel(cache_dir)
    model = _llama()
    packed_ms, input_major_ms = time_layouts(model, rows=(1, 8), repeats=3)
    assert packed_ms > 0 and input_major_ms > 0
    choice = choose_linear_layout("auto", model, CPU, torch.float32)
    assert choice.layout in ("packed", "input-major") and choice.reason.startswith("timed: ")
    for timed, expected in (((1.0, 2.0), "packed"), ((2.0, 1.0), "input-major")):
        monkeypatch.setattr(linear_layout, "time_layouts", lambda model, timed=timed: timed)
        assert choose_linear_layout("auto", model, CPU, torch.float32).layout == expected


def test_each_distinct_weight_shape_is_timed_once_and_counted_for_every_layer() -> None:
    model = _llama(tied=True)
    distinct = list(linear_layout._distinct_linears(model))
    # q/o, k/v (grouped heads), gate/up, down: the tied output projection is not the model's to change.
    assert sum(count for _, count in distinct) == 28
    assert len({(m.in_features, m.out_features) for m, _ in distinct}) == len(distinct)


@pytest.mark.parametrize("setting", ["auto", "packed", "input-major"])
def test_other_dtypes_and_devices_keep_their_weights(setting: str) -> None:
    assert choose_linear_layout(setting, _llama(), CPU, torch.bfloat16).layout == "plain"
    assert choose_linear_layout(setting, _llama(), torch.device("cuda", 0), torch.float32).layout == "plain"


def test_without_onednn_auto_and_packed_store_weights_input_major(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    for setting in ("auto", "packed"):
        choice = choose_linear_layout(setting, _llama(), CPU, torch.float32)
        assert choice.layout == "input-major" and "the only layout" in choice.reason


@pytest.mark.parametrize("setting", ["auto", "packed", "input-major", "plain"])
def test_an_engine_model_keeps_its_greedy_tokens_in_every_layout(
    setting: str, cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    if setting != "plain" and not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    config = EngineConfig(
        model="tiny-llama", cache_dir=str(cache_dir), compile="false", linear_layout=setting
    )
    with caplog.at_level(logging.INFO, logger=engine_model.__name__):
        m = load_engine_model(config)
    assert "linear weights " in caplog.text
    if setting != "auto":
        assert _layout_of(m.model) == setting
    plain = load_engine_model(
        EngineConfig(model="tiny-llama", cache_dir=str(cache_dir), compile="false", linear_layout="plain")
    )
    generator = torch.Generator().manual_seed(5)
    for n in (1, 9, 40):
        prompt = torch.randint(3, m.limits.vocab_size, (n,), generator=generator).tolist()
        assert reference_tokens(m.model, prompt, 10) == reference_tokens(plain.model, prompt, 10)
