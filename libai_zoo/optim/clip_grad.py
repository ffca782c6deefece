"""Global gradient-norm clipping that knows which gradients are shards.

A gradient split over a mesh (a DTensor with a Shard placement, e.g. a column-parallel weight)
contributes the sum of its shards' squares, reduced over that mesh once; a replicated gradient
(a Replicate DTensor or a plain tensor) is counted once, on every rank alike. Every rank then
holds the same norm and scales by the same factor. Partial gradients must have been reduced
first (`distributed.finalize_grads`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, *, sum_over: Iterable = (),
                    exclude: Iterable[torch.Tensor] = ()) -> torch.Tensor:
    """Scale all gradients so their global L2 norm is at most `max_norm` (no clipping when
    max_norm <= 0); return the norm before clipping (float32, same on every rank).

    ``sum_over``: process groups whose ranks hold different parameters (pipeline stages): their
    squares are added up. ``exclude``: parameters scaled but not counted (a tied weight's second copy).
    """
    parameters = list(parameters)
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    skip = {id(p) for p in exclude}
    # A rank may hold no gradient (a pipeline stage whose parameters are all frozen, as under LoRA):
    # it still joins the reduction over the stages
    held = grads or parameters
    device = (held[0].to_local() if isinstance(held[0], DTensor) else held[0]).device if held else None
    replicated = torch.zeros((), device=device)
    sharded: dict[object, torch.Tensor] = {}
    for grad in (p.grad for p in params if id(p) not in skip):
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        square = local.detach().float().pow(2).sum()
        if isinstance(grad, DTensor):
            if any(isinstance(p, Partial) for p in grad.placements):
                raise ValueError("a gradient is still Partial: call libai_zoo.distributed.finalize_grads before clipping")
            # Shard and FSDP's strided shards alike: every placement but Replicate splits the tensor.
            dims = tuple(i for i, p in enumerate(grad.placements) if not isinstance(p, Replicate))
            if dims:
                key = (grad.device_mesh, dims)
                sharded[key] = sharded.get(key, 0) + square
                continue
        replicated += square
    total = replicated
    for (mesh, dims), square in sharded.items():
        for group in (mesh.get_group(d) for d in dims):
            dist.all_reduce(square, group=group)
        total = total + square
    for group in sum_over:
        if group is not None:
            dist.all_reduce(total, group=group)
    norm = total.sqrt()
    if max_norm > 0:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for grad in grads:
            (grad.to_local() if isinstance(grad, DTensor) else grad).mul_(scale.to(grad.dtype))
    return norm
