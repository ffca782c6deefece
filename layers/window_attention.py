"""Attention within windows of a feature map (Swin, Liu et al. 2021; Swin V2, Liu et al. 2022).

    x [B, H·W, C] -> [B, H, W, C] -> pad bottom/right to multiples of the window w
      -> roll by -shift (shifted windows) -> windows [B·nW, w², C]
      -> Attention, its scores + the relative position bias [heads, w², w²]
                                 (+ the shift mask: -100 between tokens the roll made neighbours)
      -> windows back, roll by +shift, crop -> [B, H·W, C]

The bias of a pair of tokens depends on their offset (dh, dw) in the window, one value per head:
read from a learned table [(2w-1)², heads] (Swin), or computed by a small MLP from the offsets on
a log scale, 16·sigmoid(MLP(sign(d)·log2(1 + 8|d|/(w'-1)) / 3)) (Swin V2's continuous position bias,
w' the window it was pre-trained at). It reaches `Attention` as an additive 4-D mask
[B·nW, heads, w², w²]; under tp each rank computes its own heads' bias (`WindowPositionBias` splits
the table, or the MLP's output layer, with the heads), so nothing is exchanged beyond Attention's
own all-reduce. The padded tokens are zeros that every window's queries see, as in transformers.
The offset index, the log-spaced offsets and the shift mask are computed in forward from the
window (small integer tensors), as the zoo computes its rotary tables and masks: no buffers.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from libai_zoo.distributed import TensorParallel, local

from .attention import Attention
from .linear import Linear
from .parallel_layer import ParallelLayer, indivisible


def window_partition(x: torch.Tensor, window: int) -> torch.Tensor:
    """[B, H, W, C] (H, W multiples of `window`) -> [B·nW, window², C], windows in row-major order."""
    batch, height, width, channels = x.shape
    x = x.view(batch, height // window, window, width // window, window, channels).transpose(2, 3)
    return x.reshape(-1, window * window, channels)


def window_merge(windows: torch.Tensor, window: int, height: int, width: int) -> torch.Tensor:
    """The inverse of `window_partition`: [B·nW, window², C] -> [B, height, width, C]."""
    channels = windows.shape[-1]
    x = windows.view(-1, height // window, width // window, window, window, channels).transpose(2, 3)
    return x.reshape(-1, height, width, channels)


def relative_position_index(window: int, device=None) -> torch.Tensor:
    """[window², window²]: the row of the (2·window - 1)² offset table for each pair of tokens of a
    window (query, key), the offset (dh, dw) = query - key read row-major."""
    side = torch.arange(window, device=device)
    coords = torch.stack(torch.meshgrid(side, side, indexing="ij")).flatten(1)
    offsets = coords[:, :, None] - coords[:, None, :] + (window - 1)  # [2, w², w²], each in [0, 2w - 2]
    return offsets[0] * (2 * window - 1) + offsets[1]


def log_spaced_offsets(window: int, pretrained_window: int = 0, device=None) -> torch.Tensor:
    """[(2·window - 1)², 2]: every offset (dh, dw) of a window, scaled to [-8, 8] by the window it
    was pre-trained at (or its own), then sign(d)·log2(1 + |d|) / 3 (Swin V2's input to its bias MLP)."""
    span = torch.arange(-(window - 1), window, dtype=torch.float32, device=device)
    offsets = torch.stack(torch.meshgrid(span, span, indexing="ij"), dim=-1).reshape(-1, 2)
    reference = pretrained_window if pretrained_window > 0 else window
    if reference > 1:
        offsets = offsets / (reference - 1)
    offsets = offsets * 8
    return torch.sign(offsets) * torch.log2(offsets.abs() + 1.0) / math.log2(8)


def shift_mask(size: int, window: int, shift: int, value: float, device=None) -> torch.Tensor:
    """[nW, window², window²]: 0 between tokens of one region of the rolled map, `value` between
    tokens the roll brought together (each axis: [0, size - window), [size - window, size - shift),
    [size - shift, size) are regions; `size` is the padded side)."""
    index = torch.arange(size, device=device)
    region = (index >= size - window).long() + (index >= size - shift).long()
    regions = (region[:, None] * 3 + region[None, :])[None, :, :, None]  # [1, size, size, 1]
    ids = window_partition(regions, window).squeeze(-1)  # [nW, w²]
    different = ids[:, :, None] != ids[:, None, :]
    return torch.zeros(different.shape, device=device).masked_fill(different, value)


class WindowPositionBias(ParallelLayer, nn.Module):
    """The relative position bias of a window's attention, [1, heads, w², w²] (this rank's heads
    under tp): a learned `table` [(2w-1)², heads] split over tp along the heads, or with
    ``continuous=True`` Swin V2's MLP over log-spaced offsets (2 -> ``hidden`` -> heads, the output
    layer split with the heads), 16·sigmoid of it."""

    def __init__(self, window_size: int, num_heads: int, *, continuous: bool = False, pretrained_window_size: int = 0,
                 hidden: int = 512, device=None, dtype=None):
        super().__init__()
        self.window_size, self.num_heads = window_size, num_heads
        self.continuous, self.pretrained_window_size = continuous, pretrained_window_size
        self.sequence_parallel = False
        self.table = self.mlp_in = self.mlp_out = None
        if continuous:
            factory = dict(sequence_parallel=False, device=device, dtype=dtype)
            self.mlp_in = Linear(2, hidden, True, "data", **factory)
            self.mlp_out = Linear(hidden, num_heads, False, "col", **factory)
        else:
            self.table = nn.Parameter(torch.zeros((2 * window_size - 1) ** 2, num_heads, device=device, dtype=dtype))

    def tp_problems(self, tp_size: int) -> list[str]:
        return indivisible(self.num_heads, tp_size, "num_heads of a window's position bias",
                           "choose a tp that divides every stage's number of heads")

    def shard_(self, tp: TensorParallel) -> None:
        tp.shard_parameter(self, "table", 1)  # this rank's heads (the MLP's output layer splits itself)
        super().shard_(tp)

    def offset_table(self) -> torch.Tensor:
        """[(2w-1)², this rank's heads]: the bias of each offset."""
        if not self.continuous:
            return local(self.table)
        weight = self.mlp_in.weight
        offsets = log_spaced_offsets(self.window_size, self.pretrained_window_size, weight.device).to(weight.dtype)
        return 16 * torch.sigmoid(self.mlp_out(F.relu(self.mlp_in(offsets))))

    def forward(self) -> torch.Tensor:
        table, pairs = self.offset_table(), self.window_size ** 2
        index = relative_position_index(self.window_size, table.device)
        return table[index.flatten()].view(pairs, pairs, -1).permute(2, 0, 1).unsqueeze(0)

    def extra_repr(self) -> str:
        kind = f"continuous, pretrained_window={self.pretrained_window_size}" if self.continuous else "table"
        return f"window={self.window_size}, heads={self.num_heads}, {kind}{self.parallel_repr()}"


class WindowAttention(nn.Module):
    """Multi-head self-attention within (shifted) windows of a square feature map of side
    `resolution` (see the module docstring): `attn` (an `Attention`, its heads split over tp) and
    `position_bias` (a `WindowPositionBias`). ``shift_size`` > 0 rolls the map by it first and masks
    the pairs the roll made neighbours with ``shift_mask_value``. ``key_bias`` and ``cosine`` are
    `Attention`'s (Swin V2: no k bias, scaled cosine attention); ``continuous_position_bias`` and
    ``pretrained_window_size`` `WindowPositionBias`'s."""

    def __init__(self, hidden_size: int, num_heads: int, resolution: int, window_size: int, shift_size: int = 0, *,
                 bias: bool = True, key_bias: bool = True, cosine: bool = False,
                 continuous_position_bias: bool = False, pretrained_window_size: int = 0,
                 shift_mask_value: float = -100.0, dropout: float = 0.0, device=None, dtype=None):
        super().__init__()
        if not 0 <= shift_size < window_size:
            raise ValueError(f"shift_size = {shift_size} must be in [0, window_size = {window_size})")
        self.resolution, self.window_size, self.shift_size = resolution, window_size, shift_size
        self.shift_mask_value = shift_mask_value
        self.padded = -(-resolution // window_size) * window_size
        self.attn = Attention(hidden_size, num_heads, bias=bias, key_bias=key_bias, cosine=cosine, dropout=dropout,
                              sequence_parallel=False, device=device, dtype=dtype)
        self.position_bias = WindowPositionBias(window_size, num_heads, continuous=continuous_position_bias,
                                                pretrained_window_size=pretrained_window_size, device=device,
                                                dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, resolution², C] (row-major) -> [B, resolution², C]."""
        batch, _, channels = x.shape
        side, window, shift = self.resolution, self.window_size, self.shift_size
        x = self._pad(x.view(batch, side, side, channels))
        if shift:
            x = torch.roll(x, shifts=(-shift, -shift), dims=(1, 2))
        windows = window_partition(x, window)
        out = self.attn(windows, self._mask(batch, windows))
        x = window_merge(out, window, self.padded, self.padded)
        if shift:
            x = torch.roll(x, shifts=(shift, shift), dims=(1, 2))
        return x[:, :side, :side].reshape(batch, side * side, -1)

    def _pad(self, x: torch.Tensor) -> torch.Tensor:
        """[B, side, side, C] -> [B, padded, padded, C], zeros at the bottom and on the right."""
        extra = self.padded - self.resolution
        return F.pad(x, (0, 0, 0, extra, 0, extra)) if extra else x

    def _mask(self, batch: int, windows: torch.Tensor) -> torch.Tensor:
        """The additive mask of every window's scores: [1, heads, w², w²] without a shift, else
        [B·nW, heads, w², w²] (bias + shift mask), in the dtype attention computes in."""
        mask = self.position_bias()
        if self.shift_size:
            shifted = shift_mask(self.padded, self.window_size, self.shift_size, self.shift_mask_value, mask.device)
            mask = (mask + shifted[:, None])[None].expand(batch, -1, -1, -1, -1).flatten(0, 1)
        device = windows.device.type
        return mask.to(torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else windows.dtype)

    def extra_repr(self) -> str:
        return f"resolution={self.resolution}, window={self.window_size}, shift={self.shift_size}"
