"""SmolLM3 (Hugging Face, 2025): Llama whose every 4th layer has no positional encoding (NoPE:
``no_rope_layers[i] == 0``, or every ``no_rope_layer_interval``-th layer), tied embeddings by
default."""

from __future__ import annotations

import functools

import transformers

from libai_zoo.layers import LayerSpec

from .decoder import DecoderForCausalLM, DecoderModel
from .hf_maps.llama import llama_weight_map
from .llama import llama_layer, llama_spec


class SmolLM3Config(transformers.SmolLM3Config):
    """Hugging Face's SmolLM3Config: reads a SmolLM3 config.json unchanged and writes it back."""


def smollm3_layer(config: SmolLM3Config, index: int) -> LayerSpec:
    layer = llama_layer(config, index)
    return layer if config.no_rope_layers[index] else layer.with_attention(rope_theta=None)


class SmolLM3Model(DecoderModel):
    config_class = SmolLM3Config
    base_model_prefix = "model"
    describe = staticmethod(functools.partial(llama_spec, layer=smollm3_layer))
    weight_map = llama_weight_map


class SmolLM3ForCausalLM(DecoderForCausalLM):
    body_class = SmolLM3Model
