"""Generation on a model sharded by ZeRO (FSDP2), holding at most one layer gathered at a time.

Calling a ZeRO-wrapped model gathers its root unit (embeddings, final norm, head: at GPT-2's
vocabulary, as large as four layers) for the whole forward, prefetches the next layer while one
runs, and at ZeRO 1-2 keeps every layer it gathered. `layer_by_layer` makes `generate` follow the
run's layout instead, the same on every rank:

- each layer of the layer stack is gathered by FSDP in its own forward and freed after it (no
  prefetch, reshard after forward at every stage);
- the root unit is never gathered whole (`generate` runs the model's `forward` without FSDP's
  root hooks); its tables are used where their rows are: FSDP keeps rank r's 1/dp of a table's
  rows, so an embedding looks its tokens up in the rows it holds and the ranks sum the lookups
  (one all-reduce of the tokens' hidden states), and the head computes the logits of its rows
  and the ranks gather them (one token's logits): Megatron's vocabulary parallelism over dp;
- the root's other modules (norms; tables split over tp too) gather their own parameters over dp
  while they run and drop them after, one at a time;
- as FSDP does for the root it no longer gathers, the rows and gathered parameters are cast to the
  data-parallel param dtype (bf16 under bf16 AMP at ZeRO 1-3) and moved from CPU to the run's
  device under ``train.zero_offload`` (a 1/dp slice at a time).

A rank's peak is then its shard plus one layer as FSDP gathers it (its flat all-gather buffer and
the layer's parameters, both the layer's size, meet while FSDP copies one into the other), plus
the KV cache and one token's activations; every step gathers each layer once, as a training
forward does. That holds for the process's RSS too (`utils.memory.mapped_allocations`: glibc maps the
gathered buffers and unmaps them when freed, instead of its heap growing by them token after token;
on a model that had not stepped, each rank's peak RSS rose by twice the model).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate

from libai_zoo.layers import LMHead
from libai_zoo.models import all_layers
from libai_zoo.utils.memory import mapped_allocations

from .data_parallel import DataParallel, set_forward_prefetch


@contextmanager
def layer_by_layer(model: nn.Module, data_parallel: DataParallel) -> Iterator[nn.Module]:
    """Within the block, what to call `generate` on so that `model` (wrapped by `data_parallel`)
    generates holding at most one layer or root module gathered; `model` itself when nothing is
    sharded (dp = 1, or ZeRO-0, where every rank holds everything)."""
    if data_parallel.group is None or data_parallel.zero_stage == 0:
        yield model
        return
    layers = all_layers(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()  # an evaluation at ZeRO 1-2 leaves the units gathered
    set_forward_prefetch(layers, False)
    for layer in layers:
        layer.set_reshard_after_forward(True)  # and its experts' own unit under expert parallelism
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    to = _Target(data_parallel.ctx.device, data_parallel.param_dtype)
    handles, by_rows = [], []
    for module in model.modules():
        own = [name for name, p in module.named_parameters(recurse=False)
               if id(p) not in in_layers and isinstance(p, DTensor)]
        if own and _rows_suffice(module, own):
            module.forward = partial(_lookup_rows if isinstance(module, nn.Embedding) else _project_rows, module, to)
            by_rows.append(module)
        elif own:
            handles.append(module.register_forward_pre_hook(_gather_hook(own, to)))
            handles.append(module.register_forward_hook(_release_hook(own)))
    try:
        with mapped_allocations() if to.device.type == "cpu" else nullcontext():  # host memory only
            yield _without_root_hooks(model)
    finally:
        for handle in handles:
            handle.remove()
        for module in by_rows:
            del module.forward
        for layer in layers:
            layer.set_reshard_after_forward(data_parallel.zero_stage == 3)
        set_forward_prefetch(layers, True)


class _WithoutRootHooks:
    """Mixed in before a model's class: a call runs ``forward`` itself, so FSDP's root unit
    (embeddings, final norm, head together) is not gathered."""

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)


_PROXY_CLASSES: dict[type, type] = {}


def _without_root_hooks(model: nn.Module) -> nn.Module:
    """`model` as `generate` sees it: the same module (its state is the model's own ``__dict__``),
    of a subclass of its class whose call skips the root's hooks, so that the model's own methods
    (transformers' generate calling ``self(...)``, ``super()`` in them) run as they would on it."""
    model_class = type(model)
    if model_class not in _PROXY_CLASSES:
        _PROXY_CLASSES[model_class] = type(f"{model_class.__name__}WithoutRootHooks", (_WithoutRootHooks, model_class),
                                           {})
    proxy = object.__new__(_PROXY_CLASSES[model_class])  # not cls(): FSDP's module classes construct their model anew in __new__
    proxy.__dict__ = model.__dict__
    return proxy


def _rows_suffice(module: nn.Module, names: list[str]) -> bool:
    """Whether `module` runs on its rows of a dp-only table: an embedding or the LM head, not split
    over tp, without adapters."""
    return (isinstance(module, nn.Embedding | LMHead) and getattr(module, "tp", None) is None
            and set(names) <= {"weight", "bias"} and module.weight.device_mesh.ndim == 1)


class _Target(NamedTuple):
    """Where and in what dtype FSDP computes with its gathered parameters: the run's device (the
    shards may be in CPU memory under offload) and the mixed-precision param dtype (None: the
    parameters' own)."""

    device: torch.device
    dtype: torch.dtype | None


def _local(param: DTensor, to: _Target) -> torch.Tensor:
    """This rank's shard of `param` on `to`'s device, in its dtype: FSDP's cast before its all-gather."""
    return param.to_local().to(to.device, to.dtype or param.dtype)


def _rows(param: DTensor) -> tuple[int, int]:
    """(the index of this rank's first row of a table FSDP split over dp (dim 0, torch.chunk's cut),
    the rows per rank before the last ranks' shorter chunks)."""
    mesh = param.device_mesh
    per_rank = -(-param.shape[0] // mesh.size())
    return min(mesh.get_local_rank() * per_rank, param.shape[0]), per_rank


def _lookup_rows(module: nn.Embedding, to: _Target, ids: torch.Tensor) -> torch.Tensor:
    """The embedding of `ids`: each rank fills the tokens in its rows, the ranks sum. Only the rows
    looked up are moved and cast, not the rank's whole slice of the table."""
    shard, (start, _) = module.weight.to_local(), _rows(module.weight)
    ids = ids.to(to.device)
    inside = (ids >= start) & (ids < start + shard.shape[0])
    out = torch.zeros(*ids.shape, shard.shape[1], device=to.device, dtype=to.dtype or shard.dtype)
    out[inside] = shard[(ids[inside] - start).to(shard.device)].to(out)
    dist.all_reduce(out, group=module.weight.device_mesh.get_group())
    return out


def _project_rows(module: LMHead, to: _Target, hidden: torch.Tensor) -> torch.Tensor:
    """The logits over the whole vocabulary: each rank projects onto its rows, the ranks gather."""
    rows, (_, per_rank) = _local(module.weight, to), _rows(module.weight)
    bias = None if module.bias is None else _local(module.bias, to)
    part = F.pad(F.linear(hidden, rows, bias), (0, per_rank - rows.shape[0]))
    parts = [torch.empty_like(part) for _ in range(module.weight.device_mesh.size())]
    dist.all_gather(parts, part.contiguous(), group=module.weight.device_mesh.get_group())
    return module.shape_logits(torch.cat(parts, dim=-1)[..., :module.weight.shape[0]])


def _gather_hook(names: list[str], to: _Target):
    def gather(module: nn.Module, args) -> None:
        module._sharded = {name: getattr(module, name) for name in names}
        for name, param in module._sharded.items():
            setattr(module, name, nn.Parameter(_gathered_over_dp(param, to), requires_grad=False))
    return gather


def _release_hook(names: list[str]):
    def release(module: nn.Module, args, output) -> None:
        for name, param in module.__dict__.pop("_sharded").items():
            setattr(module, name, param)
    return release


def _gathered_over_dp(param: DTensor, to: _Target) -> torch.Tensor:
    """`param`'s dp shards joined on `to`'s device in its dtype, as FSDP's own gathered parameter
    is: a plain tensor on a dp-only mesh, a DTensor on the remaining (tp) mesh dimensions otherwise."""
    mesh = param.device_mesh
    param = DTensor.from_local(_local(param, to), mesh, param.placements, run_check=False,
                               shape=param.shape, stride=param.stride())
    if mesh.ndim == 1:
        return param.full_tensor()
    names = list(mesh.mesh_dim_names)
    dp = names.index("dp_cp" if "dp_cp" in names else "dp")  # FSDP's dimension: dp, or dp × cp
    placements = [Replicate() if dim == dp else placement for dim, placement in enumerate(param.placements)]
    whole = param.redistribute(mesh, placements).to_local()
    rest = [name for index, name in enumerate(names) if index != dp]
    return DTensor.from_local(whole, mesh[tuple(rest)] if len(rest) > 1 else mesh[rest[0]],
                              [placement for dim, placement in enumerate(placements) if dim != dp], run_check=False)
