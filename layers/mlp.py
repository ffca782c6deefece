"""Feed-forward block: column-parallel up projection, activation, row-parallel down projection.

    x [B, S, h] -> up [h, S(ffn)] -> act -> down [S(ffn), h] -> all-reduce -> [B, S, h]

With ``gated=True`` (SwiGLU, Llama) a second column-parallel projection `gate` gives
act(gate(x)) * up(x); both split the same neurons, so any tp keeps each gate with its up row.
The two share one input sync (one all-reduce of the input gradient), as one fused weight would.
act(gate)·up keeps only gate's and up's outputs for backward (`gated`), so the gated MLP saves its
input, gate, up and the down projection's input: 6·ffn elements per token beside the input, as
Megatron-LM's (``elementwise_recompute``, `config.settings.ELEMENTWISE_RECOMPUTE`: "never" keeps act(gate)
too; the plain act(up) is kept in every mode: its input is what its backward reads). ``dropout`` drops activated neurons before the down projection (T5); each tp rank
draws its own neurons' masks from its random stream, as one process would draw them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from .linear import Linear, column_inputs
from .parallel_layer import ParallelLayer, indivisible
from .recomputed import recomputed, recomputes


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
    "tanh": torch.tanh,
}


def gated(act: Callable[[torch.Tensor], torch.Tensor], gate: torch.Tensor, up: torch.Tensor,
          recompute: bool = True) -> torch.Tensor:
    """act(gate) * up, saving gate and up only: backward recomputes act(gate) (`recomputed`);
    ``recompute=False``: as autograd saves it (act(gate) besides)."""
    if not recompute:
        return act(gate) * up
    return recomputed(lambda g, u: act(g) * u, gate, up)


class MLP(ParallelLayer, nn.Module):
    """Two-layer MLP (or gated MLP) with its hidden neurons split over tp."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, *, activation: str = "gelu", gated: bool = False,
                 bias: bool = True, dropout: float = 0.0, sync_input: bool = True, reduce_output: bool = True,
                 sequence_parallel: bool = True, device=None, dtype=None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r} is not one of {sorted(ACTIVATIONS)}")
        self.activation_name, self.act = activation, ACTIVATIONS[activation]
        self.ffn_hidden_size = ffn_hidden_size
        self.sync_input, self.sequence_parallel = sync_input, sequence_parallel
        col = dict(parallel="col", sync_input=False, sequence_parallel=sequence_parallel, device=device, dtype=dtype)
        self.gate = Linear(hidden_size, ffn_hidden_size, bias, **col) if gated else None
        self.up = Linear(hidden_size, ffn_hidden_size, bias, **col)
        self.down = Linear(ffn_hidden_size, hidden_size, bias, "row", reduce_output=reduce_output,
                           sequence_parallel=sequence_parallel, device=device, dtype=dtype)
        self.dropout = nn.Dropout(dropout)
        self.elementwise_recompute = "auto"

    def tp_problems(self, tp_size: int) -> list[str]:
        return indivisible(self.ffn_hidden_size, tp_size, "ffn_hidden_size (MLP hidden neurons)",
                           "choose an intermediate size that is a multiple of tp, or lower tp")

    @property
    def column_layers(self) -> list[Linear]:
        """The column-parallel projections that read the input: [gate,] up."""
        return [self.up] if self.gate is None else [self.gate, self.up]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is not None and self.sync_input:
            x, = column_inputs(self.tp, self.sp, (x, self.column_layers))
        return self.down(self._dropout(self._activate(None if self.gate is None else self.gate(x), self.up(x))))

    def _dropout(self, h: torch.Tensor) -> torch.Tensor:
        """Dropout of this rank's neurons, from its tp rank's random stream."""
        if not (self.training and self.dropout.p):
            return h
        with self.tp.rng.fork() if self.tp is not None else nullcontext():
            return self.dropout(h)

    def _activate(self, gate: torch.Tensor | None, up: torch.Tensor) -> torch.Tensor:
        """act(up), or act(gate) * up keeping only gate and up (`gated`): the seam selective
        recomputation ("mlp_act") wraps."""
        if gate is None:
            return self.act(up)
        return gated(self.act, gate, up, recomputes(self.elementwise_recompute, True))

    def extra_repr(self) -> str:
        return f"activation={self.activation_name}, gated={self.gate is not None}{self.parallel_repr()}"
