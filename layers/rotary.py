"""Rotary position embedding (RoFormer), in the half-split layout of Llama / GPT-NeoX."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions, computed in float32 on the fly (no persistent state)."""

    def __init__(self, dim: int, base: float = 10000.0, device=None):
        super().__init__()
        self.dim, self.base = dim, base
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
        self.register_buffer("inv_freq", 1.0 / (base ** exponents), persistent=False)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, S] -> cos, sin of shape [B, S, dim] (float32)."""
        freqs = position_ids[..., None].float() * self.inv_freq.float()
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos(), angles.sin()

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base}"


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the last dimension of x by the angles whose cos/sin broadcast against x."""
    return x * cos.to(x.dtype) + rotate_half(x) * sin.to(x.dtype)
