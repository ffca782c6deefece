"""Turn a model built at full size into this rank's slice, fill a shard from a full value, and
finish its gradients."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from .collectives import all_reduce_coalesced_
from .context import ParallelContext, get_context
from .expert_parallel import ExpertParallel, experts_problems
from .tensor_parallel import TensorParallel, local_range

#: The mesh dimensions that split a parameter by model parallelism: tp, and for an MoE layer's
#: experts ept (the expert group); the others (dp, edp) are data parallelism's.
MODEL_PARALLEL_DIMS = ("tp", "ept")


def shard(model: nn.Module, ctx: ParallelContext | None = None, *,
          sequence_parallel: bool | None = None) -> nn.Module:
    """Split every parallel layer of `model` over the tensor-parallel mesh, and an MoE layer's
    experts over the expert group, in place; under context parallelism (cp > 1) every parallel
    layer is told the cp group its sequence is split over (its ``cp``).

    A parallel layer is any module with a ``shard_(tp)`` method (all of `libai_zoo.layers`); it
    keeps its own slice of each weight as a DTensor and from then on communicates in
    forward/backward. Under expert parallelism (`ParallelContext.expert_parallel`: ep × tp > 1)
    every module with a ``shard_experts_(ep)`` method (`layers.MoE`) then keeps its own experts.
    Sizes that do not split over tp (`tp_problems`) or experts that do not split over ep × tp
    (`expert_problems`) are one error, raised before anything is split. Tied weights (an LM head
    sharing the token embedding) stay one parameter. With tp=1, ep=1 and cp=1 the model is returned
    unchanged. The model ends on the context's device, unless it lives on the meta device
    (materialise it with ``to_empty``). ``sequence_parallel`` overrides the context's setting.
    """
    ctx = ctx or get_context()
    tp, ep = ctx.tensor_parallel, ctx.expert_parallel
    if tp is not None and sequence_parallel is not None and sequence_parallel != tp.sequence_parallel:
        tp = TensorParallel(tp.mesh, sequence_parallel=sequence_parallel)
        ep = ExpertParallel(ep.mesh, ep=ep.ep, tensor_parallel=tp)
    check_shardable(model, ctx)
    if ctx.context_parallel is not None:
        for module in model.modules():
            if callable(getattr(module, "shard_", None)):  # a parallel layer
                module.cp = ctx.context_parallel
    uses = parameter_uses(model)
    for method, group in (("shard_", tp), ("shard_experts_", ep)):
        if group is None:
            continue
        for module in model.modules():
            split = getattr(module, method, None)
            if callable(split):
                split(group)
    retie(uses)
    if any(p.is_meta for p in model.parameters()):
        return model
    return model.to(ctx.device)


@contextmanager
def whole_sequences(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block, `model`'s layers run on whole sequences: unsplit over cp (their ``cp``
    unset) and over tp (sequence parallelism off on their tp groups, the layers splitting heads
    and columns as before), so that each rank can run a sample alone: generation, where every rank
    of the cp and tp groups generates the same tokens one at a time. The tp groups are the parallel
    context's, so any other model on them runs without sequence parallelism inside the block too.
    A no-op without context or sequence parallelism."""
    split = [(layer, layer.cp) for layer in model.modules() if getattr(layer, "cp", None) is not None]
    groups = {id(tp): tp for layer in model.modules() if isinstance(tp := getattr(layer, "tp", None), TensorParallel)
              and tp.sequence_parallel}.values()
    for layer, _ in split:
        layer.cp = None
    for tp in groups:
        tp.sequence_parallel = False
    try:
        yield model
    finally:
        for layer, cp in split:
            layer.cp = cp
        for tp in groups:
            tp.sequence_parallel = True


def check_shardable(model: nn.Module, ctx: ParallelContext) -> None:
    """Raise one error naming every size of `model` that does not split over the context's tp
    (`tp_problems`) or experts that do not split over its ep × tp (`expert_problems`); nothing is split."""
    tp, ep = ctx.tensor_parallel, ctx.expert_parallel
    problems = (tp_problems(model, tp.size) if tp is not None else []) + \
        (expert_problems(model, ep.ep, ep.tp) if ep is not None else [])
    if problems:
        raise ValueError(f"{type(model).__name__} cannot be split over tp = {ctx.tp}, ep = {ctx.ep}:\n  "
                         + "\n  ".join(problems))


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


def expert_problems(model: nn.Module, ep: int, tp: int) -> list[str]:
    """Why the experts of `model`'s MoE layers (modules with ``shard_experts_`` and
    ``num_experts``) cannot be split over ep × tp ranks ([] when they can), each problem once."""
    problems: list[str] = []
    for module in model.modules():
        if callable(getattr(module, "shard_experts_", None)):
            problems += [p for p in experts_problems(module.num_experts, ep, tp) if p not in problems]
    return problems


