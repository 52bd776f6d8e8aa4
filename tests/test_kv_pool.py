"""The decode's paged pool: requests whose handles name the same prefix-cache blocks share them.

A model of the prefill side gives each prompt family's blocks ids, as the prefix cache does (a block
evicted and computed again gets a new id); a request's KV holds, in a keyed block, a value derived
from the block's id, and elsewhere values of its own. Whatever the order of joins, leaves and steps,
every live request reads back exactly its own KV, blocks are held by as many requests as reference
them, and a request shares exactly the leading blocks the pool holds under its keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from decode_service.kv_pool import BlockKey, KvPool, PrefixBlocks
from pdserve.kv.layout import KvLayout
from tests.devices import ON_CPU_AND_CUDA

LAYOUT = KvLayout(keys=((1, 2),), values=((1, 3),), dtype=torch.float32)
BLOCK = 4
INSTANCE = "prefill-a"


@dataclass
class Live:
    blocks: list[int]
    expected: torch.Tensor  # per position, the value its keys hold
    length: int  # positions written so far


@dataclass
class Model:
    pool: KvPool
    families: list[list[int]] = field(default_factory=list)  # each family's block ids, by block
    next_id: int = 1
    next_own: float = 10_000.0
    live: dict[int, Live] = field(default_factory=dict)
    serial: int = 0

    def family(self, index: int) -> list[int]:
        while len(self.families) <= index:
            self.families.append([])
        ids = self.families[index]
        while len(ids) < 6:
            ids.append(self.fresh_id())
        return ids

    def fresh_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def own_values(self, count: int) -> torch.Tensor:
        values = torch.arange(count, dtype=torch.float32) + self.next_own
        self.next_own += count
        return values

    def join(self, family: int, full_blocks: int, extra: int, new_tokens: int) -> None:
        ids = self.family(family)[:full_blocks]
        keys: list[BlockKey] = list(PrefixBlocks(INSTANCE, BLOCK, tuple(ids)).keys(BLOCK))
        length = full_blocks * BLOCK + extra
        expected = torch.cat(
            [torch.tensor(ids, dtype=torch.float32).repeat_interleave(BLOCK), self.own_values(extra)]
        )
        held_before = self.pool.held(keys)
        if not self.pool.can_allocate(length + new_tokens, keys):
            with pytest.raises(MemoryError):
                self.pool.admit(length + new_tokens, keys)
            return
        blocks, shared = self.pool.admit(length + new_tokens, keys)
        assert shared == len(held_before) * BLOCK
        assert blocks[: len(held_before)] == held_before
        kv = [(_as_keys(expected), _as_values(expected))]
        if shared:  # what a shared block holds must not be read from the request's KV
            kv = [(k.clone(), v.clone()) for k, v in kv]
            kv[0][0][:, :shared] = float("nan")
            kv[0][1][:, :shared] = float("nan")
        assert self.pool.write(blocks, kv, start=shared) == length
        self.live[self.serial] = Live(blocks, expected, length)
        self.serial += 1

    def step(self) -> None:
        """Every live request writes its next position (when it reserved one), as a decode step does."""
        for live in self.live.values():
            if live.length < len(live.blocks) * BLOCK:
                value = self.own_values(1)
                slot = self.pool.slot(live.blocks, live.length)
                self.pool.keys[0][slot] = value
                self.pool.values[0][slot] = -value
                live.expected = torch.cat([live.expected, value])
                live.length += 1

    def leave(self, pick: int) -> None:
        if self.live:
            serial = sorted(self.live)[pick % len(self.live)]
            self.pool.free(self.live.pop(serial).blocks)

    def recompute(self, family: int, block: int) -> None:
        """The prefill evicted a family's block and computed it again: new ids from there on."""
        ids = self.family(family)
        for i in range(block, len(ids)):
            ids[i] = self.fresh_id()

    def check(self) -> None:
        references: dict[int, int] = {}
        for live in self.live.values():
            slots = self.pool.slots(live.blocks, 0, live.length)
            assert torch.equal(self.pool.keys[0][slots][:, 0, 0], live.expected)
            assert torch.equal(self.pool.values[0][slots][:, 0, 0], -live.expected)
            for block in live.blocks:
                references[block] = references.get(block, 0) + 1
        assert self.pool.num_used_blocks == len(references)
        assert self.pool.num_free_blocks + self.pool.num_used_blocks == self.pool.num_blocks


