"""What a resumed run takes from its config rather than from its checkpoint: the optimizer's
settings and the learning-rate schedule's base values.

Loading a checkpoint puts the saved run's settings back into the optimizer's parameter groups
(lr, weight decay, betas, ...) and the saved base learning rates into the schedule, while the
schedule's shape is rebuilt from the config (``train.max_iter``, warmup). A resumed run then
takes the config's values again, as Megatron-LM's ``--override-opt_param-scheduler`` does: a
changed ``optim.lr`` takes effect from the resumed step, and the log names every change, so what
config.yaml records is what trains.
"""

from __future__ import annotations

import logging

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

logger = logging.getLogger("libai_zoo")

#: Entries of a parameter group that are not its settings: the parameters, and the learning rates
#: the schedule derives (the base one is the schedule's).
DERIVED = ("params", "lr", "initial_lr")


class ConfiguredSettings:
    """The optimizer's and schedule's settings as the config made them; `reapply` puts them back
    after a checkpoint's state replaced them. For the zoo's schedules (a `LambdaLR`: lr = base ×
    factor(step)); another schedule keeps the checkpoint's settings, as its own state decides the lr."""

    def __init__(self, optimizer: torch.optim.Optimizer, scheduler: LRScheduler):
        self.optimizer, self.scheduler = optimizer, scheduler
        self.applies = isinstance(scheduler, LambdaLR)
        self.base_lrs = list(scheduler.base_lrs) if self.applies else []
        self.groups = [{key: value for key, value in group.items() if key not in DERIVED}
                       for group in optimizer.param_groups]

    def reapply(self) -> list[str]:
        """Put the config's settings back, the learning rate at the schedule's current step
        recomputed from them; returns what the checkpoint had differently ("group 0 lr: 0.002 ->
        0.001"), which is also logged."""
        if not self.applies:
            logger.info("resumed with the checkpoint's optimizer settings and learning rates: %s is not one of the "
                        "zoo's schedules, whose base lr the config could set", type(self.scheduler).__name__)
            return []
        changes = []
        for index, (group, configured, base) in enumerate(zip(self.optimizer.param_groups, self.groups,
                                                              self.base_lrs)):
            saved_base = self.scheduler.base_lrs[index]
            if saved_base != base:
                changes.append(f"group {index} lr: {saved_base:g} -> {base:g}")
            for key, value in configured.items():
                if group.get(key) != value:
                    changes.append(f"group {index} {key}: {group.get(key)} -> {value}")
                    group[key] = value
            self.scheduler.base_lrs[index] = group["initial_lr"] = base
            group["lr"] = base * self.scheduler.lr_lambdas[index](self.scheduler.last_epoch)
        self.scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]  # get_last_lr()'s
        if changes:
            logger.info("resumed with the config's optimizer settings, not the checkpoint's (%s): they apply from "
                        "this step on", "; ".join(changes))
        return changes
