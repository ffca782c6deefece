"""BERT (Devlin et al., 2019): a bidirectional encoder with post-norm layers.

    ids -> word + position + token-type embeddings -> LayerNorm -> dropout
        -> L × [x = LN(x + attn(x)); x = LN(x + mlp(x))] -> last_hidden_state
        -> pooler (tanh(dense(x[:, 0])))           -> sequence classifier
        -> transform (dense, act, LayerNorm) -> decoder tied to the word embeddings -> MLM logits

Hugging Face's `BertConfig` describes it; weights load from and save to Hugging Face BERT
checkpoints (`hf_maps/bert.py`).
"""

from __future__ import annotations

import torch
import transformers
from torch import nn
from transformers.modeling_outputs import (BaseModelOutputWithPooling, MaskedLMOutput,
                                           SequenceClassifierOutput)

from libai_zoo.layers import (Embedding, LayerNorm, Linear, LMHead, SequenceGather, SequenceScatter,
                              TransformerLayer, VocabEmbedding)
from libai_zoo.layers.mlp import ACTIVATIONS

from .classifier import Classifier
from .contract import TrainableModel
from .hf_maps.bert import bert_weight_map
from .pretrained import PreTrainedModel


class BertConfig(transformers.BertConfig):
    """Hugging Face's BertConfig: reads a BERT config.json unchanged and writes it back."""


class BertEmbeddings(nn.Module):
    """Sum of word, position and token-type embeddings, normalised."""

    def __init__(self, config: BertConfig):
        super().__init__()
        hidden = config.hidden_size
        self.word_embeddings = VocabEmbedding(config.vocab_size, hidden, config.pad_token_id, sequence_parallel=False)
        self.position_embeddings = Embedding(config.max_position_embeddings, hidden)
        self.token_type_embeddings = Embedding(config.type_vocab_size, hidden)
        self.norm = LayerNorm(hidden, config.layer_norm_eps, sequence_parallel=False)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids, token_type_ids=None, position_ids=None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
        return self.dropout(self.norm(x + self.token_type_embeddings(token_type_ids)))


class BertModel(PreTrainedModel):
    """The BERT encoder, with the pooler unless ``add_pooling_layer=False``."""

    config_class = BertConfig
    base_model_prefix = "bert"

    def __init__(self, config: BertConfig, add_pooling_layer: bool = True):
        super().__init__(config)
        if getattr(config, "position_embedding_type", None) not in (None, "absolute"):
            raise ValueError(f"position_embedding_type={config.position_embedding_type!r} is not supported: "
                             f"libai_zoo's BERT uses absolute positions")
        if config.is_decoder or config.add_cross_attention:
            raise ValueError("libai_zoo's BERT is an encoder: is_decoder/add_cross_attention are not supported")
        hidden = config.hidden_size
        self.embeddings = BertEmbeddings(config)
        self.scatter = SequenceScatter()
        self.layer = nn.ModuleList(
            TransformerLayer(hidden, config.num_attention_heads, config.intermediate_size, norm_position="post",
                             norm_eps=config.layer_norm_eps, activation=config.hidden_act,
                             attention_dropout=config.attention_probs_dropout_prob,
                             hidden_dropout=config.hidden_dropout_prob)
            for _ in range(config.num_hidden_layers))
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

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> BaseModelOutputWithPooling:
        x = self.embed(input_ids, token_type_ids, position_ids)
        for layer in self.layer:
            x = layer(x, attention_mask)
        x = self.final_norm(x)
        return BaseModelOutputWithPooling(last_hidden_state=x,
                                          pooler_output=self.pool(x) if self.pooler is not None else None)

    def hf_weight_map(self):
        return bert_weight_map(self.config, prefix="", pooler=self.pooler is not None)


class BertMLMHead(nn.Module):
    """transform (dense, activation, LayerNorm), then the decoder onto the vocabulary (this rank's
    slice of it under tp)."""

    def __init__(self, config: BertConfig):
        super().__init__()
        hidden = config.hidden_size
        self.dense = Linear(hidden, hidden, parallel="data", sequence_parallel=False)
        self.act = ACTIVATIONS[config.hidden_act]
        self.norm = LayerNorm(hidden, config.layer_norm_eps, sequence_parallel=False)
        self.decoder = LMHead(hidden, config.vocab_size, bias=True)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.norm(self.act(self.dense(hidden_states))))


class BertTaskModel(PreTrainedModel):
    """The parts of the contract BERT's task models share: the encoder's stack and inputs."""

    config_class = BertConfig
    base_model_prefix = "bert"
    layer_stack = "bert.layer"
    first_stage_modules = ("bert.embeddings",)

    def embed(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.bert.embed(inputs["input_ids"], inputs.get("token_type_ids"), inputs.get("position_ids"))

    def layer_inputs(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"attention_mask": inputs.get("attention_mask")}

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.bert.final_norm(hidden)


class BertForMaskedLM(BertTaskModel, TrainableModel):
    """BERT with the masked-language-model head; labels are -100 except at masked positions."""

    last_stage_modules = ("mlm_head",)
    loss_unit = "token"

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.bert = BertModel(config, add_pooling_layer=False)
        self.mlm_head = BertMLMHead(config)
        self.post_init()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.mlm_head.decoder.weight = self.bert.embeddings.word_embeddings.weight

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.mlm_head(hidden)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        return self.mlm_head.decoder.loss(outputs, targets, reduction)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, return_logits: bool = True) -> MaskedLMOutput:
        logits = self.head(self.bert(input_ids, attention_mask, token_type_ids, position_ids).last_hidden_state)
        loss = None if labels is None else self.loss(logits, labels)
        return MaskedLMOutput(loss=loss, logits=self.mlm_head.decoder.gather(logits) if return_logits else None)

    def hf_weight_map(self):
        return bert_weight_map(self.config, prefix="bert.", pooler=False, mlm_head=True)


class BertForSequenceClassification(BertTaskModel, Classifier):
    """BERT with a classifier on the pooled first token; config.num_labels classes (1 = regression)."""

    last_stage_modules = ("bert.pooler", "classifier")

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.bert = BertModel(config)
        dropout = config.classifier_dropout
        self.dropout = nn.Dropout(config.hidden_dropout_prob if dropout is None else dropout)
        self.classifier = Linear(config.hidden_size, config.num_labels, parallel="data", sequence_parallel=False)
        self.post_init()

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.dropout(self.bert.pool(hidden)))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, return_logits: bool = True) -> SequenceClassifierOutput:
        """``return_logits`` is accepted for the engine's sake; the logits are small and always returned."""
        pooled = self.bert(input_ids, attention_mask, token_type_ids, position_ids).pooler_output
        logits = self.classifier(self.dropout(pooled))
        return SequenceClassifierOutput(loss=None if labels is None else self.loss(logits, labels), logits=logits)

    def hf_weight_map(self):
        return bert_weight_map(self.config, prefix="bert.", pooler=True, classifier=True)
