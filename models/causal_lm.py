"""What the decoder-only language models (GPT-2, GPT-NeoX, Llama) share: running the decoder
layers, next-token targets, the LM head and its loss, their Hugging Face-style output, and
generation.

    labels [B, S]         position t is scored against labels[t + 1] (shifted here, once)
    shift_labels [B, S]   transformers' name for targets already aligned (position t against
                          shift_labels[t]), e.g. tokens[1:] of a window of S + 1 tokens

The KV caches (one `KVCache` per layer) go in and out under the installed transformers' name:
`cache` since transformers 5.24 (which warns on the old one), `past_key_values` before; a forward
takes either.

Packed samples (several sequences in a row, `libai_zoo.data.build_chat_dataset`) follow
transformers: position_ids that restart and no attention_mask; every layer then gets one
block-diagonal causal mask (`packed_causal_mask`), so no token sees another sequence; under
context parallelism the layers' own `ContextMask` of the whole sequence (`layer_attention_mask`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from libai_zoo.layers import KVCache, layer_attention_mask
from libai_zoo.utils.transformers_versions import cache_output_name

from .contract import IGNORE_INDEX, TrainableModel
from .generation import GenerationMixin

TARGET_KEYS = ("labels", "shift_labels")
#: What the installed transformers calls the KV cache in forward arguments and outputs.
CACHE_NAME = cache_output_name(BaseModelOutputWithPast)


def pick_cache(cache: list[KVCache] | None, past_key_values: list[KVCache] | None) -> list[KVCache] | None:
    """The KV caches passed under either name (transformers' `cache`, or its older `past_key_values`)."""
    if cache is not None and past_key_values is not None:
        raise ValueError("pass the KV caches as cache or as past_key_values (its older name), not both")
    return past_key_values if cache is None else cache


@dataclass
class MoeBodyOutput(BaseModelOutputWithPast):
    """A body with MoE layers: its output and the router statistics summed over its layers
    (`layers.MoE`: [3, E])."""

    router_stats: torch.Tensor | None = None


def body_output(hidden: torch.Tensor, cache: list[KVCache] | None,
                router_stats: torch.Tensor | None = None) -> BaseModelOutputWithPast:
    """A decoder body's output, its caches under the installed transformers' name (and its router
    statistics if it has MoE layers)."""
    if router_stats is None:
        return BaseModelOutputWithPast(last_hidden_state=hidden, **{CACHE_NAME: cache})
    return MoeBodyOutput(last_hidden_state=hidden, router_stats=router_stats, **{CACHE_NAME: cache})


def run_decoder_layers(layers: torch.nn.ModuleList, x: torch.Tensor, attention_mask: torch.Tensor | None,
                       position_ids: torch.Tensor | None, cache: list[KVCache] | None,
                       router_stats: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The hidden states through a body's decoder layers, each with its KV cache when generating;
    in training, packed samples attend within themselves (transformers' rule). With
    ``router_stats`` (zeros [3, E]) the MoE layers add their router statistics to it: returns
    (hidden states, router statistics or None)."""
    if cache is None:
        attention_mask = layer_attention_mask(layers, attention_mask, position_ids)
    for i, layer in enumerate(layers):
        kv_cache = None if cache is None else cache[i]
        if router_stats is None:
            x = layer(x, attention_mask, position_ids, kv_cache=kv_cache)
        else:
            x, router_stats = layer(x, attention_mask, position_ids, kv_cache=kv_cache, router_stats=router_stats)
    return x, router_stats


def next_token_targets(labels: torch.Tensor) -> torch.Tensor:
    """Targets aligned with the positions: position t predicts labels[t + 1]; the last position has
    no next token (IGNORE_INDEX)."""
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


class LMHeadLoss:
    """The contract's head and loss of a language model whose head is ``lm_head``, a `layers.LMHead`:
    logits split over the vocabulary under tp, their vocabulary-parallel cross entropy, and the loss
    computed without all the logits at once (`LMHead.loss_from_hidden`: in chunks of tokens)."""

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        return self.lm_head.loss(outputs, targets, reduction)

    def head_loss(self, hidden: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        return self.lm_head.loss_from_hidden(hidden, targets, reduction)


class CausalLM(LMHeadLoss, GenerationMixin, TrainableModel):
    """A decoder-only language model of the zoo: a body (under ``base_model_prefix``) with
    ``embed`` and ``final_norm``, and ``lm_head``, a `layers.LMHead`."""

    loss_unit = "token"

    @staticmethod
    def targets(labels: torch.Tensor | None, shift_labels: torch.Tensor | None) -> torch.Tensor | None:
        """The targets aligned with the positions: shift_labels as they are, else labels shifted."""
        if shift_labels is not None:
            return shift_labels
        return None if labels is None else next_token_targets(labels)

    def split_batch(self, batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        inputs = {key: value for key, value in batch.items() if key not in TARGET_KEYS}
        return inputs, self.targets(batch.get("labels"), batch.get("shift_labels"))

    def layer_inputs(self, inputs: dict[str, torch.Tensor], hidden: torch.Tensor | None = None) -> dict:
        """The attention mask (a packed sample's block-diagonal causal mask, made here once for all the
        stage's layers) and the positions (rotary; learned positions ignore them here)."""
        position_ids = inputs.get("position_ids")
        return {"attention_mask": layer_attention_mask(self, inputs.get("attention_mask"), position_ids),
                "position_ids": position_ids}

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.base_model_prefix).final_norm(hidden)

    def lm_output(self, hidden: torch.Tensor, labels: torch.Tensor | None, shift_labels: torch.Tensor | None,
                  cache: list[KVCache] | None, logits_to_keep: int,
                  return_logits: bool) -> CausalLMOutputWithPast:
        """The head on the body's output: loss over the targets (if any), logits gathered over the
        vocabulary unless ``return_logits=False`` (then the loss is computed chunk by chunk for a
        large vocabulary: `LMHead.loss_from_hidden`); ``logits_to_keep=n`` projects only the last
        n positions (generation)."""
        targets = self.targets(labels, shift_labels)
        if logits_to_keep:
            if targets is not None:
                raise ValueError("logits_to_keep computes the last positions only: it cannot take labels")
            hidden = hidden[:, -logits_to_keep:]
        if targets is not None and not return_logits:  # training: never all the logits at once
            return CausalLMOutputWithPast(loss=self.head_loss(hidden, targets), **{CACHE_NAME: cache})
        logits = self.head(hidden)
        loss = None if targets is None else self.loss(logits, targets)
        return CausalLMOutputWithPast(loss=loss, logits=self.lm_head.gather(logits) if return_logits else None,
                                      **{CACHE_NAME: cache})
