"""`CheckpointManager`: when a run saves, what it keeps, and when a background write commits.

It is the one owner of a run's checkpoint lifecycle: the periodic saves, ``model_best``, the save
on preemption, the re-save after a divergence rollback, the commit of an asynchronous save and
pruning. The trainer and its hooks ask it; `Checkpointer` does the writing and loading.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import commit
from .checkpointer import Checkpointer

logger = logging.getLogger("libai_zoo")


@dataclass(frozen=True)
class Saved:
    """A save the manager started after a step: where it goes and how long the loop waited for it."""

    path: Path
    iteration: int
    stall_s: float


class CheckpointManager:
    """Decides the saves of a run and keeps its checkpoints (every rank asks alike).

    ``period``: save ``model_{steps:07d}`` every `period` steps and after the last (0: only the
    last; None: never, a fast dev run); ``max_to_keep`` of them stay (None: all). ``best_metric`` (an evaluation result's name)
    and ``best_mode`` ("max" or "min"): save ``model_best`` whenever an evaluation improved it.
    ``on_restore``: called after every restore (a resume, a rollback), before anything is saved
    again: the trainer puts the config's optimizer settings back over the checkpoint's.
    """

    def __init__(self, checkpointer: Checkpointer, *, period: int | None, max_to_keep: int | None = None,
                 best_metric: str | None = None, best_mode: str = "max",
                 on_restore: Callable[[], object] | None = None):
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"train.checkpoint.max_to_keep = {max_to_keep} must be at least 1 (None keeps all)")
        if best_mode not in ("max", "min"):
            raise ValueError(f"train.best_mode = {best_mode!r} must be 'max' or 'min'")
        self.checkpointer, self.period, self.max_to_keep = checkpointer, period, max_to_keep
        self.best_metric, self.best_mode = best_metric, best_mode
        self.best = -math.inf if best_mode == "max" else math.inf
        self.last_saved: Saved | None = None  # the save the latest `after_step` started, if any
        self.on_restore = on_restore

    def after_step(self, done: int, *, last: bool) -> Saved | None:
        """After `done` steps (`last`: the run's final one): the periodic save when it is due, then
        the commit of a background write every rank has finished (no collective while none is
        pending). Returns the save it started, if any."""
        saved = None
        if self.period is not None and ((self.period and done % self.period == 0) or last):
            start = time.perf_counter()
            path = self.checkpointer.save(f"model_{done:07d}", done)
            self.checkpointer.prune(self.max_to_keep)
            saved = Saved(path, done, time.perf_counter() - start)
        self.checkpointer.poll()
        self.last_saved = saved
        return saved

    def evaluated(self, done: int, results: dict[str, float]) -> None:
        """An evaluation after `done` steps gave `results`: save ``model_best`` if it improved the best metric."""
        value = results.get(self.best_metric) if self.best_metric else None
        if value is None or not ((value > self.best) if self.best_mode == "max" else (value < self.best)):
            return
        logger.info("eval/%s improved from %.4f to %.4f: saving model_best", self.best_metric, self.best, value)
        self.best = value
        self.checkpointer.save("model_best", done, pointer=False)

    def save_now(self, done: int) -> Path:
        """The run stops after `done` steps (preemption): its checkpoint, saved unless this step's
        exists already, returned once committed."""
        path = self.checkpointer.output_dir / f"model_{done:07d}"
        if path not in (self.checkpointer.pending, self.checkpointer.last_committed):
            self.checkpointer.save(path.name, done)
        self.checkpointer.wait()
        return path

    def start(self, resume: bool) -> tuple[Path, int] | None:
        """At the start of a run: drop what an interrupted save left and, with `resume`, restore
        the newest intact checkpoint ((its path, its steps); None: there is none). A directory
        whose every checkpoint is damaged is an error, not a fresh start."""
        self.checkpointer.remove_incomplete()
        if not resume:
            return None
        restored = self.restore()
        if restored is None and commit.resumable_candidates(self.checkpointer.output_dir):
            raise RuntimeError(f"every checkpoint in {self.checkpointer.output_dir} is damaged (see the warnings "
                               f"above): restore one, or start over with --no-resume (resume_or_load(resume=False))")
        return restored

    def restore(self, at_most: int | None = None) -> tuple[Path, int] | None:
        """Restore the newest intact checkpoint (of at most `at_most` steps): (its path, its steps),
        or None when there is none."""
        path = self.checkpointer.find_resumable(at_most=at_most)
        if path is None:
            return None
        iteration = self.checkpointer.resume(path)
        if self.on_restore is not None:
            self.on_restore()
        return path, iteration

    def resave_as_newest(self, path: Path, iteration: int) -> None:
        """Make the restored checkpoint `path` the run's newest: delete those after it (a restart
        must not resume from them) and save it again with the state as it is now (what a rollback
        changed: the data batches it skips)."""
        self.checkpointer.discard_after(iteration)
        self.checkpointer.save(path.name, iteration)
        self.checkpointer.wait()

    def finish(self) -> None:
        """The run ended: commit the last background write."""
        self.checkpointer.wait()
