"""RoBERTa (Liu et al., 2019): BERT pre-trained longer, without next-sentence prediction.

The architecture is BERT's (bert.py) with three differences:

    positions   count from padding_idx + 1 over the non-padding tokens (fairseq's rule); padding
                keeps position padding_idx
    MLM head    dense -> GELU -> LayerNorm -> decoder tied to the word embeddings (``lm_head.*``)
    classifier  on the <s> state: dropout -> tanh(dense) -> dropout -> out_proj (``classifier.*``);
                BERT's pooler moved into the head, so the encoder has none

Hugging Face's `RobertaConfig` describes it; weights load from and save to Hugging Face RoBERTa
checkpoints (`hf_maps/roberta.py`).
"""

from __future__ import annotations

import torch
import transformers
from torch import nn

from libai_zoo.layers import Linear

from .bert import BertConfig, BertForMaskedLM, BertModel, SequenceClassifier, classifier_dropout
from .hf_maps.roberta import roberta_weight_map


class RobertaConfig(transformers.RobertaConfig):
    """Hugging Face's RobertaConfig: reads a RoBERTa config.json unchanged and writes it back."""


class RobertaModel(BertModel):
    """The RoBERTa encoder, with the pooler unless ``add_pooling_layer=False``."""

    config_class = RobertaConfig
    base_model_prefix = "roberta"
    positions_after_padding = True
    weight_map = staticmethod(roberta_weight_map)


class RobertaForMaskedLM(BertForMaskedLM):
    """RoBERTa with its masked-language-model head (GELU whatever the encoder's activation)."""

    body_class = RobertaModel
    mlm_activation = "gelu"


class RobertaClassificationHead(nn.Module):
    """dropout -> tanh(dense) -> dropout -> out_proj, on the first (<s>) token's state."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = Linear(config.hidden_size, config.hidden_size, parallel="data", sequence_parallel=False)
        self.dropout = classifier_dropout(config)
        self.out_proj = Linear(config.hidden_size, config.num_labels, parallel="data", sequence_parallel=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.dropout(torch.tanh(self.dense(self.dropout(hidden[:, 0])))))


class RobertaForSequenceClassification(SequenceClassifier):
    """RoBERTa with its classification head; config.num_labels classes (1 = regression)."""

    body_class = RobertaModel
    last_stage_modules = ("classifier",)

    def __init__(self, config: RobertaConfig):
        super().__init__(config, add_pooling_layer=False)
        self.classifier = RobertaClassificationHead(config)
        self.post_init()

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.classifier(hidden)
