"""Llama 2/3 (Touvron et al., 2023): a decoder-only transformer with rotary positions, RMSNorm,
SwiGLU and grouped-query attention.

    ids -> embed_tokens -> L × [x + attn(rmsnorm(x), RoPE); x + down(silu(gate(x')) * up(x'))]
        -> norm -> lm_head (untied unless tie_word_embeddings) -> logits

Hugging Face's `LlamaConfig` describes it; weights load from and save to Hugging Face Llama
checkpoints (`hf_maps/llama.py`). ``attention_bias`` adds biases to q, k, v and o as Llama's
config defines; Qwen2 checkpoints (``model_type: qwen2``: biases on q, k, v only, sliding windows
on the layers `layer_types` names) load too. `llama_layer` and `llama_spec` are where the other
Llama-shaped families start from.
"""

from __future__ import annotations

import math

import transformers

from .decoder import DecoderForCausalLM, DecoderModel, DecoderSpec
from .hf_maps.llama import llama_weight_map


class LlamaConfig(transformers.LlamaConfig):
    """Hugging Face's LlamaConfig: reads a Llama config.json unchanged and writes it back."""


def rope_settings(config, params: dict | None = None) -> tuple[float, dict | None]:
    """(base, scaling) of RoPE, from ``params`` or the config's ``rope_parameters`` (transformers 5)
    or ``rope_theta`` and ``rope_scaling`` (4.x). Scalings: none, "linear", "llama3" (Llama 3.1
    and later), "longrope" (Phi-3, Phi-4: `longrope_scaling`) and "yarn" (Qwen's long contexts,
    DeepSeek-V3)."""
    if params is None:
        params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(params)
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    if rope_type == "default":
        return theta, None
    if rope_type not in ("linear", "llama3", "longrope", "yarn"):
        raise ValueError(f"rope_type {rope_type!r} is not supported by libai_zoo's {config.model_type} "
                         f"(supported: default, linear, llama3, longrope, yarn)")
    if rope_type == "longrope":
        return theta, longrope_scaling(config, params)
    if rope_type == "yarn" and params.get("factor") is None:  # transformers: the context's growth
        params["factor"] = config.max_position_embeddings / params["original_max_position_embeddings"]
    return theta, {**params, "rope_type": rope_type}


def refuse_quantized(config, fix: str) -> None:
    """Refuse a config whose weights are quantized (its ``quantization_config``: the hub's gpt-oss
    MXFP4 and DeepSeek-V3 FP8 files), which libai_zoo does not read, saying how to `fix` it."""
    quantization = getattr(config, "quantization_config", None)
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        raise ValueError(f"this {config.model_type} config has quantization_config ({method}): libai_zoo reads "
                         f"unquantized weights; {fix}")


def longrope_scaling(config, params: dict) -> dict:
    """LongRoPE's scaling with its defaults filled in as transformers fills them: the original
    context from the config, and the cos/sin multiplier sqrt(1 + ln(factor) / ln(original context))
    where factor (if not given) is max_position_embeddings / the original context."""
    context = params.get("original_max_position_embeddings") or config.original_max_position_embeddings
    factor = params.get("factor") or config.max_position_embeddings / context
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = math.sqrt(1 + math.log(factor) / math.log(context)) if factor > 1 else 1.0
    return {**params, "rope_type": "longrope", "original_max_position_embeddings": context,
            "attention_factor": attention_factor}


def qkv_bias(config) -> tuple[bool, bool]:
    """(biases on q/k/v, bias on o): Llama's attention_bias sets both, Qwen2 has q/k/v only."""
    if config.model_type == "qwen2":
        return True, False
    return getattr(config, "attention_bias", False), getattr(config, "attention_bias", False)


def sliding_window(config, index: int) -> int | None:
    """The window of layer `index`: the config's sliding_window on the layers `layer_types` calls
    "sliding_attention" (every layer when the config has no layer_types), None elsewhere."""
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    return window if layer_types is None or layer_types[index] == "sliding_attention" else None


def llama_layer(config, index: int, **changes) -> dict:
    """Layer `index` of a Llama-shaped `config` as `TransformerLayer` arguments, with `changes`."""
    theta, scaling = rope_settings(config)
    bias, out_bias = qkv_bias(config)
    activation = getattr(config, "hidden_act", None) or config.hidden_activation  # Gemma 2/3's name
    layer = dict(hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
                 ffn_hidden_size=config.intermediate_size, num_kv_heads=config.num_key_value_heads,
                 head_dim=getattr(config, "head_dim", None), norm="rmsnorm", norm_eps=config.rms_norm_eps,
                 activation=activation, gated_mlp=True, qkv_bias=bias, attention_out_bias=out_bias,
                 mlp_bias=getattr(config, "mlp_bias", False), attention_dropout=config.attention_dropout,
                 causal=True, rope_theta=theta, rope_scaling=scaling, sliding_window=sliding_window(config, index))
    return {**layer, **changes}


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
