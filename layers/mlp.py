"""Feed-forward block: column-parallel up projection, activation, row-parallel down projection.

    x [B, S, h] -> up [h, S(ffn)] -> act -> down [S(ffn), h] -> all-reduce -> [B, S, h]

With ``gated=True`` (SwiGLU, Llama) `up` fuses gate and up projections neuron by neuron
(`fuse_gate_up`), so any tp split keeps each gate next to its up row: act(gate) * up.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from libai_zoo.dist import TensorParallel

from .fused import interleave_groups, split_groups
from .linear import Linear
from .parallel_layer import ParallelLayer


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": functools.partial(F.gelu, approximate="tanh"),
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "quick_gelu": quick_gelu,
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


class MLP(ParallelLayer, nn.Module):
    """Two-layer MLP (or gated MLP) with its hidden neurons split over tp."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, *, activation: str = "gelu", gated: bool = False,
                 bias: bool = True, sync_input: bool = True, reduce_output: bool = True,
                 sequence_parallel: bool = True, device=None, dtype=None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r} is not one of {sorted(ACTIVATIONS)}")
        self.activation_name, self.act, self.gated = activation, ACTIVATIONS[activation], gated
        self.ffn_hidden_size = ffn_hidden_size
        self.sequence_parallel = sequence_parallel
        self.up = Linear(hidden_size, ffn_hidden_size * (2 if gated else 1), bias, "col", sync_input=sync_input,
                         sequence_parallel=sequence_parallel, device=device, dtype=dtype)
        self.down = Linear(ffn_hidden_size, hidden_size, bias, "row", reduce_output=reduce_output,
                           sequence_parallel=sequence_parallel, device=device, dtype=dtype)

    def shard_(self, tp: TensorParallel) -> None:
        tp.check_divisible(self.ffn_hidden_size, "ffn_hidden_size (MLP hidden neurons)",
                           "choose an intermediate size that is a multiple of tp")
        super().shard_(tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.up(x)
        if self.gated:
            y = y.unflatten(-1, (-1, 2))
            y = self.act(y[..., 0]) * y[..., 1]
        else:
            y = self.act(y)
        return self.down(y)

    def extra_repr(self) -> str:
        return f"activation={self.activation_name}, gated={self.gated}{self.parallel_repr()}"


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Separate gate and up weights [ffn, h] -> the fused `up` weight [2*ffn, h] of a gated MLP."""
    return interleave_groups([gate, up], gate.shape[0])


def split_gate_up(fused: torch.Tensor) -> list[torch.Tensor]:
    """The fused `up` weight of a gated MLP -> [gate, up], inverse of `fuse_gate_up`."""
    ffn = fused.shape[0] // 2
    return split_groups(fused, ffn, [ffn, ffn])
