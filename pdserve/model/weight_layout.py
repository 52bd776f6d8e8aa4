"""Linear weights stored input-major on CPU, the layout the CPU's float32 GEMM runs fastest at few rows.

``nn.Linear`` keeps its weight as ``(out, in)`` rows and computes ``x @ weight.T``: the CPU GEMM then
reads the right-hand matrix transposed. Stored as ``(in, out)`` rows instead (the same ``(out, in)``
tensor, strides swapped) the product reads it straight. With one thread and float32, a decode step's
GEMMs at 8 to 64 rows take 15 to 40% less time that way and prompt-sized GEMMs the same; bfloat16 and
float16 gain nothing, and CUDA's GEMMs read either layout at full speed. Values, shapes and module types
stay as they were: ``weight`` is the same logical tensor and everything reading it works unchanged.

A weight shared with another module (an output projection tied to the input embeddings) keeps its
layout: the embedding gathers rows of it, which the swapped strides would scatter. Whether an engine
stores its weights this way or packs them (``packed_linear``) is ``linear_layout``'s choice.
"""

from __future__ import annotations

import torch
from torch import nn


def prefers_input_major(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether linear weights run faster stored input-major on ``device`` in ``dtype``."""
    return device.type == "cpu" and dtype == torch.float32


def store_linear_weights_input_major(model: nn.Module) -> int:
    """Re-store every unshared 2-D ``nn.Linear`` weight of ``model`` input-major; returns how many."""
    owners = parameter_owners(model)
    changed = 0
    for module in model.modules():
        if not isinstance(module, nn.Linear):
            continue
        weight = module.weight
        if weight.dim() != 2 or owners[id(weight)] > 1 or weight.stride(0) == 1:
            continue
        module.weight = nn.Parameter(weight.detach().t().contiguous().t(), requires_grad=weight.requires_grad)
        changed += 1
    return changed


def parameter_owners(model: nn.Module) -> dict[int, int]:
    """How many modules of ``model`` hold each parameter (by ``id``): more than one shares it."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for parameter in module.parameters(recurse=False):
            owners[id(parameter)] = owners.get(id(parameter), 0) + 1
    return owners
