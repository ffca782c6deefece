"""Cross entropy on vocabulary-parallel logits, without gathering the full logits.

Each rank holds logits for its slice of the vocabulary [N, V/tp]. The loss needs the global max
(one all-reduce MAX) and, summed over the vocabulary, exp(logit - max) and the target's logit
(one all-reduce SUM of both together). The gradient, softmax - one_hot, stays local.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from libai_zoo.distributed.collectives import all_reduce_

from .parallel_layer import ParallelLayer

REDUCTIONS = ("mean", "sum", "none")


class _VocabParallelCrossEntropy(Function):
    @staticmethod
    def forward(ctx, logits, target, tp, ignore_index):
        vocab_start, vocab_end = tp.local_range(logits.shape[-1] * tp.size)
        ctx.dtype = logits.dtype
        logits = logits.float()
        max_logit = all_reduce_(logits.max(dim=-1).values, tp, op=dist.ReduceOp.MAX)
        shifted = logits - max_logit.unsqueeze(-1)
        in_range = (target >= vocab_start) & (target < vocab_end)
        local_target = (target - vocab_start).masked_fill_(~in_range, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill_(~in_range, 0.0)
        exp = shifted.exp_()
        sums = all_reduce_(torch.stack([exp.sum(dim=-1), target_logit]), tp)
        valid = target != ignore_index
        loss = (sums[0].log() - sums[1]).masked_fill_(~valid, 0.0)
        softmax = exp.div_(sums[0].unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, in_range, valid)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, in_range, valid = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -in_range.to(grad.dtype).unsqueeze(-1))
        grad.mul_((grad_loss * valid).unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None


class ParallelCrossEntropy(ParallelLayer, nn.Module):
    """`F.cross_entropy` (class index targets, ``ignore_index``, mean/sum/none) whose logits may be
    split over the vocabulary by tp, as a column-parallel LM head leaves them.

    Logits [..., V] (or [..., V/tp] once sharded), targets [...] with global vocabulary ids.
    The loss is computed in float32; 'mean' averages over the targets that are not ignored.
    """

    def __init__(self, ignore_index: int = -100, reduction: str = "mean"):
        super().__init__()
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction {reduction!r} is not one of {REDUCTIONS}")
        self.ignore_index, self.reduction = ignore_index, reduction

    def forward(self, logits: torch.Tensor, target: torch.Tensor, reduction: str | None = None) -> torch.Tensor:
        """``reduction`` overrides the one given at construction for this call."""
        reduction = reduction or self.reduction
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction {reduction!r} is not one of {REDUCTIONS}")
        if self.tp is None:
            flat = F.cross_entropy(logits.float().flatten(0, -2), target.flatten(),
                                   ignore_index=self.ignore_index, reduction=reduction)
            return flat.view(target.shape) if reduction == "none" else flat
        loss = _VocabParallelCrossEntropy.apply(logits, target, self.tp, self.ignore_index)
        if reduction == "none":
            return loss
        total = loss.sum()
        return total if reduction == "sum" else total / (target != self.ignore_index).sum()

    def extra_repr(self) -> str:
        return f"ignore_index={self.ignore_index}, reduction={self.reduction}{self.parallel_repr()}"
