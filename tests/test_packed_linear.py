"""Linear layers packed by oneDNN for CPU forwards: the same products as ``nn.Linear`` to float
rounding, eager and compiled (the packed sizes constants of the compiled code), every unshared linear
weight of a model replaced, and a model's greedy tokens unchanged; the operator's C++ kernel computes
what its Python kernel does, in eager and in inductor's C++-wrapped code, and one that cannot be built
is reported."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch._dynamo.testing
from torch import nn

from pdserve.config import EngineConfig
from pdserve.model import cpu_kernel, packed_linear
from pdserve.model.engine_model import load_engine_model
from pdserve.model.packed_linear import PackedLinear, can_pack_linear_weights, pack_linear_weights
from tests.cpu_kernels import require_packed_linear_kernel
from tests.test_equivalence import reference_tokens

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")


def test_only_cpu_float32_is_packed() -> None:
    assert can_pack_linear_weights(torch.device("cpu"), torch.float32)
    assert not can_pack_linear_weights(torch.device("cpu"), torch.bfloat16)
    assert not can_pack_linear_weights(torch.device("cuda", 0), torch.float32)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 48), (7, 48), (33, 48), (2, 5, 48), (0, 48)])
def test_a_packed_linear_computes_what_nn_linear_does(bias: bool, shape: tuple[int, ...]) -> None:
    generator = torch.Generator().manual_seed(len(shape) * 10 + shape[0])
    linear = nn.Linear(48, 40, bias=bias)
    packed = PackedLinear(linear)
    x = torch.randn(*shape, generator=generator)
    got = packed(x)
    assert got.shape == (*shape[:-1], 40)
    torch.testing.assert_close(got, linear(x), rtol=1e-5, atol=1e-5)
    assert torch.equal(packed.weight, linear.weight.detach())  # unpacked exactly


def test_compiled_code_calls_the_packed_product_and_compiles_once() -> None:
    # Rows first equal to the output width: were the packed sizes dynamic, dynamo would tie the two
    # and compile again once they differ.
    torch._dynamo.reset()
    linear = nn.Linear(48, 40)
    packed = PackedLinear(linear)
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(packed, backend=counter, dynamic=True)
    with torch.no_grad():
        for rows in (40, 7, 13):
            x = torch.randn(rows, 48)
            torch.testing.assert_close(compiled(x), linear(x), rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1
    inductor = torch.compile(PackedLinear(linear), dynamic=True)  # code generated, not only traced
    with torch.no_grad():
        x = torch.randn(5, 48)
        torch.testing.assert_close(inductor(x), linear(x), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def cpp_kernel(cache_dir: Path) -> None:
    require_packed_linear_kernel(cache_dir)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 256), (16, 256), (3, 32, 256), (0, 256)])
def test_the_cpp_kernel_computes_what_the_python_kernel_does(
    cpp_kernel: None, bias: bool, shape: tuple[int, ...]
) -> None:
    assert packed_linear.has_cpp_kernel()
    generator = torch.Generator().manual_seed(shape[0])
    linear = nn.Linear(256, 1024, bias=bias)
    packed = PackedLinear(linear)
    x = torch.randn(*shape, generator=generator)
    got = packed_linear.packed_linear(x, packed.packed, packed.bias, packed.out_features)
    assert torch.equal(got, packed_linear._packed_product(x, packed.packed, packed.bias, packed.out_features))
    torch.testing.assert_close(got, linear(x), rtol=1e-5, atol=1e-5)


def test_compiled_cpp_wrapped_code_calls_the_cpp_kernel(cpp_kernel: None) -> None:
    torch._dynamo.reset()
    linear = nn.Linear(64, 96)
    model = nn.Sequential(PackedLinear(linear), nn.SiLU())
    compiled = torch.compile(model, dynamic=True, options={"cpp_wrapper": True})
    with torch.no_grad():
        for rows in (5, 17):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(compiled(x), nn.functional.silu(linear(x)), rtol=1e-5, atol=1e-5)


def test_a_kernel_that_cannot_be_built_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(packed_linear, "has_cpp_kernel", lambda: False)
    monkeypatch.setenv(cpu_kernel.COMPILER_ENV, "/nonexistent/c++")
    with caplog.at_level(logging.WARNING, logger=cpu_kernel.__name__):
        assert not packed_linear.load(tmp_path)
    assert "packed products run a Python kernel" in caplog.text
    assert not (tmp_path / cpu_kernel.CACHE_SUBDIR).exists()


def test_every_unshared_linear_weight_is_packed() -> None:
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 10, bias=False))
    model[3].weight = model[0].weight  # an output projection tied to the embeddings
    assert pack_linear_weights(model) == 1
    assert isinstance(model[1], PackedLinear) and type(model[3]) is nn.Linear


def test_an_eager_model_packs_its_weights_and_keeps_its_greedy_tokens(cache_dir: Path) -> None:
    config = EngineConfig(
        model="tiny-llama", cache_dir=str(cache_dir), compile="false", linear_layout="packed"
    )
    m = load_engine_model(config)
    packed = [module for module in m.model.modules() if isinstance(module, PackedLinear)]
    assert len(packed) >= m.model.config.num_hidden_layers * 7  # q k v o, gate up down per layer
    reference = load_engine_model(config)
    for module in list(reference.model.modules()):  # the same weights, unpacked
        for name, child in list(module.named_children()):
            if isinstance(child, PackedLinear):
                plain = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                plain.weight = nn.Parameter(child.weight)
                plain.bias = child.bias
                setattr(module, name, plain)
    generator = torch.Generator().manual_seed(3)
    for n in (1, 9, 40):
        prompt = torch.randint(3, m.limits.vocab_size, (n,), generator=generator).tolist()
        assert reference_tokens(m.model, prompt, 12) == reference_tokens(reference.model, prompt, 12)