def _as_keys(values: torch.Tensor) -> torch.Tensor:
    return values[None, :, None].expand(1, -1, 2).contiguous()


def _as_values(values: torch.Tensor) -> torch.Tensor:
    return -values[None, :, None].expand(1, -1, 3).contiguous()


OPERATIONS = st.lists(
    st.one_of(
        st.tuples(
            st.just("join"),
            st.integers(0, 2),
            st.integers(0, 5),
            st.integers(0, BLOCK - 1),
            st.integers(0, 6),
        ),
        st.tuples(st.just("step")),
        st.tuples(st.just("leave"), st.integers(0, 10)),
        st.tuples(st.just("recompute"), st.integers(0, 2), st.integers(0, 5)),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(operations=OPERATIONS, num_blocks=st.integers(6, 24))
def test_every_request_reads_its_own_kv_while_prefix_blocks_are_shared(
    operations: list[tuple[Any, ...]], num_blocks: int
) -> None:
    model = Model(KvPool(LAYOUT, num_blocks, BLOCK, torch.device("cpu")))
    for name, *args in operations:
        if name == "join":
            family, full_blocks, extra, new_tokens = args
            model.join(family, full_blocks, extra if full_blocks else max(extra, 1), new_tokens)
        elif name == "step":
            model.step()
        elif name == "leave":
            model.leave(args[0])
        else:
            model.recompute(args[0], args[1])
        model.check()
    for serial in list(model.live):
        model.pool.free(model.live.pop(serial).blocks)
    assert model.pool.num_used_blocks == 0


@ON_CPU_AND_CUDA
def test_a_prefix_is_shared_while_held_and_kept_after_until_its_room_is_needed(device: str) -> None:
    pool = KvPool(LAYOUT, 6, BLOCK, torch.device(device))
    keys = PrefixBlocks(INSTANCE, BLOCK, (7, 8)).keys(BLOCK)
    values = torch.arange(10, dtype=torch.float32)
    first, shared = pool.admit(9, keys)  # 2 keyed blocks and one of its own
    assert shared == 0 and pool.num_used_blocks == 3
    pool.write(first, [(_as_keys(values[:9]), _as_values(values[:9]))])
    second, shared = pool.admit(10, keys)
    assert shared == 8 and second[:2] == first[:2] and second[2] != first[2]
    assert pool.num_used_blocks == 4
    theirs = values + 100
    theirs[:8] = float("nan")  # the shared positions are not read from the request's KV
    pool.write(second, [(_as_keys(theirs), _as_values(theirs))], start=shared)
    read = pool.keys[0][pool.slots(second, 0, 10)][:, 0, 0].cpu()
    assert torch.equal(read, torch.cat([values[:8], values[8:] + 100]))
    pool.free(first)
    pool.free(second)
    assert pool.num_used_blocks == 0 and pool.num_idle_blocks == 2 and pool.num_free_blocks == 6
    third, shared = pool.admit(9, keys)  # kept while nobody held it
    assert shared == 8 and third[:2] == first[:2]
    pool.free(third)
    # Another instance's block ids, or blocks of another size, are other blocks.
    assert pool.held(PrefixBlocks("prefill-b", BLOCK, (7, 8)).keys(BLOCK)) == []
    assert PrefixBlocks(INSTANCE, 8, (7, 8)).keys(BLOCK) == ()
    everything = pool.allocate(6 * BLOCK)  # the kept blocks' room is needed: they go
    assert pool.num_idle_blocks == 0 and pool.held(keys) == []
    pool.free(everything)
    assert pool.num_free_blocks == 6
