"""The decode step's batch context: joins copy only the joining request, leaves move one row."""

from __future__ import annotations

import torch

from decode_service.kv_pool import KvPool
from decode_service.step_cache import CAPACITY_STEP, MIN_ROWS, BatchContext, StepLayer
from pdserve.kv.layout import KvLayout
from pdserve.model.shared_prefix_attention import SharedPrefix

# Two layers; the second caches keys and values of different widths (as MLA models do).
LAYOUT = KvLayout(keys=((2, 4), (1, 6)), values=((2, 4), (1, 3)), dtype=torch.float32)


class Requests:
    """Requests with random KV written to their own pool blocks, as the engine admits them."""

    def __init__(self, pool: KvPool, seed: int = 0) -> None:
        self.pool = pool
        self.generator = torch.Generator().manual_seed(seed)
        self.blocks: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    def add(self, serial: int, length: int) -> None:
        kv = [
            (
                torch.randn(kh, length, kw, generator=self.generator),
                torch.randn(vh, length, vw, generator=self.generator),
            )
            for (kh, kw), (vh, vw) in zip(LAYOUT.keys, LAYOUT.values, strict=True)
        ]
        self.blocks[serial] = self.pool.allocate(length + 8)
        self.lengths[serial] = self.pool.write(self.blocks[serial], kv)

    def remove(self, serial: int) -> None:
        self.pool.free(self.blocks.pop(serial))
        del self.lengths[serial]

    def sync(self, context: BatchContext) -> list[int]:
        serials = list(self.blocks)
        order = context.sync(serials, [self.blocks[s] for s in serials], [self.lengths[s] for s in serials])
        return [serials[i] for i in order]

    def assert_context_holds_pool(self, context: BatchContext, rows: list[int]) -> None:
        assert context.serials == rows
        for row, serial in enumerate(rows):
            n = self.lengths[serial]
            slots = self.pool.slots(self.blocks[serial], 0, n)
            for layer in range(LAYOUT.num_layers):
                assert torch.equal(context.keys[layer][row, :n], self.pool.keys[layer][slots])
                assert torch.equal(context.values[layer][row, :n], self.pool.values[layer][slots])


def make() -> tuple[KvPool, BatchContext, Requests]:
    pool = KvPool(LAYOUT, num_blocks=256, block_size=4, device=torch.device("cpu"))
    return pool, BatchContext(pool, max_rows=64), Requests(pool)


def test_sync_returns_every_request_once_with_its_kv_in_its_row() -> None:
    _, context, requests = make()
    for serial, n in enumerate((5, 17, 1, 9)):
        requests.add(serial, n)
    rows = requests.sync(context)
    assert sorted(rows) == [0, 1, 2, 3]
    requests.assert_context_holds_pool(context, rows)
    assert context.capacity >= 18 and context.capacity % CAPACITY_STEP == 0


def test_a_join_copies_only_the_joining_request() -> None:
    _, context, requests = make()
    for serial in range(4):
        requests.add(serial, 6 + serial)
    requests.sync(context)
    keys_before = [k.clone() for k in context.keys]
    copied = context.num_rows_copied
    growths = context.num_growths
    for serial in range(4, MIN_ROWS):  # joins one at a time, without growing the context
        requests.add(serial, 3 + serial)
        rows = requests.sync(context)
        assert rows[-1] == serial  # a joining request takes the next free row
    assert context.num_growths == growths
    assert context.num_rows_copied - copied == MIN_ROWS - 4
    requests.assert_context_holds_pool(context, rows)
    for before, after in zip(keys_before, context.keys, strict=True):
        assert torch.equal(before[:4], after[:4])  # the rows that stayed did not move


def test_a_leave_moves_only_the_last_row_into_the_hole() -> None:
    _, context, requests = make()
    for serial in range(6):
        requests.add(serial, 4 + 2 * serial)
    rows = requests.sync(context)
    copied = context.num_rows_copied
    leaving = rows[1]
    requests.remove(leaving)
    after = requests.sync(context)
    assert after == [rows[0], rows[5], rows[2], rows[3], rows[4]]
    assert context.num_rows_copied - copied == 1
    requests.assert_context_holds_pool(context, after)
    requests.remove(after[-1])  # the last row leaves: nothing moves
    copied = context.num_rows_copied
    assert requests.sync(context) == after[:-1]
    assert context.num_rows_copied == copied


def test_growth_keeps_every_row_and_step_writes() -> None:
    _, context, requests = make()
    requests.add(0, 3)
    rows = requests.sync(context)
    context.keys[0][0, 3] = 7.0  # a step's write of position 3 (the pool gets it too)
    requests.pool.keys[0][requests.pool.slots(requests.blocks[0], 3, 1)] = 7.0
    requests.lengths[0] = 4
    requests.add(1, CAPACITY_STEP + 5)  # a longer context and more rows at once
    for serial in range(2, MIN_ROWS + 3):
        requests.add(serial, 2)
    rows = requests.sync(context)
    assert context.num_growths == 2
    assert context.allocated_rows >= MIN_ROWS + 3 and context.capacity > CAPACITY_STEP + 5
    requests.assert_context_holds_pool(context, rows)
    assert float(context.keys[0][rows.index(0), 3, 0, 0]) == 7.0


