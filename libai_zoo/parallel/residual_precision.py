"""The residual stream's precision under autocast: a stated choice, ``train.amp.fp32_residual``.

Left alone, the residual stream takes the embedding's dtype: float32 parameters (one process, or
any layout without FSDP2's bf16 parameters) give a float32 stream, FSDP2's bf16 parameters a bf16
one, so a layout change would change both the numerics and the memory. Instead every layer of the
stack takes its hidden states cast to one dtype (a forward pre-hook, outside activation
checkpointing): by default the autocast dtype, as Megatron-LM's default and a bf16 transformers
model; with ``fp32_residual`` float32 (Megatron's ``--fp32-residual-connection``), which costs each
layer 4 bytes per token and hidden unit more (its two norms keep float32 inputs: 36·s·b·h/t instead
of Korthikanti's 32 for a GPT layer) and doubles what a checkpointed layer keeps. Without autocast
nothing is cast: the stream is in the parameters' dtype.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def residual_dtype(amp_dtype: torch.dtype | None, fp32_residual: bool) -> torch.dtype | None:
    """The residual stream's dtype under autocast to `amp_dtype` (None: no autocast, nothing cast)."""
    if amp_dtype is None:
        return None
    return torch.float32 if fp32_residual else amp_dtype


def to_residual(hidden: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """`hidden` in the residual `dtype` while autocast is on (a training or evaluation forward)."""
    if dtype is None or not torch.is_autocast_enabled(hidden.device.type):
        return hidden
    return hidden.to(dtype)


def cast_residual(layers: Iterable[nn.Module], dtype: torch.dtype | None) -> None:
    """Make each of `layers` (a layer stack) take its hidden states (first argument) in `dtype`
    under autocast; nothing for None."""
    if dtype is None:
        return

    def hook(module: nn.Module, args: tuple) -> tuple | None:
        if args and isinstance(args[0], torch.Tensor):
            return (to_residual(args[0], dtype), *args[1:])
        return None

    for layer in layers:
        layer.register_forward_pre_hook(hook)
