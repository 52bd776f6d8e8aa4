"""DeepEP checked and set up right after an expert-parallel group forms, before the service is ready.

Each step ends with the ranks agreeing (a max over the group, on its CPU side) so that they all run
the same kernels or all stop. What each cause leads to:

| cause                                                                  | outcome                    |
|------------------------------------------------------------------------|----------------------------|
| ``--ep-dispatch all-to-all``, a CPU device, weights not in bfloat16    | all-to-all                 |
| ``deep_ep`` not installed                                              | all-to-all, logged         |
| ``--ep`` not 2, 4 or 8 (DeepEP's intranode kernels), rows not 16-byte  | all-to-all, warning        |
| aligned, more than 1024 local experts                                  |                            |
| GPUs not all connected by NVLink (DeepEP's check in ``Buffer()``)      | all-to-all, warning        |
| ``deep_ep`` installed but its import fails                             | ``DeepEpStartError``       |
| its buffer cannot be made otherwise, or the normal kernels' start-up   | ``DeepEpStartError``       |
| round trip (``deepep_round_trip``) fails                               |                            |
| low-latency kernels not asked for (a prefill, ``deepep-normal``), a    | normal kernels only, logged|
| hidden size or top-k they lack, no RDMA device (NVSHMEM's IBGDA)       |                            |
| their buffer cannot be made                                            | normal kernels only, warning|
| their round trip fails (the CUDA context may be lost)                  | ``DeepEpStartError``       |

``DeepEpStartError`` is a start-up error: the service exits 2 with its message, before it reports
ready, and its supervisor does not restart it. A broken install or a kernel that fails is a
deployment to fix; a topology or a size DeepEP does not serve is served by the all-to-all instead.
The limits are those of the commit the Dockerfile pins (``DEEPEP_REF``): ``csrc/kernels/launch.cuh``
(``SWITCH_RANKS``: 2, 4, 8; ``SWITCH_HIDDEN``), ``csrc/kernels/internode_ll.cu`` (top-k <= 11),
``csrc/deep_ep.cpp`` (16-byte rows, ``NUM_MAX_LOCAL_EXPERTS`` 1024).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pdserve.config.services import EP_DISPATCHES
from pdserve.expert_parallel.deepep_dispatch import DeepEpDispatch
from pdserve.expert_parallel.deepep_low_latency_dispatch import DeepEpLowLatencyDispatch
from pdserve.expert_parallel.deepep_round_trip import round_trip
from pdserve.expert_parallel.dispatch import Dispatch, ExpertShard
from pdserve.expert_parallel.dispatch_choice import UNKNOWN_TOKENS, DispatchChoice

logger = logging.getLogger(__name__)

INTRANODE_SIZES = (2, 4, 8)
MAX_LOCAL_EXPERTS = 1024
LOW_LATENCY_HIDDEN = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)
LOW_LATENCY_MAX_TOP_K = 11
# Upstream suggests keeping the low-latency batch near 256 per rank; its hard bound is 511 (buffer.py:
# NVSHMEM_QP_DEPTH 1024 >= (tokens + 1) * 2). The size times it must be a multiple of 4 (TMA).
LOW_LATENCY_MAX_TOKENS = 256
RDMA_DEVICES = Path("/sys/class/infiniband")

USE, FALL_BACK, FATAL = 0, 1, 2


class DeepEpStartError(RuntimeError):
    """DeepEP is installed but cannot serve this group: a start-up error (exit 2)."""


@dataclass(frozen=True)
class DeepEpRequest:
    """What a group asks of DeepEP."""

    shard: ExpertShard
    hidden: int
    top_k: int
    dtype: torch.dtype
    device: torch.device
    low_latency_tokens: int = 0  # the most tokens a decode step runs per rank; 0: no low-latency kernels
    mode: str = "auto"

    def __post_init__(self) -> None:
        if self.mode not in EP_DISPATCHES:
            raise ValueError(f"mode must be one of {EP_DISPATCHES}, got {self.mode!r}")
        if self.low_latency_tokens < 0:
            raise ValueError(f"low_latency_tokens must be >= 0, got {self.low_latency_tokens}")


def import_deep_ep() -> Any | None:
    """The ``deep_ep`` module, or None when it is not installed (a failing import raises)."""
    if importlib.util.find_spec("deep_ep") is None:
        return None
    return importlib.import_module("deep_ep")


def agree_on_max(code: int) -> int:
    """The largest ``code`` of all ranks (gloo, on the default group's CPU side)."""
    value = torch.tensor([code], dtype=torch.int64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value[0])


def has_rdma_device() -> bool:
    return RDMA_DEVICES.is_dir() and any(RDMA_DEVICES.iterdir())


def low_latency_tokens(wanted: int) -> int:
    """The low-latency buffer's tokens per rank for decode steps of at most ``wanted`` tokens."""
    return min(-(-wanted // 4) * 4, LOW_LATENCY_MAX_TOKENS)


def unsupported(request: DeepEpRequest) -> str | None:
    """Why DeepEP's normal kernels cannot serve ``request`` (None when they can)."""
    shard = request.shard
    if shard.size not in INTRANODE_SIZES:
        return f"DeepEP's intranode kernels serve {INTRANODE_SIZES} ranks, not {shard.size}"
    if request.hidden * 2 % 16:
        return f"DeepEP needs 16-byte rows; hidden size {request.hidden} in bfloat16 is not"
    if shard.num_local > MAX_LOCAL_EXPERTS:
        return f"DeepEP serves at most {MAX_LOCAL_EXPERTS} experts per rank, not {shard.num_local}"
    return None


class DeepEpSetup:
    """Chooses a group's dispatch kernels (``run``); every rank calls it at the same time."""

    def __init__(
        self,
        importer: Callable[[], Any | None] = import_deep_ep,
        agree: Callable[[int], int] = agree_on_max,
        group: Any = None,
        rdma_device: Callable[[], bool] = has_rdma_device,
        check: Callable[[Dispatch, DeepEpRequest], None] | None = None,
    ) -> None:
        self._import = importer
        self._agree = agree
        self._group = group
        self._rdma_device = rdma_device
        self._check = check or (
            lambda d, r: round_trip(d, r.shard, r.top_k, r.hidden, r.device, num_tokens=2)
        )

    def run(self, request: DeepEpRequest, choice: DispatchChoice) -> str:
        """Hands DeepEP's dispatches to ``choice`` when they passed; what the group runs, in words."""
        why_not = self._why_not(request)
        if why_not is not None:
            logger.info("expert-parallel dispatch: all-to-all (%s)", why_not)
            return "all-to-all"
        module = self._settle("import deep_ep", self._import_module, request)
        if module is None:
            return "all-to-all"
        buffer = self._settle("make DeepEP's buffer", lambda: self._normal_buffer(module, request), request)
        if buffer is None:
            return "all-to-all"
        index_dtype: torch.dtype = module.topk_idx_t
        normal = DeepEpDispatch(
            request.shard, buffer, index_dtype, lambda: choice.worst_tokens(request.shard.size), choice.stats
        )
        self._settle_check("DeepEP's normal kernels", normal, request, choice)
        low_latency = self._low_latency(module, request, index_dtype, choice)
        tokens = low_latency.max_tokens if low_latency is not None else 0
        choice.use(normal, low_latency, tokens)
        kernels = "deepep" + (f" (low-latency up to {tokens} tokens per rank)" if low_latency else "")
        logger.info("expert-parallel dispatch: %s", kernels)
        return kernels

    def _why_not(self, request: DeepEpRequest) -> str | None:
        if request.mode == "all-to-all":
            return "--ep-dispatch all-to-all"
        if request.device.type != "cuda":
            return f"DeepEP runs on CUDA, not {request.device}"
        if request.dtype != torch.bfloat16:
            return f"DeepEP's kernels move bfloat16, the weights are {request.dtype}"
        return None

    def _import_module(self) -> tuple[int, Any, str]:
        try:
            module = self._import()
        except Exception as exc:
            return FATAL, None, f"deep_ep is installed but cannot be imported: {type(exc).__name__}: {exc}"
        if module is None:
            return FALL_BACK, None, "deep_ep is not installed"
        return USE, module, ""

    def _normal_buffer(self, module: Any, request: DeepEpRequest) -> tuple[int, Any, str]:
        why = unsupported(request)
        if why is not None:
            return FALL_BACK, None, why
        size = request.shard.size
        buffer_cls = module.Buffer
        try:
            configs = (buffer_cls.get_dispatch_config(size), buffer_cls.get_combine_config(size))
            num_nvl_bytes = max(c.get_nvl_buffer_size_hint(request.hidden * 2, size) for c in configs)
            return USE, buffer_cls(self._group_or_world(), num_nvl_bytes, 0), ""
        except AssertionError as exc:
            if "nvlink" in str(exc).lower() or "pcie" in str(exc).lower():
                return FALL_BACK, None, f"DeepEP's topology check failed: {exc}"
            return FATAL, None, f"DeepEP's buffer could not be made: AssertionError: {exc}"
        except Exception as exc:
            return FATAL, None, f"DeepEP's buffer could not be made: {type(exc).__name__}: {exc}"

    def _low_latency(
        self, module: Any, request: DeepEpRequest, index_dtype: torch.dtype, choice: DispatchChoice
    ) -> DeepEpLowLatencyDispatch | None:
        why_not = self._low_latency_why_not(request)
        if why_not is not None:
            logger.info("DeepEP's low-latency kernels not used: %s", why_not)
            return None
        tokens = low_latency_tokens(request.low_latency_tokens)
        shard = request.shard
        code, buffer, why = self._low_latency_buffer(module, request, tokens)
        agreed = self._agree_or_fail(
            code, why or "another rank could not make it", "DeepEP's low-latency buffer"
        )
        if agreed != USE:
            logger.warning(
                "DeepEP's low-latency kernels not used: %s", why or "another rank could not make them"
            )
            return None
        dispatch = DeepEpLowLatencyDispatch(shard, buffer, index_dtype, tokens, choice.stats)
        self._settle_check("DeepEP's low-latency kernels", dispatch, request, choice)
        return dispatch

    def _low_latency_why_not(self, request: DeepEpRequest) -> str | None:
        if request.mode != "auto" or not request.low_latency_tokens:
            return "not asked for (a prefill service, or --ep-dispatch deepep-normal)"
        if request.hidden not in LOW_LATENCY_HIDDEN:
            return f"hidden size {request.hidden} is not one of {LOW_LATENCY_HIDDEN}"
        if request.top_k > LOW_LATENCY_MAX_TOP_K:
            return f"top-{request.top_k} routing is more than their {LOW_LATENCY_MAX_TOP_K}"
        if not self._rdma_device():
            return f"no RDMA device under {RDMA_DEVICES} (they need NVSHMEM's IBGDA transport)"
        return None

    def _low_latency_buffer(self, module: Any, request: DeepEpRequest, tokens: int) -> tuple[int, Any, str]:
        shard = request.shard
        buffer_cls = module.Buffer
        try:
            num_rdma_bytes = buffer_cls.get_low_latency_rdma_size_hint(
                tokens, request.hidden, shard.size, shard.num_experts
            )
            buffer = buffer_cls(
                self._group_or_world(),
                0,
                num_rdma_bytes,
                low_latency_mode=True,
                num_qps_per_rank=shard.num_local,  # the number of local experts, as upstream asks
            )
        except Exception as exc:
            return FALL_BACK, None, f"{type(exc).__name__}: {exc}"
        return USE, buffer, ""

    def _settle(
        self, step: str, attempt: Callable[[], tuple[int, Any, str]], request: DeepEpRequest
    ) -> Any | None:
        """Runs one step on this rank, then agrees with the others: its result, or None to fall back."""
        code, value, why = attempt()
        agreed = self._agree_or_fail(code, why or f"another rank could not {step}", step)
        if agreed == FALL_BACK:
            logger.warning(
                "expert-parallel dispatch: all-to-all (%s)", why or f"another rank could not {step}"
            )
            return None
        return value

    def _settle_check(
        self, what: str, dispatch: Dispatch, request: DeepEpRequest, choice: DispatchChoice
    ) -> None:
        choice.set_tick_tokens(2)
        try:
            self._check(dispatch, request)
            code, why = USE, ""
        except Exception as exc:
            code, why = FATAL, f"{what} failed their start-up round: {type(exc).__name__}: {exc}"
        finally:
            choice.set_tick_tokens(UNKNOWN_TOKENS)
        self._agree_or_fail(code, why or f"{what} failed their start-up round on another rank", what)

    def _agree_or_fail(self, code: int, why: str, step: str) -> int:
        try:
            agreed = self._agree(code)
        except Exception as exc:
            raise DeepEpStartError(f"{step}: the ranks could not agree ({exc}); {why}") from exc
        if agreed not in (USE, FALL_BACK):
            raise DeepEpStartError(why if code == FATAL else f"{step}: {why}")
        return agreed

    def _group_or_world(self) -> Any:
        return self._group if self._group is not None else dist.group.WORLD
