"""Linear layers whose float32 weights oneDNN has packed, for CPU forwards, eager and compiled.

``nn.Linear`` on a CPU multiplies with MKL's GEMM, which reads the weight in its plain layout at every
call. oneDNN (in every x86 build of torch) lays a weight out once in the blocked format its kernels
read fastest (``torch.ops.mkldnn._reorder_linear_weight``) and multiplies by it directly
(``_linear_pointwise``), as vLLM's CPU backend does. Measured on the 2-core CPU machine, one thread,
the 29 GEMMs of a decode step of the reference model of ``shared/PEERS.md`` (hidden 256, 4 layers,
vocab 8192) took 5.3 / 9.2 / 14.4 ms at 8 / 32 / 64 rows on input-major weights with MKL, 2.7 / 5.9 /
9.8 ms packed; the whole eager step at 32 rows 20.4 against 16.5 ms (medians of 30 alternations).
SmolLM2-135M, eager, one stack on the same machine, 16 streams of 64 prompt + 48 output tokens:
75-93 against 60-66 output tok/s. A single row pays oneDNN's higher cost per call on small layers
(39 against 32 us for 576 x 576): one stream decodes about 8% slower. Other CPUs rank the two
layouts otherwise: an engine times both on its model (``linear_layout``).

A packed (``mkldnn`` layout) tensor has no strides for torch.compile to trace: the product is an
operator of its own (``pdserve::packed_linear``, with a shape function), which compiled code calls as
it is. The compiled decode step of the reference model at 16 rows: 8.8 against 11.1 ms in the
compiled graph. A packed layer keeps no plain copy of its weight (``weight`` unpacks one when read,
for the rare reader); a weight shared with another module (an output projection tied to the input
embeddings) stays plain.

The operator's kernel is C++ (``packed_linear.cpp``, built and loaded by ``load`` with the engine's
model): compiled code on a CPU runs without the GIL (inductor's C++ wrapper) and calls it through the
dispatcher, so the 29 products of a step neither take the GIL nor run a Python frame each. Where it
cannot be built, a Python kernel calls oneDNN instead, and each call takes the GIL: compiled forwards
of the reference model, one thread, median of 15 (``scripts/bench_packed_linear.py``): 16 rows of one
token 8.3 against 11.4 ms, 3 rows of 32 tokens 14.8 against 21.2 ms, and far more than that while
another thread of the process runs Python.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from pdserve.model import cpu_kernel
from pdserve.model.compiled_forward import static_dims
from pdserve.model.weight_layout import parameter_owners

SOURCE = Path(__file__).with_suffix(".cpp")
OPERATOR = "pdserve::packed_linear"

# Rows the packed layout is chosen for (oneDNN's hint; any number of rows runs on it).
PACKED_FOR_ROWS = 32


def can_pack_linear_weights(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether linear weights of ``dtype`` on ``device`` can be packed: float32 on a CPU with oneDNN."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


class PackedLinear(nn.Module):
    """``nn.Linear``'s forward over a oneDNN-packed weight."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach().contiguous()
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_FOR_ROWS)
        # Its sizes are the model's, constants of compiled code (see ``static_dims``).
        self.packed = static_dims(packed, *range(packed.dim()))
        self.bias = linear.bias

    @property
    def weight(self) -> torch.Tensor:
        """The weight ``[out, in]``, unpacked (a copy)."""
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias, self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


# The operator is defined with torch.library's low-level API: a call goes through the dispatcher
# straight to ``_packed_product``, without ``torch.library.custom_op``'s Python layers (its autograd
# wrapper, alias checks and redispatch: 73 against 61 us per call at 32 rows of 256 x 256, where
# oneDNN's own call takes 58; 29 such calls per decode step of the reference model).
_LIBRARY = torch.library.Library("pdserve", "DEF")
_LIBRARY.define("packed_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor")


def _packed_product(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """``x @ weight.T + bias`` over oneDNN's packed ``weight``."""
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out


def _packed_product_shape(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


# Every backend key (a packed weight dispatches as MkldnnCPU, its input as CPU); inference only. The
# C++ kernel (``load``) takes the CPU and MkldnnCPU keys' place.
_LIBRARY.impl("packed_linear", _packed_product, "CompositeExplicitAutograd")
torch.library.register_fake("pdserve::packed_linear", _packed_product_shape, lib=_LIBRARY)
# What ``PackedLinear`` calls, and compiled code with it (the packed tensor has no strides to trace).
packed_linear = torch.ops.pdserve.packed_linear


def load(cache_dir: Path) -> bool:
    """Builds the operator's C++ kernel under ``cache_dir`` (once per source, torch and CPU) and loads it
    into this process; returns whether it is loaded. A build that fails is logged, and the products
    run the Python kernel."""
    if has_cpp_kernel():
        return True
    return (
        cpu_kernel.load(SOURCE, cache_dir, "packed linear kernel", "packed products run a Python kernel")
        and has_cpp_kernel()
    )


def has_cpp_kernel() -> bool:
    """Whether the C++ kernel is loaded in this process."""
    return all(torch._C._dispatch_has_kernel_for_dispatch_key(OPERATOR, key) for key in ("CPU", "MkldnnCPU"))


def pack_linear_weights(model: nn.Module) -> int:
    """Replaces every ``nn.Linear`` of ``model`` whose 2-D weight no other module shares by a
    ``PackedLinear``; returns how many."""
    owners = parameter_owners(model)
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child.weight.dim() != 2 or owners[id(child.weight)] > 1:
                continue
            setattr(parent, name, PackedLinear(child))
            replaced += 1
    return replaced
