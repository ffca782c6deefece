"""Granite 3 (IBM, 2024): Llama with its scales set by the config (muP-style).

    x = embed(ids) × embedding_multiplier;  x = x + residual_multiplier × branch(x) (both branches)
    attention softmax(q·k × attention_multiplier);  logits = lm_head(x) / logits_scaling
"""

from __future__ import annotations

from dataclasses import replace

import transformers

from libai_zoo.layers import LayerSpec

from .decoder import DecoderForCausalLM, DecoderModel
from .hf_maps.llama import llama_weight_map
from .llama import llama_layer, llama_spec


class GraniteConfig(transformers.GraniteConfig):
    """Hugging Face's GraniteConfig: reads a Granite config.json unchanged and writes it back."""


def granite_layer(config: GraniteConfig, index: int) -> LayerSpec:
    layer = replace(llama_layer(config, index), residual_multiplier=config.residual_multiplier)
    return layer.with_attention(softmax_scale=config.attention_multiplier)


def granite_spec(config: GraniteConfig):
    return llama_spec(config, layer=granite_layer, embedding_multiplier=config.embedding_multiplier,
                      logit_scale=1 / config.logits_scaling)


class GraniteModel(DecoderModel):
    config_class = GraniteConfig
    base_model_prefix = "model"
    describe = staticmethod(granite_spec)
    weight_map = llama_weight_map


class GraniteForCausalLM(DecoderForCausalLM):
    body_class = GraniteModel
