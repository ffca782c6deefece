"""Expert parallelism: the group an MoE layer's experts are split over, and the token exchange.

The expert group is the "ept" mesh, ep × tp ranks: ep carved from the data-parallel ranks, the tp
ranks borrowed (as torchtitan lets ep borrow tp). Each of its ranks holds num_experts / (ep·tp)
whole experts, a contiguous block of expert ids. One MoE layer's routed path on a rank:

    x = scatter_tokens(x, tp)          this tp rank's share of the tokens (not under sequence
                                       parallelism: the sequence is split already)
    route, sort the k copies of each token by global expert id, count them per expert
    rows, counts, route = dispatch(sorted, counts, ep)   to the experts' ranks, grouped by local expert
    out = experts(rows, counts)        this rank's experts (weights: `expert_weight`)
    back = combine(out, route, ep)     to the source ranks, in the order they were sent
    y = gather_tokens(y, tp, total)    every tp rank's tokens again
    stats = reduce_from_tp(stats, tp)  the router statistics of every tp rank's tokens
                                       (`collectives`: all-reduce forward, identity backward)

Both exchanges are `all_to_all_single` with uneven splits (the counts are exchanged first, by
`exchange_counts`), on torch's autograd-aware functional collective, so backward sends the
gradients the reverse way: an expert's gradient is the sum over every token routed to it from any
rank of the group. A rank may send no rows and an expert may receive none. The counts' exchange is
a seam: `counts_exchanged_by` states what a rank receives instead of asking the group (the
planner's fake process group exchanges no values; it takes every rank to route alike).

Expert parameters are DTensors of their global shape [E, ...] placed Shard(0) on the ept mesh (so
checkpoints reshard them across ep), and data parallelism shards or replicates them over "edp".
Their gradient on a rank sums the tokens of ep data-parallel ranks (the all-to-all's backward), so
`expert_weight` scales it by 1/ep: data parallelism's average over edp then gives the mean over dp,
as for every dense parameter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Function
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from .tensor_parallel import MeshGroup, TensorParallel, distribute_parameter


class ExpertParallel(MeshGroup):
    """The ept mesh experts are split over (ep × tp ranks), with its group, size, this rank's index,
    the ep and tp sizes, and the tp group whose ranks join it (None at tp = 1)."""

    def __init__(self, mesh: DeviceMesh, *, ep: int, tensor_parallel: TensorParallel | None):
        super().__init__(mesh, "expert-parallel")
        self.ep = ep
        self.tensor_parallel = tensor_parallel
        self.tp = tensor_parallel.size if tensor_parallel is not None else 1
        if self.size != self.ep * self.tp:
            raise ValueError(f"the expert-parallel mesh has {self.size} ranks, not ep × tp = {ep} × {self.tp}")

    def experts_problems(self, num_experts: int) -> list[str]:
        """Why `num_experts` cannot be split over this group ([] when it can)."""
        return experts_problems(num_experts, self.ep, self.tp)

    def local_experts(self, num_experts: int) -> tuple[int, int]:
        """[start, end) of the expert ids this rank holds."""
        per_rank = num_experts // self.size
        return self.rank * per_rank, (self.rank + 1) * per_rank

    def shard_parameter(self, module: nn.Module, name: str) -> None:
        """Replace ``module.<name>``, stacked over experts along dim 0, by a DTensor parameter of
        its global shape holding this rank's experts (Shard(0) on the ept mesh)."""
        distribute_parameter(module, name, self.mesh, Shard(0))

    def __repr__(self) -> str:
        return f"ExpertParallel(size={self.size}, rank={self.rank}, ep={self.ep}, tp={self.tp})"


def experts_problems(num_experts: int, ep: int, tp: int) -> list[str]:
    """Why `num_experts` cannot be split over ep × tp ranks ([] when it can): each holds whole experts."""
    if num_experts % (ep * tp):
        return [f"num_experts = {num_experts} is not divisible by ep × tp = {ep} × {tp} = {ep * tp} (each rank of "
                f"the expert group holds whole experts): choose dist.ep and dist.tp whose product divides "
                f"{num_experts}"]
    return []


