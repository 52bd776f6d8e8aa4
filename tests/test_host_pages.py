"""KV pools in host memory on transparent huge pages (``pdserve.kv.host_pages``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from decode_service.kv_pool import KvPool
from pdserve.kv.host_pages import HUGE_PAGE_BYTES, advise_huge_pages, empty_pool
from pdserve.kv.layout import KvLayout
from prefill_service.prefix_cache import PrefixCache

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str:
    """The bracketed mode of transparent huge pages ('always', 'madvise', 'never'), '' when unknown."""
    try:
        text = THP_MODE.read_text()
    except OSError:
        return ""
    return text[text.find("[") + 1 : text.find("]")] if "[" in text else ""


def _huge_kib_in(tensor: torch.Tensor) -> int:
    """KiB of the mappings holding ``tensor``'s memory that are backed by huge pages now."""
    start = tensor.data_ptr()
    return _smaps_kib_in(start, start + tensor.numel() * tensor.element_size(), "AnonHugePages:")


def _smaps_kib_in(start: int, end: int, key: str) -> int:
    """The sum of ``key`` (an /proc/self/smaps field in KiB) over the mappings holding [start, end)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low < end and start < high
        elif inside and head == key:
            total += int(line.split()[1])
    return total


def test_an_empty_pool_has_the_shape_dtype_and_device_asked_for() -> None:
    pool = empty_pool((2, 3 * HUGE_PAGE_BYTES // 4, 1), torch.float32, torch.device("cpu"))
    assert pool.shape == (2, 3 * HUGE_PAGE_BYTES // 4, 1)
    assert pool.dtype == torch.float32
    assert pool.device.type == "cpu"
    pool.fill_(1.5)
    assert float(pool.sum()) == 1.5 * pool.numel()


def test_tensors_without_a_whole_huge_page_are_left_alone() -> None:
    assert not advise_huge_pages(torch.empty(1024))
    assert not advise_huge_pages(torch.empty(2 * HUGE_PAGE_BYTES, dtype=torch.uint8)[::2])  # not contiguous
    assert not advise_huge_pages(torch.empty(0))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_HUGEPAGE) is Linux's")
def test_the_kernel_takes_the_advice_for_a_large_pool() -> None:
    assert advise_huge_pages(torch.empty(4 * HUGE_PAGE_BYTES, dtype=torch.uint8))


@pytest.mark.skipif(
    _thp_mode() not in ("always", "madvise"), reason="transparent huge pages are off on this host"
)
def test_a_pool_written_for_the_first_time_lands_on_huge_pages() -> None:
    """With THP on 'madvise' (a common default) a plain tensor stays on 4 KiB pages; the pool does not."""
    pool = empty_pool((16 * HUGE_PAGE_BYTES,), torch.uint8, torch.device("cpu"))
    pool.fill_(7)
    assert _huge_kib_in(pool) >= 8 * HUGE_PAGE_BYTES // 1024


def test_the_prefix_cache_and_the_decode_pool_are_advised(monkeypatch: pytest.MonkeyPatch) -> None:
    advised: list[int] = []
    real = advise_huge_pages

    def spy(tensor: torch.Tensor) -> bool:
        advised.append(tensor.numel())
        return real(tensor)

    monkeypatch.setattr("pdserve.kv.host_pages.advise_huge_pages", spy)
    layout = KvLayout(keys=((2, 8),) * 2, values=((2, 8),) * 2, dtype=torch.float32)
    cache = PrefixCache(block_size=16, capacity_tokens=64, layout=layout, device=torch.device("cpu"))
    assert len(advised) == 4  # keys and values of 2 layers
    assert cache.capacity_tokens == 64
    advised.clear()
    pool = KvPool(layout, num_blocks=4, block_size=16, device=torch.device("cpu"))
    assert len(advised) == 4
    assert all(float(t.abs().sum()) == 0.0 for t in [*pool.keys, *pool.values])  # zeroed, as before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_the_prefix_cache_pools_are_resident_once_built() -> None:
    """No prompt pays for the first writes of the cache's pages: they are written when it is built."""
    layout = KvLayout(keys=((4, 64),) * 2, values=((4, 64),) * 2, dtype=torch.float32)
    cache = PrefixCache(block_size=16, capacity_tokens=8192, layout=layout, device=torch.device("cpu"))
    hashes = cache.hashes(list(range(17)))
    kv = [(torch.ones(4, 16, 64), torch.ones(4, 16, 64))] * 2
    cache.insert(hashes[:1], kv)
    views = cache.kv(cache.lookup(hashes, 17))  # one block, in the pools
    pools = [view.untyped_storage() for pair in views for view in pair]
    assert len({pool.data_ptr() for pool in pools}) == 4
    for pool in pools:
        assert pool.nbytes() == 8192 * 4 * 64 * 4  # 8 MiB: the whole pool
        assert (
            _smaps_kib_in(pool.data_ptr(), pool.data_ptr() + pool.nbytes(), "Rss:") >= pool.nbytes() // 1024
        )
