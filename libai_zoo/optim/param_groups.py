"""Split a model's parameters into the two groups every transformer recipe uses, and build the
configured optimizer over them."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from omegaconf import OmegaConf
from torch import nn

from libai_zoo.config import Section, instantiate


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


def build_optimizer(optim_cfg, model_parts: Sequence[nn.Module]) -> torch.optim.Optimizer:
    """instantiate(optim_cfg) (a LazyCall of an optimizer class) over `model_parts`: its ``params``
    recipe (`param_groups` by default) is given the parts, or without one every parameter once.
    ``optim_cfg`` may be a recipe's section (``get_config("common/optim.py").optim``) too."""
    if isinstance(optim_cfg, Section):
        optim_cfg = OmegaConf.structured(optim_cfg, flags={"allow_objects": True})
    node = OmegaConf.to_container(optim_cfg, resolve=True) if OmegaConf.is_config(optim_cfg) else dict(optim_cfg)
    params = node.get("params")
    node["params"] = instantiate({**params, "model": model_parts}) if isinstance(params, dict) \
        else unique_parameters(model_parts)
    return instantiate(node)
