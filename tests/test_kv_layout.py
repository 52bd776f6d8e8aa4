"""Unit tests of pdserve.kv.layout: measuring a KV layout, packing a cache into one buffer, specs."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV2Config, DynamicCache, LlamaConfig

from pdserve.kv.layout import (
    ALIGN,
    KvLayout,
    TensorSpec,
    dtype_from_name,
    dtype_name,
    pack,
    spec_from_proto,
    unpack,
)
from pdserve.v1 import kv_pb2

pytestmark = pytest.mark.timeout(60)

BATCH = 2
SEQ = 6
CPU = torch.device("cpu")

Layers = list[tuple[torch.Tensor, torch.Tensor]]


def _llama_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA: 2 KV heads for 4 query heads
        max_position_embeddings=64,
    )


def _mla_config() -> DeepseekV2Config:
    return DeepseekV2Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        q_lora_rank=None,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        max_position_embeddings=64,
    )


def _cache_layers(config: object) -> Layers:
    """The cache tensors ``[BATCH, heads, SEQ, width]`` of a real forward of a tiny random model."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    cache = DynamicCache(config=config)
    input_ids = torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        model(input_ids=input_ids, cache=cache, use_cache=True)
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


@pytest.fixture(scope="module")
def llama_layers() -> Layers:
    return _cache_layers(_llama_config())


@pytest.fixture(scope="module")
def mla_layers() -> Layers:
    return _cache_layers(_mla_config())


@pytest.fixture(params=["llama", "mla"])
def model_layers(request: pytest.FixtureRequest) -> Layers:
    return request.getfixturevalue(f"{request.param}_layers")


def _random_layers(layout: KvLayout, batch: int, seq: int, seed: int = 0) -> Layers:
    g = torch.Generator().manual_seed(seed)
    layers = []
    for (kh, kw), (vh, vw) in zip(layout.keys, layout.values, strict=True):
        k = torch.randn(batch, kh, seq, kw, generator=g).to(layout.dtype)
        v = torch.randn(batch, vh, seq, vw, generator=g).to(layout.dtype)
        layers.append((k, v))
    return layers


def _offset(view: torch.Tensor, buf: torch.Tensor) -> int:
    return view.data_ptr() - buf.data_ptr()


# --- measuring the layout ------------------------------------------------------------------------


def test_layout_of_a_gqa_llama_cache(llama_layers: Layers) -> None:
    config = _llama_config()
    head_dim = config.hidden_size // config.num_attention_heads
    layout = KvLayout.from_cache_layers(llama_layers)
    assert layout == KvLayout(
        keys=((2, head_dim), (2, head_dim)), values=((2, head_dim), (2, head_dim)), dtype=torch.float32
    )
    assert layout.num_layers == 2


def test_layout_of_an_mla_cache_has_different_key_and_value_widths(mla_layers: Layers) -> None:
    layout = KvLayout.from_cache_layers(mla_layers)
    assert layout.keys == tuple((k.shape[1], k.shape[3]) for k, _ in mla_layers)
    assert layout.values == tuple((v.shape[1], v.shape[3]) for _, v in mla_layers)
    assert layout.num_layers == 2
    assert layout.dtype == torch.float32
    for (_, kw), (_, vw) in zip(layout.keys, layout.values, strict=True):
        assert kw != vw


def test_layout_ignores_the_batch_and_sequence_dimensions(llama_layers: Layers) -> None:
    one_row = [(k[:1, :, :1], v[:1, :, :1]) for k, v in llama_layers]
    assert KvLayout.from_cache_layers(one_row) == KvLayout.from_cache_layers(llama_layers)