def test_requests_leaving_together_move_only_the_rows_that_stay() -> None:
    _, context, requests = make()
    for serial in range(8):
        requests.add(serial, 5)
    rows = requests.sync(context)
    copied = context.num_rows_copied
    for serial in (rows[0], rows[2], rows[5], rows[6], rows[7]):
        requests.remove(serial)
    after = requests.sync(context)
    assert after == [rows[4], rows[1], rows[3]]  # the rows left at the end went without a move
    assert context.num_rows_copied - copied == 2  # one move per hole below the last live row
    requests.assert_context_holds_pool(context, after)


def test_clear_forgets_every_row_and_keeps_the_memory() -> None:
    _, context, requests = make()
    for serial in range(MIN_ROWS + 1):
        requests.add(serial, 5)
    requests.sync(context)
    allocated, capacity, growths = context.allocated_rows, context.capacity, context.num_growths
    context.clear()
    assert context.serials == []
    for serial in range(MIN_ROWS + 1):
        requests.remove(serial)
    for serial in range(100, 100 + MIN_ROWS + 1):  # the next burst fits without growing
        requests.add(serial, 7)
    rows = requests.sync(context)
    assert (context.allocated_rows, context.capacity, context.num_growths) == (allocated, capacity, growths)
    requests.assert_context_holds_pool(context, rows)


def test_rows_double_up_to_the_most_running_requests() -> None:
    pool = KvPool(LAYOUT, num_blocks=256, block_size=4, device=torch.device("cpu"))
    context, requests = BatchContext(pool, max_rows=20), Requests(pool)
    allocated = []
    for serial in range(20):
        requests.add(serial, 2)
        requests.sync(context)
        allocated.append(context.allocated_rows)
    assert sorted(set(allocated)) == [MIN_ROWS, 2 * MIN_ROWS, 20]
    requests.assert_context_holds_pool(context, context.serials)


def test_a_reallocation_keeps_no_more_than_twice_what_is_needed() -> None:
    pool = KvPool(LAYOUT, num_blocks=1024, block_size=4, device=torch.device("cpu"))
    context, requests = BatchContext(pool, max_rows=64), Requests(pool)
    requests.add(0, 300)  # one long row: a long context
    requests.sync(context)
    assert context.capacity > 300
    requests.remove(0)
    for serial in range(1, 3 * MIN_ROWS):  # many short rows: more rows, and no longer that long
        requests.add(serial, 5)
    rows = requests.sync(context)
    assert context.allocated_rows >= 3 * MIN_ROWS - 1
    assert context.capacity <= 2 * CAPACITY_STEP
    requests.assert_context_holds_pool(context, rows)
    # A reservation's rows are not kept for a long row either.
    context.reserve(32, CAPACITY_STEP)
    for serial in rows:
        requests.remove(serial)
    requests.add(100, 400)
    rows = requests.sync(context)
    assert context.capacity > 400 and context.allocated_rows <= MIN_ROWS
    requests.assert_context_holds_pool(context, rows)


def test_a_reservation_is_allocated_at_once_and_kept_by_release() -> None:
    pool = KvPool(LAYOUT, num_blocks=256, block_size=4, device=torch.device("cpu"))
    context, requests = BatchContext(pool, max_rows=16), Requests(pool)
    context.reserve(32, 100)  # rows beyond the most running requests are not reserved
    assert (context.allocated_rows, context.capacity) == (16, 2 * CAPACITY_STEP)
    reserved = context.num_bytes
    for serial in range(16):  # a burst within the reservation does not grow it
        requests.add(serial, 20)
    rows = requests.sync(context)
    assert context.num_growths == 1
    requests.assert_context_holds_pool(context, rows)
    context.release()
    assert context.num_bytes == reserved and context.serials == []
    for serial in range(16):
        requests.remove(serial)
    requests.add(50, 200)  # beyond it: grows, and release goes back to the reservation
    requests.sync(context)
    assert context.capacity > 2 * CAPACITY_STEP
    context.release()
    assert (context.allocated_rows, context.capacity) == (16, 2 * CAPACITY_STEP)


def static_indices(tensor: torch.Tensor) -> set[int]:
    return set(getattr(tensor, "_dynamo_static_indices", set()))


def test_heads_and_width_are_constants_of_a_compiled_step() -> None:
    # Compiled with dynamic sizes, they would be tied to rows or positions that happen to equal them.
    pool, context, requests = make()
    assert all(static_indices(t) == {1, 2} for t in (*pool.keys, *pool.values))
    for serial in range(3):
        requests.add(serial, CAPACITY_STEP + 5)  # grown: new tensors
    requests.sync(context)
    assert all(static_indices(t) == {2, 3} for t in (*context.keys, *context.values))
    view = context.keys[0][:2]
    StepLayer(pool.keys[0], pool.values[0], view, context.values[0][:2], torch.zeros(2), torch.zeros(2), 4)
    assert static_indices(view) == {2, 3}
    prefix = SharedPrefix([torch.zeros(2, 8, 4)], [torch.zeros(2, 8, 4)])
    assert static_indices(prefix.keys[0]) == static_indices(prefix.values[0]) == {0, 2}
