"""Llama 2/3 (Touvron et al., 2023): a decoder-only transformer with rotary positions, RMSNorm,
SwiGLU and grouped-query attention.

    ids -> embed_tokens -> L × [x + attn(rmsnorm(x), RoPE); x + down(silu(gate(x')) * up(x'))]
        -> norm -> lm_head (untied unless tie_word_embeddings) -> logits

Hugging Face's `LlamaConfig` describes it; weights load from and save to Hugging Face Llama
checkpoints (`hf_maps/llama.py`). ``attention_bias`` adds biases to q, k, v and o as Llama's
config defines; Qwen2 checkpoints (``model_type: qwen2``: biases on q, k, v only) load too.
"""

from __future__ import annotations

import torch
import transformers
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from libai_zoo.layers import KVCache, LMHead, RMSNorm, SequenceGather, TransformerLayer, VocabEmbedding

from .causal_lm import CausalLM, body_output, pick_cache, run_decoder_layers
from .hf_maps.llama import llama_weight_map
from .pretrained import PreTrainedModel


class LlamaConfig(transformers.LlamaConfig):
    """Hugging Face's LlamaConfig: reads a Llama config.json unchanged and writes it back."""


def rope_settings(config) -> tuple[float, dict | None]:
    """(base, scaling) of RoPE, from ``rope_parameters`` (transformers 5) or ``rope_theta`` and
    ``rope_scaling`` (4.x). Scalings: none, "linear" and "llama3" (Llama 3.1 and later)."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    if rope_type == "default":
        return theta, None
    if rope_type not in ("linear", "llama3"):
        raise ValueError(f"rope_type {rope_type!r} is not supported by libai_zoo's Llama "
                         f"(supported: default, linear, llama3)")
    return theta, {**params, "rope_type": rope_type}


def qkv_bias(config) -> tuple[bool, bool]:
    """(biases on q/k/v, bias on o): Llama's attention_bias sets both, Qwen2 has q/k/v only."""
    if config.model_type == "qwen2":
        return True, False
    return config.attention_bias, config.attention_bias


class LlamaModel(PreTrainedModel):
    """The Llama body: token embedding, decoder layers and the final RMSNorm."""

    config_class = LlamaConfig
    other_configs = {"qwen2": transformers.Qwen2Config}
    base_model_prefix = "model"

    def __init__(self, config: LlamaConfig):
        super().__init__(config)
        if getattr(config, "use_sliding_window", False):
            raise ValueError("sliding-window attention of Qwen2 is not supported by libai_zoo's Llama")
        hidden = config.hidden_size
        bias, out_bias = qkv_bias(config)
        theta, scaling = rope_settings(config)
        self.embed_tokens = VocabEmbedding(config.vocab_size, hidden, config.pad_token_id)
        self.layers = nn.ModuleList(
            TransformerLayer(hidden, config.num_attention_heads, config.intermediate_size,
                             num_kv_heads=config.num_key_value_heads, head_dim=getattr(config, "head_dim", None),
                             norm="rmsnorm", norm_eps=config.rms_norm_eps, activation=config.hidden_act,
                             gated_mlp=True, qkv_bias=bias, attention_out_bias=out_bias,
                             mlp_bias=getattr(config, "mlp_bias", False), attention_dropout=config.attention_dropout,
                             causal=True, rope_theta=theta, rope_scaling=scaling)
            for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.gather = SequenceGather()
        self.post_init()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings; under sequence parallelism already this rank's part of the sequence."""
        return self.embed_tokens(input_ids)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The last RMSNorm, and the whole sequence again under SP."""
        return self.gather(self.norm(x))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None,
                cache: list[KVCache] | None = None, *,
                past_key_values: list[KVCache] | None = None) -> BaseModelOutputWithPast:
        cache = pick_cache(cache, past_key_values)
        x = run_decoder_layers(self.layers, self.embed(input_ids), attention_mask, position_ids, cache)
        return body_output(self.final_norm(x), cache)

    def hf_weight_map(self):
        return llama_weight_map(self.config, prefix="", biases=qkv_bias(self.config))


class LlamaForCausalLM(PreTrainedModel, CausalLM):
    """Llama with its language-model head."""

    config_class = LlamaConfig
    base_model_prefix = "model"
    layer_stack = "model.layers"
    first_stage_modules = ("model.embed_tokens",)
    last_stage_modules = ("model.norm", "lm_head")
    other_configs = {"qwen2": transformers.Qwen2Config}

    def __init__(self, config: LlamaConfig):
        super().__init__(config)
        self.model = LlamaModel(config)
        self.lm_head = LMHead(config.hidden_size, config.vocab_size)
        self.post_init()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def embed(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model.embed(inputs["input_ids"])

    def input_limits(self) -> dict[str, int | None]:
        """Rotary positions are computed, not looked up: max_position_embeddings (the length it was
        trained at) is no hard limit."""
        return {"vocab_size": self.config.vocab_size, "max_positions": None}

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                cache: list[KVCache] | None = None, logits_to_keep: int = 0,
                return_logits: bool = True, shift_labels: torch.Tensor | None = None,
                past_key_values: list[KVCache] | None = None) -> CausalLMOutputWithPast:
        """labels [B, S] (shifted inside) or shift_labels (already aligned): see `causal_lm`; -100
        is ignored. ``return_logits=False`` skips gathering the vocabulary-split logits (training)."""
        cache = pick_cache(cache, past_key_values)
        hidden = self.model(input_ids, attention_mask, position_ids, cache).last_hidden_state
        return self.lm_output(hidden, labels, shift_labels, cache, logits_to_keep, return_logits)

    def hf_weight_map(self):
        return llama_weight_map(self.config, prefix="model.", biases=qkv_bias(self.config),
                                lm_head=not self.config.tie_word_embeddings)
