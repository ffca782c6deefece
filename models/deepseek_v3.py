"""DeepSeek-V3 (DeepSeek-AI, 2024; DeepSeek-R1 and Kimi K2 share it): multi-head latent attention
and a Mixture of Experts with shared experts, on a pre-norm RMSNorm decoder.

    ids -> embed_tokens -> L × [x + mla(rmsnorm(x)); x + ffn(rmsnorm(x))] -> norm -> lm_head -> logits
    mla: q through a normalised low-rank latent (q_lora_rank), k and v through one normalised kv
         latent (kv_lora_rank) plus one rotary key for all heads (qk_rope_head_dim, yarn-scaled;
         softmax scale × yarn's mscale²): `layers.LatentAttention`
    ffn: a SwiGLU MLP (intermediate_size) in the first `first_k_dense_replace` layers; after them an
         MoE: sigmoid router, experts chosen by score + e_score_correction_bias within the topk_group
         best of n_group groups, weights normalised × routed_scaling_factor, k of n_routed_experts
         SwiGLU experts (moe_intermediate_size) + n_shared_experts as one shared SwiGLU MLP

Hugging Face's `DeepseekV3Config` describes it; weights load from and save to its checkpoints
(one tensor per expert, `hf_maps/llama.py`); the multi-token-prediction layers after the last
one (``num_nextn_predict_layers``) are skipped as transformers skips them. transformers' DeepSeek-V3
computes no auxiliary loss, and neither does this; the auxiliary-loss-free balancing moves the
correction bias after each step (`layers.Router.update_correction_bias`, `train.expert_bias_update_rate`). Kimi K2 directories
(``model_type: kimi_k2``) load as DeepSeek-V3.
"""

from __future__ import annotations

from dataclasses import replace

import transformers

from libai_zoo.layers import LatentAttentionSpec, LayerSpec, MoESpec, yarn_mscale

from .config_reading import refuse_quantized, rope_settings
from .decoder import DecoderForCausalLM, DecoderModel, DecoderNames, DecoderSpec
from .hf_maps.llama import llama_weight_map
from .llama import llama_layer, llama_spec


class DeepseekV3Config(transformers.DeepseekV3Config):
    """Hugging Face's DeepseekV3Config: reads a DeepSeek-V3 (or Kimi K2) config.json and writes it back."""


def softmax_scale(config, scaling: dict | None) -> float:
    """qk_head_dim^-0.5, × mscale(factor, mscale_all_dim)² under a rotary `scaling` with mscale_all_dim
    (as transformers' DeepSeek-V3 attention)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    if scaling and scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
    return scale


def deepseek_v3_layer(config, index: int) -> LayerSpec:
    """Layer `index`: Llama's with latent attention; its MLP dense in the first
    first_k_dense_replace layers, an MoE after them."""
    theta, scaling = rope_settings(config)
    latent = LatentAttentionSpec(num_heads=config.num_attention_heads, q_lora_rank=config.q_lora_rank,
                                 kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_nope_head_dim,
                                 qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim,
                                 bias=config.attention_bias, dropout=config.attention_dropout, rope_theta=theta,
                                 rope_scaling=scaling, rope_interleave=config.rope_interleave,
                                 softmax_scale=softmax_scale(config, scaling))
    layer = replace(llama_layer(config, index), attention=latent)
    if index < config.first_k_dense_replace:
        return layer
    shared = config.moe_intermediate_size * config.n_shared_experts if config.n_shared_experts else None
    moe = MoESpec(num_experts=config.n_routed_experts, top_k=config.num_experts_per_tok,
                  ffn_hidden_size=config.moe_intermediate_size, router="sigmoid_group",
                  norm_topk_prob=config.norm_topk_prob, n_group=config.n_group, topk_group=config.topk_group,
                  routed_scaling_factor=config.routed_scaling_factor, score_correction_bias=True,
                  activation=config.hidden_act, shared_expert_size=shared)
    return replace(layer, mlp=moe)


def deepseek_v3_spec(config) -> DecoderSpec:
    """The model as a `DecoderSpec`: its layers, and its experts with no auxiliary loss."""
    refuse_quantized(config, "dequantize the checkpoint to bf16 first (DeepSeek-V3's inference/fp8_cast_bf16.py) "
                             "and drop quantization_config from its config.json")
    return llama_spec(config, deepseek_v3_layer, num_experts=config.n_routed_experts)


class DeepseekV3Model(DecoderModel):
    """The DeepSeek-V3 body: token embedding, latent-attention layers (dense, then MoE) and the final RMSNorm."""

    config_class = DeepseekV3Config
    other_configs = {"kimi_k2": DeepseekV3Config}
    base_model_prefix = "model"
    names = DecoderNames(shared_expert="shared_experts")
    describe = staticmethod(deepseek_v3_spec)
    weight_map = llama_weight_map


class DeepseekV3ForCausalLM(DecoderForCausalLM):
    """DeepSeek-V3 with its language-model head."""

    body_class = DeepseekV3Model
