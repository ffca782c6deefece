"""The training loop and its hooks: everything that is not forward/backward/step is a hook.

    before_train
    for iteration in [start_iter, max_iter):
        before_step ; run_step ; after_step
    after_train

`trainer.iter` is the index of the running step, so after_step sees `iter + 1` steps done.
"""

from __future__ import annotations

import logging
import weakref

from .events import EventStorage

logger = logging.getLogger("libai_zoo")


class HookBase:
    """Override any of the four callbacks; `self.trainer` is set by `register_hooks`."""

    trainer: TrainerBase

    def before_train(self) -> None:
        pass

    def after_train(self) -> None:
        pass

    def before_step(self) -> None:
        pass

    def after_step(self) -> None:
        pass


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
        with EventStorage(start_iter, max_iter) as self.storage:
            try:
                self._call("before_train")
                for self.iter in range(start_iter, max_iter):
                    self.storage.iter = self.iter
                    self._call("before_step")
                    self.run_step()
                    self._call("after_step")
                self.iter = max_iter  # the loop is done: after_train sees every step counted
            finally:
                self._call("after_train")

    def _call(self, stage: str) -> None:
        for hook in self._hooks:
            getattr(hook, stage)()

    def run_step(self) -> None:
        raise NotImplementedError
