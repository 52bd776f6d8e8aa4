"""How a group chooses its dispatch kernels at start-up (``deepep_setup``), with a stand-in ``deep_ep``
module: which causes fall back to the all-to-all, which are start-up errors, when the low-latency
kernels are used, and how ``DispatchChoice`` then picks per tick."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pdserve.expert_parallel.all_to_all_dispatch import AllToAllDispatch
from pdserve.expert_parallel.deepep_dispatch import DeepEpDispatch
from pdserve.expert_parallel.deepep_low_latency_dispatch import DeepEpLowLatencyDispatch
from pdserve.expert_parallel.deepep_setup import (
    FATAL,
    LOW_LATENCY_MAX_TOKENS,
    DeepEpRequest,
    DeepEpSetup,
    DeepEpStartError,
)
from pdserve.expert_parallel.dispatch import Dispatch, ExpertShard
from pdserve.expert_parallel.dispatch_choice import UNKNOWN_TOKENS, DispatchChoice
from tests.deepep_stand_in import INDEX_DTYPE

CUDA = torch.device("cuda:1")


class _Config:
    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return hidden_bytes * num_ranks * 1024


class _StandInDeepEp:
    """A ``deep_ep`` module: ``Buffer`` records how it was made, or raises what it is told to."""

    topk_idx_t = INDEX_DTYPE

    def __init__(
        self, normal_error: Exception | None = None, low_latency_error: Exception | None = None
    ) -> None:
        self.made: list[dict[str, Any]] = []
        module = self

        class Buffer:
            def __init__(
                self, group: Any, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, **kwargs: Any
            ) -> None:
                low_latency = kwargs.get("low_latency_mode", False)
                error = module.low_latency_error if low_latency else module.normal_error
                if error is not None:
                    raise error
                module.made.append({"group": group, "nvl": num_nvl_bytes, "rdma": num_rdma_bytes, **kwargs})

            @staticmethod
            def get_dispatch_config(num_ranks: int) -> _Config:
                assert num_ranks in (2, 4, 8), f"Unsupported number of EP ranks: {num_ranks}"
                return _Config()

            get_combine_config = get_dispatch_config

            @staticmethod
            def get_low_latency_rdma_size_hint(
                tokens: int, hidden: int, num_ranks: int, num_experts: int
            ) -> int:
                return tokens * hidden * num_ranks * num_experts

        self.Buffer = Buffer
        self.normal_error = normal_error
        self.low_latency_error = low_latency_error


def _request(**overrides: Any) -> DeepEpRequest:
    values: dict[str, Any] = {
        "shard": ExpertShard(1, 2, 64),
        "hidden": 2048,
        "top_k": 6,
        "dtype": torch.bfloat16,
        "device": CUDA,
    }
    values.update(overrides)
    return DeepEpRequest(**values)


def _choice() -> DispatchChoice:
    return DispatchChoice(AllToAllDispatch(ExpertShard(1, 2, 64)))


class _Run:
    """One rank's setup, with what it agreed and checked."""

    def __init__(
        self,
        module: Any = None,
        others: int = 0,
        rdma: bool = True,
        check_error: str = "",
        installed: bool = True,
    ) -> None:
        self.module = module if module is not None else _StandInDeepEp()
        self.agreed: list[int] = []
        self.checked: list[tuple[Dispatch, int]] = []
        self.imported = 0
        self._check_error = check_error

        def importer() -> Any:
            self.imported += 1
            if not installed:
                return None
            if isinstance(self.module, Exception):
                raise self.module
            return self.module

        def agree(code: int) -> int:
            self.agreed.append(code)
            return max(code, others)

        def check(dispatch: Dispatch, request: DeepEpRequest) -> None:
            self.checked.append((dispatch, choice_tokens()))
            if self._check_error and self._check_error in type(dispatch).__name__:
                raise RuntimeError("device-side assert triggered")

        self.choice = _choice()

        def choice_tokens() -> int:
            return self.choice.tick_tokens

        self.setup = DeepEpSetup(importer, agree, group="the group", rdma_device=lambda: rdma, check=check)

    def run(self, request: DeepEpRequest) -> str:
        return self.setup.run(request, self.choice)


@pytest.mark.parametrize(
    "overrides",
    [{"mode": "all-to-all"}, {"device": torch.device("cpu")}, {"dtype": torch.float32}],
    ids=["asked", "cpu", "float32"],
)
def test_settings_that_never_use_deepep_do_not_import_it(overrides: dict[str, Any]) -> None:
    run = _Run()
    assert run.run(_request(**overrides)) == "all-to-all"
    assert run.imported == 0 and run.agreed == [], "decided from the settings, the same on every rank"


def test_not_installed_falls_back_to_all_to_all() -> None:
    run = _Run(installed=False)
    assert run.run(_request()) == "all-to-all"
    assert run.agreed == [1]
    assert isinstance(run.choice._pick(), AllToAllDispatch)


