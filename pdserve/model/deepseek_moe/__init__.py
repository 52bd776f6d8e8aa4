"""DeepSeekMoE (``model_type`` ``deepseek``): importing this package registers it with transformers.

After the import, ``AutoConfig``/``AutoModel``/``AutoModelForCausalLM.from_pretrained`` load DeepSeekMoE
checkpoints (their per-expert weights fused on load) without remote code.
"""

from __future__ import annotations

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from pdserve.model.deepseek_moe.configuration import DeepseekMoeConfig
from pdserve.model.deepseek_moe.conversion import register_conversion
from pdserve.model.deepseek_moe.modeling import DeepseekMoeForCausalLM, DeepseekMoeModel

__all__ = ["DeepseekMoeConfig", "DeepseekMoeForCausalLM", "DeepseekMoeModel"]

AutoConfig.register(DeepseekMoeConfig.model_type, DeepseekMoeConfig, exist_ok=True)
AutoModel.register(DeepseekMoeConfig, DeepseekMoeModel, exist_ok=True)
AutoModelForCausalLM.register(DeepseekMoeConfig, DeepseekMoeForCausalLM, exist_ok=True)
register_conversion()
