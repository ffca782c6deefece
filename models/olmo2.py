"""OLMo 2 (Team OLMo, 2024): Llama with its norms moved onto the branch outputs and an RMSNorm
over the whole q and k projections.

    x = x + rmsnorm(attn(x));   x = x + rmsnorm(mlp(x))          (no norm on a branch's input)
    attn: q = rmsnorm(q_proj(x)), k = rmsnorm(k_proj(x)) over all heads at once; RoPE; SDPA; o_proj

Under tensor parallelism each rank holds its heads' part of q and k and of their norm weights;
the norm's mean square is summed over tp (`layers.RMSNorm` with ``split_dim``), q and k are not
gathered.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import transformers

from libai_zoo.layers import LayerSpec

from .decoder import DecoderForCausalLM, DecoderModel
from .hf_maps.llama import llama_weight_map
from .llama import llama_layer, llama_spec


class Olmo2Config(transformers.Olmo2Config):
    """Hugging Face's Olmo2Config: reads an OLMo 2 config.json unchanged and writes it back."""


def olmo2_layer(config: Olmo2Config, index: int) -> LayerSpec:
    """OLMo 2's RMSNorms apply their weight before the cast back (it matters under bf16)."""
    layer = replace(llama_layer(config, index), norm_position="output", norm="rmsnorm_fp32_weight")
    return layer.with_attention(qk_norm="projection", qk_norm_eps=config.rms_norm_eps,
                                qk_norm_kind="rmsnorm_fp32_weight")


class Olmo2Model(DecoderModel):
    config_class = Olmo2Config
    base_model_prefix = "model"
    describe = staticmethod(functools.partial(llama_spec, layer=olmo2_layer, final_norm="rmsnorm_fp32_weight"))
    weight_map = llama_weight_map


class Olmo2ForCausalLM(DecoderForCausalLM):
    body_class = Olmo2Model
