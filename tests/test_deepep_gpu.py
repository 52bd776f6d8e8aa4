"""Expert parallelism on 2 GPUs (2 processes, ``cpu:gloo,cuda:nccl``): skipped without two GPUs.

- the all-to-all dispatch in float32 over NCCL: one MoE layer's output equal bit for bit to the
  one-process eager experts on the whole group's tokens, and the same on a second run;
- DeepEP in bfloat16 (skipped without ``deep_ep``): the start-up checks (``DeepEpSetup``), then a
  DeepSeekMoE of 16B's hidden size and routing (2 layers, random weights) prefilling with the
  normal kernels and decoding with the low-latency ones (when the machine has an RDMA device),
  against the same model in one process: the run repeats bit for bit, and wherever a greedy token
  differs the reference's top-1/top-2 margin there is printed and must be small.

Run with ``scripts/gpu_check.sh`` (or ``pytest -m gpu tests/test_deepep_gpu.py``) on a machine with
2 GPUs; each test prints one JSON line of what it measured.
"""

from __future__ import annotations

import importlib.util
import json
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pdserve.expert_parallel.all_to_all_dispatch import AllToAllDispatch
from pdserve.expert_parallel.deepep_setup import DeepEpRequest, DeepEpSetup
from pdserve.expert_parallel.dispatch import ExpertShard
from pdserve.expert_parallel.experts import ShardedExperts
from pdserve.expert_parallel.rank_model import ExpertSharding
from pdserve.model.deepseek_moe import DeepseekMoeConfig
from pdserve.model.deepseek_moe.modeling import DeepseekMoeExperts, DeepseekMoeForCausalLM
from tests.stack import free_port

SIZE = 2
MARGIN_BOUND = 0.25  # a greedy token may differ from the reference only where its top-2 are this close
PROMPT_LEN, NEW_TOKENS, BATCH = 24, 12, 3

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < SIZE, reason="needs two GPUs"),
    pytest.mark.timeout(300),
]


def _join_group(rank: int, port: int) -> torch.device:
    device = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, SIZE, rank == 0, timedelta(seconds=60))
    dist.init_process_group(
        "cpu:gloo,cuda:nccl",
        store=store,
        rank=rank,
        world_size=SIZE,
        timeout=timedelta(seconds=60),
        device_id=device,
    )
    return device


