"""NCCL fails like gloo: the error handling is set before any group, and a pair's group is aborted or
shut down by its channel, never left to the watchdog or the garbage collector (no GPU needed)."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import pytest
import torch

from pdserve.core.nccl import CLEAN_UP_ONLY, ERROR_HANDLING_ENV, configure_error_handling
from pdserve.kv.channel import ChannelState, PairChannel, TransferError
from pdserve.rpc.server import run_service

CPU = torch.device("cpu")


@pytest.mark.parametrize(("before", "after"), [(None, "2"), ("3", "2"), ("1", "2"), ("0", "0"), ("2", "2")])
def test_error_handling_never_ends_the_process(before: str | None, after: str) -> None:
    environ = {} if before is None else {ERROR_HANDLING_ENV: before}
    assert configure_error_handling(environ) == after
    assert environ[ERROR_HANDLING_ENV] == after


def test_every_service_process_sets_it_before_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ERROR_HANDLING_ENV, "3")
    seen: list[str | None] = []

    async def main() -> None:
        seen.append(os.environ.get(ERROR_HANDLING_ENV))

    run_service(main)
    assert seen == [CLEAN_UP_ONLY]


class _Work:
    def __init__(self, ok: bool) -> None:
        self._ok = ok

    def wait(self, timeout: timedelta) -> bool:
        if not self._ok:
            raise RuntimeError("NCCL communicator was aborted")
        return True


class _Group:
    """Stands in for a ProcessGroupNCCL: records how it was ended."""

    def __init__(self, ok: bool) -> None:
        self.ok = ok
        self.ended: list[str] = []

    def send(self, tensors: Any, peer: int, tag: int) -> _Work:
        return _Work(self.ok)

    recv = send

    def abort(self) -> None:
        self.ended.append("abort")

    def shutdown(self) -> None:
        self.ended.append("shutdown")


def _channel(group: _Group) -> PairChannel:
    return PairChannel(
        None, "p/", 0, "gloo", CPU, "127.0.0.1", timedelta(seconds=1), build_group=lambda: group
    )  # type: ignore[arg-type]


def test_a_failed_transfer_aborts_the_group_before_it_reports() -> None:
    group = _Group(ok=False)
    channel = _channel(group)
    with pytest.raises(TransferError):
        channel.send(torch.zeros(8, dtype=torch.uint8)).result(10)
    assert group.ended == ["abort"]
    assert channel.state is ChannelState.BROKEN
    channel.close()
    assert group.ended == ["abort"]


def test_a_closed_channel_shuts_its_group_down() -> None:
    group = _Group(ok=True)
    channel = _channel(group)
    channel.send(torch.zeros(8, dtype=torch.uint8)).result(10)
    channel.close()
    channel._executor.shutdown(wait=True)
    assert group.ended == ["shutdown"]
