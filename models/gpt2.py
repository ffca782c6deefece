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
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from libai_zoo.layers import (Embedding, KVCache, LayerNorm, LMHead, SequenceGather, SequenceScatter,
                              TransformerLayer, VocabEmbedding)

from .causal_lm import CausalLM, body_output, pick_cache, run_decoder_layers
from .hf_maps.gpt2 import gpt2_weight_map
from .pretrained import PreTrainedModel

UNSUPPORTED = {"scale_attn_by_inverse_layer_idx": True, "reorder_and_upcast_attn": True,
               "scale_attn_weights": False, "add_cross_attention": True}


class GPT2Config(transformers.GPT2Config):
    """Hugging Face's GPT2Config: reads a GPT-2 config.json unchanged and writes it back."""


class GPT2Model(PreTrainedModel):
    """The GPT-2 body: embeddings, transformer layers and the final norm."""

    config_class = GPT2Config
    base_model_prefix = "transformer"

    def __init__(self, config: GPT2Config):
        super().__init__(config)
        for key, value in UNSUPPORTED.items():
            if getattr(config, key, not value) == value:
                raise ValueError(f"GPT2Config.{key}={value} is not supported by libai_zoo's GPT-2")
        hidden = config.n_embd
        self.wte = VocabEmbedding(config.vocab_size, hidden, sequence_parallel=False)
        self.wpe = Embedding(config.n_positions, hidden)
        self.drop = nn.Dropout(config.embd_pdrop)
        self.scatter = SequenceScatter()
        self.h = nn.ModuleList(
            TransformerLayer(hidden, config.n_head, config.n_inner or 4 * hidden, norm="layernorm",
                             norm_eps=config.layer_norm_epsilon, activation=config.activation_function,
                             attention_dropout=config.attn_pdrop, hidden_dropout=config.resid_pdrop, causal=True)
            for _ in range(config.n_layer))
        self.ln_f = LayerNorm(hidden, config.layer_norm_epsilon)
        self.gather = SequenceGather()
        self.post_init()

    def init_parameter(self, name: str, module: nn.Module, tensor: torch.Tensor,
                       generator: torch.Generator | None) -> None:
        """GPT-2 scales the residual projections' weights by 1/sqrt(2 n_layer)."""
        if name.endswith(("attn.out.weight", "mlp.down.weight")):
            std = self.config.initializer_range / math.sqrt(2 * self.config.n_layer)
            tensor.normal_(0.0, std, generator=generator)
        else:
            super().init_parameter(name, module, tensor, generator)

    def embed(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None,
              position_ids: torch.Tensor | None = None, past: int = 0) -> torch.Tensor:
        """Token + position (+ token type) embeddings, dropout; this rank's part of the sequence under SP."""
        if position_ids is None:
            position_ids = torch.arange(past, past + input_ids.shape[1], device=input_ids.device)[None]
        x = self.wte(input_ids) + self.wpe(position_ids)
        if token_type_ids is not None:
            x = x + self.wte(token_type_ids)
        return self.scatter(self.drop(x))

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """ln_f, and the whole sequence again under SP."""
        return self.gather(self.ln_f(x))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                cache: list[KVCache] | None = None, *,
                past_key_values: list[KVCache] | None = None) -> BaseModelOutputWithPast:
        cache = pick_cache(cache, past_key_values)
        past = 0 if cache is None else cache[0].length
        x = self.embed(input_ids, token_type_ids, position_ids, past)
        x = run_decoder_layers(self.h, x, attention_mask, position_ids, cache)
        return body_output(self.final_norm(x), cache)

    def hf_weight_map(self):
        return gpt2_weight_map(self.config, prefix="")


class GPT2LMHeadModel(PreTrainedModel, CausalLM):
    """GPT-2 with its language-model head (tied to the token embedding unless the config says not)."""

    config_class = GPT2Config
    base_model_prefix = "transformer"
    layer_stack = "transformer.h"
    first_stage_modules = ("transformer.wte", "transformer.wpe")
    last_stage_modules = ("transformer.ln_f", "lm_head")

    def __init__(self, config: GPT2Config):
        super().__init__(config)
        self.transformer = GPT2Model(config)
        self.lm_head = LMHead(config.n_embd, config.vocab_size)
        self.post_init()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.transformer.wte.weight

    def embed(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.transformer.embed(inputs["input_ids"], inputs.get("token_type_ids"), inputs.get("position_ids"))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, cache: list[KVCache] | None = None,
                logits_to_keep: int = 0, return_logits: bool = True,
                shift_labels: torch.Tensor | None = None,
                past_key_values: list[KVCache] | None = None) -> CausalLMOutputWithPast:
        """labels [B, S] (shifted inside) or shift_labels (already aligned): see `causal_lm`; -100
        is ignored. ``return_logits=False`` skips gathering the vocabulary-split logits (training)."""
        cache = pick_cache(cache, past_key_values)
        hidden = self.transformer(input_ids, attention_mask, token_type_ids, position_ids,
                                  cache).last_hidden_state
        return self.lm_output(hidden, labels, shift_labels, cache, logits_to_keep, return_logits)

    def hf_weight_map(self):
        return gpt2_weight_map(self.config, prefix="transformer.", lm_head=not self.config.tie_word_embeddings)
