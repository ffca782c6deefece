"""LayerNorm and RMSNorm: replicated over tensor parallelism, split over the sequence under
sequence parallelism (each rank normalizes its own tokens; weight gradients are then partial
and summed over tp by `libai_zoo.distributed.finalize_grads`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from libai_zoo.distributed import local

from .parallel_layer import ParallelLayer


class LayerNorm(ParallelLayer, nn.LayerNorm):
    """`nn.LayerNorm` over the last dimension, parameters replicated over tp."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 *, sequence_parallel: bool = True, device=None, dtype=None):
        super().__init__(hidden_size, eps, elementwise_affine, bias, device=device, dtype=dtype)
        self.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, local(self.weight, partial_grad=self.sp),
                            local(self.bias, partial_grad=self.sp), self.eps)

    def extra_repr(self) -> str:
        return super().extra_repr() + self.parallel_repr()


class RMSNorm(ParallelLayer, nn.RMSNorm):
    """`nn.RMSNorm` over the last dimension, computed in float32 and cast back as Llama does."""

    def __init__(self, hidden_size: int, eps: float | None = None, elementwise_affine: bool = True,
                 *, sequence_parallel: bool = True, device=None, dtype=None):
        super().__init__(hidden_size, eps, elementwise_affine, device=device, dtype=dtype)
        self.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), self.normalized_shape, eps=self.eps).to(x.dtype)
        weight = local(self.weight, partial_grad=self.sp)
        return normed if weight is None else weight * normed

    def extra_repr(self) -> str:
        return super().extra_repr() + self.parallel_repr()
