"""Divergence: after ``train.max_bad_steps`` steps in a row whose loss or gradient norm was not
finite, the run stops with `DivergenceError`, or (``train.on_divergence="rollback"``) goes back
to the newest intact checkpoint before them and skips the data batches read since it (PaLM's
recipe)."""

from __future__ import annotations

import logging

from libai_zoo.checkpoint import CheckpointManager
from libai_zoo.config import ConfigError

from .train_step import StepResult
from .training_data import DataPosition

logger = logging.getLogger("libai_zoo")

MAX_ROLLBACKS_TO_ONE_CHECKPOINT = 2


class DivergenceError(RuntimeError):
    """Too many steps in a row had a non-finite loss or gradient norm."""


class DivergenceWatch:
    """Counts the bad steps in a row, stops the run or rolls it back. ``on_divergence``: "stop" or
    "rollback"; ``max_bad_steps``: how many bad steps in a row it takes."""

    def __init__(self, on_divergence: str = "stop", max_bad_steps: int = 5):
        if on_divergence not in ("stop", "rollback"):
            raise ConfigError(f"train.on_divergence = {on_divergence!r} must be 'stop' or 'rollback'")
        if max_bad_steps < 1:
            raise ConfigError(f"train.max_bad_steps = {max_bad_steps} must be at least 1")
        self.on_divergence, self.max_bad_steps = on_divergence, max_bad_steps
        self._bad_steps: list[int] = []  # the iterations of the current run of bad steps
        self._rollbacks: dict[int, int] = {}  # checkpoint iteration -> rollbacks to it
        self._what = ""

    def rollback_due(self, iteration: int, result: StepResult, nonfinite_grads: list[str], rank: int) -> bool:
        """Count step `iteration`; True when the run must roll back now (`roll_back`). Raises
        `DivergenceError` when it must stop."""
        if not result.diverged:
            self._bad_steps.clear()
            return False
        self._bad_steps.append(iteration)
        if len(self._bad_steps) < self.max_bad_steps:
            return False
        self._what = (f"steps {self._bad_steps[0] + 1}..{iteration + 1} had a non-finite loss or gradient norm "
                      f"(last loss {result.loss}, gradient norm {result.grad_norm}); parameters whose gradients "
                      f"were not finite on rank {rank}: {', '.join(nonfinite_grads) or 'none (the loss itself)'}")
        if self.on_divergence == "rollback":
            return True
        raise DivergenceError(f"the run diverged: {self._what}. Lower optim.lr or raise the warm-up, look at the data "
                              f"of those steps, or set train.on_divergence=rollback to go back to the last good "
                              f"checkpoint and skip those batches")

    def roll_back(self, iteration: int, checkpoints: CheckpointManager, position: DataPosition) -> int:
        """Restore the newest intact checkpoint before the bad steps (step `iteration` the last of
        them), skip the data batches read since it, make it the run's newest checkpoint with that
        skip recorded, and return its iteration."""
        good = self._bad_steps[0]
        next_batch = iteration + 1 + position.skipped_batches  # of the data stream
        restored = checkpoints.restore(at_most=good)
        if restored is None:
            raise DivergenceError(f"the run diverged and there is no intact checkpoint of at most {good} steps to "
                                  f"roll back to: {self._what}. Lower optim.lr, or save more often "
                                  f"(train.checkpoint.period) and keep more (train.checkpoint.max_to_keep)")
        path, back_to = restored
        self._rollbacks[back_to] = self._rollbacks.get(back_to, 0) + 1
        if self._rollbacks[back_to] > MAX_ROLLBACKS_TO_ONE_CHECKPOINT:
            raise DivergenceError(f"the run diverged again after {MAX_ROLLBACKS_TO_ONE_CHECKPOINT} rollbacks to "
                                  f"{path}: {self._what}. Lower optim.lr or look at the data")
        skipped = next_batch - back_to - position.skipped_batches  # the checkpoint's own skip restored
        position.skipped_batches = next_batch - back_to
        logger.warning("the run diverged (%s): rolled back to %s (after %d steps); skipping the %d data batches "
                       "read since it (steps %d..%d)", self._what, path, back_to, skipped, back_to + 1, iteration + 1)
        # A restart from here on must find this state, the skipped batches included, and nothing newer.
        checkpoints.resave_as_newest(path, back_to)
        self._bad_steps.clear()
        return back_to
