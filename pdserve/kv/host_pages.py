"""Large KV pools in host memory, on transparent huge pages where the kernel offers them.

A pool's memory is mapped when it is allocated but faulted in page by page when first written. With
4 KiB pages each one is a fault, and the prefill's prefix cache, filled slot after slot by new
prompts, would write into slots never written before until it is full (gigabytes): measured on the
2-core CPU machine, 8 MiB of KV copied into fresh pages took 7-14 ms, into pages already written
1.1 ms, and into fresh 2 MiB pages 1.3 ms. ``empty_pool`` asks the kernel
(``madvise(MADV_HUGEPAGE)``) to back a CPU pool with 2 MiB pages; with transparent huge pages off,
or on another OS, the pool is the same ``torch.empty`` with 4 KiB pages. CUDA memory is
unaffected. Huge pages make the faults fewer, not free (on a virtual machine the host backs a page
the first time the guest writes it): the decode's pool and the prefix cache take theirs written
whole (``zeroed_pool``) when they are built, before any request.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
MADV_HUGEPAGE = 14  # Linux, every architecture


def empty_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty(shape)`` on ``device``; a CPU pool of at least one huge page is advised onto
    huge pages."""
    tensor = torch.empty(shape, dtype=dtype, device=device)
    advise_huge_pages(tensor)
    return tensor


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``empty_pool`` written whole (zeros) now, so that no later write faults its pages in."""
    return empty_pool(shape, dtype, device).zero_()


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Asks for huge pages under the whole 2 MiB pages of a contiguous CPU tensor's memory; whether
    the kernel took the advice (False: too small, not Linux, or refused)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return False
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    last = end // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if last <= first:
        return False
    madvise = _madvise()
    if madvise is None:
        return False
    if madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) refused: errno %d", ctypes.get_errno())
        return False
    return True


@functools.cache
def _madvise() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    function = libc.madvise
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function
