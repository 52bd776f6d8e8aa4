"""DeepSeekMoE (``model_type`` ``deepseek``).

Importing this package registers its config with transformers: ``AutoConfig.from_pretrained`` reads a
DeepSeekMoE checkpoint's config (all a gateway needs, without torch's model code). Importing
``pdserve.model.deepseek_moe.modeling`` registers the models too: ``AutoModel``/
``AutoModelForCausalLM.from_pretrained`` then load DeepSeekMoE checkpoints (their per-expert weights
fused on load) without remote code.
"""

from __future__ import annotations

from transformers import AutoConfig

from pdserve.model.deepseek_moe.configuration import DeepseekMoeConfig

__all__ = ["DeepseekMoeConfig"]

AutoConfig.register(DeepseekMoeConfig.model_type, DeepseekMoeConfig, exist_ok=True)
