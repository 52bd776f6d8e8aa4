"""Whether an engine compiles (``--compile auto|true|false``, ``--enforce-eager``), and the fallback
to eager forwards when a compilation fails at the warm-up."""

from __future__ import annotations

import argparse
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.config import EngineConfig, flags
from pdserve.launch.spec import UpConfig
from pdserve.model.compile_choice import choose_compile
from pdserve.model.compiled_forward import (
    INDUCTOR_CACHE_ENV,
    RECOMPILE_LIMIT,
    CompiledForward,
    compile_model,
    stop_compiling,
    use_compile_cache,
    warm_up_or_fall_back,
)


def parse(cls: type, *args: str, env: dict[str, str] | None = None) -> Any:
    parser = argparse.ArgumentParser()
    flags.add_arguments(parser, cls, env=env or {})
    return flags.build(cls, parser.parse_args(list(args)))


def test_compile_flag_values() -> None:
    assert parse(EngineConfig).compile == "auto"
    assert parse(EngineConfig, "--compile").compile == "true"
    assert parse(EngineConfig, "--compile", "false").compile == "false"
    assert parse(EngineConfig, "--compile", "1").compile == "true"
    assert parse(EngineConfig, env={"PDSERVE_COMPILE": "off"}).compile == "false"
    assert parse(EngineConfig, "--compile", env={"PDSERVE_COMPILE": "false"}).compile == "true"
    assert parse(EngineConfig, "--enforce-eager").enforce_eager is True
    assert parse(UpConfig, "--compile").compile == "true"
    with pytest.raises(ValueError, match="compile"):
        EngineConfig(compile="sometimes")
    with pytest.raises(ValueError, match="contradict"):
        EngineConfig(compile="true", enforce_eager=True)
    with pytest.raises(ValueError, match="contradict"):
        UpConfig(compile="true", enforce_eager=True)


@pytest.mark.parametrize(
    ("config", "model_type", "device", "enabled"),
    [
        (EngineConfig(), "llama", "cpu", True),  # the reference Llama: measured faster compiled
        (EngineConfig(enforce_eager=True), "llama", "cpu", False),
        (EngineConfig(compile="false"), "llama", "cpu", False),
        (EngineConfig(), "mixtral", "cpu", False),  # not measured: eager by default
        (EngineConfig(), "deepseek", "cpu", False),
        (EngineConfig(), "llama", "cuda", False),
        (EngineConfig(ep=2), "llama", "cpu", False),
        (EngineConfig(compile="true"), "mixtral", "cuda", True),
        (EngineConfig(compile="true", ep=2), "deepseek", "cpu", True),
    ],
)
def test_where_compile_is_chosen(config: EngineConfig, model_type: str, device: str, enabled: bool) -> None:
    choice = choose_compile(config, model_type, device, num_layers=4)
    assert choice.enabled is enabled and choice.reason


@pytest.mark.parametrize(("num_layers", "enabled"), [(4, True), (8, True), (9, False), (30, False)])
def test_auto_leaves_deep_models_eager(num_layers: int, enabled: bool) -> None:
    """SmolLM2's 30 layers take minutes to compile cold on a small CPU: auto keeps them eager, and
    --compile true still compiles them."""
    assert choose_compile(EngineConfig(), "llama", "cpu", num_layers).enabled is enabled
    assert choose_compile(EngineConfig(compile="true"), "llama", "cpu", num_layers).enabled


def failing_backend(graph: Any, example_inputs: Any) -> Any:
    raise RuntimeError("this compiler lowers nothing")


def test_a_failed_compilation_falls_back_to_eager_forwards() -> None:
    model = torch.nn.Linear(4, 3)
    forward = CompiledForward(model, torch.compile(model, backend=failing_backend))
    x = torch.randn(2, 4)

    def warm_up() -> float:
        forward(input=x)
        return 1.0

    assert warm_up_or_fall_back(forward, warm_up) == 0.0
    assert not forward.active and "this compiler lowers nothing" in forward.fallback_reason
    torch.testing.assert_close(forward(input=x), model(x))


def test_the_warm_up_error_passed_through_is_raised() -> None:
    model = torch.nn.Linear(4, 3)
    forward = CompiledForward(model, model)

    def broken() -> float:
        raise KeyError("the group is gone")

    with pytest.raises(KeyError):
        warm_up_or_fall_back(forward, broken, (KeyError,))
    assert forward.active


def test_compile_cache_goes_under_the_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(INDUCTOR_CACHE_ENV, raising=False)
    assert use_compile_cache(tmp_path) == tmp_path / "torch-compile"
    assert os.environ[INDUCTOR_CACHE_ENV] == str(tmp_path / "torch-compile")
    assert (tmp_path / "torch-compile").is_dir()
    monkeypatch.setenv(INDUCTOR_CACHE_ENV, str(tmp_path / "mine"))
    assert use_compile_cache(tmp_path / "other") == tmp_path / "mine"


def test_compiling_allows_every_shape_class_the_warm_ups_compile() -> None:
    """Dynamo runs a frame eagerly past its recompile limit (8 by default, and a setting of each
    thread): an engine thread calling the forward compiles up to RECOMPILE_LIMIT classes."""
    forward = compile_model(torch.nn.Identity(), torch.device("cpu"))
    seen: list[int] = []

    def engine_thread() -> None:
        assert torch._dynamo.config.recompile_limit == 8
        forward(input=torch.ones(3))
        seen.append(torch._dynamo.config.recompile_limit)

    thread = threading.Thread(target=engine_thread)
    thread.start()
    thread.join()
    assert seen == [RECOMPILE_LIMIT] and RECOMPILE_LIMIT > 8


def test_after_the_warm_ups_a_shape_class_they_missed_runs_eagerly_and_compiles_nothing() -> None:
    """``stop_compiling``: compiled code still serves the classes it was compiled for; a new class
    (here a batch of one, which dynamo specialises) runs eagerly, with the same result, and no frame
    is compiled for it. Without it (``--recompile-in-serving``) the new class compiles."""
    from torch._dynamo.utils import counters

    def frames() -> int:
        return int(counters["frames"]["ok"])

    torch._dynamo.reset()
    module = torch.nn.Linear(4, 3)
    forward = CompiledForward(module, torch.compile(module, dynamic=True, backend="eager"))
    batch = torch.randn(5, 4)
    forward(input=batch)
    compiled = frames()
    try:
        stop_compiling()
        with torch.no_grad():
            assert torch.equal(forward(input=batch), module(batch))  # the compiled class
            one = torch.randn(1, 4)
            assert torch.equal(forward(input=one), module(one))  # a class nobody compiled: eager
        assert frames() == compiled
    finally:
        torch.compiler.set_stance("default")
    forward(input=torch.randn(1, 4))
    assert frames() == compiled + 1  # compiling again: the class of one row compiles now
    torch._dynamo.reset()


def test_recompile_in_serving_is_an_engine_and_up_flag() -> None:
    assert parse(EngineConfig, "--model", "m").recompile_in_serving is False
    assert parse(EngineConfig, "--model", "m", "--recompile-in-serving").recompile_in_serving is True
    assert parse(UpConfig, "--recompile-in-serving").recompile_in_serving is True
