"""The decoder-only transformer every causal-LM family of the zoo is built from, and the
description a family gives of itself.

    ids -> embed (+ learned positions) (× multiplier) -> dropout -> L × TransformerLayer(spec.layers[i])
        -> final norm -> lm_head (× logit scale, soft-capped) -> logits

A family (GPT-2, Llama, Qwen3, Gemma, ...) is its config translated into a `DecoderSpec` (one
`layers.LayerSpec` per layer, typed and frozen: its `AttentionSpec` (q/k norms, rotary per layer or
none, sliding window, softmax scale and soft-cap) or DeepSeek's `LatentAttentionSpec`, its
`MLPSpec` (gated or plain) or `MoESpec`, norm kind and placement, residual multiplier; and the
embedding and head around them), the attribute names of its parts
(`DecoderNames`, Hugging Face's, so its weight map stays short) and its weight map. A
Llama-shaped family's layers are `llama.llama_layer`'s with what differs replaced
(`dataclasses.replace`, `LayerSpec.with_attention`). Its model file declares these in two small
classes:

    class Qwen3Model(DecoderModel):            config_class, base_model_prefix, names, describe, weight_map
    class Qwen3ForCausalLM(DecoderForCausalLM): body_class = Qwen3Model
"""

from __future__ import annotations

import contextlib
from abc import abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast, MoeCausalLMOutputWithPast

from libai_zoo.hf import WeightMap
from libai_zoo.layers import (
    NORMS,
    Embedding,
    KVCache,
    LayerSpec,
    LMHead,
    Router,
    SequenceGather,
    SequenceScatter,
    TransformerLayer,
    VocabEmbedding,
    load_balancing_loss,
    router_z_loss,
)

from .causal_lm import CACHE_NAME, CausalLM, body_output, pick_cache, run_decoder_layers
from .pretrained import PreTrainedModel


@dataclass(frozen=True)
class DecoderNames:
    """Attribute names of a decoder body's parts (its Hugging Face names)."""

    embed: str = "embed_tokens"
    layers: str = "layers"
    final_norm: str = "norm"
    positions: str | None = None  # a learned position table (GPT-2's wpe)
    #: an MoE layer's MLP, its experts' three projections (gate, up, down) and its shared expert, as the
    #: checkpoint names them
    moe: str = "mlp"
    experts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    shared_expert: str = "shared_expert"


@dataclass(frozen=True)
class DecoderSpec:
    """What a decoder-only model is, whatever its family calls it."""

    vocab_size: int
    hidden_size: int
    #: each layer's `layers.LayerSpec`, in order (they may differ per layer: sliding and full
    #: attention, rotary bases, NoPE layers, dense and MoE MLPs)
    layers: tuple[LayerSpec, ...]
    final_norm: str = "rmsnorm"
    final_norm_eps: float = 1e-6
    padding_idx: int | None = None
    #: a learned position table of this many positions (GPT-2); None: positions are the layers' (rotary) or none
    max_positions: int | None = None
    #: GPT-2 adds the token embedding of token_type_ids when given
    token_types: bool = False
    embedding_dropout: float = 0.0
    #: the embeddings are multiplied by it (Granite's embedding_multiplier, Gemma's sqrt(hidden))
    embedding_multiplier: float = 1.0
    #: Gemma rounds the multiplier to the embeddings' dtype first (it matters under bf16)
    multiplier_in_dtype: bool = False
    #: logits × logit_scale (Granite: 1 / logits_scaling), then capped at ±logit_softcap (Gemma 2)
    logit_scale: float = 1.0
    logit_softcap: float | None = None
    #: Mixture of Experts: the experts of each MoE layer (0: no MoE layer; layers whose ``mlp`` is a
    #: `layers.MoESpec` are MoE layers), and transformers' auxiliary loss: added × router_aux_loss_coef to the loss when
    #: output_router_logits; the router z-loss (ST-MoE) added × router_z_loss_coef
    num_experts: int = 0
    router_aux_loss_coef: float = 0.0
    output_router_logits: bool = False
    router_z_loss_coef: float = 0.0


@dataclass
class MoeCausalLMOutput(MoeCausalLMOutputWithPast):
    """transformers' MoE output, with the router statistics summed over the layers (`layers.MoE`),
    from which the train step tells the auxiliary terms (`aux_loss`) from the loss over the targets."""

    router_stats: torch.Tensor | None = None


