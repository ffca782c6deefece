"""Turn a model built at full size into this rank's slice, and finish its gradients."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from .collectives import all_reduce_coalesced_
from .context import ParallelContext, get_context
from .tensor_parallel import TensorParallel


def shard(model: nn.Module, ctx: ParallelContext | None = None, *,
          sequence_parallel: bool | None = None) -> nn.Module:
    """Split every parallel layer of `model` over the tensor-parallel mesh, in place.

    A parallel layer is any module with a ``shard_(tp)`` method (all of `libai_zoo.layers`); it
    keeps its own slice of each weight as a DTensor and from then on communicates in
    forward/backward. Sizes that do not split over tp (`tp_problems`) are one error, raised before
    anything is split. Tied weights (an LM head sharing the token embedding)
    stay one parameter. With tp=1 the model is returned unchanged. The model ends on the
    context's device, unless it lives on the meta device (materialise it with ``to_empty``).
    ``sequence_parallel`` overrides the context's setting.
    """
    ctx = ctx or get_context()
    tp = ctx.tensor_parallel
    if tp is not None:
        if sequence_parallel is not None and sequence_parallel != tp.sequence_parallel:
            tp = TensorParallel(tp.mesh, sequence_parallel=sequence_parallel)
        problems = tp_problems(model, tp.size)
        if problems:
            raise ValueError(f"{type(model).__name__} cannot be split over tp = {tp.size}:\n  "
                             + "\n  ".join(problems))
        uses = _parameter_uses(model)
        for module in model.modules():
            shard_ = getattr(module, "shard_", None)
            if callable(shard_):
                shard_(tp)
        _retie(uses)
    if any(p.is_meta for p in model.parameters()):
        return model
    return model.to(ctx.device)


def tp_problems(model: nn.Module, tp_size: int) -> list[str]:
    """Why `model` cannot be split over `tp_size` ranks ([] when it can), asked of every parallel
    layer (``tp_problems``); the layers inside one that already said no are not asked again, and
    each problem is named once. Needs no process group: the model may live on the meta device."""
    problems: list[str] = []
    refused: list[str] = []
    for name, module in model.named_modules():
        if name and any(name.startswith(prefix) for prefix in refused):
            continue
        found = module.tp_problems(tp_size) if callable(getattr(module, "tp_problems", None)) else []
        if found:
            refused.append(f"{name}." if name else "")  # the root: every other module is inside it
            problems += [p for p in found if p not in problems]
    return problems


def _parameter_uses(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """For each parameter shared by several modules, every (module, name) that holds it."""
    uses: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            uses.setdefault(id(param), []).append((module, name))
    return [places for places in uses.values() if len(places) > 1]


def _retie(shared: list[list[tuple[nn.Module, str]]]) -> None:
    """Point every holder of a shared parameter at the first holder's (now sharded) one."""
    for (first, first_name), *others in shared:
        param = getattr(first, first_name)
        for module, name in others:
            sharded = getattr(module, name)
            if isinstance(sharded, DTensor) and sharded.placements != param.placements:
                raise ValueError(f"a tied parameter is split as {param.placements} in {type(first).__name__} "
                                 f"but as {sharded.placements} in {type(module).__name__}: tie layers split "
                                 f"the same way (a vocab embedding with a column-parallel head)")
            setattr(module, name, param)


@torch.no_grad()
def finalize_grads(model: nn.Module) -> None:
    """Sum the partial gradients of replicated parameters over their mesh, one all-reduce per group.

    Under sequence parallelism a norm weight (or a row-parallel bias) sees only this rank's part
    of the sequence, so its gradient is a Partial DTensor. Call this after backward and before
    clipping and the optimizer step: it reduces all of them in one coalesced all-reduce (as
    Megatron-LM does once per step) and leaves replicated gradients. Without it DTensor reduces
    each one lazily wherever it is used, which is correct but slower.
    """
    buckets: dict[tuple, list[nn.Parameter]] = {}
    for param in model.parameters():
        grad = param.grad
        if isinstance(grad, DTensor) and any(isinstance(p, Partial) for p in grad.placements):
            if grad.device_mesh.ndim != 1:
                raise ValueError("finalize_grads handles partial gradients on 1-D (tp) meshes")
            buckets.setdefault((grad.device_mesh, grad.dtype), []).append(param)
    for (mesh, _), params in buckets.items():
        locals_ = [p.grad.to_local() for p in params]
        all_reduce_coalesced_(locals_, mesh.get_group())
        for param, grad in zip(params, locals_):
            param.grad = DTensor.from_local(grad, mesh, [Replicate()], run_check=False)
