"""Llama 2/3 (Touvron et al., 2023): a decoder-only transformer with rotary positions, RMSNorm,
SwiGLU and grouped-query attention.

    ids -> embed_tokens -> L × [x + attn(rmsnorm(x), RoPE); x + down(silu(gate(x')) * up(x'))]
        -> norm -> lm_head (untied unless tie_word_embeddings) -> logits

Hugging Face's `LlamaConfig` describes it; weights load from and save to Hugging Face Llama
checkpoints (`hf_maps/llama.py`). ``attention_bias`` adds biases to q, k, v and o as Llama's
config defines; Qwen2 checkpoints (``model_type: qwen2``: biases on q, k, v only, sliding windows
on the layers `layer_types` names) load too. `llama_layer` (a `layers.LayerSpec`) and `llama_spec`
are where the other Llama-shaped families start from.
"""

from __future__ import annotations

import transformers

from libai_zoo.layers import AttentionSpec, LayerSpec, MLPSpec

from .config_reading import qkv_bias, refuse_quantized, rope_settings, sliding_window
from .decoder import DecoderForCausalLM, DecoderModel, DecoderSpec
from .hf_maps.llama import llama_weight_map


class LlamaConfig(transformers.LlamaConfig):
    """Hugging Face's LlamaConfig: reads a Llama config.json unchanged and writes it back."""


def llama_layer(config, index: int) -> LayerSpec:
    """Layer `index` of a Llama-shaped `config`: pre-norm RMSNorm, rotary grouped-query attention,
    a gated MLP of the config's activation."""
    theta, scaling = rope_settings(config)
    bias, out_bias = qkv_bias(config)
    activation = getattr(config, "hidden_act", None) or config.hidden_activation  # Gemma 2/3's name
    attention = AttentionSpec(num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
                              head_dim=getattr(config, "head_dim", None), causal=True, bias=bias, out_bias=out_bias,
                              dropout=config.attention_dropout, rope_theta=theta, rope_scaling=scaling,
                              sliding_window=sliding_window(config, index))
    mlp = MLPSpec(config.intermediate_size, activation=activation, gated=True,
                  bias=getattr(config, "mlp_bias", False))
    return LayerSpec(config.hidden_size, attention, mlp, norm="rmsnorm", norm_eps=config.rms_norm_eps)


def llama_spec(config, layer=llama_layer, **changes) -> DecoderSpec:
    """A Llama-shaped `config` as a `DecoderSpec`: each layer from `layer(config, index)`."""
    refuse_quantized(config, "load it with transformers, dequantize it and save_pretrained an unquantized copy")
    spec = dict(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                layers=tuple(layer(config, i) for i in range(config.num_hidden_layers)),
                final_norm="rmsnorm", final_norm_eps=config.rms_norm_eps, padding_idx=config.pad_token_id)
    return DecoderSpec(**{**spec, **changes})


def moe_spec(config, layer, **changes) -> DecoderSpec:
    """A Llama-shaped Mixture-of-Experts `config` (its experts ``num_experts`` or Mixtral's
    ``num_local_experts``) as a `DecoderSpec`, with transformers' auxiliary-loss settings."""
    if getattr(config, "router_jitter_noise", 0.0):
        raise ValueError(f"router_jitter_noise = {config.router_jitter_noise}: libai_zoo's routers add no noise; "
                         f"set it to 0")
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    return llama_spec(config, layer, num_experts=experts, router_aux_loss_coef=config.router_aux_loss_coef,
                      output_router_logits=config.output_router_logits, **changes)


class LlamaModel(DecoderModel):
    """The Llama body: token embedding, decoder layers and the final RMSNorm."""

    config_class = LlamaConfig
    other_configs = {"qwen2": transformers.Qwen2Config}
    base_model_prefix = "model"
    describe = staticmethod(llama_spec)
    weight_map = llama_weight_map


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama with its language-model head."""

    body_class = LlamaModel