def _run_ranks(target: Any, *args: Any) -> list[Any]:
    port = free_port()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    processes = [ctx.Process(target=target, args=(r, port, results, *args)) for r in range(SIZE)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(240)
        assert p.exitcode == 0, f"rank process exited with {p.exitcode}"
    return [results.get(timeout=5) for _ in range(SIZE)]


# --- the all-to-all in float32 ---------------------------------------------------------------------

EXPERTS, HIDDEN, TOP_K = 16, 256, 4


def _layer() -> DeepseekMoeExperts:
    config = DeepseekMoeConfig(hidden_size=HIDDEN, moe_intermediate_size=128, n_routed_experts=EXPERTS)
    module = DeepseekMoeExperts(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        module.gate_up_proj.copy_(torch.randn(module.gate_up_proj.shape, generator=generator) * 0.05)
        module.down_proj.copy_(torch.randn(module.down_proj.shape, generator=generator) * 0.05)
    return module


def _layer_inputs(rank: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10 + rank)
    scores = torch.rand((num_tokens, EXPERTS), generator=generator)
    weights, index = torch.topk(scores.softmax(-1), TOP_K)
    return torch.randn((num_tokens, HIDDEN), generator=generator), index, weights


def _all_to_all_rank(rank: int, port: int, results: Any) -> None:
    device = _join_group(rank, port)
    try:
        module = _layer().to(device)
        inputs = [_layer_inputs(r, (53, 37)[r]) for r in range(SIZE)]
        whole = [torch.cat(parts).to(device) for parts in zip(*inputs, strict=True)]
        with torch.no_grad():
            want = module(*whole).split([53, 37])[rank]
            local = ShardedExperts(_Owned(module, rank))
            dispatch = AllToAllDispatch(ExpertShard(rank, SIZE, EXPERTS))
            mine = [t.to(device) for t in inputs[rank]]
            got = [dispatch(local, *mine) for _ in range(2)]
        results.put(
            {
                "rank": rank,
                "equal": bool(torch.equal(got[0], want)),
                "repeat": bool(torch.equal(got[0], got[1])),
                "max_diff": float((got[0] - want).abs().max()),
            }
        )
    finally:
        dist.destroy_process_group()


class _Owned(torch.nn.Module):
    def __init__(self, module: DeepseekMoeExperts, rank: int) -> None:
        super().__init__()
        local = EXPERTS // SIZE
        self.gate_up_proj = module.gate_up_proj.data[rank * local : (rank + 1) * local]
        self.down_proj = module.down_proj.data[rank * local : (rank + 1) * local]
        self.act_fn = module.act_fn

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        out: torch.Tensor = self.act_fn(gate) * up
        return out


def test_all_to_all_in_float32_on_two_gpus_is_exact_and_repeats() -> None:
    got = _run_ranks(_all_to_all_rank)
    print(json.dumps({"test": "all_to_all_float32_ep2", "ranks": got}))
    assert all(r["equal"] and r["repeat"] for r in got), got


# --- DeepEP in bfloat16 ----------------------------------------------------------------------------


def _model_config() -> DeepseekMoeConfig:
    """DeepSeekMoE-16B's hidden size and routing (64 experts, top-6, 2 shared), 2 layers, a small vocabulary."""
    return DeepseekMoeConfig(
        vocab_size=512,
        bos_token_id=0,
        eos_token_id=1,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        intermediate_size=1024,
        num_attention_heads=16,
        dtype="bfloat16",
    )


def _model() -> DeepseekMoeForCausalLM:
    torch.manual_seed(0)
    config = _model_config()
    config._experts_implementation = "eager"
    return DeepseekMoeForCausalLM(config).to(torch.bfloat16).eval()


def _greedy(
    model: Any, prompts: torch.Tensor, before: Any = lambda tokens: None
) -> tuple[list[list[int]], Any]:
    """Prefill then one-token decode steps with a cache; the tokens and each step's last logits."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    ids, steps = prompts, []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            before(ids.numel())
            logits = model(input_ids=ids, cache=cache, use_cache=True).logits[:, -1].float()
            steps.append(logits)
            ids = logits.argmax(-1, keepdim=True)
    tokens = torch.stack([s.argmax(-1) for s in steps], dim=1)
    return tokens.tolist(), torch.stack(steps, dim=1)


def _deepep_rank(rank: int, port: int, results: Any) -> None:
    device = _join_group(rank, port)
    try:
        reference = _model().to(device)
        model = _model()
        sharding = ExpertSharding(rank, SIZE)
        sharding(model)
        model = model.to(device)
        assert sharding.dispatch is not None and sharding.shard is not None
        config = model.config
        kernels = DeepEpSetup().run(
            DeepEpRequest(
                sharding.shard, config.hidden_size, config.num_experts_per_tok, torch.bfloat16, device, 8
            ),
            sharding.dispatch,
        )
        prompts = torch.randint(
            0, config.vocab_size, (BATCH, PROMPT_LEN), generator=torch.Generator().manual_seed(rank)
        )
        prompts = prompts.to(device)
        tick = sharding.dispatch.set_tick_tokens  # both ranks run the same shapes at every step
        got, got_logits = _greedy(model, prompts, tick)
        again, again_logits = _greedy(model, prompts, tick)
        want, want_logits = _greedy(reference, prompts)
        report = []
        for row, (g, w) in enumerate(zip(got, want, strict=True)):
            if g != w:
                i = next(k for k, (a, b) in enumerate(zip(g, w, strict=True)) if a != b)
                top = torch.topk(want_logits[row, i], 2).values
                report.append(
                    {"row": row, "step": i, "margin": float(top[0] - top[1]), "got": g[i], "want": w[i]}
                )
        results.put(
            {
                "rank": rank,
                "kernels": kernels,
                "repeat": bool(torch.equal(got_logits, again_logits)) and got == again,
                "max_logit_diff": float((got_logits - want_logits).abs().max()),
                "divergences": report,
            }
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(importlib.util.find_spec("deep_ep") is None, reason="deep_ep is not installed")
def test_deepep_ep2_in_bfloat16_against_the_one_process_model() -> None:
    got = _run_ranks(_deepep_rank)
    print(json.dumps({"test": "deepep_bfloat16_ep2", "ranks": got}))
    assert all(r["kernels"].startswith("deepep") for r in got), "DeepEP did not pass its start-up checks"
    assert all(r["repeat"] for r in got), "the same inputs gave different outputs"
    for r in got:
        for d in r["divergences"]:
            assert d["margin"] < MARGIN_BOUND, f"rank {r['rank']} diverged where the reference was sure: {d}"
