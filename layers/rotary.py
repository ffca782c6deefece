"""Rotary position embedding (RoFormer), in the half-split layout of Llama / GPT-NeoX.

Context extension rescales the frequencies (``scaling``): "linear" divides them all by a
factor (position interpolation); "llama3" (Llama 3.1) divides only the low frequencies, whose
wavelength exceeds the original context / low_freq_factor, keeps those shorter than original
context / high_freq_factor, and blends linearly in between; "longrope" (Phi-3, Phi-4) divides each
frequency by its own factor, the long ones once a position lies past the original context
(``original_max_position_embeddings``) and the short ones before, and multiplies cos and sin by
``attention_factor`` (which scales q·k on the rotated channels); "yarn" (YaRN, Peng et al. 2023:
DeepSeek-V3, Qwen's long contexts) keeps the frequencies that turn more than ``beta_fast`` times
over the original context, divides by ``factor`` those turning fewer than ``beta_slow`` times, ramps
linearly in between, and multiplies cos and sin by ``attention_factor`` (by default
mscale(factor, mscale) / mscale(factor, mscale_all_dim), or mscale(factor): `yarn_mscale`).

DeepSeek lays each head's rotary channels out in interleaved pairs (x0, x1), (x2, x3), ...:
`deinterleave` reorders them to the half-split layout first, as transformers'
``apply_rotary_pos_emb_interleave`` does (q and k alike, so q·k is unchanged).
"""

from __future__ import annotations

import math

import torch
from torch import nn

SCALINGS = ("linear", "llama3", "longrope", "yarn")


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions, computed in float32 on the fly.

    It holds no tensors at all, so a model built on the meta device (as `from_pretrained` does)
    needs nothing re-initialised once its weights are loaded.
    """

    def __init__(self, dim: int, base: float = 10000.0, scaling: dict | None = None):
        super().__init__()
        if scaling is not None and scaling.get("rope_type") not in SCALINGS:
            raise ValueError(f"rope scaling {scaling.get('rope_type')!r} is not one of {SCALINGS}")
        self.dim, self.base, self.scaling = dim, base, scaling
        longrope = scaling is not None and scaling["rope_type"] == "longrope"
        #: the length past which the frequencies change (longrope's original context), else None
        self.switch_length = scaling["original_max_position_embeddings"] if longrope else None
        self.attention_factor = 1.0
        if longrope:
            self.attention_factor = scaling["attention_factor"]
        elif scaling is not None and scaling["rope_type"] == "yarn":
            self.attention_factor = yarn_attention_factor(scaling)

    def inv_freq(self, position_ids: torch.Tensor) -> torch.Tensor:
        """The frequencies for a call on `position_ids` (longrope's depend on the last position)."""
        device = position_ids.device
        exponents = torch.arange(0, self.dim, 2, dtype=torch.int64, device=device).float() / self.dim
        if self.switch_length is not None:
            short, long = (torch.tensor(self.scaling[key], dtype=torch.float32, device=device)
                           for key in ("short_factor", "long_factor"))
            # as transformers picks them, and with no host sync: for the whole call, by its last position
            factors = torch.where(position_ids.max() + 1 > self.switch_length, long, short)
            return 1.0 / (factors * self.base ** exponents)
        inv_freq = 1.0 / (self.base ** exponents)
        if self.scaling is None:
            return inv_freq
        factor = self.scaling["factor"]
        if self.scaling["rope_type"] == "linear":
            return inv_freq / factor
        if self.scaling["rope_type"] == "yarn":
            return self._yarn(exponents, factor)
        context = self.scaling["original_max_position_embeddings"]
        low, high = self.scaling["low_freq_factor"], self.scaling["high_freq_factor"]
        wavelength = 2 * math.pi / inv_freq
        blend = ((context / wavelength - low) / (high - low)).clamp(0.0, 1.0)  # 0: long waves, 1: short ones
        return (1 - blend) * inv_freq / factor + blend * inv_freq

    def _yarn(self, exponents: torch.Tensor, factor: float) -> torch.Tensor:
        """YaRN's frequencies: each pair of channels between kept (fast) and divided by factor (slow)."""
        scaling, dim = self.scaling, self.dim
        context = scaling["original_max_position_embeddings"]

        def channel(rotations: float) -> float:  # the channel whose frequency turns `rotations` times over the context
            return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(self.base))

        low, high = channel(scaling.get("beta_fast") or 32), channel(scaling.get("beta_slow") or 1)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=exponents.device) - low)
                / (high - low if high != low else 0.001)).clamp(0.0, 1.0)  # 0: kept, 1: divided by factor
        periods = self.base ** exponents
        return 1.0 / (factor * periods) * ramp + 1.0 / periods * (1 - ramp)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, S] -> cos, sin of shape [B, S, dim] (float32)."""
        freqs = position_ids[..., None].float() * self.inv_freq(position_ids)
        angles = torch.cat((freqs, freqs), dim=-1)
        if self.attention_factor != 1.0:
            return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor
        return angles.cos(), angles.sin()

    def extra_repr(self) -> str:
        scaling = f", scaling={self.scaling['rope_type']}" if self.scaling else ""
        return f"dim={self.dim}, base={self.base}{scaling}"


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class _Rotation(torch.autograd.Function):
    """x · cos + rotate_half(x) · sin, keeping only cos and sin: the gradient is rotated back by
    the inverse rotation (cos, −sin), the same ops autograd would run, so no copy of x is kept."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.shape = x.shape
        return x * cos + rotate_half(x) * sin

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return (grad * cos - rotate_half(grad * sin)).sum_to_size(ctx.shape), None, None


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the last dimension of x by the angles whose cos/sin broadcast against x; when the
    tables are narrower (partial rotary, GPT-NeoX's rotary_pct), only its first channels. Cast
    cos and sin to x's dtype first when rotating several tensors (else each call casts its own)."""
    rotated = cos.shape[-1]
    if rotated < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rotated], cos, sin), x[..., rotated:]), dim=-1)
    return _Rotation.apply(x, cos.to(x.dtype), sin.to(x.dtype))


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Rotary channels in interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek) -> the half-split
    layout `apply_rotary` rotates: the even channels, then the odd ones."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context `factor` times longer: 0.1 · mscale · ln(factor) + 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(scaling: dict) -> float:
    """YaRN's cos/sin multiplier: ``attention_factor`` if given, else mscale(factor, mscale) /
    mscale(factor, mscale_all_dim) when both are set (DeepSeek), else mscale(factor)."""
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    factor, mscale, mscale_all_dim = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)