# --- packing -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("row", "start", "num_tokens"), [(0, 0, SEQ), (1, 0, SEQ), (1, 2, 3), (0, 5, 1)])
def test_pack_then_unpack_round_trips_a_row_window(
    model_layers: Layers, row: int, start: int, num_tokens: int
) -> None:
    layout = KvLayout.from_cache_layers(model_layers)
    buf = pack(model_layers, layout, row, start, num_tokens, CPU)
    assert buf.dtype == torch.uint8
    assert buf.dim() == 1
    assert buf.numel() == layout.num_bytes(num_tokens)
    views = unpack(buf, layout, num_tokens)
    assert len(views) == layout.num_layers
    for (k, v), (kd, vd) in zip(model_layers, views, strict=True):
        assert kd.dtype == k.dtype
        assert vd.dtype == v.dtype
        assert torch.equal(kd, k[row, :, start : start + num_tokens])
        assert torch.equal(vd, v[row, :, start : start + num_tokens])


def test_pack_copies_rather_than_aliases_the_cache(llama_layers: Layers) -> None:
    layers = [(k.clone(), v.clone()) for k, v in llama_layers]
    layout = KvLayout.from_cache_layers(layers)
    buf = pack(layers, layout, 0, 0, SEQ, CPU)
    expected = [(k[0].clone(), v[0].clone()) for k, v in layers]
    for k, v in layers:
        k.zero_()
        v.zero_()
    for (kd, vd), (ke, ve) in zip(unpack(buf, layout, SEQ), expected, strict=True):
        assert torch.equal(kd, ke)
        assert torch.equal(vd, ve)


def test_unpacked_views_alias_the_buffer() -> None:
    layout = KvLayout(keys=((1, 4),), values=((1, 4),), dtype=torch.float32)
    buf = torch.zeros(layout.num_bytes(2), dtype=torch.uint8)
    ((k, v),) = unpack(buf, layout, 2)
    k.fill_(1.5)
    v.fill_(-2.0)
    ((k2, v2),) = unpack(buf, layout, 2)
    assert torch.equal(k2, torch.full((1, 2, 4), 1.5))
    assert torch.equal(v2, torch.full((1, 2, 4), -2.0))


def test_every_view_starts_at_a_64_byte_aligned_offset_without_overlap(mla_layers: Layers) -> None:
    assert ALIGN == 64
    layout = KvLayout.from_cache_layers(mla_layers)
    for num_tokens in (1, 3, SEQ):
        buf = pack(mla_layers, layout, 0, 0, num_tokens, CPU)
        views = [t for pair in unpack(buf, layout, num_tokens) for t in pair]
        specs = layout.tensor_specs(num_tokens)
        expected_offset = 0
        for view, spec in zip(views, specs, strict=True):
            offset = _offset(view, buf)
            assert offset % 64 == 0
            assert offset == expected_offset
            assert view.is_contiguous()
            assert tuple(view.shape) == spec.shape
            expected_offset = offset + (spec.num_bytes + 63) // 64 * 64
        assert expected_offset == buf.numel()


def test_alignment_with_sizes_that_are_not_multiples_of_64() -> None:
    # 1 head x 3 tokens x 3 bf16 = 18 bytes per tensor: every tensor needs padding.
    layout = KvLayout(keys=((1, 3), (2, 5)), values=((1, 3), (1, 7)), dtype=torch.bfloat16)
    layers = _random_layers(layout, batch=1, seq=3)
    buf = pack(layers, layout, 0, 0, 3, CPU)
    views = [t for pair in unpack(buf, layout, 3) for t in pair]
    assert [_offset(v, buf) for v in views] == [0, 64, 128, 192]
    assert buf.numel() == 256


def test_bfloat16_with_mixed_heads_and_widths_round_trips_exactly() -> None:
    layout = KvLayout(keys=((2, 8), (1, 16), (4, 3)), values=((2, 4), (1, 5), (4, 3)), dtype=torch.bfloat16)
    layers = _random_layers(layout, batch=3, seq=7, seed=5)
    buf = pack(layers, layout, 2, 1, 5, CPU)
    assert buf.numel() == layout.num_bytes(5)
    for (k, v), (kd, vd) in zip(layers, unpack(buf, layout, 5), strict=True):
        assert kd.dtype == torch.bfloat16
        assert vd.dtype == torch.bfloat16
        assert torch.equal(kd, k[2, :, 1:6])
        assert torch.equal(vd, v[2, :, 1:6])


