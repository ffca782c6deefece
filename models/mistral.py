"""Mistral 7B (Jiang et al., 2023): Llama with sliding-window attention (each token sees the last
``sliding_window`` positions) and an explicit head_dim (Mistral Nemo, Small)."""

from __future__ import annotations

import transformers

from .decoder import DecoderForCausalLM, DecoderModel
from .hf_maps.llama import llama_weight_map
from .llama import llama_spec


class MistralConfig(transformers.MistralConfig):
    """Hugging Face's MistralConfig: reads a Mistral config.json unchanged and writes it back."""


class MistralModel(DecoderModel):
    config_class = MistralConfig
    base_model_prefix = "model"
    describe = staticmethod(llama_spec)
    weight_map = llama_weight_map


class MistralForCausalLM(DecoderForCausalLM):
    body_class = MistralModel
