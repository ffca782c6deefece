"""The training loop and its hooks: the trainer acts, the hooks observe and report.

    before_train
    for iteration in [start_iter, max_iter):
        before_step ; run_step ; complete_step ; after_step ; report_step ; end_step
    complete_train ; after_train    only when every step ran (not when the loop raised)
    close                           always: release files, progress bars

`trainer.iter` is the index of the running step, so after_step sees `iter + 1` steps done. The
loop times each step (`step_time`: before_step hooks and `run_step`) and keeps what `run_step`
returned (`last_step`). `complete_step` is the trainer's own work after a step (DefaultTrainer:
the LR schedule, an evaluation, a checkpoint when one is due); the hooks then read the step's
result and the trainer's records, never one another: in after_step they record the step's scalars
in `trainer.storage`, in report_step (once every hook has recorded) the writers write them out, so
their order does not matter. `run_step` returns `RolledBack` when the run went
back to an earlier state (a divergence rollback): the loop goes on from there, and that step
has no after_step. When the loop raises, the log says at which iteration, and no hook does work
meant for a finished run.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass

from .events import EventStorage

logger = logging.getLogger("libai_zoo")


@dataclass(frozen=True)
class RolledBack:
    """What `run_step` returns when the trainer restored the state after `iteration` steps."""

    iteration: int


class HookBase:
    """Override any of the callbacks; `self.trainer` is set by `register_hooks`. A hook observes the
    step and reports (timing, goodput, the writers, a sample at the end); it reads the trainer's
    records, never another hook's. Whether the run goes on is the loop's to decide, though a hook
    may raise to stop it (a fault injected on purpose)."""

    trainer: TrainerBase

    def before_train(self) -> None:
        """Before the first step."""

    def after_train(self) -> None:
        """After the last step, when the loop finished."""

    def close(self) -> None:
        """After the loop, whether it finished or raised."""

    def before_step(self) -> None:
        """Before each step."""

    def after_step(self) -> None:
        """After each step; `trainer.iter + 1` steps are done, `trainer.last_step` is the step's result."""

    def report_step(self) -> None:
        """After every hook's after_step, when the step's scalars are all in `trainer.storage`."""


class TrainerBase:
    """A loop over `run_step` with hooks around it; subclasses implement `run_step`."""

    def __init__(self):
        self._hooks: list[HookBase] = []
        self.iter = self.start_iter = self.max_iter = 0
        self.storage: EventStorage | None = None
        #: What the last `run_step` returned (DefaultTrainer: a `StepResult`).
        self.last_step: object = None
        #: Seconds of the last step: its before_step hooks and `run_step`.
        self.step_time = 0.0

    def register_hooks(self, hooks: list[HookBase | None]) -> None:
        """Append hooks (None entries are skipped); they run in registration order."""
        for hook in hooks:
            if hook is not None:
                hook.trainer = weakref.proxy(self)  # no reference cycle trainer <-> hook
                self._hooks.append(hook)

    def train(self, start_iter: int, max_iter: int) -> None:
        """Run steps start_iter .. max_iter - 1."""
        logger.info("starting training from iteration %d", start_iter)
        self.iter = self.start_iter = start_iter
        self.max_iter = max_iter
        self.storage = EventStorage(start_iter, max_iter)
        try:
            self._call("before_train")
            while self.iter < max_iter:
                self.storage.iter = self.iter
                start = time.perf_counter()
                self._call("before_step")
                outcome = self.run_step()
                if isinstance(outcome, RolledBack):
                    self.iter = outcome.iteration
                    continue
                self.last_step, self.step_time = outcome, time.perf_counter() - start
                self.complete_step()
                self._call("after_step")
                self._call("report_step")
                self.end_step()
                self.iter += 1
        except BaseException as error:
            log = logger.warning if getattr(error, "exit_code", None) else logger.error
            log("the run stopped at iteration %d: %s: %s", self.iter + 1, type(error).__name__, error)
            raise
        else:
            self.complete_train()
            self._call("after_train")
        finally:
            self._call("close")

    def _call(self, stage: str) -> None:
        for hook in self._hooks:
            getattr(hook, stage)()

    def run_step(self) -> object:
        """One step; returns its result (kept as `last_step`), or `RolledBack`."""
        raise NotImplementedError

    def complete_step(self) -> None:
        """The trainer's own work after a step, before the hooks observe it (`iter + 1` steps done).
        The default does nothing."""

    def complete_train(self) -> None:
        """The trainer's own work after the last step, before the after_train hooks. The default does nothing."""

    def end_step(self) -> None:
        """After the step's hooks (`iter + 1` steps done): the loop's own decision to stop or go on
        (DefaultTrainer: preemption). The default goes on."""