class DecoderModel(PreTrainedModel):
    """A decoder-only body: embedding, the described layers and the final norm. A family sets
    `config_class`, `base_model_prefix`, `names`, and implements `describe` and `weight_map`."""

    names: ClassVar[DecoderNames] = DecoderNames()

    @staticmethod
    @abstractmethod
    def describe(config) -> DecoderSpec:
        """The family's config as a `DecoderSpec`."""

    @abstractmethod
    def weight_map(self, prefix: str, lm_head: bool) -> WeightMap:
        """The rules between this body's parameters (names after `prefix`) and the checkpoint's,
        and the untied ``lm_head`` when asked."""

    def __init__(self, config):
        super().__init__(config)
        spec = self.spec = self.describe(config)
        names, hidden = self.names, spec.hidden_size
        # Learned positions and dropout act on the whole sequence: the embedding is split (SP) after them.
        split_later = spec.max_positions is not None or spec.embedding_dropout > 0
        setattr(self, names.embed, VocabEmbedding(spec.vocab_size, hidden, spec.padding_idx,
                                                  sequence_parallel=not split_later))
        if spec.max_positions is not None:
            setattr(self, names.positions, Embedding(spec.max_positions, hidden))
        self.embed_dropout = nn.Dropout(spec.embedding_dropout)
        self.scatter = SequenceScatter() if split_later else None
        setattr(self, names.layers, nn.ModuleList(TransformerLayer(layer) for layer in spec.layers))
        setattr(self, names.final_norm, NORMS[spec.final_norm](hidden, spec.final_norm_eps))
        self.gather = SequenceGather()
        self.post_init()

    def embed(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None,
              position_ids: torch.Tensor | None = None, past: int = 0) -> torch.Tensor:
        """Token (+ position, + token type) embeddings, scaled, dropout; under sequence parallelism
        this rank's part of the sequence."""
        spec, table = self.spec, getattr(self, self.names.embed)
        x = table(input_ids)
        if spec.max_positions is not None:
            if position_ids is None:
                position_ids = torch.arange(past, past + input_ids.shape[1], device=input_ids.device)[None]
            x = x + getattr(self, self.names.positions)(position_ids)
        if token_type_ids is not None:
            if not spec.token_types:
                raise ValueError(f"{type(self).__name__} takes no token_type_ids: leave them out of the batch "
                                 f"(a tokenizer's return_token_type_ids=False)")
            x = x + table(token_type_ids)
        if spec.embedding_multiplier != 1.0:
            multiplier = spec.embedding_multiplier
            x = x * (torch.tensor(multiplier, dtype=x.dtype) if spec.multiplier_in_dtype else multiplier)
        return x if self.scatter is None else self.scatter(self.embed_dropout(x))

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The last norm, and the whole sequence again under SP."""
        return self.gather(getattr(self, self.names.final_norm)(x))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: list[KVCache] | None = None, *,
                token_type_ids: torch.Tensor | None = None,
                past_key_values: list[KVCache] | None = None) -> BaseModelOutputWithPast:
        cache = pick_cache(cache, past_key_values)
        past = 0 if cache is None else cache[0].length
        x = self.embed(input_ids, token_type_ids, position_ids, past)
        stats = x.new_zeros(3, self.spec.num_experts, dtype=torch.float32) if self.spec.num_experts else None
        x, stats = run_decoder_layers(getattr(self, self.names.layers), x, attention_mask, position_ids, cache, stats)
        return body_output(self.final_norm(x), cache, stats)

    def hf_weight_map(self) -> WeightMap:
        return self.weight_map(prefix="", lm_head=False)


class DecoderForCausalLM(PreTrainedModel, CausalLM):
    """A decoder body (`body_class`) with its language-model head, untied unless the config ties
    it; the contract's paths follow from the body's names."""

    body_class: ClassVar[type[DecoderModel]]

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        body = cls.body_class
        cls.config_class, cls.other_configs, cls.containers = body.config_class, body.other_configs, body.containers
        cls.base_model_prefix = prefix = body.base_model_prefix
        names = body.names
        cls.layer_stack = f"{prefix}.{names.layers}"
        cls.first_stage_modules = tuple(f"{prefix}.{name}" for name in (names.embed, names.positions) if name)
        cls.last_stage_modules = (f"{prefix}.{names.final_norm}", "lm_head")

    def __init__(self, config):
        super().__init__(config)
        body = self.body_class(config)
        setattr(self, self.base_model_prefix, body)
        spec = body.spec
        self.lm_head = LMHead(spec.hidden_size, spec.vocab_size, logit_scale=spec.logit_scale,
                              logit_softcap=spec.logit_softcap)
        self.post_init()

    @property
    def body(self) -> DecoderModel:
        return getattr(self, self.base_model_prefix)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = getattr(self.body, self.body.names.embed).weight

    def embed(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.body.embed(inputs["input_ids"], inputs.get("token_type_ids"), inputs.get("position_ids"))

    def input_limits(self) -> dict[str, int | None]:
        """The token ids the embedding holds; the learned position table's length, if any (rotary
        positions are computed: max_position_embeddings is no hard limit)."""
        return {"vocab_size": self.body.spec.vocab_size, "max_positions": self.body.spec.max_positions}

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                cache: list[KVCache] | None = None, logits_to_keep: int = 0,
                return_logits: bool = True, shift_labels: torch.Tensor | None = None, *,
                token_type_ids: torch.Tensor | None = None, past_key_values: list[KVCache] | None = None,
                output_router_logits: bool | None = None) -> CausalLMOutputWithPast | MoeCausalLMOutput:
        """labels [B, S] (shifted inside) or shift_labels (already aligned): see `causal_lm`; -100
        is ignored. ``return_logits=False`` skips gathering the vocabulary-split logits (training).
        With MoE layers, as transformers: ``aux_loss`` (and the loss + router_aux_loss_coef ×
        aux_loss) and ``router_logits`` when ``output_router_logits`` (default: the config's)."""
        cache = pick_cache(cache, past_key_values)
        spec = self.body.spec
        asked = bool(spec.num_experts) and (output_router_logits if output_router_logits is not None
                                            else spec.output_router_logits)
        # training (return_logits=False) needs the statistics only: no logits recorded or gathered
        with self._recording_router_logits(input_ids.shape, asked and return_logits) as router_logits:
            body = self.body(input_ids, attention_mask, position_ids, cache, token_type_ids=token_type_ids)
        out = self.lm_output(body.last_hidden_state, labels, shift_labels, cache, logits_to_keep, return_logits)
        if not spec.num_experts:
            return out
        return self.moe_output(out, body.router_stats, asked, router_logits)

    @contextlib.contextmanager
    def _recording_router_logits(self, shape: torch.Size, asked: bool) -> Iterator[list[torch.Tensor] | None]:
        """While the body runs, each MoE layer's router logits [tokens, E] (float32; the whole
        sequence under sequence parallelism), in layer order, when `asked`: recorded by forward
        hooks on the routers, as transformers records its router_logits. `shape`: the input ids'."""
        if not asked:
            yield None
            return
        logits = []

        def record(router, args, routing):
            every = router.logits_of_all_tokens(routing.logits, shape.numel())
            logits.append(self.body.gather(every.view(shape[0], -1, router.num_experts)).flatten(0, 1))

        handles = [module.register_forward_hook(record) for module in self.body.modules() if isinstance(module, Router)]
        try:
            yield logits
        finally:
            for handle in handles:
                handle.remove()

    def moe_output(self, out: CausalLMOutputWithPast, stats: torch.Tensor, with_aux: bool,
                   router_logits: list[torch.Tensor] | None) -> MoeCausalLMOutput:
        """The output with the auxiliary loss (`with_aux`: output_router_logits) and the z-loss from
        the router statistics (`layers.MoE`), and the router logits when recorded."""
        spec, loss, aux_loss = self.body.spec, out.loss, None
        if with_aux:
            aux_loss = load_balancing_loss(stats, spec.num_experts)
            if loss is not None:
                loss = loss + spec.router_aux_loss_coef * aux_loss
        if spec.router_z_loss_coef and loss is not None:
            loss = loss + spec.router_z_loss_coef * router_z_loss(stats)
        return MoeCausalLMOutput(loss=loss, aux_loss=aux_loss, logits=out.logits, router_stats=stats,
                                 router_logits=None if router_logits is None else tuple(router_logits),
                                 **{CACHE_NAME: getattr(out, CACHE_NAME)})

    @property
    def has_aux_loss(self) -> bool:
        spec = self.body.spec
        return bool(spec.num_experts) and (spec.output_router_logits or bool(spec.router_z_loss_coef))

    def router_stats(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor | None:
        spec = self.body.spec
        return torch.zeros(3, spec.num_experts, device=inputs["input_ids"].device) if spec.num_experts else None

    def aux_loss(self, stats: torch.Tensor) -> torch.Tensor:
        """router_aux_loss_coef × the load-balancing loss (when the config's output_router_logits, as
        transformers) + router_z_loss_coef × the z-loss: what forward adds to the loss."""
        spec = self.body.spec
        term = stats.new_zeros(())
        if spec.output_router_logits:
            term = term + spec.router_aux_loss_coef * load_balancing_loss(stats, spec.num_experts)
        if spec.router_z_loss_coef:
            term = term + spec.router_z_loss_coef * router_z_loss(stats)
        return term

    def hf_weight_map(self) -> WeightMap:
        return self.body.weight_map(prefix=self.base_model_prefix + ".", lm_head=not self.config.tie_word_embeddings)
