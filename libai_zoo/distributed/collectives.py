"""Autograd-aware collectives over the tensor-parallel group (Megatron-LM's mappings).

Each function is a pair: what it does forward and what its backward does with the gradient.

    copy_to_tp            identity         | all-reduce      (input of a column-parallel layer)
    reduce_from_tp        all-reduce       | identity        (output of a row-parallel layer)
    gather_from_tp        all-gather       | split           (gather a split output for replicated use)
    scatter_to_tp         split            | all-gather      (take this rank's part of a replicated tensor)
    gather_from_sp        all-gather       | reduce-scatter  (sequence-parallel input of a column layer)
    reduce_scatter_to_sp  reduce-scatter   | all-gather      (sequence-parallel output of a row layer)

A column-parallel layer followed by a row-parallel one costs one all-reduce forward and one
backward; with sequence parallelism each all-reduce becomes an all-gather + reduce-scatter pair
of the same total volume. `reduce_from_tp` (forward) and `copy_to_tp` (backward) reduce in place:
give them tensors nothing else reads, such as the fresh output (gradient) of a matmul.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd import Function

from .tensor_parallel import TensorParallel


def _check_splittable(x: torch.Tensor, tp: TensorParallel, dim: int) -> None:
    if x.shape[dim] % tp.size:
        raise ValueError(
            f"dim {dim} (size {x.shape[dim]}) of a tensor of shape {tuple(x.shape)} does not split evenly "
            f"over tp = {tp.size}: pad it to a multiple of {tp.size} (under sequence parallelism this "
            f"is the sequence length)")


class Pending:
    """A collective started with ``async_op=True``; `wait` finishes it and returns its result.
    `buffers` (its input) stay alive until then."""

    def __init__(self, work, finish, *buffers: torch.Tensor):
        self.work, self.finish, self.buffers = work, finish, buffers

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return self.finish()


def all_gather_async(x: torch.Tensor, tp: TensorParallel, dim: int) -> Pending:
    """Start concatenating every tp rank's `x` along `dim` (no autograd)."""
    x = x.contiguous()
    out = x.new_empty((tp.size * x.shape[0], *x.shape[1:]))
    work = dist.all_gather_single(out, x, group=tp.group, async_op=True)
    if dim % x.dim() == 0:
        return Pending(work, lambda: out, x)
    return Pending(work, lambda: torch.cat(out.chunk(tp.size), dim=dim), x)


def all_gather(x: torch.Tensor, tp: TensorParallel, dim: int) -> torch.Tensor:
    """Concatenate every tp rank's `x` along `dim` (no autograd)."""
    return all_gather_async(x, tp, dim).wait()


def reduce_scatter_async(x: torch.Tensor, tp: TensorParallel, dim: int) -> Pending:
    """Start summing `x` over tp ranks, keeping this rank's equal slice along `dim` (no autograd)."""
    _check_splittable(x, tp, dim)
    if dim % x.dim() == 0:
        x = x.contiguous()
    else:  # lay the slices one after another along dim 0, the layout the collective splits
        x = torch.cat(x.chunk(tp.size, dim), dim=0)
    out = x.new_empty((x.shape[0] // tp.size, *x.shape[1:]))
    work = dist.reduce_scatter_single(out, x, group=tp.group, async_op=True)
    return Pending(work, lambda: out, x)


def reduce_scatter(x: torch.Tensor, tp: TensorParallel, dim: int) -> torch.Tensor:
    """Sum `x` over tp ranks and keep this rank's equal slice along `dim` (no autograd)."""
    return reduce_scatter_async(x, tp, dim).wait()


def split(x: torch.Tensor, tp: TensorParallel, dim: int) -> torch.Tensor:
    """This rank's equal slice of `x` along `dim` (no communication, no autograd)."""
    _check_splittable(x, tp, dim)
    return x.chunk(tp.size, dim)[tp.rank].contiguous()


def all_reduce_(x: torch.Tensor, tp: TensorParallel, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Reduce `x` in place over the tp group (no autograd)."""
    dist.all_reduce(x, op=op, group=tp.group)
    return x


def all_reduce_coalesced_(tensors: list[torch.Tensor], group) -> None:
    """Sum `tensors` (one dtype and device) over `group` in place with one all-reduce of their
    concatenation."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    for tensor, piece in zip(tensors, flat.split([t.numel() for t in tensors])):
        tensor.copy_(piece.view_as(tensor))


def broadcast_(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Overwrite `x` in place with tp rank 0's (no autograd): one choice for every rank, e.g. a sampled token."""
    dist.broadcast(x, src=dist.get_global_rank(tp.group, 0), group=tp.group)
    return x


class _CopyToTP(Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_(grad.contiguous(), ctx.tp), None


class _ReduceFromTP(Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.mark_dirty(x)
        return all_reduce_(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _autograd_pair(name: str, forward, backward) -> type[Function]:
    """A Function computing forward(x, tp, dim) whose backward is backward(grad, tp, dim)."""

    def fwd(ctx, x, tp, dim):
        ctx.tp, ctx.dim = tp, dim
        return forward(x, tp, dim)

    def bwd(ctx, grad):
        return backward(grad, ctx.tp, ctx.dim), None, None

    return type(name, (Function,), {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})


_GatherFromTP = _autograd_pair("_GatherFromTP", all_gather, split)
_ScatterToTP = _autograd_pair("_ScatterToTP", split, all_gather)
_GatherFromSP = _autograd_pair("_GatherFromSP", all_gather, reduce_scatter)
_ReduceScatterToSP = _autograd_pair("_ReduceScatterToSP", reduce_scatter, all_gather)


class _SumOverTP(Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return all_reduce_(x.clone(), tp)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_(grad.contiguous(), ctx.tp), None


def sum_over_tp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """All-reduce (sum) forward and backward: a statistic every rank computes part of and every
    rank uses (a norm over a tp-split dimension), so each rank's gradient is a share of the whole."""
    return _SumOverTP.apply(x, tp)


def copy_to_tp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient backward (Megatron's f)."""
    return _CopyToTP.apply(x, tp)


def reduce_from_tp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """All-reduce (sum) forward, in place; identity backward (Megatron's g)."""
    return _ReduceFromTP.apply(x, tp)


def gather_from_tp(x: torch.Tensor, tp: TensorParallel, dim: int = -1) -> torch.Tensor:
    """All-gather along `dim` forward; take this rank's slice of the gradient backward."""
    return _GatherFromTP.apply(x, tp, dim)


def scatter_to_tp(x: torch.Tensor, tp: TensorParallel, dim: int = -1) -> torch.Tensor:
    """Take this rank's slice along `dim` forward; all-gather the gradient backward."""
    return _ScatterToTP.apply(x, tp, dim)


def gather_from_sp(x: torch.Tensor, tp: TensorParallel, dim: int = 1) -> torch.Tensor:
    """All-gather the sequence forward; reduce-scatter the gradient backward."""
    return _GatherFromSP.apply(x, tp, dim)


def reduce_scatter_to_sp(x: torch.Tensor, tp: TensorParallel, dim: int = 1) -> torch.Tensor:
    """Reduce-scatter over the sequence forward; all-gather the gradient backward."""
    return _ReduceScatterToSP.apply(x, tp, dim)


def row_output(x: torch.Tensor, tp: TensorParallel, sequence_parallel: bool) -> torch.Tensor:
    """Sum the partial outputs of row-parallel layers: `reduce_from_tp`, or a reduce-scatter onto
    sequence shards (`reduce_scatter_to_sp`) under sequence parallelism."""
    return reduce_scatter_to_sp(x, tp) if sequence_parallel else reduce_from_tp(x, tp)
