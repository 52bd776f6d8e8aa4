"""Unit tests of prefill_service.kv_registry: parked KV under leases, with a fake clock."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.kv import handle as kv_handle
from pdserve.kv.handle import HANDLE_ID_BYTES
from prefill_service.kv_registry import KvRegistry

LEASE_S = 10.0


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def registry(clock: FakeClock) -> KvRegistry:
    return KvRegistry(LEASE_S, clock=clock)


def _buf(num_bytes: int) -> torch.Tensor:
    return torch.zeros(num_bytes, dtype=torch.uint8)


def test_park_records_the_entry_and_its_lease(registry: KvRegistry, clock: FakeClock) -> None:
    buffer = _buf(128)
    before = time.time()
    entry = registry.park(buffer, num_tokens=7)
    after = time.time()
    assert isinstance(entry.handle_id, bytes)
    assert len(entry.handle_id) == HANDLE_ID_BYTES == 16
    assert entry.buffer is buffer
    assert entry.num_tokens == 7
    assert entry.num_bytes == 128
    assert entry.expires_at == clock.now + LEASE_S
    assert before + LEASE_S <= entry.expires_at_unix <= after + LEASE_S
    assert registry.num_parked == 1
    assert registry.num_bytes_parked == 128


def test_handle_ids_come_from_secrets_token_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def fake_token_bytes(n: int) -> bytes:
        calls.append(n)
        return bytes([len(calls)]) * n

    monkeypatch.setattr(kv_handle.secrets, "token_bytes", fake_token_bytes)
    registry = KvRegistry(LEASE_S, clock=FakeClock())
    a = registry.park(_buf(1), 1)
    b = registry.park(_buf(1), 1)
    assert calls == [16, 16]
    assert a.handle_id == b"\x01" * 16
    assert b.handle_id == b"\x02" * 16


def test_handle_ids_are_unique(registry: KvRegistry) -> None:
    ids = {registry.park(_buf(1), 1).handle_id for _ in range(500)}
    assert len(ids) == 500
    assert all(len(i) == 16 for i in ids)
    assert registry.num_parked == 500


def test_take_removes_and_returns_the_entry_once(registry: KvRegistry) -> None:
    entry = registry.park(_buf(64), 3)
    other = registry.park(_buf(32), 2)
    assert registry.take(entry.handle_id) is entry
    assert registry.num_parked == 1
    assert registry.num_bytes_parked == 32
    assert registry.take(entry.handle_id) is None
    assert registry.release(entry.handle_id) is False
    assert registry.take(other.handle_id) is other
    assert registry.num_parked == 0
    assert registry.num_bytes_parked == 0


def test_a_taken_handle_is_not_expired_later(registry: KvRegistry, clock: FakeClock) -> None:
    entry = registry.park(_buf(8), 1)
    assert registry.take(entry.handle_id) is entry
    clock.now += LEASE_S * 2
    assert registry.expire() == []


def test_release_removes_the_entry_once(registry: KvRegistry, clock: FakeClock) -> None:
    entry = registry.park(_buf(64), 3)
    assert registry.release(entry.handle_id) is True
    assert registry.num_parked == 0
    assert registry.num_bytes_parked == 0
    assert registry.release(entry.handle_id) is False
    assert registry.take(entry.handle_id) is None
    clock.now += LEASE_S
    assert registry.expire() == []


def test_unknown_handles(registry: KvRegistry) -> None:
    registry.park(_buf(8), 1)
    assert registry.take(b"\x00" * 16) is None
    assert registry.release(b"\x00" * 16) is False
    assert registry.take(b"") is None
    assert registry.num_parked == 1


def test_take_just_before_the_deadline_succeeds(registry: KvRegistry, clock: FakeClock) -> None:
    entry = registry.park(_buf(8), 1)
    clock.now += LEASE_S - 0.001
    assert registry.expire() == []
    assert registry.take(entry.handle_id) is entry


def test_an_expired_handle_cannot_be_taken(registry: KvRegistry, clock: FakeClock) -> None:
    entry = registry.park(_buf(8), 1)
    clock.now += LEASE_S  # the lease ends exactly now
    assert registry.take(entry.handle_id) is None
    # Still held until swept, and the failed take did not remove it.
    assert registry.num_parked == 1
    assert registry.num_bytes_parked == 8
    assert registry.take(entry.handle_id) is None


def test_expire_returns_each_expired_handle_exactly_once(registry: KvRegistry, clock: FakeClock) -> None:
    old = registry.park(_buf(100), 4)
    clock.now += 4.0
    young = registry.park(_buf(30), 2)

    clock.now += LEASE_S - 4.0  # `old` reaches its deadline, `young` has 4 s left
    assert registry.expire() == [old]
    assert registry.num_parked == 1
    assert registry.num_bytes_parked == 30
    assert registry.expire() == []
    assert registry.take(old.handle_id) is None
    assert registry.release(old.handle_id) is False

    clock.now += 4.0
    assert registry.take(young.handle_id) is None
    assert registry.expire() == [young]
    assert registry.expire() == []
    assert registry.num_parked == 0
    assert registry.num_bytes_parked == 0


def test_expire_returns_every_expired_handle(registry: KvRegistry, clock: FakeClock) -> None:
    entries = [registry.park(_buf(i + 1), i + 1) for i in range(5)]
    assert registry.num_bytes_parked == 15
    clock.now += LEASE_S + 1
    expired = registry.expire()
    assert sorted(e.handle_id for e in expired) == sorted(e.handle_id for e in entries)
    assert len(expired) == 5
    assert registry.num_parked == 0
    assert registry.num_bytes_parked == 0


def test_lease_is_measured_on_the_injected_clock(clock: FakeClock) -> None:
    registry = KvRegistry(0.5, clock=clock)
    entry = registry.park(_buf(8), 1)
    assert entry.expires_at == clock.now + 0.5
    clock.now += 0.5
    assert registry.expire() == [entry]
