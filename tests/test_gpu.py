"""CUDA paths: the engines on a GPU, KV packing on the device, KV read in place over CUDA IPC on
one GPU (and streams continued exactly when a decode of that GPU dies), NCCL pairs and their
failures on two. Skipped without CUDA.

Run them with `scripts/gpu_check.sh` on a machine with a GPU.
"""

from __future__ import annotations

import asyncio
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.kv.channel import PairChannel, TransferError
from pdserve.kv.layout import pack, unpack
from pdserve.kv.rendezvous import connect_store, host_store, pair_prefix
from pdserve.model.engine_model import load_engine_model
from pdserve.v1 import prefill_pb2, prefill_pb2_grpc, sampling_pb2
from tests.conftest import PRESETS, assert_no_leaks
from tests.devices import NEEDS_CUDA
from tests.grpc_client import Stream, generate_many, make_request
from tests.kv_peer import Peer
from tests.stack import Stack, free_port, scrape, wait_for
from tests.test_equivalence import reference_tokens

pytestmark = NEEDS_CUDA


@pytest.mark.parametrize("model_name", PRESETS)
def test_kv_pack_on_device_round_trips(model_name: str, cache_dir: Path) -> None:
    from transformers import DynamicCache

    m = load_engine_model(EngineConfig(model=model_name, device="cuda:0", cache_dir=str(cache_dir)))
    cache = DynamicCache(config=m.model.config)
    ids = torch.randint(0, m.limits.vocab_size, (2, 9), device=m.device)
    with torch.inference_mode():
        m.model(input_ids=ids, cache=cache, use_cache=True)
    layers = [(layer.keys, layer.values) for layer in cache.layers]
    buf = pack(layers, m.kv_layout, row=1, start=2, num_tokens=7, device=m.device)
    assert buf.device == m.device
    for (k, v), (kd, vd) in zip(layers, unpack(buf, m.kv_layout, 7), strict=True):
        assert kd.device == m.device and torch.equal(kd, k[1, :, 2:9])
        assert torch.equal(vd, v[1, :, 2:9])


GPU_PRESETS = (*PRESETS, "tiny-deepseek-moe")
STACK_CASES = [(m, "cuda-ipc") for m in GPU_PRESETS] + [
    (m, t) for m in PRESETS for t in ("gloo", "cpu-decode")
]


@pytest.mark.parametrize(("model_name", "transport"), STACK_CASES)
def test_stack_on_cuda_matches_generate(
    model_name: str, transport: str, cache_dir: Path, tmp_path: Path
) -> None:
    """The three processes on one GPU: the KV read in place over CUDA IPC (what auto takes there),
    or staged through host memory over gloo; and a GPU prefill with a CPU decode, which auto meets
    on gloo. Greedy tokens equal to model.generate in float32."""
    from transformers import AutoModelForCausalLM

    from pdserve.model.source import resolve_model_dir

    backend = {"cuda-ipc": "auto", "gloo": "gloo", "cpu-decode": "auto"}[transport]
    prefill_args = ["--device", "cuda:0", "--dtype", "float32", "--kv-backend", backend]
    decode_args = ["--dtype", "float32"] if transport == "cpu-decode" else prefill_args
    stack = Stack(model_name, cache_dir, tmp_path, prefill_args=prefill_args, decode_args=decode_args).start()
    try:
        model = (
            AutoModelForCausalLM.from_pretrained(resolve_model_dir(model_name, cache_dir)).to("cuda:0").eval()
        )
        prompts = [list(range(3, 3 + n)) for n in (1, 17, 120)]
        results = asyncio.run(
            generate_many(
                stack.address,
                [
                    make_request(prompt_token_ids=p, max_tokens=24, temperature=0.0, ignore_eos=True)
                    for p in prompts
                ],
            )
        )
        for prompt, result in zip(prompts, results, strict=True):
            ids = torch.tensor([prompt], device="cuda:0")
            ref = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
            assert result.token_ids == ref[0, len(prompt) :].tolist()
        used = "gloo" if transport == "cpu-decode" else transport
        pulls = scrape(stack.decodes[0].metrics)
        assert pulls[f"pdserve_kv_transport_pulls_total{{transport={used}}}"] == len(prompts)
        assert_no_leaks(stack)
    finally:
        stack.stop()


