"""The training loop and its hooks: everything that is not forward/backward/step is a hook.

    before_train
    for iteration in [start_iter, max_iter):
        before_step ; run_step ; after_step
    after_train                     only when every step ran (not when the loop raised)
    close                           always: release files, progress bars

`run_step` may raise `RolledBack(iteration)`: the run went back to the state after `iteration`
steps (a divergence rollback), and the loop goes on from there without that step's after_step.

`trainer.iter` is the index of the running step, so after_step sees `iter + 1` steps done. When
the loop raises, the log says at which iteration, and no hook does work meant for a finished
run (a summary line, a sample generated with collectives a dead peer would never join).
"""

from __future__ import annotations

import logging
import weakref

from .events import EventStorage

logger = logging.getLogger("libai_zoo")


class RolledBack(Exception):
    """Raised by `run_step` when the trainer restored the state after `iteration` steps."""

    def __init__(self, iteration: int):
        super().__init__(f"rolled back to iteration {iteration}")
        self.iteration = iteration


class HookBase:
    """Override any of the callbacks; `self.trainer` is set by `register_hooks`."""

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
        """After each step; `trainer.iter + 1` steps are done."""


class TrainerBase:
    """A loop over `run_step` with hooks around it; subclasses implement `run_step`."""

    def __init__(self):
        self._hooks: list[HookBase] = []
        self.iter = self.start_iter = self.max_iter = 0
        self.storage: EventStorage | None = None

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
                self._call("before_step")
                try:
                    self.run_step()
                except RolledBack as back:
                    self.iter = back.iteration
                    continue
                self._call("after_step")
                self.iter += 1
        except BaseException as error:
            log = logger.warning if getattr(error, "exit_code", None) else logger.error
            log("the run stopped at iteration %d: %s: %s", self.iter + 1, type(error).__name__, error)
            raise
        else:
            self._call("after_train")
        finally:
            self._call("close")

    def _call(self, stage: str) -> None:
        for hook in self._hooks:
            getattr(hook, stage)()

    def run_step(self) -> None:
        raise NotImplementedError
