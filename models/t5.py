"""T5 (Raffel et al., 2020, "Exploring the Limits of Transfer Learning with a Unified Text-to-Text
Transformer"): an encoder-decoder whose attention knows positions only through a learned bias per
head and bucket of relative distance. mT5 (mt5.py) is T5 1.1's architecture on more languages.

    input_ids -> shared -> dropout -> encoder: N × block -> final norm -> dropout -> encoder states
                 block: x = x + attn(norm(x), + bias_enc (bidirectional buckets), padding)
                        x = x + mlp(norm(x))
    labels -> shifted right (decoder_start_token_id first, -100 -> pad_token_id) = decoder_input_ids
    decoder_input_ids -> shared -> dropout -> decoder: M × block -> final norm -> dropout
                 block: x = x + causal attn(norm(x), + bias_dec (causal buckets))
                        x = x + cross attn(norm(x), encoder states, their padding)
                        x = x + mlp(norm(x))
        -> lm_head (T5 1.0: the shared table, logits × d_model^-0.5) -> logits
    loss: mean cross entropy over the labels that are not -100

In the zoo's layers:
- every norm T5's LayerNorm: an RMSNorm computed in float32 and cast to the weight's dtype
  ("rmsnorm_t5"); no bias anywhere;
- attention unscaled (softmax_scale 1: T5 folds the scale into its initialisation); each stack's
  `RelativePositionBias` is computed once per forward from its table and handed to every block of
  the stack as its self-attention's additive mask [B or 1, heads, S_q, S_k], padding at the dtype's
  lowest value (the decoder's causality is its attention layers' own); cross-attention has no
  position bias, only the encoder's padding;
- MLP: T5 1.0's ReLU (feed_forward_proj "relu"); T5 1.1's and mT5's gated GELU ("gated-gelu": the
  tanh approximation), act(wi_0) · wi_1;
- dropout_rate where transformers applies it: after the embedding, on the activated MLP neurons,
  on the attention probabilities, on every branch, after each final norm;
- the head tied to `shared` and applied to the decoder's output × d_model^-0.5 (T5 1.0:
  `scale_decoder_outputs`, an `LMHead` logit scale), or its own, unscaled (T5 1.1, mT5).

Under tensor parallelism the heads split (each stack's bias table with them), as do the MLP
neurons and the vocabulary; under sequence parallelism each stack runs on sequence shards from its
embedding to its final norm, and the encoder's output reaches the cross-attentions whole.

transformers 5 forces `tie_word_embeddings` true in T5Config and MT5Config and unties the head only
when the checkpoint holds a different lm_head.weight; the zoo's configs keep config.json's value,
which says the same of the hub's checkpoints (false in T5 1.1's and mT5's) before a weight is read.

The model contract sees two stacks (`stacks`), the encoder's then the decoder's: pipeline stages cut
them in a row, the stage that starts the decoder normalises the encoder's output and embeds the
decoder's inputs (`enter_stack`), and the encoder's output travels on with the decoder's hidden
states to every later stage (its gradient back), as in Megatron-LM's T5.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import transformers
from torch import nn
from transformers.modeling_outputs import BaseModelOutput, Seq2SeqLMOutput, Seq2SeqModelOutput

from libai_zoo.layers import (
    NORMS,
    AttentionSpec,
    EncoderDecoderCache,
    LayerSpec,
    LMHead,
    MLPSpec,
    RelativePositionBias,
    RMSNorm,
    SequenceGather,
    SequenceScatter,
    TransformerLayer,
    VocabEmbedding,
)
from libai_zoo.utils.transformers_versions import tie_word_embeddings_as_saved

from .causal_lm import CACHE_NAME, LMHeadLoss, pick_cache
from .contract import IGNORE_INDEX, Stack, TrainableModel
from .generation import Seq2SeqGenerationMixin
from .hf_maps.t5 import t5_weight_map
from .pretrained import PreTrainedModel

#: T5's LayerNorm: the root mean square in float32, the result cast to the weight's dtype
NORM = "rmsnorm_t5"


class KeepsTiedHead:
    """A config mixin: ``tie_word_embeddings`` as config.json says (transformers 5 forces it true)."""

    def __post_init__(self, **kwargs):
        tied = tie_word_embeddings_as_saved(self, kwargs)
        super().__post_init__(**kwargs)
        self.tie_word_embeddings = tied


class T5Config(KeepsTiedHead, transformers.T5Config):
    """Hugging Face's T5Config, its head tied or not as config.json says (see the module docstring)."""


