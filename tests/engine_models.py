"""Engine models the tests load in their own process: eager, since under ``--compile auto`` (the
default) tiny-llama's forwards would compile on first use, shape by shape, with no warm-up. Tests
about compilation build their ``EngineConfig`` themselves."""

from __future__ import annotations

from pathlib import Path

from pdserve.config import EngineConfig
from pdserve.model.engine_model import EngineModel, load_engine_model


def eager_engine_model(model: str, cache_dir: Path, device: str = "cpu") -> EngineModel:
    return load_engine_model(
        EngineConfig(model=model, cache_dir=str(cache_dir), compile="false", device=device)
    )
