"""A cheap function whose output backward recomputes: only its inputs are saved.

Norms and the gated activation act(gate)·up are elementwise or per token: recomputing them costs a
pass over tensors already in memory, while autograd would keep their intermediates (a float32
copy of a norm's input, the normalised values beside the weighted ones, act(gate) beside gate).
`recomputed(fn, *tensors)` saves `tensors` alone; backward runs `fn` on them again, with the same
ops under the forward's autocast state, and differentiates that, so the gradients are the ones
autograd gives without it, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


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
