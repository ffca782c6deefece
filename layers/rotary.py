"""Rotary position embedding (RoFormer), in the half-split layout of Llama / GPT-NeoX."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions, computed in float32 on the fly.

    It holds no tensors at all, so a model built on the meta device (as `from_pretrained` does)
    needs nothing re-initialised once its weights are loaded.
    """

    def __init__(self, dim: int, base: float = 10000.0):
        super().__init__()
        self.dim, self.base = dim, base

    def inv_freq(self, device) -> torch.Tensor:
        exponents = torch.arange(0, self.dim, 2, dtype=torch.int64, device=device).float() / self.dim
        return 1.0 / (self.base ** exponents)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, S] -> cos, sin of shape [B, S, dim] (float32)."""
        freqs = position_ids[..., None].float() * self.inv_freq(position_ids.device)
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