class _ScaleGrad(Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def expert_weight(param: torch.Tensor | None, ep: ExpertParallel | None) -> torch.Tensor | None:
    """The local tensor of an expert parameter (this rank's experts), differentiable; under expert
    parallelism its gradient is scaled by 1/ep (see the module docstring)."""
    if ep is None or param is None:
        return param
    return _ScaleGrad.apply(param.to_local() if isinstance(param, DTensor) else param, 1.0 / ep.ep)


@dataclass
class Route:
    """Where `dispatch` sent this rank's rows: what `combine` needs to bring them back."""

    sent: list[int]       # rows sent to each rank of the group
    received: list[int]   # rows received from each rank
    order: torch.Tensor   # the received rows, taken in this order, are grouped by local expert


def _all_to_all_counts(received: torch.Tensor, counts: torch.Tensor, ep: ExpertParallel) -> None:
    dist.all_to_all_single(received, counts, group=ep.group)


_exchange_counts: Callable[[torch.Tensor, torch.Tensor, ExpertParallel], None] = _all_to_all_counts


def exchange_counts(received: torch.Tensor, counts: torch.Tensor, ep: ExpertParallel) -> None:
    """Fill `received` (like `counts`) with what each rank of the group sends this rank's experts,
    `counts` [E] (int64) being the rows this rank sends each expert of the group: ``received[s·L +
    j]`` rows from rank s for local expert j (L experts a rank). One all-to-all over the group, or
    what the exchange given to `counts_exchanged_by` writes."""
    _exchange_counts(received, counts, ep)


@contextmanager
def counts_exchanged_by(exchange: Callable[[torch.Tensor, torch.Tensor, ExpertParallel], None]) -> Iterator[None]:
    """Meanwhile `dispatch` has ``exchange(received, counts, ep)`` fill in what the group's ranks
    send this rank (the seam of `exchange_counts`): the planner, on a fake process group, has every
    rank route alike (`plan.kernel_emulation`)."""
    global _exchange_counts
    previous, _exchange_counts = _exchange_counts, exchange
    try:
        yield
    finally:
        _exchange_counts = previous


def dispatch(rows: torch.Tensor, counts: torch.Tensor, ep: ExpertParallel
             ) -> tuple[torch.Tensor, torch.Tensor, Route]:
    """Send this rank's `rows` (sorted by global expert id; ``counts[e]`` of them for expert e, an
    integer tensor over every expert) to the ranks holding their experts. Returns the rows this
    rank's experts compute, grouped by local expert (every source rank's rows for expert 0, then
    for expert 1, ...), the number of rows per local expert, and the route back for `combine`."""
    num_experts = counts.numel()
    local = num_experts // ep.size
    counts = counts.to(torch.int64)
    # received[s, j]: rows source rank s sends to this rank's local expert j
    received = torch.empty_like(counts)
    exchange_counts(received, counts, ep)
    received = received.view(ep.size, local)
    sent = counts.view(ep.size, local).sum(1).tolist()
    from_each = received.sum(1).tolist()
    arrived = all_to_all_single_autograd(rows.contiguous(), from_each, sent, ep.group)
    # they arrive in (source rank, local expert) blocks: a stable sort by (expert, source) groups them
    block = torch.arange(num_experts, device=counts.device)
    key = (block % local) * ep.size + block // local
    order = torch.argsort(key.repeat_interleave(received.reshape(-1)), stable=True)
    return arrived[order], received.sum(0), Route(sent, from_each, order)


def combine(rows: torch.Tensor, route: Route, ep: ExpertParallel) -> torch.Tensor:
    """The inverse of `dispatch`: the experts' output `rows` (grouped by local expert) sent back to
    their source ranks, where they come out in the order `dispatch` was given them."""
    inverse = torch.empty_like(route.order)
    inverse[route.order] = torch.arange(route.order.numel(), device=route.order.device)
    return all_to_all_single_autograd(rows[inverse].contiguous(), route.sent, route.received, ep.group)


def token_counts(total: int, size: int) -> list[int]:
    """How `total` tokens split over `size` ranks: as equal as can be, the first ranks one more."""
    return [total // size + (rank < total % size) for rank in range(size)]


def local_tokens(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """This tp rank's share of the tokens (dim 0) of `x` (`token_counts`; no autograd)."""
    counts = token_counts(x.shape[0], tp.size)
    return x.narrow(0, sum(counts[:tp.rank]), counts[tp.rank])


def _gather_tokens(x: torch.Tensor, tp: TensorParallel, total: int) -> torch.Tensor:
    counts = token_counts(total, tp.size)
    padded = x.new_zeros((counts[0], *x.shape[1:]))  # every rank sends as many rows as the first
    padded[:x.shape[0]] = x
    out = x.new_empty((tp.size * counts[0], *x.shape[1:]))
    dist.all_gather_single(out, padded, group=tp.group)
    return torch.cat([piece[:n] for piece, n in zip(out.chunk(tp.size), counts)])


class _ScatterTokens(Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp, ctx.total = tp, x.shape[0]
        return local_tokens(x, tp).clone()

    @staticmethod
    def backward(ctx, grad):
        return _gather_tokens(grad.contiguous(), ctx.tp, ctx.total), None


class _GatherTokens(Function):
    @staticmethod
    def forward(ctx, x, tp, total):
        ctx.tp = tp
        return _gather_tokens(x.contiguous(), tp, total)

    @staticmethod
    def backward(ctx, grad):
        return local_tokens(grad, ctx.tp).contiguous(), None, None


def scatter_tokens(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """This tp rank's share of the tokens (dim 0) of `x`, replicated over tp (`token_counts`: any
    number of tokens, e.g. one in generation); backward all-gathers the gradient."""
    return _ScatterTokens.apply(x, tp)


def gather_tokens(x: torch.Tensor, tp: TensorParallel, total: int) -> torch.Tensor:
    """Every tp rank's share of `total` tokens (dim 0), joined in rank order (the inverse of
    `scatter_tokens`); backward takes this rank's share of the gradient."""
    return _GatherTokens.apply(x, tp, total)
