"""The sampling defaults of a model's ``generation_config.json``, as vLLM's ``--generation-config``.

vLLM's default, ``auto``, reads the model's generation config and takes the values it sets
explicitly (those that differ from transformers' own defaults) for ``temperature``, ``top_p``,
``top_k``, ``repetition_penalty`` and ``min_p``: a request that omits one of these gets the model's
value. ``vllm`` ignores the file; a directory reads that directory's file instead. A model without
the file has pdserve's defaults (those of ``SamplingParams``).
"""

from __future__ import annotations

import dataclasses
import logging
import os

from transformers import GenerationConfig

from pdserve.core.sampling import SamplingParams

logger = logging.getLogger(__name__)

FIELDS = ("temperature", "top_p", "top_k", "repetition_penalty", "min_p")


def generation_defaults(source: str, model_dir: str) -> SamplingParams:
    """The defaults ``--generation-config source`` gives the model in ``model_dir`` (ValueError
    when the file holds a value out of range, naming it)."""
    if source == "vllm":
        return SamplingParams()
    directory = model_dir if source == "auto" else source
    if not os.path.isfile(os.path.join(directory, "generation_config.json")):
        if source != "auto":
            raise ValueError(f"generation_config: {directory} has no generation_config.json")
        return SamplingParams()
    config = GenerationConfig.from_pretrained(directory)
    diff = config.to_diff_dict()
    values = {name: diff[name] for name in FIELDS if diff.get(name) is not None}
    if values.get("top_k") == -1:  # vLLM's "off"
        values["top_k"] = 0
    try:
        defaults = dataclasses.replace(SamplingParams(), **values)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"generation_config.json of {directory}: {exc}") from None
    if values:
        logger.info("sampling defaults from %s/generation_config.json: %s", directory, values)
    return defaults
