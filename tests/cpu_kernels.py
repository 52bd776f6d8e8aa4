"""The C++ operators for tests that run them: built, or the test skipped without a compiler."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from pdserve.model import cpu_kernel, decode_attention, packed_linear


def require_kernel(load: Callable[[Path], bool], cache_dir: Path, name: str) -> None:
    """Loads a kernel with ``load``; skips where no C++ compiler is on PATH (a bare GPU image), fails
    where one is and the build did not work."""
    if load(cache_dir):
        return
    compiler = cpu_kernel.compiler()
    if shutil.which(compiler) is None:
        pytest.skip(f"no C++ compiler ({compiler}) to build the {name} kernel")
    pytest.fail(f"the {name} kernel did not build (see the log)")


def require_decode_kernel(cache_dir: Path) -> None:
    require_kernel(decode_attention.load, cache_dir, "decode attention")


def require_packed_linear_kernel(cache_dir: Path) -> None:
    require_kernel(packed_linear.load, cache_dir, "packed linear")
