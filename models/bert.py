"""BERT (Devlin et al., 2019): a bidirectional encoder with post-norm layers.

    ids -> word + position + token-type embeddings -> LayerNorm -> dropout
        -> L × [x = LN(x + attn(x)); x = LN(x + mlp(x))] -> last_hidden_state
        -> pooler (tanh(dense(x[:, 0])))           -> sequence classifier
        -> transform (dense, act, LayerNorm) -> decoder tied to the word embeddings -> MLM logits

Hugging Face's `BertConfig` describes it; weights load from and save to Hugging Face BERT
checkpoints (`hf_maps/bert.py`). RoBERTa (roberta.py) is this model with its positions counted
from the padding, other head names and its own classification head: the classes below take
those as class attributes (`positions_after_padding`, `weight_map`, `body_class`,
`mlm_activation`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
import transformers
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPooling, MaskedLMOutput, SequenceClassifierOutput

from libai_zoo.hf import WeightMap
from libai_zoo.layers import (
    AttentionSpec,
    Embedding,
    LayerNorm,
    LayerSpec,
    Linear,
    LMHead,
    MLPSpec,
    SequenceGather,
    SequenceScatter,
    TransformerLayer,
    VocabEmbedding,
)
from libai_zoo.layers.mlp import ACTIVATIONS

from .classifier import Classifier
from .contract import TrainableModel
from .hf_maps.bert import bert_weight_map
from .pretrained import PreTrainedModel


class BertConfig(transformers.BertConfig):
    """Hugging Face's BertConfig: reads a BERT config.json unchanged and writes it back."""


class BertEmbeddings(nn.Module):
    """Sum of word, position and token-type embeddings, normalised. Positions count from 0, or with
    `positions_after_padding` (RoBERTa, after fairseq) from padding_idx + 1 over the non-padding
    tokens, padding keeping position padding_idx (a row that gets no gradient)."""

    def __init__(self, config: BertConfig, positions_after_padding: bool = False):
        super().__init__()
        hidden, pad = config.hidden_size, config.pad_token_id
        self.word_embeddings = VocabEmbedding(config.vocab_size, hidden, pad, sequence_parallel=False)
        self.position_embeddings = Embedding(config.max_position_embeddings, hidden,
                                             pad if positions_after_padding else None)
        self.token_type_embeddings = Embedding(config.type_vocab_size, hidden)
        self.norm = LayerNorm(hidden, config.layer_norm_eps, sequence_parallel=False)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.positions_after_padding, self.padding_idx = positions_after_padding, pad

    def position_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.positions_after_padding:
            return torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        tokens = input_ids.ne(self.padding_idx)
        return tokens.cumsum(1) * tokens + self.padding_idx

    def forward(self, input_ids, token_type_ids=None, position_ids=None) -> torch.Tensor:
        if position_ids is None:
            position_ids = self.position_ids(input_ids)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
        return self.dropout(self.norm(x + self.token_type_embeddings(token_type_ids)))


