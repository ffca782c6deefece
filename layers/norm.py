"""LayerNorm and RMSNorm: replicated over tensor parallelism, split over the sequence under
sequence parallelism (each rank normalizes its own tokens; weight gradients are then partial
and summed over tp by `libai_zoo.distributed.finalize_grads`).

Both can keep only their input for backward, in its own dtype, and recompute the normalised values
there (`recomputed`): no float32 copy of a bf16 input (autocast runs layer_norm in float32), no
normalised values beside the weighted ones. ``elementwise_recompute`` says when
(`config.settings.ELEMENTWISE_RECOMPUTE`; "auto": an RMSNorm always, a LayerNorm only when autocast
upcasts its input, since a LayerNorm in its input's dtype keeps no more than its input, mean and rstd). A norm over a tp-split dimension (``split_dim``)
then all-reduces its square sums again in backward (a [B, S, 1] tensor).

RMSNorm also covers what today's decoders add: the weight applied in float32 before the cast
back (OLMo 2: ``float32_weight``), Gemma's (1 + w) weight so applied (``unit_offset``), the
normalised values cast to the weight's dtype rather than the input's (T5: ``cast_to_weight``), a
norm over each rank's own heads (q/k norms of Qwen3 and Gemma 3:
``split_input``, the weight's gradient is partial under any tp) and a norm over a dimension tp
splits (OLMo 2's q/k norm over the whole projection: ``split_dim``, the weight is split with it
and the mean square is summed over tp; q and k are never gathered).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from libai_zoo.distributed import TensorParallel, local
from libai_zoo.distributed.collectives import sum_over_tp

from .parallel_layer import ParallelLayer, indivisible
from .recomputed import recomputed, recomputes


class LayerNorm(ParallelLayer, nn.LayerNorm):
    """`nn.LayerNorm` over the last dimension, parameters replicated over tp."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 *, sequence_parallel: bool = True, device=None, dtype=None):
        super().__init__(hidden_size, eps, elementwise_affine, bias, device=device, dtype=dtype)
        self.sequence_parallel = sequence_parallel
        self.elementwise_recompute = "auto"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = local(self.weight, partial_grad=self.sp), local(self.bias, partial_grad=self.sp)
        # recomputing frees memory only where autocast would keep a float32 copy of the input
        upcast = x.dtype != torch.float32 and torch.is_autocast_enabled(x.device.type)
        if recomputes(self.elementwise_recompute, upcast):
            return recomputed(self._normalize, x, weight, bias)
        return self._normalize(x, weight, bias)

    def _normalize(self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)

    def extra_repr(self) -> str:
        return super().extra_repr() + self.parallel_repr()


class RMSNorm(ParallelLayer, nn.RMSNorm):
    """`nn.RMSNorm` over the last dimension, computed in float32 and cast back as Llama does.

    ``float32_weight``: the weight multiplies the float32 normalized values, then the cast (OLMo 2);
    Llama casts first. ``cast_to_weight``: the float32 normalized values are cast to the weight's
    dtype when it is 16-bit, else kept in float32, then weighted (T5's LayerNorm: a bf16 input of a
    float32 norm gives float32). ``unit_offset``: Gemma's weight, (1 + w) so applied (it starts at 0).
    ``split_input``: the input is a per-rank part of the data under any tp (each rank's heads).
    ``split_dim``: the normalized dimension itself is split over tp (see the module docstring).
    """

    def __init__(self, hidden_size: int, eps: float | None = None, elementwise_affine: bool = True,
                 *, float32_weight: bool = False, unit_offset: bool = False, cast_to_weight: bool = False,
                 split_input: bool = False, split_dim: bool = False,
                 sequence_parallel: bool = True, device=None, dtype=None):
        super().__init__(hidden_size, eps, elementwise_affine, device=device, dtype=dtype)
        self.float32_weight, self.unit_offset = float32_weight or unit_offset, unit_offset
        self.cast_to_weight = cast_to_weight
        self.split_input, self.split_dim = split_input, split_dim
        self.sequence_parallel = sequence_parallel
        self.elementwise_recompute = "auto"

    def tp_problems(self, tp_size: int) -> list[str]:
        if not self.split_dim:
            return []
        return indivisible(self.normalized_shape[0], tp_size, "the normalized size of a norm split over tp",
                           "choose a tp that divides the number of heads")

    def shard_(self, tp: TensorParallel) -> None:
        if self.split_dim and self.weight is not None:
            tp.shard_parameter(self, "weight", 0)
        super().shard_(tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self.sp or (self.tp is not None and self.split_input)
        weight = local(self.weight, partial_grad=partial)
        if recomputes(self.elementwise_recompute, True):  # frees the normalised values beside the weighted
            return recomputed(self._normalize, x, weight)
        return self._normalize(x, weight)

    def _normalize(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        if self.split_dim and self.tp is not None:
            normed = self._split_rms(x.float())
        else:
            normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.float32_weight and weight is not None:
            return (normed * (1.0 + weight.float() if self.unit_offset else weight.float())).to(x.dtype)
        if self.cast_to_weight and weight is not None:
            return weight * (normed.to(weight.dtype) if weight.dtype in (torch.float16, torch.bfloat16) else normed)
        normed = normed.to(x.dtype)
        return normed if weight is None else weight * normed

    def _split_rms(self, x: torch.Tensor) -> torch.Tensor:
        """x / rms(x) where x is this rank's part of the normalized dimension."""
        square_sum = sum_over_tp(x.pow(2).sum(-1, keepdim=True), self.tp)
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        return x * torch.rsqrt(square_sum / self.normalized_shape[0] + eps)

    def extra_repr(self) -> str:
        kinds = [k for k in ("float32_weight", "unit_offset", "cast_to_weight", "split_input", "split_dim")
                 if getattr(self, k)]
        return super().extra_repr() + "".join(f", {k}" for k in kinds) + self.parallel_repr()


#: Norm kinds by name, for `TransformerLayer`, q/k norms and a decoder's final norm: "rmsnorm_1p" is
#: Gemma's (1 + w) RMSNorm, "rmsnorm_fp32_weight" OLMo 2's (the weight applied before the cast),
#: "rmsnorm_t5" T5's LayerNorm (cast to the weight's dtype).
NORMS = {"layernorm": LayerNorm, "rmsnorm": RMSNorm, "rmsnorm_1p": functools.partial(RMSNorm, unit_offset=True),
         "rmsnorm_fp32_weight": functools.partial(RMSNorm, float32_weight=True),
         "rmsnorm_t5": functools.partial(RMSNorm, cast_to_weight=True)}
