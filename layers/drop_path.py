"""Stochastic depth (Huang et al., 2016): a residual branch dropped for whole samples.

    training:  branch(x) · keep / (1 - p), keep ~ Bernoulli(1 - p), one draw per sample
    eval:      branch(x)

The draw comes from the default random stream, which every tp rank holds alike (as a replicated
dropout's), so the ranks of a tp group drop the same samples and the residual stream stays
replicated.
"""

from __future__ import annotations

import torch
from torch import nn


class DropPath(nn.Module):
    """Drop the branch's output of each sample with probability `p` in training (the kept ones scaled
    by 1 / (1 - p)); the identity in eval or at p = 0."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"drop path probability {p} is not in [0, 1)")
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = 1.0 - self.p
        # u + keep >= 1 with probability keep: the draw transformers' (and timm's) DropPath makes
        kept = (torch.rand((x.shape[0],) + (1,) * (x.dim() - 1), dtype=x.dtype, device=x.device) + keep).floor()
        return x / keep * kept

    def extra_repr(self) -> str:
        return f"p={self.p}"
