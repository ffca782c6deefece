"""Split a model's parameters into the two groups every transformer recipe uses."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


def unique_parameters(model: nn.Module | Sequence[nn.Module]) -> list[nn.Parameter]:
    """The parameters of a model, or of the parts a pipeline rank holds, each once (a tied weight too)."""
    parts = [model] if isinstance(model, nn.Module) else model
    return list({id(p): p for part in parts for p in part.parameters()}.values())


def param_groups(model: nn.Module | Sequence[nn.Module], weight_decay: float = 0.01) -> list[dict]:
    """[decayed, not decayed] of a model (or of the parts a pipeline rank holds): biases and norm
    weights (every parameter with fewer than two dimensions) get no weight decay, as in
    Megatron-LM and BERT; matrices and embeddings do. Tied parameters appear once."""
    decay, no_decay = [], []
    for param in unique_parameters(model):
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
