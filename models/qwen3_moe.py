"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B; Qwen Team, 2025): Qwen3 (per-head q/k RMSNorms, an
explicit head_dim) whose MLPs are Mixtures of Experts: softmax router, top-k renormalised with
``norm_topk_prob``; dense layers where `qwen2_moe.is_sparse` says (``mlp_only_layers``,
``decoder_sparse_step``)."""

from __future__ import annotations

import functools

import transformers

from libai_zoo.layers import LayerSpec

from .decoder import DecoderForCausalLM, DecoderModel
from .hf_maps.llama import llama_weight_map
from .llama import moe_spec
from .qwen2_moe import qwen_moe_layer


class Qwen3MoeConfig(transformers.Qwen3MoeConfig):
    """Hugging Face's Qwen3MoeConfig: reads a Qwen3-MoE config.json unchanged and writes it back."""


def qwen3_moe_layer(config: Qwen3MoeConfig, index: int) -> LayerSpec:
    return qwen_moe_layer(config, index).with_attention(qk_norm="head", qk_norm_eps=config.rms_norm_eps)


class Qwen3MoeModel(DecoderModel):
    config_class = Qwen3MoeConfig
    base_model_prefix = "model"
    describe = staticmethod(functools.partial(moe_spec, layer=qwen3_moe_layer))
    weight_map = llama_weight_map


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    body_class = Qwen3MoeModel