def parameter_uses(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """For each parameter shared by several modules (a tied weight), every (module, name) that
    holds it: what `retie` makes one parameter again after it was replaced (sharded, ``to_empty``)."""
    uses: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            uses.setdefault(id(param), []).append((module, name))
    return [places for places in uses.values() if len(places) > 1]


def retie(shared: list[list[tuple[nn.Module, str]]]) -> None:
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


def to_empty(module: nn.Module, device: torch.device | str) -> nn.Module:
    """`nn.Module.to_empty`, a DTensor's local part allocated and wrapped with its placements: DTensor's
    own empty_like first decides the op's sharding, about 35 ms a new shape in a fresh process (a
    second of every rank's start-up). Tied weights are allocated anew per holder: `retie` them."""
    device = torch.device(device)

    def empty_like(tensor: torch.Tensor) -> torch.Tensor:
        if isinstance(tensor, DTensor):
            return DTensor.from_local(torch.empty_like(tensor.to_local(), device=device), tensor.device_mesh,
                                      tensor.placements, run_check=False, shape=tensor.shape, stride=tensor.stride())
        return torch.empty_like(tensor, device=device)
    return module._apply(empty_like)


def tp_slice_of(param: torch.Tensor) -> tuple[int, int, int] | None:
    """(dim, index, count): the model-parallel slice of a parameter this rank holds (slice `index`
    of `count` along `dim`): its tensor-parallel slice, or for an MoE layer's stacked experts its
    block of experts over the expert group (ept); None when neither splits it. The parameter may
    also be split over dp (ZeRO: a 2-D DTensor on the ("dp", "tp") or ("edp", "ept") mesh)."""
    if not isinstance(param, DTensor):
        return None
    names = param.device_mesh.mesh_dim_names or ()
    found = [name for name in MODEL_PARALLEL_DIMS if name in names]
    if not found:
        return None
    mesh_dim = names.index(found[0])
    placement = param.placements[mesh_dim]
    if placement.is_replicate():
        return None
    if type(placement) is not Shard:
        raise ValueError(f"a parameter placed {placement} over tp has no slice of its full value")
    return placement.dim, param.device_mesh.get_local_rank(mesh_dim), param.device_mesh.size(mesh_dim)


def dp_rows_of(param: torch.Tensor) -> tuple[int, int] | None:
    """[start, end) of dim 0 of this rank's tp slice (`tp_slice_of`) that it keeps when ZeRO shards
    the parameter over dp (FSDP2 cuts dim 0 of the tp slice as torch.chunk does), or None when no
    other mesh dimension splits it."""
    if not isinstance(param, DTensor):
        return None
    mesh, tp = param.device_mesh, tp_slice_of(param)
    for mesh_dim, (name, placement) in enumerate(zip(mesh.mesh_dim_names or (), param.placements)):
        if name in MODEL_PARALLEL_DIMS or getattr(placement, "dim", None) is None:
            continue
        if placement.dim != 0:
            raise ValueError(f"a parameter split along dim {placement.dim} over {name} has no row range: "
                             f"libai_zoo shards over dp along dim 0 only")
        rows = param.shape[0] // tp[2] if tp is not None and tp[0] == 0 else param.shape[0]
        per_rank = -(-rows // mesh.size(mesh_dim))
        start = min(mesh.get_local_rank(mesh_dim) * per_rank, rows)
        return start, min(start + per_rank, rows)
    return None


@torch.no_grad()
def fill_shard_(param: torch.Tensor, value: torch.Tensor) -> None:
    """Copy this rank's part of `value`, the full value of `param`, into `param` (into
    ``param.to_local()``, whatever its placements: its tp slice, ZeRO's rows of that slice, or a
    replica). The part is cut where `value` lies (the CPU, for a drawn weight) and only the part
    is copied to the parameter's device."""
    if isinstance(param, DTensor):
        param.to_local().copy_(_local_part(param, value))
    else:
        param.copy_(value)


def _local_part(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The view of `value` (the full value of `param`) that this rank holds: the tp slice
    `tp_slice_of` names, then the rows `dp_rows_of` names; a view, no copy."""
    tp = tp_slice_of(param)
    if tp is not None:
        dim, index, count = tp
        start, end = local_range(param.shape[dim], index, count)
        value = value.narrow(dim, start, end - start)
    rows = dp_rows_of(param)
    return value if rows is None else value[rows[0]:rows[1]]


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
            partial = tuple(i for i, p in enumerate(grad.placements) if isinstance(p, Partial))
            buckets.setdefault((grad.device_mesh, partial, grad.placements, grad.dtype), []).append(param)
    for (mesh, partial, placements, _), params in buckets.items():
        locals_ = [p.grad.to_local() for p in params]
        for mesh_dim in partial:
            all_reduce_coalesced_(locals_, mesh.get_group(mesh_dim))
        reduced = [Replicate() if i in partial else p for i, p in enumerate(placements)]
        for param, grad in zip(params, locals_):
            param.grad = DTensor.from_local(grad, mesh, reduced, run_check=False)
