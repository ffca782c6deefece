"""Split a model's parameters into the two groups every transformer recipe uses."""

from __future__ import annotations

from torch import nn


def param_groups(model: nn.Module, weight_decay: float = 0.01) -> list[dict]:
    """[decayed, not decayed]: biases and norm weights (every parameter with fewer than two
    dimensions) get no weight decay, as in Megatron-LM and BERT; matrices and embeddings do.
    Tied parameters appear once."""
    decay, no_decay = [], []
    for param in model.parameters():  # de-duplicated: a tied weight is one parameter
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
