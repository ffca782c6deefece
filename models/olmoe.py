"""OLMoE (Muennighoff et al., 2024): a pre-norm Llama with an RMSNorm over the whole q and k
projections (as OLMo 2's) and Mixture-of-Experts MLPs in every layer: softmax router, top-k
(8 of 64) not renormalised unless ``norm_topk_prob``.

    attn: q = rmsnorm(q_proj(x)), k = rmsnorm(k_proj(x)) over all heads at once; RoPE; SDPA; o_proj
"""

from __future__ import annotations

import functools
from dataclasses import replace

import transformers

from libai_zoo.layers import LayerSpec, MoESpec

from .decoder import DecoderForCausalLM, DecoderModel
from .hf_maps.llama import llama_weight_map
from .llama import llama_layer, moe_spec


class OlmoeConfig(transformers.OlmoeConfig):
    """Hugging Face's OlmoeConfig: reads an OLMoE config.json unchanged and writes it back."""


def olmoe_layer(config: OlmoeConfig, index: int) -> LayerSpec:
    if config.clip_qkv is not None:
        raise ValueError(f"clip_qkv = {config.clip_qkv}: libai_zoo's OLMoE does not clip q, k and v; "
                         f"use a checkpoint without it (clip_qkv null)")
    moe = MoESpec(num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                  ffn_hidden_size=config.intermediate_size, norm_topk_prob=config.norm_topk_prob,
                  activation=config.hidden_act)
    layer = replace(llama_layer(config, index), mlp=moe)
    return layer.with_attention(qk_norm="projection", qk_norm_eps=config.rms_norm_eps)


class OlmoeModel(DecoderModel):
    config_class = OlmoeConfig
    base_model_prefix = "model"
    describe = staticmethod(functools.partial(moe_spec, layer=olmoe_layer))
    weight_map = llama_weight_map


class OlmoeForCausalLM(DecoderForCausalLM):
    body_class = OlmoeModel
