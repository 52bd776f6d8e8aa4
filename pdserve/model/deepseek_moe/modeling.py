"""DeepSeekMoE as a transformers causal LM: Llama attention, RoPE and RMSNorm, DeepSeekMoE's MoE MLP.

The routed experts use the fused layout of transformers' MoE models (``gate_up_proj [E, 2I, H]``,
``down_proj [E, H, I]``, called as ``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])``)
behind the experts interface, so ``model.set_experts_implementation(name)`` chooses how they run:
``eager`` (the loop below), ``batched_mm``, ``grouped_mm`` or any function registered in
``transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS``. Checkpoints store one module per expert;
``conversion.py`` fuses them at load time and splits them again on save.

Importing this module registers the models with ``AutoModel`` and ``AutoModelForCausalLM``, and the
checkpoint conversion.
"""

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModel, AutoModelForCausalLM, GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.integrations import use_experts_implementation
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRMSNorm, LlamaRotaryEmbedding
from transformers.utils import can_return_tuple
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from pdserve.model.deepseek_moe.configuration import DeepseekMoeConfig
from pdserve.model.deepseek_moe.conversion import register_conversion


class DeepseekMoeMLP(nn.Module):
    """SwiGLU MLP: the dense layers' MLP and the fused shared experts."""

    def __init__(self, config: DeepseekMoeConfig, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DeepseekMoeGate(nn.Module):
    """Softmax scores over the routed experts; the top-k of them, optionally renormalized, then scaled.

    Scores are computed in float32 whatever the model's dtype, so routing does not flip on rounding.
    """

    def __init__(self, config: DeepseekMoeConfig) -> None:
        super().__init__()
        if config.n_routed_experts is None or config.num_experts_per_tok is None:
            raise ValueError("a MoE layer needs n_routed_experts and num_experts_per_tok")
        self.num_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size))

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``hidden_states [T, H]`` -> router logits ``[T, E]``, top-k weights and expert ids ``[T, k]``."""
        logits = F.linear(hidden_states.float(), self.weight.float())
        scores = logits.softmax(dim=-1)
        top_weights, top_index = torch.topk(scores, self.top_k, dim=-1)
        if self.norm_topk_prob and self.top_k > 1:
            top_weights = top_weights / (top_weights.sum(dim=-1, keepdim=True) + 1e-20)
        top_weights = top_weights * self.routed_scaling_factor
        return logits, top_weights.to(hidden_states.dtype), top_index


@use_experts_implementation
class DeepseekMoeExperts(nn.Module):
    """The routed experts as two 3D weights; ``forward`` is the ``eager`` implementation."""

    def __init__(self, config: DeepseekMoeConfig) -> None:
        super().__init__()
        if config.n_routed_experts is None:
            raise ValueError("experts need n_routed_experts")
        self.num_experts = config.n_routed_experts
        self.hidden_dim = config.hidden_size
        self.intermediate_dim = config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(
            torch.empty(self.num_experts, 2 * self.intermediate_dim, self.hidden_dim)
        )
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim, self.intermediate_dim))
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """Each expert runs once over the tokens that picked it; ids ``>= num_experts`` are skipped."""
        top_k = top_k_index.shape[-1]
        expert_ids = top_k_index.reshape(-1)
        order = torch.argsort(expert_ids, stable=True)
        tokens_in_order = order // top_k
        weights_in_order = top_k_weights.reshape(-1)[order]
        counts = torch.bincount(expert_ids, minlength=self.num_experts)[: self.num_experts].tolist()
        out = torch.zeros_like(hidden_states)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = slice(start, start + count)
            start += count
            tokens = tokens_in_order[rows]
            gate, up = F.linear(hidden_states[tokens], self.gate_up_proj[expert]).chunk(2, dim=-1)
            routed = F.linear(self.act_fn(gate) * up, self.down_proj[expert]) * weights_in_order[rows, None]
            out.index_add_(0, tokens, routed.to(out.dtype))
        return out


class DeepseekMoeSparseBlock(nn.Module):
    """Routed experts chosen by the gate, plus the shared experts every token goes through."""

    def __init__(self, config: DeepseekMoeConfig) -> None:
        super().__init__()
        self.gate = DeepseekMoeGate(config)
        self.experts = DeepseekMoeExperts(config)
        shared = config.shared_intermediate_size
        self.shared_experts = DeepseekMoeMLP(config, shared) if shared else None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        flat = hidden_states.reshape(-1, shape[-1])
        _, top_k_weights, top_k_index = self.gate(flat)
        out = self.experts(flat, top_k_index, top_k_weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(shape)


class DeepseekMoeDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: DeepseekMoeConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config=config, layer_idx=layer_idx)
        self.mlp: nn.Module = (
            DeepseekMoeSparseBlock(config)
            if config.is_moe_layer(layer_idx)
            else DeepseekMoeMLP(config, config.intermediate_size)
        )
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        attn_out, _ = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states),
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states = hidden_states + attn_out
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class DeepseekMoePreTrainedModel(PreTrainedModel):
    config_class = DeepseekMoeConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DeepseekMoeDecoderLayer"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_record_outputs = {
        "router_logits": OutputRecorder(DeepseekMoeGate, index=0),
        "hidden_states": DeepseekMoeDecoderLayer,
        "attentions": LlamaAttention,
    }

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, DeepseekMoeExperts):
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)
        elif isinstance(module, DeepseekMoeGate):
            init.normal_(module.weight, mean=0.0, std=std)


class DeepseekMoeModel(DeepseekMoePreTrainedModel):
    def __init__(self, config: DeepseekMoeConfig) -> None:
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [DeepseekMoeDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> MoeModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is None:
            seen = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + seen)[None]
        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=position_ids,
        )
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        for layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states = layer(
                hidden_states,
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                **kwargs,
            )
        return MoeModelOutputWithPast(last_hidden_state=self.norm(hidden_states), cache=cache)


class DeepseekMoeForCausalLM(DeepseekMoePreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: DeepseekMoeConfig) -> None:
        super().__init__(config)
        self.model = DeepseekMoeModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_router_logits: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Any,
    ) -> MoeCausalLMOutputWithPast:
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_router_logits=output_router_logits,
            **kwargs,
        )
        logits = self.lm_head(slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep))
        loss = None
        if labels is not None:
            loss = self.loss_function(
                logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs
            )
        return MoeCausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits,
        )


AutoModel.register(DeepseekMoeConfig, DeepseekMoeModel, exist_ok=True)
AutoModelForCausalLM.register(DeepseekMoeConfig, DeepseekMoeForCausalLM, exist_ok=True)
register_conversion()