class T5Stack(nn.Module):
    """One of T5's two stacks: its blocks (`block`, transformers' name), the relative position
    bias they share and the final norm; the token embedding is the model's (`shared`)."""

    def __init__(self, config: T5Config, *, decoder: bool):
        super().__init__()
        rate = config.dropout_rate
        self.relative_attention_bias = RelativePositionBias(
            config.num_heads, config.relative_attention_num_buckets, config.relative_attention_max_distance,
            bidirectional=not decoder)
        self.dropout = nn.Dropout(rate)
        self.scatter = SequenceScatter()
        attention = AttentionSpec(num_heads=config.num_heads, head_dim=config.d_kv, causal=decoder, bias=False,
                                  dropout=rate, softmax_scale=1.0)
        mlp = MLPSpec(config.d_ff, activation=config.dense_act_fn, gated=config.is_gated_act, bias=False,
                      dropout=rate)
        block = LayerSpec(config.d_model, attention, mlp, norm=NORM, norm_eps=config.layer_norm_epsilon,
                          hidden_dropout=rate, cross_attention=decoder)
        self.block = nn.ModuleList(TransformerLayer(block)
                                   for _ in range(config.num_decoder_layers if decoder else config.num_layers))
        self.final_layer_norm = NORMS[NORM](config.d_model, config.layer_norm_epsilon)
        self.gather = SequenceGather()

    def embed(self, embeddings: torch.Tensor) -> torch.Tensor:
        """The first block's input: the token embeddings after dropout; this rank's part of the
        sequence under sequence parallelism."""
        return self.scatter(self.dropout(embeddings))

    def attention_bias(self, length: int, padding: torch.Tensor | None, past: int = 0) -> torch.Tensor:
        """What every block's self-attention adds to its scores, for `length` queries after `past`
        cached positions: the stack's relative position bias [1, heads, length, past + length]
        (this rank's heads), and where `padding` [B, past + length] is 0 the dtype's lowest value
        instead ([B, heads, ...]), as transformers masks."""
        bias = self.relative_attention_bias(length, past + length, past)
        if padding is None:
            return bias
        return torch.where(padding[:, None, None, :].bool(), bias, torch.finfo(bias.dtype).min)

    def final(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm; the whole sequence again under sequence parallelism; dropout."""
        return self.dropout(self.gather(self.final_layer_norm(hidden)))

    def forward(self, embeddings: torch.Tensor, attention_mask: torch.Tensor | None = None,
                encoder_hidden_states: torch.Tensor | None = None, encoder_attention_mask: torch.Tensor | None = None,
                cache: EncoderDecoderCache | None = None) -> torch.Tensor:
        """The token embeddings [B, S, d_model] through the stack (a decoder's: of the new tokens after
        the cached ones, each block with its layer's caches) -> its output, the whole sequence."""
        bias = self.attention_bias(embeddings.shape[1], attention_mask, 0 if cache is None else cache.length)
        x = self.embed(embeddings)
        for i, block in enumerate(self.block):
            caches = {} if cache is None else {"kv_cache": cache.self_attention[i],
                                               "cross_kv_cache": cache.cross_attention[i]}
            x = block(x, attention_mask=bias, encoder_hidden_states=encoder_hidden_states,
                      encoder_attention_mask=encoder_attention_mask, **caches)
        return self.final(x)


class T5PreTrainedModel(PreTrainedModel):
    """What T5's models share: the token embedding `shared`, the encoder and (but for the encoder
    model) the decoder, T5's initialisation and its weight map."""

    config_class = T5Config
    base_model_prefix = "transformer"
    #: whether the model has the decoder stack (T5EncoderModel: no)
    has_decoder: ClassVar[bool] = True

    def __init__(self, config: T5Config):
        super().__init__(config)
        self.shared = VocabEmbedding(config.vocab_size, config.d_model, sequence_parallel=False)
        self.encoder = T5Stack(config, decoder=False)
        if self.has_decoder:
            self.decoder = T5Stack(config, decoder=True)
            self.decoder.embed_tokens = self.shared  # the same table: the decoder's own name for its pipeline stage

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The encoder's output [B, S, d_model], the whole sequence on every tp rank."""
        return self.encoder(self.shared(input_ids), attention_mask)

    def decode(self, decoder_input_ids: torch.Tensor, decoder_attention_mask: torch.Tensor | None,
               encoder_states: torch.Tensor, attention_mask: torch.Tensor | None,
               cache: EncoderDecoderCache | None = None) -> torch.Tensor:
        """The decoder's output [B, S_dec, d_model] over the encoder's output and its padding mask."""
        return self.decoder(self.shared(decoder_input_ids), decoder_attention_mask, encoder_states, attention_mask,
                            cache)

    def init_parameter(self, name: str, module: nn.Module, tensor: torch.Tensor,
                       generator: torch.Generator | None) -> None:
        """transformers' T5 initialisation, every value × initializer_factor: norms 1; normals of
        std 1 for the embedding and the head, d_model^-0.5 for the MLP's inputs and k, v and the bias
        tables, d_ff^-0.5 for its output, (d_model · d_kv)^-0.5 for q, (heads · d_kv)^-0.5 for the
        attention output."""
        config = self.config
        factor, d_model = config.initializer_factor, config.d_model
        if isinstance(module, RMSNorm):
            tensor.fill_(factor)
            return
        q_std, kv_std = (d_model * config.d_kv) ** -0.5, d_model ** -0.5
        std = {"shared": 1.0, "lm_head": 1.0, "relative_attention_bias": d_model ** -0.5, "gate": d_model ** -0.5,
               "up": d_model ** -0.5, "down": config.d_ff ** -0.5, "q": q_std, "kv": kv_std,
               "out": (config.num_heads * config.d_kv) ** -0.5}
        owner = name.split(".")[-2]
        if owner == "qkv":  # grouped per head: [q, k, v] rows of each
            tensor.normal_(0.0, factor, generator=generator)
            grouped = tensor.view(config.num_heads, 3, -1, tensor.shape[-1])
            grouped[:, 0].mul_(q_std)
            grouped[:, 1:].mul_(kv_std)
        else:
            tensor.normal_(0.0, factor * std[owner], generator=generator)

    def hf_weight_map(self):
        return t5_weight_map(self.config, decoder=self.has_decoder, lm_head=False)


class T5Model(T5PreTrainedModel):
    """The bare encoder-decoder: the decoder's last hidden state."""

    def __init__(self, config: T5Config):
        super().__init__(config)
        self.post_init()

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                decoder_input_ids: torch.Tensor | None = None, decoder_attention_mask: torch.Tensor | None = None,
                *, encoder_outputs: tuple[torch.Tensor, ...] | None = None,
                cache: EncoderDecoderCache | None = None,
                past_key_values: EncoderDecoderCache | None = None) -> Seq2SeqModelOutput:
        """``encoder_outputs`` (its first element the encoder's output) skips the encoder."""
        if decoder_input_ids is None:
            raise ValueError("T5Model needs decoder_input_ids (the targets shifted right, decoder_start_token_id "
                             "first; T5ForConditionalGeneration makes them from labels)")
        cache = pick_cache(cache, past_key_values)
        encoder_states = self.encode(input_ids, attention_mask) if encoder_outputs is None else encoder_outputs[0]
        hidden = self.decode(decoder_input_ids, decoder_attention_mask, encoder_states, attention_mask, cache)
        return Seq2SeqModelOutput(last_hidden_state=hidden, encoder_last_hidden_state=encoder_states,
                                  **{CACHE_NAME: cache})


class T5EncoderModel(T5PreTrainedModel):
    """The encoder alone (a text encoder for retrieval or diffusion models); it loads the encoder of
    any T5 checkpoint."""

    has_decoder = False

    def __init__(self, config: T5Config):
        super().__init__(config)
        self.post_init()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> BaseModelOutput:
        return BaseModelOutput(last_hidden_state=self.encode(input_ids, attention_mask))


class T5ForConditionalGeneration(T5PreTrainedModel, LMHeadLoss, Seq2SeqGenerationMixin, TrainableModel):
    """T5 with its language-model head: labels [B, S_dec] are the targets, and shifted right the
    decoder's inputs (unless decoder_input_ids are given). Its two stacks pipeline as Megatron-LM's
    T5 does: encoder stages, then decoder stages, the encoder's output travelling to every one."""

    layer_stack = "encoder.block"
    first_stage_modules = ("shared",)
    last_stage_modules = ("decoder.final_layer_norm", "lm_head")
    loss_unit = "token"
    #: whether the decoder's output is scaled by d_model^-0.5 before the head; None: as the config's
    #: ``scale_decoder_outputs`` says (T5: when config.json does not untie the head)
    scales_decoder_output: ClassVar[bool | None] = None

    def __init__(self, config: T5Config):
        super().__init__(config)
        scaled = config.scale_decoder_outputs if self.scales_decoder_output is None else self.scales_decoder_output
        self.lm_head = LMHead(config.d_model, config.vocab_size, logit_scale=config.d_model ** -0.5 if scaled else 1.0)
        self.post_init()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.shared.weight

    def decoder_inputs(self, labels: torch.Tensor) -> torch.Tensor:
        """The decoder's inputs of `labels`: shifted right, decoder_start_token_id first, -100 (ignored
        targets) as pad_token_id, as transformers makes them."""
        start, pad = getattr(self.config, "decoder_start_token_id", None), self.config.pad_token_id
        if start is None or pad is None:
            raise ValueError(f"{type(self).__name__} makes its decoder's inputs from the labels with the config's "
                             f"decoder_start_token_id and pad_token_id (T5's: 0 and 0): set them in config.json")
        shifted = torch.cat([labels.new_full((*labels.shape[:-1], 1), start), labels[..., :-1]], dim=-1)
        return shifted.masked_fill(shifted == IGNORE_INDEX, pad)

    # ------------------------------------------------------------------------------- the contract
    def split_batch(self, batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """(inputs with the decoder's inputs made from the labels unless given, the labels)."""
        inputs = {key: value for key, value in batch.items() if key != "labels"}
        if "decoder_input_ids" not in inputs:
            inputs["decoder_input_ids"] = self.decoder_inputs(batch["labels"])
        return inputs, batch["labels"]

    def stacks(self) -> tuple[Stack, ...]:
        """The encoder's blocks, then the decoder's: the stage running the decoder's first block holds
        the encoder's final norm and the shared table (`enter_stack`); each stack's position bias is
        on every stage running one of its blocks; the encoder's output travels with the decoder."""
        return (Stack("encoder.block", shared_modules=("encoder.relative_attention_bias",)),
                Stack("decoder.block", ("encoder.final_layer_norm", "decoder.embed_tokens"),
                      ("decoder.relative_attention_bias",),
                      carries=1))

    def embed(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The encoder's first block's input."""
        return self.encoder.embed(self.shared(inputs["input_ids"]))

    def layer_inputs(self, inputs: dict[str, torch.Tensor], hidden: torch.Tensor | None = None) -> dict:
        """The encoder blocks' keyword arguments: the encoder's position bias, with its padding."""
        length = self.encoder.scatter.whole_length(hidden)
        return {"attention_mask": self.encoder.attention_bias(length, inputs.get("attention_mask"))}

    def enter_stack(self, index: int, hidden: torch.Tensor, carried: tuple[torch.Tensor, ...],
                    inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The decoder's embedded inputs, and the encoder's output (normalised, whole) to carry."""
        embedded = self.decoder.embed(self.decoder.embed_tokens(inputs["decoder_input_ids"]))
        return embedded, (self.encoder.final(hidden),)

    def stack_layer_inputs(self, index: int, inputs: dict[str, torch.Tensor], hidden: torch.Tensor,
                           carried: tuple[torch.Tensor, ...]) -> dict:
        """The encoder's `layer_inputs`; the decoder blocks': the decoder's position bias (with its
        padding), the encoder's output and its padding."""
        if index == 0:
            return self.layer_inputs(inputs, hidden)
        length = inputs["decoder_input_ids"].shape[1]
        return {"attention_mask": self.decoder.attention_bias(length, inputs.get("decoder_attention_mask")),
                "encoder_hidden_states": carried[0], "encoder_attention_mask": inputs.get("attention_mask")}

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.decoder.final(hidden)

    def input_limits(self) -> dict[str, int | None]:
        """The token ids the shared table holds; relative positions have no length limit."""
        return {"vocab_size": self.config.vocab_size, "max_positions": None}

    def looked_up_parameters(self) -> list[nn.Parameter]:
        """The shared table (unless it is also the head) and both stacks' position bias tables. The
        contract's FLOPs count then takes a source token through the encoder and a target token
        through the decoder (targets as long as the sources), each self- and cross-attention counted."""
        return [*super().looked_up_parameters(), self.encoder.relative_attention_bias.weight,
                self.decoder.relative_attention_bias.weight]

    # ----------------------------------------------------------------------------------- forward
    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                decoder_input_ids: torch.Tensor | None = None, decoder_attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, return_logits: bool = True, *,
                encoder_outputs: tuple[torch.Tensor, ...] | None = None, cache: EncoderDecoderCache | None = None,
                past_key_values: EncoderDecoderCache | None = None) -> Seq2SeqLMOutput:
        """labels [B, S_dec] (-100: ignored) give the loss and, shifted right, the decoder's inputs
        unless ``decoder_input_ids`` are given. ``return_logits=False`` skips gathering the
        vocabulary-split logits (training: the loss is then computed chunk by chunk for a large
        vocabulary). ``encoder_outputs`` (its first element the encoder's output) skips the encoder;
        ``cache``: the decoder's caches while generating."""
        cache = pick_cache(cache, past_key_values)
        encoder_states = self.encode(input_ids, attention_mask) if encoder_outputs is None else encoder_outputs[0]
        if decoder_input_ids is None:
            if labels is None:
                raise ValueError(f"{type(self).__name__} needs decoder_input_ids, or labels to make them from")
            decoder_input_ids = self.decoder_inputs(labels)
        hidden = self.decode(decoder_input_ids, decoder_attention_mask, encoder_states, attention_mask, cache)
        out = {"encoder_last_hidden_state": encoder_states, CACHE_NAME: cache}
        if labels is not None and not return_logits:  # training: never all the logits at once
            return Seq2SeqLMOutput(loss=self.head_loss(hidden, labels), **out)
        logits = self.head(hidden)
        loss = None if labels is None else self.loss(logits, labels)
        return Seq2SeqLMOutput(loss=loss, logits=self.lm_head.gather(logits) if return_logits else None, **out)

    def hf_weight_map(self):
        return t5_weight_map(self.config, decoder=True, lm_head=not self.config.tie_word_embeddings)
