"""Learning-rate schedules stepped once per optimizer step: linear warmup, then cosine, linear
or constant. Each is a `LambdaLR`, so its state saves and loads with the checkpoint.

The trainer builds them with the optimizer and ``train.max_iter`` filled in:
``scheduler = LazyCall(WarmupCosineLR)(warmup_iters=100, min_lr_ratio=0.1)``. ``warmup_iters`` is
a number of steps, or a fraction of the run when below 1 (0.05: the first 5% of max_iter), as
transformers' ``warmup_steps`` takes it; a warmup longer than the run is cut to the run, with a
warning, so a short trial run of a recipe works.
"""

from __future__ import annotations

import logging
import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

logger = logging.getLogger("libai_zoo")


def warmup_steps(warmup_iters: float, max_iter: int) -> int:
    """The warmup of a run of `max_iter` steps, in steps (see the module docstring)."""
    if warmup_iters < 0:
        raise ValueError(f"warmup_iters = {warmup_iters} must be a number of steps >= 0, or a fraction of the run "
                         f"in [0, 1)")
    steps = round(warmup_iters * max_iter) if warmup_iters < 1 else int(warmup_iters)
    if steps > max_iter:
        logger.warning("warmup_iters = %s is longer than the run (max_iter = %d): warming up over all %d steps",
                       warmup_iters, max_iter, max_iter)
        return max_iter
    return steps


class _WarmupThenDecay(LambdaLR):
    """lr × (it+1)/warmup during warmup, then lr × decay(progress), progress going 0 -> 1 at max_iter."""

    def __init__(self, optimizer: Optimizer, max_iter: int, warmup_iters: float, decay):
        warmup_iters = warmup_steps(warmup_iters, max_iter)

        def factor(it: int) -> float:
            if it < warmup_iters:
                return (it + 1) / warmup_iters
            return decay(min(1.0, (it - warmup_iters) / max(1, max_iter - warmup_iters)))

        super().__init__(optimizer, factor)


class WarmupCosineLR(_WarmupThenDecay):
    """Linear warmup, then a half cosine from lr down to lr × min_lr_ratio at max_iter."""

    def __init__(self, optimizer: Optimizer, max_iter: int, warmup_iters: float = 0, min_lr_ratio: float = 0.0):
        super().__init__(optimizer, max_iter, warmup_iters,
                         lambda progress: min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class WarmupLinearLR(_WarmupThenDecay):
    """Linear warmup, then linear decay to lr × min_lr_ratio at max_iter."""

    def __init__(self, optimizer: Optimizer, max_iter: int, warmup_iters: float = 0, min_lr_ratio: float = 0.0):
        super().__init__(optimizer, max_iter, warmup_iters, lambda progress: 1 - (1 - min_lr_ratio) * progress)


class ConstantLR(_WarmupThenDecay):
    """Linear warmup, then lr."""

    def __init__(self, optimizer: Optimizer, max_iter: int, warmup_iters: float = 0):
        super().__init__(optimizer, max_iter, warmup_iters, lambda progress: 1.0)
