"""GPT-NeoX (Black et al., 2022) in its sequential form: a decoder-only transformer with rotary
positions on a share of each head's channels, pre-LayerNorm and a GELU MLP, all with biases. It is
also the Hugging Face form of a Megatron-LM GPT trained with `--position-embedding-type rope`.

    ids -> embed_in -> dropout -> L × [x + attn(ln(x), RoPE on rotary_pct of each head);
                                       x + mlp(ln(x))] -> final_layer_norm -> embed_out -> logits

Hugging Face's `GPTNeoXConfig` describes it; weights load from and save to Hugging Face GPT-NeoX
checkpoints (`hf_maps/gpt_neox.py`). The parallel residual of Pythia and GPT-NeoX-20B
(`use_parallel_residual=True`: x + attn(ln1(x)) + mlp(ln2(x))) is not built here.
"""

from __future__ import annotations

import torch
import transformers
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from libai_zoo.layers import (KVCache, LayerNorm, LMHead, SequenceGather, SequenceScatter, TransformerLayer,
                              VocabEmbedding)

from .causal_lm import CausalLM, body_output, pick_cache, run_decoder_layers
from .hf_maps.gpt_neox import gpt_neox_weight_map
from .llama import rope_settings
from .pretrained import PreTrainedModel


class GPTNeoXConfig(transformers.GPTNeoXConfig):
    """Hugging Face's GPTNeoXConfig: reads a GPT-NeoX config.json unchanged and writes it back."""


def rotary_fraction(config) -> float:
    """The share of each head's channels that rotate (rotary_pct; partial_rotary_factor in transformers 5)."""
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("partial_rotary_factor", getattr(config, "rotary_pct", 1.0)))


class GPTNeoXModel(PreTrainedModel):
    """The GPT-NeoX body: token embedding, decoder layers and the final LayerNorm."""

    config_class = GPTNeoXConfig
    base_model_prefix = "gpt_neox"

    def __init__(self, config: GPTNeoXConfig):
        super().__init__(config)
        if config.use_parallel_residual:
            raise ValueError("GPTNeoXConfig.use_parallel_residual=True (Pythia, GPT-NeoX-20B) is not supported by "
                             "libai_zoo's GPT-NeoX, which builds the sequential residual")
        hidden, heads = config.hidden_size, config.num_attention_heads
        theta, scaling = rope_settings(config)
        self.embed_in = VocabEmbedding(config.vocab_size, hidden, sequence_parallel=False)
        self.emb_dropout = nn.Dropout(config.hidden_dropout)
        self.scatter = SequenceScatter()
        self.layers = nn.ModuleList(
            TransformerLayer(hidden, heads, config.intermediate_size, norm="layernorm", norm_eps=config.layer_norm_eps,
                             activation=config.hidden_act, qkv_bias=config.attention_bias,
                             attention_out_bias=config.attention_bias, mlp_bias=True,
                             attention_dropout=config.attention_dropout, hidden_dropout=config.hidden_dropout,
                             causal=True, rope_theta=theta, rope_scaling=scaling,
                             rotary_dim=int(hidden // heads * rotary_fraction(config)))
            for _ in range(config.num_hidden_layers))
        self.final_layer_norm = LayerNorm(hidden, config.layer_norm_eps)
        self.gather = SequenceGather()
        self.post_init()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings, dropout; this rank's part of the sequence under SP."""
        return self.scatter(self.emb_dropout(self.embed_in(input_ids)))

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The last LayerNorm, and the whole sequence again under SP."""
        return self.gather(self.final_layer_norm(x))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None,
                cache: list[KVCache] | None = None, *,
                past_key_values: list[KVCache] | None = None) -> BaseModelOutputWithPast:
        cache = pick_cache(cache, past_key_values)
        x = run_decoder_layers(self.layers, self.embed(input_ids), attention_mask, position_ids, cache)
        return body_output(self.final_norm(x), cache)

    def hf_weight_map(self):
        return gpt_neox_weight_map(self.config, prefix="")


class GPTNeoXForCausalLM(PreTrainedModel, CausalLM):
    """GPT-NeoX with its language-model head (`lm_head`, Hugging Face's `embed_out`; untied unless
    the config ties it)."""

    config_class = GPTNeoXConfig
    base_model_prefix = "gpt_neox"
    layer_stack = "gpt_neox.layers"
    first_stage_modules = ("gpt_neox.embed_in",)
    last_stage_modules = ("gpt_neox.final_layer_norm", "lm_head")

    def __init__(self, config: GPTNeoXConfig):
        super().__init__(config)
        self.gpt_neox = GPTNeoXModel(config)
        self.lm_head = LMHead(config.hidden_size, config.vocab_size)
        self.post_init()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.gpt_neox.embed_in.weight

    def embed(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.gpt_neox.embed(inputs["input_ids"])

    def input_limits(self) -> dict[str, int | None]:
        """Rotary positions are computed, not looked up: no hard length limit."""
        return {"vocab_size": self.config.vocab_size, "max_positions": None}

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                cache: list[KVCache] | None = None, logits_to_keep: int = 0,
                return_logits: bool = True, shift_labels: torch.Tensor | None = None,
                past_key_values: list[KVCache] | None = None) -> CausalLMOutputWithPast:
        """labels [B, S] (shifted inside) or shift_labels (already aligned): see `causal_lm`; -100
        is ignored. ``return_logits=False`` skips gathering the vocabulary-split logits (training)."""
        cache = pick_cache(cache, past_key_values)
        hidden = self.gpt_neox(input_ids, attention_mask, position_ids, cache).last_hidden_state
        return self.lm_output(hidden, labels, shift_labels, cache, logits_to_keep, return_logits)

    def hf_weight_map(self):
        return gpt_neox_weight_map(self.config, prefix="gpt_neox.", lm_head=not self.config.tie_word_embeddings)