class BertModel(PreTrainedModel):
    """The BERT encoder, with the pooler unless ``add_pooling_layer=False``."""

    config_class = BertConfig
    base_model_prefix = "bert"
    positions_after_padding: ClassVar[bool] = False
    #: the checkpoint names of this body and of its task models' heads (hf_maps/)
    weight_map: ClassVar[Callable[..., WeightMap]] = staticmethod(bert_weight_map)

    def __init__(self, config: BertConfig, add_pooling_layer: bool = True):
        super().__init__(config)
        if getattr(config, "position_embedding_type", None) not in (None, "absolute"):
            raise ValueError(f"position_embedding_type={config.position_embedding_type!r} is not supported: "
                             f"libai_zoo's {config.model_type} uses absolute positions")
        if config.is_decoder or config.add_cross_attention:
            raise ValueError(f"libai_zoo's {config.model_type} is an encoder: is_decoder/add_cross_attention are "
                             f"not supported")
        hidden = config.hidden_size
        self.embeddings = BertEmbeddings(config, self.positions_after_padding)
        self.scatter = SequenceScatter()
        layer = LayerSpec(hidden, AttentionSpec(config.num_attention_heads, dropout=config.attention_probs_dropout_prob),
                          MLPSpec(config.intermediate_size, activation=config.hidden_act), norm_position="post",
                          norm_eps=config.layer_norm_eps, hidden_dropout=config.hidden_dropout_prob)
        self.layer = nn.ModuleList(TransformerLayer(layer) for _ in range(config.num_hidden_layers))
        self.gather = SequenceGather()
        self.pooler = Linear(hidden, hidden, parallel="data", sequence_parallel=False) if add_pooling_layer else None
        self.post_init()

    def embed(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None,
              position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The embeddings; this rank's part of the sequence under SP."""
        return self.scatter(self.embeddings(input_ids, token_type_ids, position_ids))

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """BERT's post-norm layers end normalised: only the whole sequence again under SP."""
        return self.gather(x)

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """tanh(dense(the [CLS] state))."""
        return torch.tanh(self.pooler(x[:, 0]))

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
               token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The last hidden state (before the pooler)."""
        x = self.embed(input_ids, token_type_ids, position_ids)
        for layer in self.layer:
            x = layer(x, attention_mask)
        return self.final_norm(x)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> BaseModelOutputWithPooling:
        x = self.encode(input_ids, attention_mask, token_type_ids, position_ids)
        return BaseModelOutputWithPooling(last_hidden_state=x,
                                          pooler_output=self.pool(x) if self.pooler is not None else None)

    def hf_weight_map(self):
        return self.weight_map(self.config, prefix="", pooler=self.pooler is not None)


class BertMLMHead(nn.Module):
    """transform (dense, activation, LayerNorm), then the decoder onto the vocabulary (this rank's
    slice of it under tp)."""

    def __init__(self, config: BertConfig, activation: str):
        super().__init__()
        hidden = config.hidden_size
        self.dense = Linear(hidden, hidden, parallel="data", sequence_parallel=False)
        self.act = ACTIVATIONS[activation]
        self.norm = LayerNorm(hidden, config.layer_norm_eps, sequence_parallel=False)
        self.decoder = LMHead(hidden, config.vocab_size, bias=True)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.norm(self.act(self.dense(hidden_states))))


class BertTaskModel(PreTrainedModel):
    """The parts of the contract BERT's task models share: the encoder (`body_class`, kept under
    its ``base_model_prefix``), its stack and inputs."""

    body_class: ClassVar[type[BertModel]] = BertModel

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.config_class, cls.base_model_prefix = cls.body_class.config_class, cls.body_class.base_model_prefix
        cls.layer_stack = f"{cls.base_model_prefix}.layer"
        cls.first_stage_modules = (f"{cls.base_model_prefix}.embeddings",)

    def __init__(self, config: BertConfig, add_pooling_layer: bool):
        super().__init__(config)
        setattr(self, self.base_model_prefix, self.body_class(config, add_pooling_layer=add_pooling_layer))

    @property
    def body(self) -> BertModel:
        return getattr(self, self.base_model_prefix)

    def embed(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.body.embed(inputs["input_ids"], inputs.get("token_type_ids"), inputs.get("position_ids"))

    def layer_inputs(self, inputs: dict[str, torch.Tensor], hidden: torch.Tensor | None = None) -> dict:
        return {"attention_mask": inputs.get("attention_mask")}

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.body.final_norm(hidden)

    def input_limits(self) -> dict[str, int | None]:
        """Positions counted after the padding leave padding_idx + 1 rows of the table unused by tokens."""
        limits = super().input_limits()
        if self.body_class.positions_after_padding:
            limits["max_positions"] -= self.config.pad_token_id + 1
        return limits

    def body_weight_map(self, **heads: bool) -> WeightMap:
        """The checkpoint names of the body (its pooler if it has one) and of `heads`."""
        return self.body_class.weight_map(self.config, prefix=f"{self.base_model_prefix}.",
                                          pooler=self.body.pooler is not None, **heads)


class BertForMaskedLM(BertTaskModel, TrainableModel):
    """BERT with the masked-language-model head; labels are -100 except at masked positions."""

    last_stage_modules = ("mlm_head",)
    loss_unit = "token"
    #: the head's activation; None: the config's hidden_act
    mlm_activation: ClassVar[str | None] = None

    def __init__(self, config: BertConfig):
        super().__init__(config, add_pooling_layer=False)
        self.mlm_head = BertMLMHead(config, self.mlm_activation or config.hidden_act)
        self.post_init()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.mlm_head.decoder.weight = self.body.embeddings.word_embeddings.weight

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.mlm_head(hidden)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        return self.mlm_head.decoder.loss(outputs, targets, reduction)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, return_logits: bool = True) -> MaskedLMOutput:
        logits = self.head(self.body.encode(input_ids, attention_mask, token_type_ids, position_ids))
        loss = None if labels is None else self.loss(logits, labels)
        return MaskedLMOutput(loss=loss, logits=self.mlm_head.decoder.gather(logits) if return_logits else None)

    def hf_weight_map(self):
        return self.body_weight_map(mlm_head=True)


class SequenceClassifier(BertTaskModel, Classifier):
    """A classifier over the encoder's states; subclasses build the head."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, return_logits: bool = True) -> SequenceClassifierOutput:
        """``return_logits`` is accepted for the engine's sake; the logits are small and always returned."""
        logits = self.head(self.body.encode(input_ids, attention_mask, token_type_ids, position_ids))
        return SequenceClassifierOutput(loss=None if labels is None else self.loss(logits, labels), logits=logits)

    def hf_weight_map(self):
        return self.body_weight_map(classifier=True)


def classifier_dropout(config: BertConfig) -> nn.Dropout:
    return nn.Dropout(config.hidden_dropout_prob if config.classifier_dropout is None else config.classifier_dropout)


class BertForSequenceClassification(SequenceClassifier):
    """BERT with a classifier on the pooled first token; config.num_labels classes (1 = regression)."""

    last_stage_modules = ("bert.pooler", "classifier")

    def __init__(self, config: BertConfig):
        super().__init__(config, add_pooling_layer=True)
        self.dropout = classifier_dropout(config)
        self.classifier = Linear(config.hidden_size, config.num_labels, parallel="data", sequence_parallel=False)
        self.post_init()

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.dropout(self.body.pool(hidden)))