def test_a_failing_import_is_a_start_up_error() -> None:
    run = _Run(module=OSError("libnvshmem_host.so.3: cannot open shared object file"))
    with pytest.raises(DeepEpStartError, match="cannot be imported: OSError: libnvshmem_host"):
        run.run(_request())
    assert run.agreed == [FATAL]


def test_a_failure_on_another_rank_stops_this_one_too() -> None:
    run = _Run(others=FATAL)
    with pytest.raises(DeepEpStartError, match="another rank"):
        run.run(_request())


def test_a_group_size_deepep_lacks_uses_the_all_to_all() -> None:
    run = _Run()
    assert run.run(_request(shard=ExpertShard(0, 3, 63))) == "all-to-all"
    assert run.module.made == [] and run.agreed == [0, 1]


def test_gpus_without_nvlink_use_the_all_to_all() -> None:
    error = AssertionError("GPU 0 and GPU 1 are not connected via NVLink")
    run = _Run(module=_StandInDeepEp(normal_error=error))
    assert run.run(_request()) == "all-to-all"
    assert run.checked == []


def test_a_buffer_that_cannot_be_made_is_a_start_up_error() -> None:
    run = _Run(module=_StandInDeepEp(normal_error=RuntimeError("CUDA out of memory")))
    with pytest.raises(DeepEpStartError, match="buffer could not be made: RuntimeError: CUDA out of memory"):
        run.run(_request())


def test_a_failed_round_trip_is_a_start_up_error() -> None:
    run = _Run(check_error="DeepEpDispatch")
    with pytest.raises(DeepEpStartError, match="normal kernels failed their start-up round"):
        run.run(_request())


def test_a_prefill_runs_the_normal_kernels_only() -> None:
    run = _Run()
    assert run.run(_request()) == "deepep"
    (made,) = run.module.made
    assert made["group"] == "the group" and made["nvl"] == 2048 * 2 * 2 * 1024 and made["rdma"] == 0
    (checked,) = run.checked
    assert isinstance(checked[0], DeepEpDispatch) and checked[1] == 2, "the round runs with its tick's size"
    choice = run.choice
    assert choice.tick_tokens == UNKNOWN_TOKENS and choice.worst_tokens(2) == 0
    choice.set_tick_tokens(5000)
    assert isinstance(choice._pick(), DeepEpDispatch) and choice.worst_tokens(2) == 10000


def test_a_decode_adds_the_low_latency_kernels_for_its_steps() -> None:
    run = _Run()
    assert run.run(_request(low_latency_tokens=5)) == "deepep (low-latency up to 8 tokens per rank)"
    _, low_latency = run.module.made
    assert low_latency["low_latency_mode"] is True and low_latency["num_qps_per_rank"] == 32
    assert low_latency["nvl"] == 0 and low_latency["rdma"] == 8 * 2048 * 2 * 64
    assert [type(d).__name__ for d, _ in run.checked] == ["DeepEpDispatch", "DeepEpLowLatencyDispatch"]
    choice = run.choice
    for tokens, kind in [(1, DeepEpLowLatencyDispatch), (8, DeepEpLowLatencyDispatch), (9, DeepEpDispatch)]:
        choice.set_tick_tokens(tokens)
        assert isinstance(choice._pick(), kind), tokens
    choice.set_tick_tokens(UNKNOWN_TOKENS)
    assert isinstance(choice._pick(), DeepEpDispatch)


def test_the_low_latency_buffer_is_capped() -> None:
    run = _Run()
    assert str(LOW_LATENCY_MAX_TOKENS) in run.run(_request(low_latency_tokens=1000))


@pytest.mark.parametrize(
    ("overrides", "rdma", "error"),
    [
        ({"hidden": 64}, True, None),
        ({"top_k": 12}, True, None),
        ({"mode": "deepep-normal"}, True, None),
        ({}, False, None),
        ({}, True, RuntimeError("nvshmem init failed")),
    ],
    ids=["hidden", "top-k", "asked", "no RDMA device", "buffer fails"],
)
def test_decodes_the_low_latency_kernels_cannot_serve_use_the_normal_ones(
    overrides: dict[str, Any], rdma: bool, error: Exception | None
) -> None:
    run = _Run(module=_StandInDeepEp(low_latency_error=error), rdma=rdma)
    assert run.run(_request(low_latency_tokens=64, **overrides)) == "deepep"
    run.choice.set_tick_tokens(1)
    assert isinstance(run.choice._pick(), DeepEpDispatch)


def test_a_failed_low_latency_round_trip_is_a_start_up_error() -> None:
    run = _Run(check_error="LowLatency")
    with pytest.raises(DeepEpStartError, match="low-latency kernels failed their start-up round"):
        run.run(_request(low_latency_tokens=64))


def test_requests_are_checked() -> None:
    with pytest.raises(ValueError, match="mode must be one of"):
        _request(mode="fast")
    with pytest.raises(ValueError, match="low_latency_tokens"):
        _request(low_latency_tokens=-1)
