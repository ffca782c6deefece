"""Learning-rate schedules stepped once per optimizer step: linear warmup, then cosine, linear
or constant. Each is a `LambdaLR`, so its state saves and loads with the checkpoint.

The trainer builds them with the optimizer and ``train.max_iter`` filled in:
``scheduler = LazyCall(WarmupCosineLR)(warmup_iters=100, min_lr_ratio=0.1)``.
"""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


class _WarmupThenDecay(LambdaLR):
    """lr × (it+1)/warmup_iters during warmup, then lr × decay(progress), progress going 0 -> 1 at max_iter."""

    def __init__(self, optimizer: Optimizer, max_iter: int, warmup_iters: int, decay):
        if not 0 <= warmup_iters <= max_iter:
            raise ValueError(f"warmup_iters = {warmup_iters} must be between 0 and max_iter = {max_iter}")

        def factor(it: int) -> float:
            if it < warmup_iters:
                return (it + 1) / warmup_iters
            return decay(min(1.0, (it - warmup_iters) / max(1, max_iter - warmup_iters)))

        super().__init__(optimizer, factor)


class WarmupCosineLR(_WarmupThenDecay):
    """Linear warmup, then a half cosine from lr down to lr × min_lr_ratio at max_iter."""

    def __init__(self, optimizer: Optimizer, max_iter: int, warmup_iters: int = 0, min_lr_ratio: float = 0.0):
        super().__init__(optimizer, max_iter, warmup_iters,
                         lambda progress: min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class WarmupLinearLR(_WarmupThenDecay):
    """Linear warmup, then linear decay to lr × min_lr_ratio at max_iter."""

    def __init__(self, optimizer: Optimizer, max_iter: int, warmup_iters: int = 0, min_lr_ratio: float = 0.0):
        super().__init__(optimizer, max_iter, warmup_iters, lambda progress: 1 - (1 - min_lr_ratio) * progress)


class ConstantLR(_WarmupThenDecay):
    """Linear warmup, then lr."""

    def __init__(self, optimizer: Optimizer, max_iter: int, warmup_iters: int = 0):
        super().__init__(optimizer, max_iter, warmup_iters, lambda progress: 1.0)
