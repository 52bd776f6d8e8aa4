"""The devices a test runs on: the CPU always; CUDA when there is one, marked ``gpu`` (what
``scripts/gpu_check.sh`` runs)."""

from __future__ import annotations

import pytest
import torch

NEEDS_CUDA = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
ON_CPU_AND_CUDA = pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=NEEDS_CUDA)])
