"""Shared fixtures: a preset cache per session, one real stack per model, reference models."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.model.source import resolve_model_dir
from tests.stack import Stack, scrape, wait_for

torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PRESETS = ("tiny-llama", "tiny-moe", "tiny-mla-moe")
EOS_PROMPT = [5, 17, 99, 230, 41, 7, 64]


def first_greedy_token(model: Any, prompt: list[int]) -> int:
    with torch.no_grad():
        return int(model(torch.tensor([prompt])).logits[0, -1].argmax())


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pdserve-cache")


class StackPool:
    def __init__(self, cache_dir: Path, log_root: Path) -> None:
        self._cache_dir = cache_dir
        self._log_root = log_root
        self.stacks: dict[str, Stack] = {}

    def get(self, model: str) -> Stack:
        if model not in self.stacks:
            self.stacks[model] = Stack(model, self._cache_dir, self._log_root / model).start()
        return self.stacks[model]

    def stop(self) -> None:
        for stack in self.stacks.values():
            stack.stop()


@pytest.fixture(scope="session")
def stack_pool(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackPool]:
    pool = StackPool(cache_dir, tmp_path_factory.mktemp("stack-logs"))
    yield pool
    pool.stop()


def assert_no_leaks(stack: Stack, timeout_s: float = 15.0) -> None:
    """No parked or lent KV, no transfer in flight, no transfer thread beyond one per open pair,
    nothing running, waiting or borrowed in decode."""

    def clean() -> bool:
        for address in [a for prefill in stack.prefills for a in prefill.rank_metrics]:
            m = scrape(address)
            if m["pdserve_kv_parked_handles"] or m["pdserve_kv_parked_bytes"]:
                return False
            if m.get("pdserve_kv_lent_handles", 0.0):
                return False
            if m["pdserve_kv_sends_in_flight"] or m["pdserve_kv_transfer_threads"] > m["pdserve_kv_pairs"]:
                return False
        for address in [a for decode in stack.decodes for a in decode.rank_metrics]:
            m = scrape(address)
            if (
                m["pdserve_decode_running"]
                or m["pdserve_decode_waiting"]
                or m["pdserve_decode_kv_blocks_used"]
            ):
                return False
            if m.get("pdserve_kv_borrowed_handles", 0.0):
                return False
            if m["pdserve_kv_receives_in_flight"] or m["pdserve_kv_transfer_threads"] > m["pdserve_kv_pairs"]:
                return False
        return True

    assert wait_for(clean, timeout_s), "KV left parked or requests left running after the test"


@pytest.fixture(autouse=True)
def leak_check(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "stack_pool" in request.fixturenames:
        pool: StackPool = request.getfixturevalue("stack_pool")
        for stack in pool.stacks.values():
            assert_no_leaks(stack)


@pytest.fixture(scope="session")
def reference_models(cache_dir: Path) -> Callable[[str], tuple[Any, Any]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import pdserve.model.deepseek_moe.modeling  # noqa: F401  (registers the DeepSeekMoE models)
    from pdserve.model.source import resolve_model_dir

    loaded: dict[str, tuple[Any, Any]] = {}

    def get(model: str) -> tuple[Any, Any]:
        if model not in loaded:
            path = resolve_model_dir(model, cache_dir)
            loaded[model] = (
                AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(),
                AutoTokenizer.from_pretrained(path),
            )
        return loaded[model]

    return get


def eos_model_copy(cache_dir: Path, reference_models: Any, parent: Path) -> tuple[Path, int]:
    """A copy of tiny-llama whose EOS is the greedy first token of EOS_PROMPT, and that token."""
    model, _ = reference_models("tiny-llama")
    eos = first_greedy_token(model, EOS_PROMPT)
    model_dir = parent / "tiny-llama-eos"
    shutil.copytree(resolve_model_dir("tiny-llama", cache_dir), model_dir)
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        data = json.loads(path.read_text())
        data["eos_token_id"] = eos
        path.write_text(json.dumps(data))
    return model_dir, eos


@pytest.fixture(scope="session")
def eos_stack(cache_dir: Path, reference_models: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """tiny-llama with its EOS set to the greedy first token of EOS_PROMPT, and 1 s leases."""
    model_dir, eos = eos_model_copy(cache_dir, reference_models, tmp_path_factory.mktemp("eos-model"))
    stack = Stack(
        str(model_dir), cache_dir, tmp_path_factory.mktemp("eos-logs"), prefill_args=["--lease-s", "1"]
    ).start()
    yield stack, eos
    stack.stop()


@pytest.fixture(scope="session")
def limits_stack(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """tiny-llama with HTTP on, at the default request limits (shared by the input-limit tests)."""
    stack = Stack(
        "tiny-llama", cache_dir, tmp_path_factory.mktemp("limits-logs"), gateway_args=["--http-port", "0"]
    ).start()
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def limits_client(limits_stack: Stack) -> Any:
    """The official `openai` client of ``limits_stack``'s HTTP API."""
    import openai

    assert limits_stack.gateway is not None
    address = limits_stack.gateway.ready["http"]
    return openai.OpenAI(base_url=f"http://{address}/v1", api_key="unused", max_retries=0)
