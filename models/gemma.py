"""Gemma (Gemma Team, 2024), Gemma 2 (2024) and Gemma 3 (2025, its text model): Llama-shaped
decoders with Gemma's own touches, each generation adding to the one before.

    Gemma:   RMSNorm (1 + w) in float32 (final norm too); embeddings × sqrt(hidden) rounded to the
             weights' dtype; GeGLU (tanh GELU); head_dim ≠ hidden / heads; tied head.
    Gemma 2: + sandwich norms (x + norm(attn(norm(x))), the same around the MLP); softmax scale
             query_pre_attn_scalar^-0.5; attention scores and final logits soft-capped
             (cap·tanh(s/cap)); sliding and full attention layers alternating (`layer_types`).
    Gemma 3: + RMSNorm (1 + w) on each head of q and k before rotary; two rotary tables, the
             sliding layers' (local base, 10k) and the full layers' (global base, 1M, scaled on
             the larger models), five sliding layers to one full.

The 4B-27B Gemma 3 checkpoints are `Gemma3ForConditionalGeneration` (``model_type: gemma3``):
the text model loads from them (its config is ``text_config``, its tensors ``language_model.*``);
the vision tower and projector are skipped, and the load says so. Weights are named as Llama's
(`hf_maps/llama.py`).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import transformers

from libai_zoo.hf import Container
from libai_zoo.layers import LayerSpec

from .config_reading import rope_settings
from .decoder import DecoderForCausalLM, DecoderModel, DecoderSpec
from .hf_maps.llama import llama_weight_map
from .llama import llama_layer, llama_spec


class GemmaConfig(transformers.GemmaConfig):
    """Hugging Face's GemmaConfig: reads a Gemma config.json unchanged and writes it back."""


class Gemma2Config(transformers.Gemma2Config):
    """Hugging Face's Gemma2Config: reads a Gemma 2 config.json unchanged and writes it back."""


class Gemma3TextConfig(transformers.Gemma3TextConfig):
    """Hugging Face's Gemma3TextConfig: reads a Gemma 3 text config.json unchanged and writes it back."""


def gemma_layer(config, index: int) -> LayerSpec:
    """Llama's layer with (1 + w) norms (the activation is the config's: GELU-tanh)."""
    return replace(llama_layer(config, index), norm="rmsnorm_1p")


def gemma2_layer(config, index: int) -> LayerSpec:
    """Gemma's layer in sandwich norms, its softmax scaled by query_pre_attn_scalar and capped."""
    layer = replace(gemma_layer(config, index), norm_position="sandwich")
    return layer.with_attention(softmax_scale=config.query_pre_attn_scalar ** -0.5,
                                softcap=config.attn_logit_softcapping)


def gemma3_layer(config, index: int) -> LayerSpec:
    """Gemma 2's layer with per-head (1 + w) q/k norms and the rotary table of its layer type."""
    theta, scaling = rope_settings(config, config.rope_parameters[config.layer_types[index]])
    return gemma2_layer(config, index).with_attention(rope_theta=theta, rope_scaling=scaling, qk_norm="head",
                                                      qk_norm_eps=config.rms_norm_eps, qk_norm_kind="rmsnorm_1p")


def gemma_spec(config, layer=gemma_layer) -> DecoderSpec:
    """A Gemma `config` as a `DecoderSpec`: each layer from `layer(config, index)`."""
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(f"{config.model_type}: use_bidirectional_attention (an encoder) is not supported by "
                         f"libai_zoo's Gemma models, which are causal LMs; set it to false")
    return llama_spec(config, layer=layer, final_norm="rmsnorm_1p", embedding_multiplier=config.hidden_size ** 0.5,
                      multiplier_in_dtype=True, logit_softcap=getattr(config, "final_logit_softcapping", None))


class GemmaModel(DecoderModel):
    config_class = GemmaConfig
    base_model_prefix = "model"
    describe = staticmethod(gemma_spec)
    weight_map = llama_weight_map


class GemmaForCausalLM(DecoderForCausalLM):
    body_class = GemmaModel


class Gemma2Model(GemmaModel):
    config_class = Gemma2Config
    describe = staticmethod(functools.partial(gemma_spec, layer=gemma2_layer))


class Gemma2ForCausalLM(DecoderForCausalLM):
    body_class = Gemma2Model


class Gemma3TextModel(GemmaModel):
    config_class = Gemma3TextConfig
    #: the multimodal checkpoints: the text model's config and tensors inside them
    containers = {"gemma3": Container(config_key="text_config", prefix="language_model.",
                                      skipped=("vision_tower.", "multi_modal_projector."))}
    describe = staticmethod(functools.partial(gemma_spec, layer=gemma3_layer))


class Gemma3ForCausalLM(DecoderForCausalLM):
    body_class = Gemma3TextModel