MIGRATED_STREAMS, MIGRATED_TOKENS = 8, 300


def test_a_decode_killed_mid_stream_on_cuda_has_its_streams_continued_exactly(
    cache_dir: Path, tmp_path: Path
) -> None:
    """A prefill and two decodes on one GPU, the KV over CUDA IPC, float32. Once every stream has
    tokens, the decode running the most of them is killed -9: the gateway continues each of its
    streams on the other decode (a prefill of the prompt and the tokens already delivered, resumed
    at the same step), so every stream completes, token for token equal to model.generate, and the
    prefill and the surviving decode hold nothing afterwards."""
    from transformers import AutoModelForCausalLM

    from pdserve.model.source import resolve_model_dir

    model_name = "tiny-llama"
    args = ["--device", "cuda:0", "--dtype", "float32", "--kv-backend", "cuda-ipc"]
    stack = Stack(model_name, cache_dir, tmp_path, num_decode=2, prefill_args=args, decode_args=args).start()
    try:
        prompts = [
            torch.randint(3, 200, (4 + 9 * i,), generator=torch.Generator().manual_seed(i)).tolist()
            for i in range(MIGRATED_STREAMS)
        ]
        requests = [
            make_request(prompt_token_ids=p, max_tokens=MIGRATED_TOKENS, temperature=0.0, ignore_eos=True)
            for p in prompts
        ]

        async def scenario() -> tuple[list[Stream], int, float]:
            streams = [Stream(stack.address, r, timeout_s=300) for r in requests]
            deadline = time.monotonic() + 60
            while not all(len(s.tokens) >= 2 for s in streams):
                assert time.monotonic() < deadline, "the streams did not start"
                assert not any(s.task.done() for s in streams), "a stream ended before the kill"
                await asyncio.sleep(0.005)
            running = [scrape(d.metrics)["pdserve_decode_running"] for d in stack.decodes]
            victim = 0 if running[0] >= running[1] else 1
            stack.decodes[victim].signal(signal.SIGKILL)
            await asyncio.wait_for(asyncio.gather(*(s.task for s in streams)), 300)
            return streams, victim, running[victim]

        streams, victim, moved = asyncio.run(scenario())
        assert moved > 0, "the killed decode ran no stream: nothing was migrated"
        model = (
            AutoModelForCausalLM.from_pretrained(resolve_model_dir(model_name, cache_dir)).to("cuda:0").eval()
        )
        for prompt, stream in zip(prompts, streams, strict=True):
            assert stream.error is None, f"a stream failed: {stream.error}"
            ids = torch.tensor([prompt], device="cuda:0")
            ref = model.generate(
                ids, max_new_tokens=MIGRATED_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
            )
            assert stream.tokens == ref[0, len(prompt) :].tolist()
        survivor = stack.decodes[1 - victim]
        stack.decodes = [survivor]  # the leak check reads the services still running
        assert_no_leaks(stack)
    finally:
        stack.stop()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL pairs need two GPUs")
def test_an_nccl_send_nobody_receives_fails_in_bound_and_the_next_generation_works() -> None:
    """A timeout on an NCCL pair fails that transfer only: this process lives on, the group is
    aborted, and a pair of the next generation moves data again."""
    timeout = timedelta(seconds=5)
    store = host_store("127.0.0.1", 0, timeout)
    client = connect_store(f"127.0.0.1:{store.port}", timeout)
    lonely = PairChannel(
        store, pair_prefix("p", "d", 1), 0, "nccl", torch.device("cuda:0"), "127.0.0.1", timeout
    )
    started = time.monotonic()
    with pytest.raises(TransferError):
        lonely.send(torch.ones(1 << 20, dtype=torch.uint8, device="cuda:0")).result(timeout=60)
    assert time.monotonic() - started < 5 + 30, "the send failed past its bound"
    lonely.close()
    prefix = pair_prefix("p", "d", 2)
    sender = PairChannel(store, prefix, 0, "nccl", torch.device("cuda:0"), "127.0.0.1", timeout)
    receiver = PairChannel(client, prefix, 1, "nccl", torch.device("cuda:1"), "127.0.0.1", timeout)
    sent = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8, device="cuda:0")
    got = torch.empty(1 << 20, dtype=torch.uint8, device="cuda:1")
    for future in (sender.send(sent), receiver.recv(got)):
        future.result(timeout=120)
    assert torch.equal(sent.cpu(), got.cpu())
    sender.close()
    receiver.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL pairs need two GPUs")