def test_cache_cast_to_bfloat16_round_trips(llama_layers: Layers) -> None:
    layers = [(k.to(torch.bfloat16), v.to(torch.bfloat16)) for k, v in llama_layers]
    layout = KvLayout.from_cache_layers(layers)
    assert layout.dtype == torch.bfloat16
    buf = pack(layers, layout, 1, 1, 4, CPU)
    for (k, v), (kd, vd) in zip(layers, unpack(buf, layout, 4), strict=True):
        assert torch.equal(kd, k[1, :, 1:5])
        assert torch.equal(vd, v[1, :, 1:5])


# --- specs and sizes -----------------------------------------------------------------------------


def test_tensor_specs_order_names_shapes_and_dtype() -> None:
    layout = KvLayout(keys=((2, 8), (1, 16)), values=((2, 4), (1, 3)), dtype=torch.bfloat16)
    assert layout.tensor_specs(5) == [
        TensorSpec("layers.0.keys", (2, 5, 8), torch.bfloat16),
        TensorSpec("layers.0.values", (2, 5, 4), torch.bfloat16),
        TensorSpec("layers.1.keys", (1, 5, 16), torch.bfloat16),
        TensorSpec("layers.1.values", (1, 5, 3), torch.bfloat16),
    ]


def test_num_bytes_pads_every_tensor_to_64_bytes() -> None:
    layout = KvLayout(keys=((2, 8), (1, 16)), values=((2, 4), (1, 3)), dtype=torch.bfloat16)
    # T=3: 96 -> 128, 48 -> 64, 96 -> 128, 18 -> 64
    assert layout.num_bytes(3) == 384
    # T=4: 128, 64, 128, 24 -> 64
    assert layout.num_bytes(4) == 384
    # T=5: 160 -> 192, 80 -> 128, 160 -> 192, 30 -> 64
    assert layout.num_bytes(5) == 576
    assert layout.num_bytes(0) == 0
    # Unpadded: 2*8*2 + 2*4*2 + 1*16*2 + 1*3*2
    assert layout.bytes_per_token() == 86


def test_num_bytes_of_a_float32_layout() -> None:
    layout = KvLayout(keys=((2, 8),), values=((2, 8),), dtype=torch.float32)
    assert layout.num_bytes(1) == 128  # 64 + 64
    assert layout.num_bytes(2) == 256  # 128 + 128
    assert layout.num_bytes(3) == 384  # 192 + 192
    assert layout.bytes_per_token() == 128


def test_zero_tokens_unpack_to_empty_views() -> None:
    layout = KvLayout(keys=((2, 8),), values=((1, 4),), dtype=torch.float32)
    ((k, v),) = unpack(torch.empty(0, dtype=torch.uint8), layout, 0)
    assert tuple(k.shape) == (2, 0, 8)
    assert tuple(v.shape) == (1, 0, 4)


def test_tensor_spec_num_bytes() -> None:
    assert TensorSpec("x", (2, 3, 4), torch.float32).num_bytes == 96
    assert TensorSpec("x", (2, 3, 4), torch.bfloat16).num_bytes == 48
    assert TensorSpec("x", (2, 0, 4), torch.float16).num_bytes == 0


