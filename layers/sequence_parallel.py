"""The two ends of the sequence-parallel region of a model.

Between `SequenceScatter` and `SequenceGather` the activations [B, S, h] are split over the
sequence inside the tp group ([B, S/tp, h] per rank); norms, dropout and residual adds run on
that shard. Without sequence parallelism (or tp=1) both are identities, so a model file can
always call them.
"""

from __future__ import annotations

import torch
from torch import nn

from libai_zoo.distributed.collectives import gather_from_tp, scatter_to_tp

from .parallel_layer import ParallelLayer


class SequenceScatter(ParallelLayer, nn.Module):
    """Keep this rank's part of the sequence of a replicated activation (no communication)."""

    def __init__(self, seq_dim: int = 1):
        super().__init__()
        self.seq_dim = seq_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scatter_to_tp(x, self.tp, self.seq_dim) if self.sp else x

    def whole_length(self, part: torch.Tensor) -> int:
        """The sequence length of which `part` (an output of this layer) is this rank's part."""
        return part.shape[self.seq_dim] * (self.tp.size if self.sp else 1)


class SequenceGather(ParallelLayer, nn.Module):
    """All-gather the sequence shards into the whole sequence, replicated over tp."""

    def __init__(self, seq_dim: int = 1):
        super().__init__()
        self.seq_dim = seq_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gather_from_tp(x, self.tp, self.seq_dim) if self.sp else x