def test_nccl_pair_moves_device_buffers_in_order() -> None:
    timeout = timedelta(seconds=60)
    store = host_store("127.0.0.1", 0, timeout)
    prefix = pair_prefix("p", "d", 1)
    sender = PairChannel(store, prefix, 0, "nccl", torch.device("cuda:0"), "127.0.0.1", timeout)
    receiver = PairChannel(
        connect_store(f"127.0.0.1:{store.port}", timeout),
        prefix,
        1,
        "nccl",
        torch.device("cuda:1"),
        "127.0.0.1",
        timeout,
    )
    sizes = (1 << 10, 1 << 20, 3 << 20)
    sent = [torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda:0") for n in sizes]
    received = [torch.empty(n, dtype=torch.uint8, device="cuda:1") for n in sizes]
    futures: list[Any] = []
    for s, r in zip(sent, received, strict=True):
        futures += [sender.send(s), receiver.recv(r)]
    for f in futures:
        f.result(timeout=120)
    for s, r in zip(sent, received, strict=True):
        assert torch.equal(s.cpu(), r.cpu())
    sender.close()
    receiver.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the NCCL stack needs two GPUs")
def test_full_stack_over_nccl(cache_dir: Path, tmp_path: Path, reference_models: Any) -> None:
    """Prefill on cuda:0, decode on cuda:1, the KV over an NCCL pair: the tokens themselves equal
    the plain model's, over one pair kept between requests."""
    args = ["--dtype", "float32", "--kv-backend", "nccl"]
    stack = Stack(
        "tiny-llama",
        cache_dir,
        tmp_path,
        prefill_args=["--device", "cuda:0", *args],
        decode_args=["--device", "cuda:1", *args],
    ).start()
    try:
        model, _ = reference_models("tiny-llama")
        prompts = [[5, 6, 7], list(range(3, 90))]
        requests = [
            make_request(prompt_token_ids=p, max_tokens=16, temperature=0.0, ignore_eos=True) for p in prompts
        ]
        results = asyncio.run(generate_many(stack.address, requests))
        for prompt, result in zip(prompts, results, strict=True):
            assert result.token_ids == reference_tokens(model, prompt, 16)
        assert scrape(stack.decodes[0].metrics)["pdserve_kv_transport_pulls_total{transport=nccl}"] == 2
        assert scrape(stack.prefills[0].metrics)["pdserve_kv_pairs"] == 1
        assert_no_leaks(stack)
    finally:
        stack.stop()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the NCCL stack needs two GPUs")
def test_a_decode_killed_during_an_nccl_pull_fails_that_pull_only_and_the_prefill_serves_on(
    cache_dir: Path, tmp_path: Path, reference_models: Any
) -> None:
    """A decode on cuda:1 pulls a KV from the prefill on cuda:0 over NCCL and is killed -9 before
    its receive: the prefill's send fails within the transfer timeout (NCCL's watchdog must not
    take the process down), its pair is torn down, and the same prefill then serves the real
    decode over a pair of its own, tokens equal to the plain model's, nothing left behind."""
    import grpc

    timeout_s = 5.0
    args = ["--dtype", "float32", "--kv-backend", "nccl", "--transfer-timeout-s", str(timeout_s)]
    stack = Stack(
        "tiny-llama",
        cache_dir,
        tmp_path,
        prefill_args=["--device", "cuda:0", *args],
        decode_args=["--device", "cuda:1", *args],
    ).start()
    prefill = stack.prefills[0]
    try:
        prompt = list(range(3, 40))

        async def prefill_call() -> prefill_pb2.PrefillResponse:
            async with grpc.aio.insecure_channel(prefill.grpc) as channel:
                return await prefill_pb2_grpc.PrefillStub(channel).Prefill(
                    prefill_pb2.PrefillRequest(
                        request_id="t",
                        prompt_token_ids=prompt,
                        sampling=sampling_pb2.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                    )
                )

        handle_hex = asyncio.run(prefill_call()).kv_handle.SerializeToString().hex()
        before = scrape(prefill.metrics)
        victim = Peer("decode", "nccl", "cuda:1")
        try:
            assert victim.ask("pull", "decode-a", handle_hex, "1")["ok"]
            assert victim.ask("connect", "decode-a", handle_hex, "1") == {"ok": True}
            killed = time.monotonic()
            victim.kill()
            assert wait_for(
                lambda: scrape(prefill.metrics)["pdserve_kv_sends_in_flight"] == 0, timeout_s + 30
            )
            assert time.monotonic() - killed < timeout_s + 30, "the send failed past its bound"
        finally:
            victim.kill()
        assert prefill.popen is not None and prefill.popen.poll() is None, "the prefill process died"
        after = scrape(prefill.metrics)
        assert after["pdserve_kv_pull_failures_total"] == before["pdserve_kv_pull_failures_total"] + 1
        assert after["pdserve_kv_pairs"] == before["pdserve_kv_pairs"], "the failed pair is torn down"
        model, _ = reference_models("tiny-llama")
        prompts = [[5, 6, 7], prompt]
        requests = [
            make_request(prompt_token_ids=p, max_tokens=8, temperature=0.0, ignore_eos=True) for p in prompts
        ]
        for p, result in zip(prompts, asyncio.run(generate_many(stack.address, requests)), strict=True):
            assert result.token_ids == reference_tokens(model, p, 8)
        assert_no_leaks(stack)
    finally:
        stack.stop()


def test_expert_parallel_path_on_cuda_tensors(cache_dir: Path) -> None:
    """The sharded experts, dispatch and lockstep on CUDA tensors, in a group of one rank (NCCL
    refuses two ranks on one GPU): every buffer on the device, logits equal to the plain model's."""

    import torch.distributed as dist

    from pdserve.expert_parallel.rank_model import ExpertSharding, expert_parallel_model

    config = EngineConfig(
        model="tiny-deepseek-moe", device="cuda:0", dtype="float32", cache_dir=str(cache_dir)
    )
    reference = load_engine_model(config).model
    sharding = ExpertSharding(0, 1)
    m = load_engine_model(config, sharding)
    ids = torch.randint(3, m.limits.vocab_size, (3, 11), device=m.device)
    with torch.inference_mode():
        want = reference(input_ids=ids).logits
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, True, timedelta(seconds=60))
    dist.init_process_group("cpu:gloo,cuda:nccl", store=store, rank=0, world_size=1, device_id=m.device)
    try:
        rank_model = expert_parallel_model(m, sharding)
        rank_model.lockstep.start()
        got = rank_model.engine_model.forward(input_ids=ids).logits
        assert got.device == m.device
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert rank_model.dispatch.stats.calls > 0
        rank_model.lockstep.stop()
        rank_model.lockstep.join(30)
        assert rank_model.lockstep.failure is None
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="an EP group of 2 needs two GPUs")
def test_ep_prefill_group_on_two_gpus(cache_dir: Path, tmp_path: Path) -> None:
    """A prefill of 2 ranks on cuda:0 and cuda:1 (NCCL exchanges, DeepEP when installed) and a CPU
    decode, the KV moving over gloo: greedy tokens equal to the plain model's."""
    from transformers import AutoModelForCausalLM

    from pdserve.model.source import resolve_model_dir

    model_name = "tiny-deepseek-moe"
    args = ["--device", "cuda", "--dtype", "float32", "--ep", "2"]
    stack = Stack(
        model_name, cache_dir, tmp_path, prefill_args=args, decode_args=["--dtype", "float32"]
    ).start()
    try:
        assert len(stack.prefills[0].ready["ranks"]) == 2
        model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(model_name, cache_dir)).eval()
        prompts = [list(range(3, 3 + n)) for n in (1, 17, 60)]
        requests = [
            make_request(prompt_token_ids=p, max_tokens=12, temperature=0.0, ignore_eos=True) for p in prompts
        ]
        results = asyncio.run(generate_many(stack.address, requests))
        for prompt, result in zip(prompts, results, strict=True):
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
            assert result.token_ids == ref[0, len(prompt) :].tolist()
    finally:
        stack.stop()
