"""Phi-3 and Phi-4 (Microsoft, 2024-25; Phi-4 and Phi-4-mini are Phi-3 checkpoints): Llama with
q, k, v fused in one ``qkv_proj`` and gate, up in one ``gate_up_proj`` in its checkpoints (split
into the zoo's grouped qkv and separate gate and up on load, fused back on save:
`hf_maps/phi3.py`), LongRoPE for long contexts and partial rotary (Phi-4-mini rotates 3/4 of
each head's channels).

    LongRoPE: inv_freq_i = 1 / (factor_i · theta^(2i/d)), factor = long_factor past
    original_max_position_embeddings (any position of the call), short_factor before;
    cos, sin × sqrt(1 + ln(max_position_embeddings / original) / ln(original))
"""

from __future__ import annotations

import functools
from dataclasses import replace

import transformers

from libai_zoo.layers import LayerSpec

from .decoder import DecoderForCausalLM, DecoderModel
from .gpt_neox import rotary_fraction
from .hf_maps.phi3 import phi3_weight_map
from .llama import llama_layer, llama_spec


class Phi3Config(transformers.Phi3Config):
    """Hugging Face's Phi3Config: reads a Phi-3 / Phi-4 config.json unchanged and writes it back."""


def phi3_layer(config: Phi3Config, index: int) -> LayerSpec:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layer = replace(llama_layer(config, index), hidden_dropout=config.resid_pdrop)
    return layer.with_attention(rotary_dim=int(head_dim * rotary_fraction(config)))


class Phi3Model(DecoderModel):
    config_class = Phi3Config
    base_model_prefix = "model"
    describe = staticmethod(functools.partial(llama_spec, layer=phi3_layer))
    weight_map = phi3_weight_map


class Phi3ForCausalLM(DecoderForCausalLM):
    body_class = Phi3Model
