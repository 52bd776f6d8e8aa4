"""How an engine's linear layers hold their weights on a CPU, chosen by timing the model's own products.

Two layouts serve float32 on a CPU (``packed_linear``: packed by oneDNN; ``weight_layout``: plain,
stored input-major for MKL's GEMM), and which is faster depends on the CPU: on one 2-core machine the
packed products of a decode step took half the time, on another (AVX-512 with AMX, a 300 MB L3) MKL on
input-major weights was as fast at 16 rows and faster at 1 and at 96 rows of prompt tokens. ``auto``
(the default) times both on the model's own weight shapes at 1, 16 and 64 rows, alternating, and keeps
the one whose products take less time in all, each shape counted as often as the model has it: a
tenth of a second at start-up for the reference model of ``shared/PEERS.md``, whose products took
10.0 ms packed and 7.9 ms input-major on that second machine. ``packed``,
``input-major`` and ``plain`` (weights as loaded) choose without timing. Elsewhere (CUDA, bfloat16,
float16) weights stay as loaded.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from pdserve.model.packed_linear import (
    PACKED_FOR_ROWS,
    can_pack_linear_weights,
    pack_linear_weights,
    packed_linear,
)
from pdserve.model.weight_layout import (
    parameter_owners,
    prefers_input_major,
    store_linear_weights_input_major,
)

TIMED_ROWS = (1, 16, 64)
TIMED_REPEATS = 9


@dataclass(frozen=True)
class LayoutChoice:
    layout: str  # packed, input-major or plain
    reason: str


def choose_linear_layout(
    setting: str, model: nn.Module, device: torch.device, dtype: torch.dtype
) -> LayoutChoice:
    """The layout ``model``'s linear weights take on ``device`` in ``dtype`` under ``setting``."""
    can_pack = can_pack_linear_weights(device, dtype)
    can_transpose = prefers_input_major(device, dtype)
    if setting == "plain" or not (can_pack or can_transpose):
        return LayoutChoice(
            "plain", "--linear-layout plain" if setting == "plain" else f"{dtype} on {device}"
        )
    if setting == "packed" and can_pack:
        return LayoutChoice("packed", "--linear-layout packed")
    if setting == "input-major" and can_transpose:
        return LayoutChoice("input-major", "--linear-layout input-major")
    if not (can_pack and can_transpose):
        layout = "packed" if can_pack else "input-major"
        return LayoutChoice(layout, f"the only layout for {dtype} on {device} (--linear-layout {setting})")
    packed_ms, input_major_ms = time_layouts(model)
    layout = "packed" if packed_ms < input_major_ms else "input-major"
    return LayoutChoice(
        layout,
        f"timed: the model's products at {'/'.join(map(str, TIMED_ROWS))} rows took {packed_ms:.2f} ms "
        f"packed, {input_major_ms:.2f} ms input-major",
    )


def apply_linear_layout(model: nn.Module, layout: str) -> int:
    """Gives ``model``'s unshared linear weights ``layout``; returns how many changed."""
    if layout == "packed":
        return pack_linear_weights(model)
    if layout == "input-major":
        return store_linear_weights_input_major(model)
    return 0


@torch.inference_mode()
def time_layouts(
    model: nn.Module, rows: tuple[int, ...] = TIMED_ROWS, repeats: int = TIMED_REPEATS
) -> tuple[float, float]:
    """Milliseconds the products of ``model``'s unshared linear layers take, packed and input-major:
    one product per layer and per number of ``rows`` (medians of ``repeats`` alternating calls on one
    layer of each weight shape)."""
    totals = [0.0, 0.0]
    for linear, count in _distinct_linears(model):
        weight = linear.weight.detach()
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACKED_FOR_ROWS)
        input_major = weight.t().contiguous().t()
        bias = linear.bias
        for n in rows:
            x = torch.randn(n, linear.in_features, dtype=weight.dtype, device=weight.device)
            packed_ms, input_major_ms = _median_products_ms(x, packed, input_major, bias, repeats)
            totals[0] += count * packed_ms
            totals[1] += count * input_major_ms
    return totals[0], totals[1]


def _median_products_ms(
    x: torch.Tensor, packed: torch.Tensor, input_major: torch.Tensor, bias: torch.Tensor | None, repeats: int
) -> tuple[float, float]:
    """Medians of ``repeats`` products of ``x`` by the packed and by the input-major weight, alternating
    (after one call each: first calls allocate and pick kernels)."""
    out_features = input_major.shape[0]
    packed_linear(x, packed, bias, out_features)
    nn.functional.linear(x, input_major, bias)
    packed_s: list[float] = []
    input_major_s: list[float] = []
    for _ in range(repeats):
        start = time.perf_counter()
        packed_linear(x, packed, bias, out_features)
        middle = time.perf_counter()
        nn.functional.linear(x, input_major, bias)
        packed_s.append(middle - start)
        input_major_s.append(time.perf_counter() - middle)
    return statistics.median(packed_s) * 1e3, statistics.median(input_major_s) * 1e3


def _distinct_linears(model: nn.Module) -> Iterator[tuple[nn.Linear, int]]:
    """One unshared 2-D ``nn.Linear`` of each (in, out, bias) shape of ``model``, and how many it has."""
    owners = parameter_owners(model)
    found: dict[tuple[int, int, bool], list[nn.Linear]] = {}
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.dim() == 2 and owners[id(module.weight)] == 1:
            key = (module.in_features, module.out_features, module.bias is not None)
            found.setdefault(key, []).append(module)
    for modules in found.values():
        yield modules[0], len(modules)
