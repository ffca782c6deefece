"""GPT-NeoX (Black et al., 2022): a decoder-only transformer with rotary positions on a share of
each head's channels, LayerNorm and a GELU MLP, all with biases; in its sequential form also the
Hugging Face form of a Megatron-LM GPT trained with `--position-embedding-type rope`.

    sequential:                ids -> embed_in -> L × [x + attn(ln1(x), RoPE on rotary_pct of each head);
                                                      x + mlp(ln2(x))] -> final_layer_norm -> embed_out
    parallel (Pythia, 20B):    each layer x + attn(ln1(x)) + mlp(ln2(x)), one reduction under tp

Hugging Face's `GPTNeoXConfig` describes it (``use_parallel_residual`` picks the form); weights
load from and save to Hugging Face GPT-NeoX checkpoints (`hf_maps/gpt_neox.py`).
"""

from __future__ import annotations

import transformers

from libai_zoo.layers import AttentionSpec, LayerSpec, MLPSpec
from libai_zoo.utils.transformers_versions import partial_rotary_factor

from .config_reading import rope_settings
from .decoder import DecoderForCausalLM, DecoderModel, DecoderNames, DecoderSpec
from .hf_maps.gpt_neox import gpt_neox_weight_map


class GPTNeoXConfig(transformers.GPTNeoXConfig):
    """Hugging Face's GPTNeoXConfig: reads a GPT-NeoX config.json unchanged and writes it back."""


def rotary_fraction(config) -> float:
    """The share of each head's channels that rotate (rotary_pct; partial_rotary_factor in transformers 5)."""
    return partial_rotary_factor(config)


def gpt_neox_spec(config: GPTNeoXConfig) -> DecoderSpec:
    hidden, heads = config.hidden_size, config.num_attention_heads
    theta, scaling = rope_settings(config)
    attention = AttentionSpec(num_heads=heads, causal=True, bias=config.attention_bias,
                              dropout=config.attention_dropout, rope_theta=theta, rope_scaling=scaling,
                              rotary_dim=int(hidden // heads * rotary_fraction(config)))
    layer = LayerSpec(hidden, attention, MLPSpec(config.intermediate_size, activation=config.hidden_act),
                      norm="layernorm", norm_eps=config.layer_norm_eps, hidden_dropout=config.hidden_dropout,
                      parallel_block=config.use_parallel_residual, parallel_norms=2)
    return DecoderSpec(vocab_size=config.vocab_size, hidden_size=hidden, layers=(layer,) * config.num_hidden_layers,
                       final_norm="layernorm", final_norm_eps=config.layer_norm_eps,
                       embedding_dropout=config.hidden_dropout)


class GPTNeoXModel(DecoderModel):
    """The GPT-NeoX body: token embedding, decoder layers and the final LayerNorm."""

    config_class = GPTNeoXConfig
    base_model_prefix = "gpt_neox"
    names = DecoderNames(embed="embed_in", final_norm="final_layer_norm")
    describe = staticmethod(gpt_neox_spec)
    weight_map = gpt_neox_weight_map


class GPTNeoXForCausalLM(DecoderForCausalLM):
    """GPT-NeoX with its language-model head (`lm_head`, Hugging Face's `embed_out`; untied unless
    the config ties it)."""

    body_class = GPTNeoXModel