# --- unpack rejects wrong buffers ----------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda n: torch.zeros(n - 1, dtype=torch.uint8), id="one-byte-short"),
        pytest.param(lambda n: torch.zeros(n + 1, dtype=torch.uint8), id="one-byte-long"),
        pytest.param(lambda n: torch.zeros(n + 64, dtype=torch.uint8), id="one-block-long"),
        pytest.param(lambda n: torch.zeros(n, dtype=torch.int8), id="int8"),
        pytest.param(lambda n: torch.zeros(n // 4, dtype=torch.float32), id="float32-same-bytes"),
        pytest.param(lambda n: torch.zeros(n, dtype=torch.float32), id="float32-same-numel"),
        pytest.param(lambda n: torch.zeros(2, n // 2, dtype=torch.uint8), id="2-d"),
    ],
)
def test_unpack_rejects_wrong_size_dtype_or_shape(make: object) -> None:
    layout = KvLayout(keys=((2, 8), (1, 16)), values=((2, 4), (1, 3)), dtype=torch.bfloat16)
    n = layout.num_bytes(3)
    assert n == 384
    with pytest.raises(ValueError, match=r"^buffer must be 1-D uint8 of 384 bytes, got "):
        unpack(make(n), layout, 3)  # type: ignore[operator]


def test_unpack_rejects_a_buffer_sized_for_another_token_count() -> None:
    layout = KvLayout(keys=((2, 8),), values=((2, 8),), dtype=torch.float32)
    buf = torch.zeros(layout.num_bytes(2), dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"of 384 bytes, got torch\.uint8 \(256,\)"):
        unpack(buf, layout, 3)


# --- TensorSpec <-> proto, dtype names -----------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8])
def test_tensor_spec_proto_round_trip(dtype: torch.dtype) -> None:
    spec = TensorSpec("layers.3.keys", (4, 17, 64), dtype)
    msg = spec.to_proto()
    assert isinstance(msg, kv_pb2.TensorSpec)
    assert msg.name == "layers.3.keys"
    assert list(msg.shape) == [4, 17, 64]
    assert msg.dtype == dtype_name(dtype)
    wire = kv_pb2.TensorSpec.FromString(msg.SerializeToString())
    back = spec_from_proto(wire)
    assert back == spec
    assert isinstance(back.shape, tuple)


def test_dtype_names() -> None:
    assert dtype_name(torch.float32) == "float32"
    assert dtype_name(torch.bfloat16) == "bfloat16"
    assert dtype_from_name("float32") is torch.float32
    assert dtype_from_name("bfloat16") is torch.bfloat16
    assert dtype_from_name("float16") is torch.float16


@pytest.mark.parametrize("name", ["float33", "", "Tensor", "nn", "torch.float32", "FLOAT32"])
def test_dtype_from_name_rejects_unknown_names(name: str) -> None:
    with pytest.raises(ValueError, match=r"^unknown dtype "):
        dtype_from_name(name)


def test_spec_from_proto_rejects_an_unknown_dtype() -> None:
    msg = kv_pb2.TensorSpec(name="layers.0.keys", shape=[1, 2, 3], dtype="float128")
    with pytest.raises(ValueError, match=r"unknown dtype 'float128'"):
        spec_from_proto(msg)


def test_unpacking_a_buffer_inside_a_larger_one_reads_its_own_bytes() -> None:
    """A KV is often a window of a larger buffer (a region of an arena, one handle of a batched
    receive): its views start where the window does."""
    layout = KvLayout(keys=((2, 3), (1, 5)), values=((2, 4), (1, 5)), dtype=torch.bfloat16)
    layers = [
        (torch.randn(1, h, 7, w).bfloat16(), torch.randn(1, vh, 7, vw).bfloat16())
        for (h, w), (vh, vw) in zip(layout.keys, layout.values, strict=True)
    ]
    alone = pack(layers, layout, 0, 0, 7, CPU)
    outer = torch.zeros(4096 + alone.numel() + 64, dtype=torch.uint8)
    outer[4096 : 4096 + alone.numel()] = alone
    window = outer.narrow(0, 4096, alone.numel())
    for (k, v), (wk, wv) in zip(layers, unpack(window, layout, 7), strict=True):
        assert torch.equal(wk, k[0]) and torch.equal(wv, v[0])
