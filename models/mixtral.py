"""Mixtral 8x7B (Jiang et al., 2024): Mistral whose MLPs are Mixtures of Experts: a router
picks the top 2 of 8 SwiGLU experts per token, their weights renormalised to sum 1.

    x = x + attn(rmsnorm(x));   x = x + Σ_{e in top-k} w_e · expert_e(rmsnorm(x))

Checkpoints keep one tensor per expert (``block_sparse_moe.experts.{e}.w1/w3/w2``: gate, up,
down) and the router as ``block_sparse_moe.gate``; the loss adds router_aux_loss_coef × the
load-balancing loss when ``output_router_logits``.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import transformers

from libai_zoo.layers import LayerSpec, MoESpec

from .decoder import DecoderForCausalLM, DecoderModel, DecoderNames
from .hf_maps.llama import llama_weight_map
from .llama import llama_layer, moe_spec


class MixtralConfig(transformers.MixtralConfig):
    """Hugging Face's MixtralConfig: reads a Mixtral config.json unchanged and writes it back."""


def mixtral_layer(config: MixtralConfig, index: int) -> LayerSpec:
    moe = MoESpec(num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
                  ffn_hidden_size=config.intermediate_size, norm_topk_prob=True, activation=config.hidden_act)
    return replace(llama_layer(config, index), mlp=moe)


class MixtralModel(DecoderModel):
    config_class = MixtralConfig
    base_model_prefix = "model"
    names = DecoderNames(moe="block_sparse_moe", experts=("w1", "w3", "w2"))
    describe = staticmethod(functools.partial(moe_spec, layer=mixtral_layer))
    weight_map = llama_weight_map


class MixtralForCausalLM(DecoderForCausalLM):
    body_class = MixtralModel
