"""A model's end-of-sequence token ids, read from its directory (no model code: the gateway reads them too)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from transformers import GenerationConfig


def eos_token_ids(model_dir: Path, config: Any) -> frozenset[int]:
    """EOS ids from generation_config.json when present, else from config.json."""
    ids: set[int] = set()
    sources: list[Any] = [config]
    with contextlib.suppress(OSError):
        sources.insert(0, GenerationConfig.from_pretrained(model_dir))
    for source in sources:
        value = getattr(source, "eos_token_id", None)
        if value is None:
            continue
        ids.update([value] if isinstance(value, int) else value)
        break
    return frozenset(ids)
