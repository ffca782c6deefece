"""A cheap function whose output backward recomputes: only its inputs are saved.

Norms and the gated activation act(gate)·up are elementwise or per token: recomputing them costs a
pass over tensors already in memory, while autograd would keep their intermediates (a float32
copy of a norm's input, the normalised values beside the weighted ones, act(gate) beside gate).
`recomputed(fn, *tensors)` saves `tensors` alone; backward runs `fn` on them again, with the same
ops under the forward's autocast state, and differentiates that, so the gradients are the ones
autograd gives without it, bit for bit.

Whether a layer recomputes is its ``elementwise_recompute`` (``train.elementwise_recompute``, set on
a model by `set_elementwise_recompute`; `ELEMENTWISE_RECOMPUTE`). Recomputing frees memory only where
the op would keep more than its inputs, and it is not free where the kernels are cheap: a LayerNorm in
its input's dtype keeps its input, mean and rstd, so recomputing it frees 8 bytes a token while it
runs the forward again inside a nested autograd pass. Measured (2-core CPU, fp32, torch 2.13.0+cpu,
2026-12-03; benchmarks/results/README.md, "elementwise_recompute"): one LayerNorm forward + backward
of [4, 128, 256] takes 0.70 ms recomputed against 0.34 ms kept (2 threads; 0.91 against 0.49 ms on 1),
and GPT-2's training step (hidden 256, 4 layers, seq 128, batch 4: 9 LayerNorms) 1.011-1.017 × as long
with its norms recomputed ("always") as kept ("auto"). Under autocast, where CUDA runs layer_norm in
float32, a kept LayerNorm holds a float32 copy of its 16-bit input: recomputing it frees 2 bytes an
element. "auto", the default, recomputes where that frees memory: every RMSNorm (which keeps its
normalised values besides), act(gate)·up (act(gate)) and a LayerNorm whose 16-bit input autocast
upcasts; a LayerNorm in its input's dtype runs as `F.layer_norm`. So a bf16-autocast run saves what it
saved before, and the planner, which measures the layers as they run (`plan.activations`), counts it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from libai_zoo.config.settings import ELEMENTWISE_RECOMPUTE


def recomputes(mode: str, frees_memory: bool) -> bool:
    """Whether an op under ``elementwise_recompute`` = `mode` recomputes, given whether doing so frees
    memory there."""
    return mode == "always" or (mode == "auto" and frees_memory)


def set_elementwise_recompute(model: nn.Module, mode: str) -> None:
    """Set ``elementwise_recompute`` on every layer of `model` that has one (norms, MLPs)."""
    if mode not in ELEMENTWISE_RECOMPUTE:
        raise ValueError(f"elementwise_recompute = {mode!r} is not one of {sorted(ELEMENTWISE_RECOMPUTE)}")
    for module in model.modules():
        if hasattr(module, "elementwise_recompute"):
            module.elementwise_recompute = mode


class _Recomputed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:
        device = tensors[0].device.type
        ctx.fn, ctx.device = fn, device
        ctx.autocast = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
        ctx.save_for_backward(*tensors)
        return fn(*tensors)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        tensors = [None if t is None else t.detach().requires_grad_(needs)
                   for t, needs in zip(ctx.saved_tensors, ctx.needs_input_grad[1:])]
        enabled, dtype = ctx.autocast
        with torch.enable_grad(), torch.autocast(ctx.device, dtype=dtype, enabled=enabled):
            out = ctx.fn(*tensors)
        wanted = [t for t in tensors if t is not None and t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad))
        return None, *(next(grads) if t is not None and t.requires_grad else None for t in tensors)


def recomputed(fn: Callable[..., torch.Tensor], *tensors: torch.Tensor | None) -> torch.Tensor:
    """fn(*tensors), keeping only `tensors` for backward (which recomputes fn; module docstring).
    `fn` must be deterministic; a tensor it closes over instead of taking gets no gradient. The
    first of `tensors` may not be None (its device is the autocast state's)."""
    return _Recomputed.apply(fn, *tensors)
