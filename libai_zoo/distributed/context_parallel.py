"""Context parallelism: the sequence of every sample split over a group of ranks ("cp").

Causal attention makes later tokens costlier than earlier ones, so a plain split would give the
last rank most of the work. Each sample is cut into 2·cp equal chunks and rank r holds chunks r and
2·cp − 1 − r (Megatron-LM's and torchtitan's load balance): every rank then attends over the same
number of (query, key) pairs. A rank's tokens are its two chunks side by side, in this order; their
positions (rotary, learned) and targets are cut the same way, so every per-token part of a model
(embeddings, norms, MLPs, the head and its loss) runs unchanged on them, and only attention, which
mixes tokens, talks to the other ranks.

Attention gathers the keys and values of the whole sequence (`gather_sequence`, Llama 3's
all-gather context parallelism): its backward reduce-scatters their gradients back to each rank's
chunks. The gathered tensors are in the sequence's own order, so a mask by global position (causal,
sliding window, packed documents, padding) is the one-process mask's rows for this rank's queries.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Function
from torch.distributed.device_mesh import DeviceMesh

from .tensor_parallel import MeshGroup


class ContextParallel(MeshGroup):
    """The cp mesh a sequence is split over, with its group, size and this rank's index."""

    def __init__(self, mesh: DeviceMesh):
        super().__init__(mesh, "context-parallel")

    @property
    def chunks(self) -> tuple[int, int]:
        """The indices of this rank's two chunks among the 2·cp of a sample."""
        return chunks_of(self.rank, self.size)

    def split(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's two chunks of `x` along `dim` (a sample's sequence), side by side."""
        return split_sequence(x, self.rank, self.size, dim)

    def positions(self, seq_len: int, device: torch.device | None = None) -> torch.Tensor:
        """The global positions [seq_len / cp] of this rank's tokens in a sequence of `seq_len`."""
        return split_sequence(torch.arange(seq_len, device=device), self.rank, self.size, 0)

    def __repr__(self) -> str:
        return f"ContextParallel(size={self.size}, rank={self.rank})"


def chunks_of(rank: int, size: int) -> tuple[int, int]:
    """Chunks r and 2·cp − 1 − r of the 2·cp: rank `rank`'s share of a sequence under cp = `size`."""
    return rank, 2 * size - 1 - rank


def split_sequence(x: torch.Tensor, rank: int, size: int, dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s two chunks of `x` along `dim`, side by side (no communication, no autograd)."""
    if x.shape[dim] % (2 * size):
        raise ValueError(f"a sequence of {x.shape[dim]} tokens does not split into 2·cp = {2 * size} equal chunks: "
                         f"make the sequence length a multiple of {2 * size} (pad it, or change the data's "
                         f"sequence length or dist.cp)")
    pieces = x.chunk(2 * size, dim)
    first, second = chunks_of(rank, size)
    return torch.cat((pieces[first], pieces[second]), dim)


def merge_sequence(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's `split_sequence` (`parts[r]` is rank r's), in order:
    the inverse of the split (no communication, no autograd)."""
    size = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * size)
    for rank, part in enumerate(parts):
        first, second = chunks_of(rank, size)
        chunks[first], chunks[second] = part.chunk(2, dim)
    return torch.cat(chunks, dim)


def all_gather_sequence(x: torch.Tensor, cp: ContextParallel, dim: int = 1) -> torch.Tensor:
    """Every cp rank's two chunks of `x` along `dim` joined into the whole sequence, in its order
    (no autograd: also for integer position ids and padding masks)."""
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((cp.size * x.shape[0], *x.shape[1:]))
    dist.all_gather_single(out, x, group=cp.group)
    halves = out.unflatten(0, (cp.size, 2, -1))  # [rank, its first / second chunk, chunk length, ...]
    # chunks 0 .. cp-1 are the ranks' first ones in rank order, chunks cp .. 2cp-1 their second ones in reverse
    return torch.cat((halves[:, 0], halves[:, 1].flip(0))).flatten(0, 1).movedim(0, dim)


def reduce_scatter_sequence(x: torch.Tensor, cp: ContextParallel, dim: int = 1) -> torch.Tensor:
    """The sum over cp ranks of `x` (whole sequence along `dim`), of which this rank keeps its two
    chunks: the inverse of `all_gather_sequence` for gradients (no autograd)."""
    size = cp.size
    chunks = x.movedim(dim, 0).chunk(2 * size)
    by_rank = torch.cat([chunks[i] for rank in range(size) for i in chunks_of(rank, size)]).contiguous()
    out = by_rank.new_empty((by_rank.shape[0] // size, *by_rank.shape[1:]))
    dist.reduce_scatter_single(out, by_rank, group=cp.group)
    return out.movedim(0, dim)


class _GatherSequence(Function):
    @staticmethod
    def forward(ctx, x, cp, dim):
        ctx.cp, ctx.dim = cp, dim
        return all_gather_sequence(x, cp, dim)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_sequence(grad, ctx.cp, ctx.dim), None, None


def gather_sequence(x: torch.Tensor, cp: ContextParallel, dim: int = 1) -> torch.Tensor:
    """All-gather over cp into the whole sequence in order (`all_gather_sequence`); backward
    reduce-scatters the gradient back to this rank's chunks (every rank's queries read every key)."""
    return _GatherSequence.apply(x, cp, dim)


def cp_problems(model: nn.Module, cp_size: int) -> list[str]:
    """Why `model` cannot split its sequences over `cp_size` ranks ([] when it can), asked of every
    module with a ``cp_problems`` method (the attention layers), before anything is built."""
    if cp_size == 1:
        return []
    return [f"{name or type(model).__name__}: {problem}" for name, module in model.named_modules()
            if callable(getattr(module, "cp_problems", None)) for problem in module.cp_problems(cp_size)]
