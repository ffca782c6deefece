"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B; Qwen Team, 2024): Qwen2 whose MLPs are Mixtures of
Experts with a shared expert every token goes through, scaled by a sigmoid gate.

    x = x + attn(rmsnorm(x))                               (biases on q, k, v: qkv_bias)
    x = x + Σ_{e in top-k} w_e · expert_e(h) + sigmoid(shared_expert_gate(h)) · shared_expert(h),  h = rmsnorm(x)

Layer i is an MoE layer unless it is in ``mlp_only_layers`` or (i + 1) is not a multiple of
``decoder_sparse_step``; the others keep a dense MLP of ``intermediate_size``. The top-k weights
are renormalised only with ``norm_topk_prob``.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import transformers

from libai_zoo.layers import LayerSpec, MoESpec

from .decoder import DecoderForCausalLM, DecoderModel
from .hf_maps.llama import llama_weight_map
from .llama import llama_layer, moe_spec


class Qwen2MoeConfig(transformers.Qwen2MoeConfig):
    """Hugging Face's Qwen2MoeConfig: reads a Qwen2-MoE config.json unchanged and writes it back."""


def is_sparse(config, index: int) -> bool:
    """Whether layer `index` of a Qwen-MoE config is an MoE layer (transformers' rule)."""
    return (index not in config.mlp_only_layers and config.num_experts > 0
            and (index + 1) % config.decoder_sparse_step == 0)


def qwen_moe_layer(config, index: int, **shared) -> LayerSpec:
    """Layer `index` of a Qwen-MoE-shaped config: a Llama layer, its MLP an MoE of
    ``moe_intermediate_size`` experts where `is_sparse` (with the `MoESpec` fields `shared`: a
    shared expert)."""
    layer = llama_layer(config, index)
    if not is_sparse(config, index):
        return layer
    return replace(layer, mlp=MoESpec(num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                                      ffn_hidden_size=config.moe_intermediate_size,
                                      norm_topk_prob=config.norm_topk_prob, activation=config.hidden_act, **shared))


def qwen2_moe_layer(config: Qwen2MoeConfig, index: int) -> LayerSpec:
    layer = qwen_moe_layer(config, index, shared_expert_size=config.shared_expert_intermediate_size,
                           shared_expert_gate=True)
    return layer.with_attention(bias=config.qkv_bias, out_bias=False)


class Qwen2MoeModel(DecoderModel):
    config_class = Qwen2MoeConfig
    base_model_prefix = "model"
    describe = staticmethod(functools.partial(moe_spec, layer=qwen2_moe_layer))
    weight_map = llama_weight_map


class Qwen2MoeForCausalLM(DecoderForCausalLM):
    body_class = Qwen2MoeModel
