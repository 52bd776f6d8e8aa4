"""The CPU decode attention kernel for tests that run it: built, or the test skipped without a compiler."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pdserve.model import decode_attention


def require_decode_kernel(cache_dir: Path) -> None:
    """Loads the kernel; skips where no C++ compiler is on PATH (a bare GPU image), fails where one
    is and the build did not work."""
    if decode_attention.load(cache_dir):
        return
    compiler = decode_attention.compiler()
    if shutil.which(compiler) is None:
        pytest.skip(f"no C++ compiler ({compiler}) to build the decode attention kernel")
    pytest.fail("the decode attention kernel did not build (see the log)")
