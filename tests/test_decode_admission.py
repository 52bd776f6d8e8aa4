"""The decode's admission without a model: a short request past a long one that waits for the
pool (bounded, so the long one is not starved), deadlines of waiting and running requests, and the
batch context's memory given back."""

from __future__ import annotations

import time

import torch

from decode_service.kv_pool import KvPool
from decode_service.scheduler import Scheduler
from decode_service.sequence import DeadlineExpired
from decode_service.step_cache import BatchContext
from tests.test_decode_scheduler import EOS, LAYOUT, Requests, assert_no_leaks, step
from tests.test_step_cache import LAYOUT as CONTEXT_LAYOUT
from tests.test_step_cache import Requests as ContextRequests


def make(max_bypass: int, num_blocks: int = 8) -> tuple[KvPool, Scheduler, Requests]:
    pool = KvPool(LAYOUT, num_blocks, block_size=4, device=torch.device("cpu"))
    return pool, Scheduler(pool, 4, frozenset({EOS}), max_bypass=max_bypass), Requests()


def test_a_request_that_fits_is_admitted_past_one_that_does_not() -> None:
    pool, scheduler, requests = make(max_bypass=8)
    big = requests.make("big", 10, 15)  # 6 of the 8 blocks
    bigger = requests.make("bigger", 10, 7)  # 4 blocks: waits for big
    small = requests.make("small", 1, 2)  # 1 block
    for seq in (big, bigger, small):
        scheduler.add(seq)
    assert scheduler.schedule() == [big, small]
    assert list(scheduler.waiting) == [bigger] and bigger.bypassed == 1 and scheduler.num_bypassed == 1
    step(scheduler, [big, small], [9, 9])  # small ends at its 2nd token
    assert [e.finish_reason for e in requests.emissions["small"]] == ["length"]
    big.cancel()
    assert scheduler.schedule() == []
    assert scheduler.schedule() == [bigger]  # then it fits
    scheduler.abandon(RuntimeError("stopped"))
    assert_no_leaks(pool, scheduler)


def test_bypasses_are_bounded_so_the_long_request_is_not_starved() -> None:
    pool, scheduler, requests = make(max_bypass=2)
    big = requests.make("big", 10, 15)
    scheduler.add(big)
    assert scheduler.schedule() == [big]
    bigger = requests.make("bigger", 10, 7)
    scheduler.add(bigger)
    admitted = []
    for i in range(4):
        seq = requests.make(f"small{i}", 1, 2)
        scheduler.add(seq)
        rows = scheduler.schedule()
        admitted.append(seq in rows)
        for row in [r for r in rows if r is not big]:
            row.cancel()  # the small ones leave at once
        scheduler.schedule()
    assert admitted == [True, True, False, False]  # two past it, then the line waits for it
    assert bigger.bypassed == 2
    big.cancel()
    scheduler.schedule()
    assert bigger in scheduler.schedule()
    scheduler.abandon(RuntimeError("stopped"))
    assert_no_leaks(pool, scheduler)


def test_requests_whose_deadline_passed_end_with_deadline_expired() -> None:
    pool, scheduler, requests = make(max_bypass=0)
    running = requests.make("running", 3, 10)
    waiting = requests.make("waiting", 10, 30)  # does not fit beside it
    running.deadline = time.monotonic() + 0.05
    waiting.deadline = time.monotonic() + 0.05
    scheduler.add(running)
    scheduler.add(waiting)
    assert scheduler.schedule() == [running]
    time.sleep(0.06)
    assert scheduler.schedule() == []
    for name in ("running", "waiting"):
        (emission,) = requests.emissions[name]
        assert isinstance(emission.error, DeadlineExpired) and emission.is_last
    assert scheduler.num_expired == 2
    assert_no_leaks(pool, scheduler)


def test_release_gives_the_batch_context_memory_back() -> None:
    pool = KvPool(CONTEXT_LAYOUT, num_blocks=256, block_size=4, device=torch.device("cpu"))
    context, requests = BatchContext(pool, max_rows=16), ContextRequests(pool)
    for serial, length in enumerate((5, 40, 90)):
        requests.add(serial, length)
    rows = requests.sync(context)
    held = context.num_bytes
    assert held > 0
    context.release()
    assert context.num_bytes == 0 and context.serials == [] and context.capacity == 0
    assert requests.sync(context) == rows  # the next step allocates anew, every row copied in again
    requests.assert_context_holds_pool(context, rows)
    assert context.num_bytes == held
