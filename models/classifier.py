"""What the sequence and image classifiers share: one label per sample, and the loss transformers
chooses for it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

from .contract import TrainableModel


class Classifier(TrainableModel):
    """A classifier of the zoo: its ``config`` says num_labels and problem_type; the loss averages
    over samples."""

    loss_unit = "sample"

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        loss = classification_loss(outputs, targets, self.config)
        return loss * targets.shape[0] if reduction == "sum" else loss


def classification_loss(logits: torch.Tensor, labels: torch.Tensor, config: PretrainedConfig) -> torch.Tensor:
    """Mean squared error for one label (regression), cross entropy for class ids, binary cross
    entropy for multi-hot float labels; ``config.problem_type`` forces one and is set on first use."""
    if config.problem_type is None:
        if config.num_labels == 1:
            config.problem_type = "regression"
        elif labels.dtype in (torch.long, torch.int):
            config.problem_type = "single_label_classification"
        else:
            config.problem_type = "multi_label_classification"
    if config.problem_type == "regression":
        return F.mse_loss(logits.squeeze(-1).float(), labels.squeeze(-1).float()) if config.num_labels == 1 \
            else F.mse_loss(logits.float(), labels.float())
    if config.problem_type == "single_label_classification":
        return F.cross_entropy(logits.view(-1, config.num_labels).float(), labels.view(-1))
    if config.problem_type == "multi_label_classification":
        return F.binary_cross_entropy_with_logits(logits.float(), labels.float())
    raise ValueError(f"problem_type {config.problem_type!r} is not one of 'regression', "
                     f"'single_label_classification', 'multi_label_classification'")
