"""Activation checkpointing per transformer layer: keep only each layer's input, recompute the
layer in backward. Trades one extra forward of the layers for their activation memory."""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

from libai_zoo.layers import TransformerLayer


def apply_activation_checkpointing(model: nn.Module, module_types: tuple[type, ...] = (TransformerLayer,)) -> int:
    """Make every module of `module_types` recompute its forward in backward
    (`torch.utils.checkpoint`, non-reentrant, so keyword arguments and autograd collectives work).

    Only the instance's forward is wrapped: parameter names, state dicts and hooks are unchanged.
    Returns how many modules were wrapped."""
    count = 0
    for module in model.modules():
        if isinstance(module, module_types) and not getattr(module, "_activation_checkpointed", False):
            module.forward = functools.partial(checkpoint, module.forward, use_reentrant=False)
            module._activation_checkpointed = True
            count += 1
    return count
