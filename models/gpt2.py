"""GPT-2 (Radford et al., 2019): a decoder-only transformer with learned positions and pre-norm.

    ids -> wte + wpe -> dropout -> n_layer × [x + attn(ln_1(x)); x + mlp(ln_2(x))] -> ln_f
        -> lm_head (tied to wte) -> logits

Hugging Face's `GPT2Config` (config.json as it is) describes it; weights load from and save to
Hugging Face GPT-2 checkpoints (`hf_maps/gpt2.py`).
"""

from __future__ import annotations

import math

import torch
import transformers
from torch import nn

from libai_zoo.layers import AttentionSpec, LayerSpec, MLPSpec

from .decoder import DecoderForCausalLM, DecoderModel, DecoderNames, DecoderSpec
from .hf_maps.gpt2 import gpt2_weight_map

UNSUPPORTED = {"scale_attn_by_inverse_layer_idx": True, "reorder_and_upcast_attn": True,
               "scale_attn_weights": False, "add_cross_attention": True}


class GPT2Config(transformers.GPT2Config):
    """Hugging Face's GPT2Config: reads a GPT-2 config.json unchanged and writes it back."""


def gpt2_spec(config: GPT2Config) -> DecoderSpec:
    for key, value in UNSUPPORTED.items():
        if getattr(config, key, not value) == value:
            raise ValueError(f"GPT2Config.{key}={value} is not supported by libai_zoo's GPT-2")
    hidden = config.n_embd
    attention = AttentionSpec(num_heads=config.n_head, causal=True, dropout=config.attn_pdrop)
    mlp = MLPSpec(config.n_inner or 4 * hidden, activation=config.activation_function)
    layer = LayerSpec(hidden, attention, mlp, norm="layernorm", norm_eps=config.layer_norm_epsilon,
                      hidden_dropout=config.resid_pdrop)
    return DecoderSpec(vocab_size=config.vocab_size, hidden_size=hidden, layers=(layer,) * config.n_layer,
                       final_norm="layernorm", final_norm_eps=config.layer_norm_epsilon,
                       max_positions=config.n_positions, token_types=True, embedding_dropout=config.embd_pdrop)


class GPT2Model(DecoderModel):
    """The GPT-2 body: embeddings, transformer layers and the final norm."""

    config_class = GPT2Config
    base_model_prefix = "transformer"
    names = DecoderNames(embed="wte", positions="wpe", layers="h", final_norm="ln_f")
    describe = staticmethod(gpt2_spec)
    weight_map = gpt2_weight_map

    def init_parameter(self, name: str, module: nn.Module, tensor: torch.Tensor,
                       generator: torch.Generator | None) -> None:
        """GPT-2 scales the residual projections' weights by 1/sqrt(2 n_layer)."""
        if name.endswith(("attn.out.weight", "mlp.down.weight")):
            std = self.config.initializer_range / math.sqrt(2 * self.config.n_layer)
            tensor.normal_(0.0, std, generator=generator)
        else:
            super().init_parameter(name, module, tensor, generator)


class GPT2LMHeadModel(DecoderForCausalLM):
    """GPT-2 with its language-model head (tied to the token embedding unless the config says not)."""

    body_class = GPT2Model
