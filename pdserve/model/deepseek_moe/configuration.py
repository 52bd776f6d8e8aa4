"""The configuration of DeepSeekMoE checkpoints (``model_type`` ``deepseek``).

Field names and meanings are those of the checkpoints' ``config.json``; the defaults are the shapes of
DeepSeekMoE-16B. Layer ``i`` is a MoE layer when the model has routed experts, ``i >= first_k_dense_replace``
and ``i % moe_layer_freq == 0``; every other layer has a dense MLP of ``intermediate_size``. A MoE layer
scores the routed experts with a softmax over the gate's logits, keeps the ``num_experts_per_tok`` best,
renormalizes their weights to sum to one only when ``norm_topk_prob`` is set, scales them by
``routed_scaling_factor`` (absent from DeepSeekMoE checkpoints, so 1.0), and adds ``n_shared_experts``
always-active experts, run as one MLP of ``n_shared_experts * moe_intermediate_size``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters

SCORING_FUNCTIONS = ("softmax",)


@strict
class DeepseekMoeConfig(PreTrainedConfig):
    model_type = "deepseek"
    attribute_map: ClassVar[dict[str, str]] = {"num_experts": "n_routed_experts"}
    base_model_pp_plan: ClassVar[dict[str, Any]] = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    vocab_size: int = 102400
    hidden_size: int = 2048
    intermediate_size: int = 10944
    moe_intermediate_size: int = 1408
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int | None = None
    n_shared_experts: int | None = 2
    n_routed_experts: int | None = 64
    num_experts_per_tok: int | None = 6
    moe_layer_freq: int = 1
    first_k_dense_replace: int = 1
    norm_topk_prob: bool = False
    scoring_func: str = "softmax"
    routed_scaling_factor: float = 1.0
    aux_loss_alpha: float = 0.001
    seq_aux: bool = True
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 100000
    eos_token_id: int | list[int] | None = 100001
    pretraining_tp: int | None = 1
    tie_word_embeddings: bool = False
    rope_parameters: RopeParameters | dict | None = None
    attention_bias: bool = False
    attention_dropout: int | float | None = 0.0
    head_dim: int | None = None
    output_router_logits: bool = False

    def __post_init__(self, **kwargs: Any) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        super().__post_init__(**kwargs)

    def validate_architecture(self) -> None:
        """Part of the ``@strict`` validation: the shapes and routing settings must make a model."""
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) is not a multiple of num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.num_key_value_heads is not None and self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of num_key_value_heads "
                f"({self.num_key_value_heads})"
            )
        if self.scoring_func not in SCORING_FUNCTIONS:
            raise ValueError(
                f"scoring_func {self.scoring_func!r} is not supported; expected one of {SCORING_FUNCTIONS}"
            )
        if self.moe_layer_freq < 1:
            raise ValueError(f"moe_layer_freq must be >= 1, got {self.moe_layer_freq}")
        if self.first_k_dense_replace < 0:
            raise ValueError(f"first_k_dense_replace must be >= 0, got {self.first_k_dense_replace}")
        if self.n_routed_experts is not None:
            if self.n_routed_experts < 1:
                raise ValueError(f"n_routed_experts must be >= 1 or null, got {self.n_routed_experts}")
            top_k = self.num_experts_per_tok
            if top_k is None or not 1 <= top_k <= self.n_routed_experts:
                raise ValueError(
                    f"num_experts_per_tok must be in [1, n_routed_experts={self.n_routed_experts}], got {top_k}"
                )
        if self.n_shared_experts is not None and self.n_shared_experts < 0:
            raise ValueError(f"n_shared_experts must be >= 0 or null, got {self.n_shared_experts}")

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer ``layer_idx`` routes over experts (else it has a dense MLP)."""
        return (
            self.n_routed_experts is not None
            and layer_idx >= self.first_k_dense_replace
            and layer_idx % self.moe_layer_freq == 0
        )

    @property
    def shared_intermediate_size(self) -> int:
        """Width of the fused shared-experts MLP (0 when the model has none)."""
        return self.moe_intermediate_size * (self.n_shared_experts or 0)
