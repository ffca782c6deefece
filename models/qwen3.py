"""Qwen3 (dense; Qwen Team, 2025): Llama with an RMSNorm on each head of q and k before rotary,
an explicit head_dim, and sliding windows on the layers `layer_types` names.

    attn: q, k, v = proj(x); q, k = rmsnorm_per_head(q), rmsnorm_per_head(k); RoPE; SDPA; o_proj
"""

from __future__ import annotations

import functools

import transformers

from libai_zoo.layers import LayerSpec

from .decoder import DecoderForCausalLM, DecoderModel
from .hf_maps.llama import llama_weight_map
from .llama import llama_layer, llama_spec


class Qwen3Config(transformers.Qwen3Config):
    """Hugging Face's Qwen3Config: reads a Qwen3 config.json unchanged and writes it back."""


def qwen3_layer(config: Qwen3Config, index: int) -> LayerSpec:
    return llama_layer(config, index).with_attention(qk_norm="head", qk_norm_eps=config.rms_norm_eps)


class Qwen3Model(DecoderModel):
    config_class = Qwen3Config
    base_model_prefix = "model"
    describe = staticmethod(functools.partial(llama_spec, layer=qwen3_layer))
    weight_map = llama_weight_map


class Qwen3ForCausalLM(DecoderForCausalLM):
    body_class = Qwen3Model
