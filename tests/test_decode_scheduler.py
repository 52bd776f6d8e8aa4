"""The decode scheduler without a model: admission, absorbing a step's tokens, leaving, and no leaks."""

from __future__ import annotations

import torch

from decode_service.kv_pool import KvPool
from decode_service.runner import StepOutput
from decode_service.scheduler import Scheduler
from decode_service.sequence import DecodeSequence, Emission
from pdserve.core.sampling import SamplingParams
from pdserve.kv.layout import KvLayout

LAYOUT = KvLayout(keys=((1, 2),), values=((1, 2),), dtype=torch.float32)
EOS = 2


class Requests:
    """Sequences of zero KV whose emissions are recorded by request id."""

    def __init__(self) -> None:
        self.emissions: dict[str, list[Emission]] = {}

    def make(
        self, request_id: str, num_tokens: int, max_tokens: int, first_token_id: int = 7
    ) -> DecodeSequence:
        kv = [(torch.zeros(1, num_tokens, 2), torch.zeros(1, num_tokens, 2))]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=(3,))
        seq = DecodeSequence(
            request_id, kv, first_token_id, params, self.emissions.setdefault(request_id, []).append
        )
        seq.last_token_id = first_token_id
        return seq


def make(num_blocks: int = 8, max_running: int = 4) -> tuple[KvPool, Scheduler, Requests]:
    pool = KvPool(LAYOUT, num_blocks, block_size=4, device=torch.device("cpu"))
    return pool, Scheduler(pool, max_running, frozenset({EOS})), Requests()


def step(scheduler: Scheduler, rows: list[DecodeSequence], token_ids: list[int]) -> None:
    scheduler.absorb(StepOutput(rows, token_ids))


def assert_no_leaks(pool: KvPool, scheduler: Scheduler) -> None:
    assert scheduler.is_idle and pool.num_used_blocks == 0


def test_admission_is_first_come_first_served_within_the_pool_and_max_running() -> None:
    pool, scheduler, requests = make(num_blocks=8, max_running=2)
    big = requests.make("big", 10, 15)  # 24 positions: 6 of the 8 blocks
    bigger = requests.make("bigger", 10, 7)  # 16 positions: 4 blocks, more than are left
    small = requests.make("small", 1, 2)  # 2 positions: 1 block, would fit
    for seq in (big, bigger, small):
        scheduler.add(seq)
    assert scheduler.schedule() == [big]
    assert list(scheduler.waiting) == [bigger, small]  # the head waits for blocks; nobody overtakes it
    assert pool.num_used_blocks == 6 and big.num_cached == 10 and big.kv == ()
    big.cancel()
    assert scheduler.schedule() == []  # the cancelled request leaves after this step's admission
    assert scheduler.schedule() == [bigger, small]  # then the next two fit
    assert big.blocks == [] and pool.num_used_blocks == 5
    scheduler.add(requests.make("third", 1, 2))
    assert len(scheduler.schedule()) == 2  # max_running
    scheduler.abandon(RuntimeError("stopped"))
    assert [e.error is not None for e in requests.emissions["third"]] == [True]
    assert_no_leaks(pool, scheduler)


def test_a_request_complete_at_its_first_token_is_answered_without_running() -> None:
    pool, scheduler, requests = make()
    scheduler.add(requests.make("eos", 3, 10, first_token_id=EOS))
    scheduler.add(requests.make("one", 3, 1))
    cancelled = requests.make("cancelled", 3, 10)
    cancelled.cancel()
    scheduler.add(cancelled)
    assert scheduler.schedule() == []
    assert [(e.token_ids, e.finish_reason) for e in requests.emissions["eos"]] == [((), "eos")]
    assert [(e.token_ids, e.finish_reason) for e in requests.emissions["one"]] == [((), "length")]
    assert requests.emissions["cancelled"] == []
    assert_no_leaks(pool, scheduler)


def test_absorb_counts_finishes_and_frees_in_the_step_order() -> None:
    pool, scheduler, requests = make()
    rows = [requests.make(name, 5, 3) for name in ("a", "b", "c")]
    for seq in rows:
        scheduler.add(seq)
    assert scheduler.schedule() == rows
    ran = [rows[2], rows[0], rows[1]]  # the order the step ran them in
    step(scheduler, ran, [EOS, 11, 3])
    assert scheduler.running == [rows[0]]
    assert (rows[0].num_cached, rows[0].num_generated, rows[0].last_token_id) == (6, 2, 11)
    assert [e.finish_reason for e in requests.emissions["c"]] == ["eos"]
    assert [e.finish_reason for e in requests.emissions["b"]] == ["stop"]
    step(scheduler, scheduler.schedule(), [12])
    assert [(e.token_ids, e.finish_reason) for e in requests.emissions["a"]] == [
        ((11,), None),
        ((12,), "length"),
    ]
    assert_no_leaks(pool, scheduler)


def test_a_failed_step_ends_its_requests_and_keeps_the_waiting_ones() -> None:
    pool, scheduler, requests = make(max_running=1)
    running, waiting = requests.make("running", 4, 8), requests.make("waiting", 4, 8)
    scheduler.add(running)
    scheduler.add(waiting)
    scheduler.schedule()
    error = RuntimeError("forward failed")
    scheduler.fail(error)
    assert [e.error for e in requests.emissions["running"]] == [error]
    assert scheduler.running == [] and list(scheduler.waiting) == [waiting]
    assert scheduler.schedule() == [waiting]
    scheduler.abandon(RuntimeError("stopped"))
    assert_no_leaks(pool, scheduler)
