"""Checkpoint layout <-> model layout of DeepSeekMoE's routed experts, as a transformers conversion mapping.

DeepSeekMoE checkpoints hold one MLP per routed expert (``mlp.experts.E.{gate,up,down}_proj.weight``, each
``[I, H]`` or ``[H, I]``); the model holds them fused (``mlp.experts.gate_up_proj [E, 2I, H]`` with the gate
rows first, ``mlp.experts.down_proj [E, H, I]``). Registered for ``model_type`` ``deepseek``,
``from_pretrained`` fuses while loading and ``save_pretrained`` writes the per-expert layout back. Every
other tensor (gate, shared experts, attention, norms) has the same name in both.
"""

from __future__ import annotations

from typing import Any

from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

from pdserve.model.deepseek_moe.configuration import DeepseekMoeConfig


def expert_weight_converters() -> list[Any]:
    """The converters that fuse per-expert checkpoint weights into the experts' 3D parameters."""
    return [
        WeightConverter(
            source_patterns=["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"],
            target_patterns="mlp.experts.gate_up_proj",
            operations=[MergeModulelist(dim=0), Concatenate(dim=1)],
        ),
        WeightConverter(
            source_patterns="mlp.experts.*.down_proj.weight",
            target_patterns="mlp.experts.down_proj",
            operations=[MergeModulelist(dim=0)],
        ),
    ]


def register_conversion() -> None:
    """Make ``from_pretrained``/``save_pretrained`` of ``deepseek`` models use the per-expert layout on disk."""
    register_checkpoint_conversion_mapping(
        DeepseekMoeConfig.model_type, expert_weight_converters(), overwrite=True
    )
