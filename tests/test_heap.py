"""The start-up heap is kept out of the garbage collector: in one process, and in every service of a stack."""

from __future__ import annotations

import gc
import re
import weakref
from collections.abc import Iterator

import pytest

from pdserve.core.heap import freeze_heap
from tests.conftest import StackPool

FROZE = re.compile(r"(\d+) start-up objects kept out of the garbage collector")


@pytest.fixture
def unfrozen() -> Iterator[None]:
    yield
    gc.unfreeze()


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_freeze_collects_the_garbage_and_keeps_the_rest_out_of_later_collections(unfrozen: None) -> None:
    dead_a, dead_b = _Node(), _Node()
    dead_a.other, dead_b.other = dead_b, dead_a  # a cycle only the collector frees
    gone = weakref.ref(dead_a)
    del dead_a, dead_b
    alive = _Node()
    alive.other = alive
    gc.disable()  # no collection between the cycle's end and the freeze but its own
    try:
        tracked = len(gc.get_objects())
        frozen = freeze_heap("test")
    finally:
        gc.enable()
    assert gone() is None
    # Frozen objects that die later (freed by reference counts here or in another thread of the
    # test process) leave the permanent generation, so the count can only have fallen since.
    assert 0 < gc.get_freeze_count() <= frozen
    assert frozen > 0.9 * tracked  # what was alive, less the garbage the freeze's collection freed
    assert all(obj is not alive for obj in gc.get_objects())  # later collections do not walk it
    assert not any(obj is alive for obj in gc.get_objects(generation=2))


def test_every_service_of_a_stack_freezes_its_start_up_heap(stack_pool: StackPool) -> None:
    stack = stack_pool.get("tiny-llama")
    for service in [*stack.prefills, *stack.decodes, stack.gateway]:
        found = FROZE.findall(service.log_path.read_text())
        assert len(found) == 1, (service.name, found)
        assert int(found[0]) > 10_000, (service.name, found)  # modules, the model, the tokenizer
