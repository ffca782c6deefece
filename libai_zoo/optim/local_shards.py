"""An elementwise optimizer steps each rank's local shards, not its DTensors.

AdamW, Adam and SGD update every element from that element's parameter, gradient and state alone,
so stepping the local shards gives the same numbers as stepping the DTensors, as Megatron-LM's
distributed optimizer steps its shard of a flat buffer. It spares each step DTensor's dispatch of
every elementwise op (a sharding decision per op and parameter shape: about a third of a small
model's 4-process run on CPU; on a GPU the dispatch's per-op Python cost, not measured here).
The state stays DTensors of the parameters' layout between steps, so checkpoints and their
resharding see what they saw before.

Anything else steps its DTensors as before: an optimizer that reads across elements (LAMB's trust
ratio is a norm over the whole parameter), a gradient whose layout differs from its parameter's
(DTensor would redistribute it), a 0-dimensional parameter, a float8 weight (torchao's tensor
subclass as its shard, which torch's foreach kernels do not take).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.distributed.tensor import DTensor

#: optimizers whose update of an element reads only that element (the exact classes: a subclass may not)
ELEMENTWISE = (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD)


def _steps_locally(param: torch.Tensor) -> bool:
    grad = param.grad
    # plain local tensors only: a float8 weight's (torchao's subclass) would leave torch's foreach kernels
    return (isinstance(grad, DTensor) and param.dim() > 0 and grad.placements == param.placements
            and grad.device_mesh == param.device_mesh
            and type(param._local_tensor) is torch.Tensor and type(grad._local_tensor) is torch.Tensor)


@contextmanager
def local_shards(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """``with local_shards(optimizer): optimizer.step()`` steps each DTensor parameter's local shard
    (module docstring); a state the step creates becomes a DTensor of its parameter's layout."""
    held = [p for group in optimizer.param_groups for p in group["params"] if isinstance(p, DTensor)
            and p.grad is not None]
    if type(optimizer) not in ELEMENTWISE or not held or not all(_steps_locally(p) for p in held):
        yield  # mixed DTensor and plain tensors would meet in one foreach kernel: all or nothing
        return
    local = {p: p._local_tensor for p in held}
    originals = {id(shard): p for p, shard in local.items()}
    state, before = optimizer.state, {}
    groups = [group["params"] for group in optimizer.param_groups]
    try:
        for p, shard in local.items():
            shard.grad = p.grad._local_tensor
            if p in state:
                before[p] = state.pop(p)
                state[shard] = {k: v._local_tensor if isinstance(v, DTensor) else v for k, v in before[p].items()}
        for params in groups:
            params[:] = [local.get(p, p) for p in params]
        yield
    finally:
        for params in groups:
            params[:] = [originals.get(id(t), t) for t in params]
        for p, shard in local.items():
            shard.grad = None
            stepped = state.pop(shard, None)
            if stepped is None:
                if p in before:
                    state[p] = before[p]
                continue
            old = before.get(p, {})
            state[p] = {k: _as_dtensor(v, p, old.get(k)) for k, v in stepped.items()}


def _as_dtensor(value: object, param: DTensor, old: object) -> object:
    """A state value back in its parameter's layout: the DTensor it was, or a new one around a
    tensor of the shard's shape (a scalar such as Adam's step count stays as it is)."""
    if isinstance(old, DTensor) and value is old._local_tensor:
        return old
    if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) \
            and value.shape == param._local_tensor.shape:
        return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return value
